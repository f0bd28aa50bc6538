"""Accuracy by generation on a task with checkable answers (`meshdistill.data.tasks`), and its training hook.

`task_accuracy` completes held-out prompts with a model and scores every completion with the task's scorer:

* ``greedy`` -- the share of prompts whose greedy completion is right (exact match of the final answer);
* with ``samples = k > 0``: ``sampled`` -- the share of right completions among k samples per prompt at
  ``temperature``; ``pass@k`` -- the share of prompts with at least one right sample among its k (the plain
  estimate with n = k samples).

Generation is `meshdistill.models.generate.generate`: one compiled program, rows split over ``data`` of
``mesh`` and the weights where they are (``tensor``), so every layout scores the same text (sampling keys are
fixed by ``seed``; row ``r``'s noise does not depend on the batch it is in). The prompt list is padded with
copies of its last prompt to a multiple of ``data``; those rows are not scored.

`TaskAccuracy` is the `meshdistill.train.loop.hooks.Hook` that logs these numbers as eval metrics during training
(``task_greedy``, ``task_sampled``, ``task_pass@k``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from meshdistill.data.tasks import ArithmeticTask
from meshdistill.train.loop.hooks import Hook
from meshdistill.models.generate import SamplingConfig, generate, left_pad
from meshdistill.parallel.mesh import DATA


def complete(model, prompts: Sequence[str], tokenizer, *, max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, mesh: Mesh | None = None) -> list[str]:
  """Completions (decoded text, up to EOS) of ``prompts`` by ``model`` (a `Decoder` or ``(graphdef, params)``)."""
  data = 1 if mesh is None else mesh.shape[DATA]
  padded = list(prompts) + [prompts[-1]] * (-len(prompts) % data)
  pad = int(getattr(tokenizer, "pad_id", None) or 0)
  tokens, mask = left_pad([tokenizer.encode(p) for p in padded], pad_id=pad)
  cfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, eos_id=tokenizer.eos_id, pad_id=pad)
  gen = generate(model, tokens, mask, None if temperature == 0 else jax.random.key(seed), cfg, mesh=mesh)
  out_BxN, keep_BxN = np.asarray(jax.device_get(gen.tokens_BxN)), np.asarray(jax.device_get(gen.mask_BxN))
  eos = tokenizer.eos_id
  return [tokenizer.decode([int(t) for t, k in zip(row, keep) if k and t != eos])
          for row, keep in zip(out_BxN[: len(prompts)], keep_BxN[: len(prompts)])]


def task_accuracy(model, task: ArithmeticTask, prompts: Sequence[str], tokenizer, *, samples: int = 0,
                  temperature: float = 1.0, seed: int = 0, mesh: Mesh | None = None) -> dict[str, float]:
  """``{"greedy": ..., "sampled": ..., "pass@k": ...}`` of ``model`` on ``prompts`` of ``task`` (module docstring);
  ``samples=0``: greedy only."""
  if not prompts:
    raise ValueError("task accuracy needs at least one prompt (the task's held-out split is empty)")
  if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
    raise ValueError(f"samples={samples!r} must be an integer >= 0 (completions sampled per prompt for pass@k)")
  n_new = task.answer_width + 1  # the answer and EOS
  greedy = complete(model, prompts, tokenizer, max_new_tokens=n_new, mesh=mesh)
  out = {"greedy": float(np.mean([task.score(p, c) for p, c in zip(prompts, greedy)]))}
  if samples:
    many = [p for p in prompts for _ in range(samples)]
    texts = complete(model, many, tokenizer, max_new_tokens=n_new, temperature=temperature, seed=seed, mesh=mesh)
    right = np.array([task.score(p, c) for p, c in zip(many, texts)]).reshape(len(prompts), samples)
    out["sampled"] = float(right.mean())
    out[f"pass@{samples}"] = float(right.any(axis=1).mean())
  return out


class TaskAccuracy(Hook):
  """Task accuracy of the student every ``every`` steps and at the end, logged as eval metrics ``task_<name>``."""

  def __init__(self, task: ArithmeticTask, prompts: Sequence[str], tokenizer, every: int, *, samples: int = 0,
               temperature: float = 1.0, seed: int = 0):
    self.task, self.prompts, self.tokenizer, self.every = task, list(prompts), tokenizer, every
    self.samples, self.temperature, self.seed = samples, temperature, seed

  def due(self, run, step):
    return bool(self.prompts) and ((self.every and step % self.every == 0) or step == run.steps)

  def after_step(self, run, step):
    trainer = run.trainer
    model = (trainer.student_def, trainer.unreplicate(run.state.params)["student"])
    acc = task_accuracy(model, self.task, self.prompts, self.tokenizer, samples=self.samples,
                        temperature=self.temperature, seed=self.seed, mesh=trainer.layout.eval_mesh)
    run.monitor.eval(step, {f"task_{k}": v for k, v in acc.items()})
