"""Jobs on a finished (or running) distillation run: `evaluate` its latest checkpoint, `evaluate_task` (accuracy by
generation on a task with checkable answers), `generate` with its
student or teacher, `load_run` (its student in Python), `run_teacher` (the run's teacher) and the final
`summary_table`. The teacher comes from the run's teacher source (`meshdistill.teachers.kinds`,
`TeacherSource.saved_model`): a source without a teacher model (``none``, a top-k cache) evaluates and generates with
the student alone, and says so when asked for the teacher."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import IO, Any, NamedTuple

from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.config import Config
from meshdistill.config import run_config
from meshdistill.core.fsutil import write_text_atomic
from meshdistill.jobs._distill_job import _evaluate_pair, _evaluate_student
from meshdistill.jobs._setup import build_mesh, load_data, resolve_mesh, stream_reporter
from meshdistill.jobs._teacher import services
from meshdistill.jobs._training import make_distiller
from meshdistill.data import chat
from meshdistill.data.tasks import parse_task
from meshdistill.train.loop.task_eval import task_accuracy
from meshdistill.models import generate as generate_lib
from meshdistill.models.compress.qat import quantize_aware
from meshdistill.models.generate import SamplingConfig, left_pad
from meshdistill.parallel.backends import layout_class, make_layout
from meshdistill.teachers import kinds, multi
from meshdistill.train.teacher import TeacherKind


def evaluate(cfg: Config, *, stream: IO[str] | None = None) -> dict:
  """Evaluates the latest checkpoint of the run in ``run.run_dir`` against its teacher."""
  say = stream_reporter(stream)
  if not os.path.isdir(cfg.checkpoint_dir):  # evaluation creates nothing
    raise FileNotFoundError(
      f"no checkpoint in {cfg.checkpoint_dir}: run `meshdistill distill` with run.run_dir={cfg.run.run_dir} first"
    )
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0, read_only=True)
  try:
    if ckpt.latest_step() is None:
      raise FileNotFoundError(
        f"no checkpoint in {cfg.checkpoint_dir}: run `meshdistill distill` with run.run_dir={cfg.run.run_dir} first"
      )
    meta = ckpt.read_meta()
    if meta.get("kind") != "distill":
      raise ValueError(f"{cfg.checkpoint_dir} holds a {meta.get('kind')!r} run, not a distillation run")
    mesh = build_mesh(cfg)
    data = load_data(cfg, mesh=mesh)
    try:
      tdir, teacher = run_teacher(cfg, meta, mesh, data.tokenizer)
    except kinds.NoTeacherModel:  # no teacher, or its top-k only: the student is evaluated alone
      prepared = kinds.for_config(cfg).prepare(data, mesh, None, services(report=say))
      tdir, teacher = prepared.identity, prepared.teacher
    distiller = make_distiller(cfg, teacher, mesh)
    state, _, meta = ckpt.restore(distiller, distiller.init_state())  # meta: of the step restored
    say(f"evaluating step {meta['step']} of {cfg.run.run_dir} (teacher {tdir or 'none'})")
    pair = _evaluate_pair if distiller.teacher_output.kind is TeacherKind.MODEL else _evaluate_student
    summary = pair(distiller, state, data.val_batches(max_batches=cfg.train.eval_batches))
  finally:
    ckpt.close()
  summary.update({"step": int(meta["step"]), "teacher_dir": tdir, "run_dir": cfg.run.run_dir})
  return summary


def generate(
  cfg: Config,
  prompts: list,
  *,
  model: str = "student",
  sampling: Any = None,
  seed: int = 0,
  stream: IO[str] | None = None,
) -> list[str]:
  """Completions of ``prompts`` by the ``model`` (``student``: the run's latest checkpoint; ``teacher``: its
  teacher) of the run in ``run.run_dir``, decoded with ``sampling`` (a `meshdistill.models.generate.SamplingConfig`;
  its ``eos_id`` defaults to the tokenizer's) from ``jax.random.key(seed)`` on the run's layout.

  A prompt is a string (its tokens as they are) or a conversation (a list of ``{role, content}`` turns ending with the
  turn the assistant answers): rendered with the chat template of ``data.tokenizer`` (or ``data.chat_template``) and
  its generation prompt (`meshdistill.data.chat.prompt_ids`); the reply then ends at the template tokenizer's end of
  turn (its ``eos_token``) unless ``sampling`` names another ``eos_id``."""
  return [r["text"] for r in _completions(cfg, prompts, model=model, sampling=sampling, seed=seed, stream=stream)]


def generate_records(cfg: Config, prompts: list, *, out: str | None = None, **kwargs) -> list[dict]:
  """`generate` as training records (`meshdistill.data._records`), written as JSONL to ``out`` when given (through a
  rename: never half written): a conversation's as ``{"messages": turns + [the reply as an assistant turn],
  "finished": ...}``, a string's as ``{"prompt", "completion", "finished"}``; ``finished`` is false for a completion
  cut at ``max_new_tokens`` before its end (drop those, or keep them: the template closes them as if the model had
  stopped)."""
  records = []
  for prompt, r in zip(prompts, _completions(cfg, prompts, **kwargs)):
    if isinstance(prompt, str):
      records.append({"prompt": prompt, "completion": r["text"], "finished": r["finished"]})
    else:
      records.append({"messages": [*prompt, {"role": "assistant", "content": r["text"]}], "finished": r["finished"]})
  if out is not None:
    write_text_atomic(out, "".join(json.dumps(r) + "\n" for r in records))
  return records


def _completions(cfg: Config, prompts: list, *, model: str = "student", sampling: Any = None, seed: int = 0,
                 stream: IO[str] | None = None) -> list[dict]:
  """``[{"text", "finished"}]`` per prompt: `generate`'s work."""
  import jax  # pylint: disable=g-import-not-at-top

  if model not in ("student", "teacher"):
    raise ValueError(f"model={model!r}; choose student or teacher")
  if not prompts:
    raise ValueError("no prompts: give --prompt TEXT or --prompts-file FILE")
  say = stream_reporter(stream)
  net, mesh, tokenizer, step = _run_model(cfg, model)
  say(f"generating with the {model} of {cfg.run.run_dir}" + (f" (step {step})" if model == "student" else ""))
  sampling = sampling or SamplingConfig()
  template = None
  if any(not isinstance(p, str) for p in prompts):  # conversations: the chat template's rendering and end of turn
    template = chat.load_chat_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    if sampling.eos_id is None and template.eos_token_id is not None:
      sampling = dataclasses.replace(sampling, eos_id=int(template.eos_token_id))
  if sampling.eos_id is None:
    sampling = dataclasses.replace(sampling, eos_id=tokenizer.eos_id)
  ids = [tokenizer.encode(p) if isinstance(p, str) else chat.prompt_ids(template, p, where=f"prompt {i}")
         for i, p in enumerate(prompts)]
  rows = len(ids)
  if mesh is not None and rows % mesh.shape["data"]:  # fill the batch up to a multiple of the data axis
    ids += [ids[-1]] * (mesh.shape["data"] - rows % mesh.shape["data"])
  tokens, mask = left_pad(ids, pad_id=getattr(tokenizer, "pad_id", 0) or 0)
  gen = jax.device_get(generate_lib.generate(net, tokens, mask, jax.random.key(seed), sampling, mesh=mesh))
  out = []
  for r in range(rows):
    kept = [int(t) for t, m in zip(gen.tokens_BxN[r], gen.mask_BxN[r]) if m]
    row = [t for t in kept if t != sampling.eos_id]
    out.append({"text": tokenizer.decode(row), "finished": len(row) < len(kept)})
  return out


def _run_model(cfg: Config, model: str = "student"):
  """``(net, mesh, tokenizer, step)``: the ``model`` (``student``: the latest checkpoint; ``teacher``) of the run in
  ``run.run_dir`` on its layout, read only."""
  # Read only: generating never creates, prunes or moves aside anything in the run (no run yet: the teacher).
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0, read_only=True) if os.path.isdir(cfg.checkpoint_dir) else None
  try:
    step = None if ckpt is None else ckpt.latest_step()
    meta = ckpt.read_meta() if step is not None else {}
    if step is not None and meta.get("kind") != "distill":
      raise ValueError(f"{cfg.checkpoint_dir} holds a {meta.get('kind')!r} run, not a distillation run")
    if step is None and model == "student":
      raise FileNotFoundError(
        f"no checkpoint in {cfg.checkpoint_dir}: run `meshdistill distill` with run.run_dir={cfg.run.run_dir} "
        "first, or generate with the teacher (--model teacher)"
      )
    source = kinds.for_config(cfg)
    # A saved teacher carries its tokenizer; otherwise (a Hugging Face teacher, none) the run's data settings name it.
    tokenizer = source.saved_tokenizer(meta.get("teacher_dir")) or load_data(cfg).tokenizer
    mesh = build_mesh(cfg)
    try:
      _, net = run_teacher(cfg, meta, mesh, tokenizer)
    except kinds.NoTeacherModel:
      if model == "teacher":
        raise
      net = None  # the student alone, read from the checkpoint as `load_run` does
    if model == "student" and net is None:
      mesh = make_layout(cfg.mesh.backend, mesh).eval_mesh
      net = ckpt.restore_student(stored_student_config(cfg, mesh), mesh, lora=cfg.models.student_lora)
      net = as_trained(cfg, net)  # a quantization-aware student: its quantized forward, as the distiller runs it
      step = int(ckpt.restored_step)  # an older step when the newest is damaged
    elif model == "student":
      distiller = make_distiller(cfg, net, mesh)
      state, _, restored = ckpt.restore(distiller, distiller.init_state())
      step = int(restored["step"])  # an older step when the newest is damaged
      net = distiller.student(state)
      mesh = distiller.layout.eval_mesh
  finally:
    if ckpt is not None:
      ckpt.close()
  return net, mesh, tokenizer, step


def evaluate_task(cfg: Config, task: str, *, model: str = "student", prompts: int = 256, samples: int = 0,
                  temperature: float = 1.0, seed: int = 0, stream: IO[str] | None = None) -> dict:
  """Accuracy by generation of the run's ``model`` on ``prompts`` held-out problems of ``task`` (a name of
  `meshdistill.data.tasks.parse_task`, e.g. ``add3``): greedy, and with ``samples = k > 0`` sampled accuracy and
  pass@k at ``temperature`` (`meshdistill.train.loop.task_eval.task_accuracy`), on the run's layout."""
  if model not in ("student", "teacher"):
    raise ValueError(f"model={model!r}; choose student or teacher")
  spec = parse_task(task)
  if isinstance(prompts, bool) or not isinstance(prompts, int) or prompts < 1:
    raise ValueError(f"--prompts={prompts!r} must be a positive number of held-out problems, e.g. 256")
  say = stream_reporter(stream)
  net, mesh, tokenizer, step = _run_model(cfg, model)
  say(f"task {task}: {prompts} held-out problems, the {model} of {cfg.run.run_dir}"
      + (f" (step {step})" if model == "student" else ""))
  rows = spec.rows("held_out", prompts)
  acc = task_accuracy(net, spec, [r["prompt"] for r in rows], tokenizer, samples=samples, temperature=temperature,
                      seed=seed, mesh=mesh)
  return {"task": task, "model": model, "step": step, "prompts": prompts, **acc}


class LoadedRun(NamedTuple):
  """What `load_run` returns: ``student, config, step = md.load_run("runs/default")``."""

  student: Any  # a `meshdistill.Decoder` holding the checkpoint's weights, computing as the run trained it
  config: Config  # the run's own config.yaml, with run.run_dir pointing at the directory loaded
  step: int  # the checkpoint step the weights come from


def load_run(run_dir: str, step: int | None = None, *, mesh=None) -> LoadedRun:
  """The student of a `meshdistill distill` run directory, from its newest intact checkpoint (or ``step``).

  Reads the run's ``config.yaml`` and restores only the student's weights (no teacher, no optimizer
  state) with `meshdistill.storage.checkpoint.Checkpointer.restore_student`, as ``meshdistill export`` does; a
  damaged newest step is skipped with a warning naming it. ``mesh=None`` puts every weight on one device
  (``jax.devices()[0]``); a `jax.sharding.Mesh` with a ``tensor`` axis splits it as training did (a vocabulary
  padded for the run's ``tensor`` needs a ``tensor`` that divides the padded size). A LoRA
  run's student holds its adapters (`meshdistill.models.lora.merge_lora` folds them in). Nothing in
  ``run_dir`` is created or changed.

  The student computes what the run trained and validated (`as_trained`): for a quantization-aware run
  (``student.quantize_aware``) that is its quantized forward pass -- the float weights of the checkpoint through
  the run's fake quantization, whose logits are those of ``meshdistill export`` (weights on the quantization grid)
  and of ``meshdistill export --quantized`` -- not the float student, which no step ever ran.

  Raises:
    FileNotFoundError: ``run_dir`` is missing, holds no ``config.yaml`` or no finished checkpoint.
    ValueError: ``step`` is not one of its checkpoints, or the run is not a distillation run.
    meshdistill.storage.checkpoint.CheckpointError: ``step``, or every step, is damaged.
  """
  if not os.path.isdir(run_dir):
    raise FileNotFoundError(f"run_dir={run_dir!r} does not exist; give the run.run_dir of a `meshdistill distill` run")
  cfg = run_config(run_dir)
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0, read_only=True) if os.path.isdir(cfg.checkpoint_dir) else None
  try:
    steps = [] if ckpt is None else ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(
        f"run_dir={run_dir!r} has no finished checkpoint in {cfg.checkpoint_dir}: run `meshdistill distill` with "
        f"run.run_dir={run_dir} to at least its first checkpoint (checkpoint.every, or its last step)"
      )
    if step is not None and step not in steps:
      raise ValueError(f"step={step} is not a checkpoint of {run_dir!r}; its checkpoints: {sorted(steps)}")
    step = ckpt.intact_step() if step is None else step
    meta = ckpt.read_meta(step)
    if meta.get("kind") != "distill":
      raise ValueError(f"run_dir={run_dir!r} holds a {meta.get('kind')!r} run, not a distillation run")
    student = ckpt.restore_student(stored_student_config(cfg, mesh), mesh, step, lora=cfg.models.student_lora)
  finally:
    if ckpt is not None:
      ckpt.close()
  return LoadedRun(as_trained(cfg, student), cfg, int(step))


def as_trained(cfg: Config, student):
  """The checkpoint's ``student`` (its stored float weights) computing as the run's distiller ran it: through
  ``student.quantize_aware``'s fake quantization when the run trained quantization-aware
  (`meshdistill.models.compress.quantize_aware`: the weights stay float and shared, the forward is quantized), else
  unchanged. The float forward of a quantization-aware student is never what was trained or validated: its float
  weights are `meshdistill.models.compress.qat.dequantized`'s input, not the model."""
  settings = cfg.models.student_quantize_aware
  return quantize_aware(student, settings) if settings.enabled else student


def stored_student_config(cfg: Config, mesh=None):
  """The student's `ModelConfig` as the run's checkpoints store it, fitted to ``mesh`` (None: one device).

  On a mesh, training pads a vocabulary its ``tensor`` does not divide and may replicate key/value heads
  (`meshdistill.models.ModelConfig.for_tensor`); the checkpoint holds those padded rows, so the student is
  read with the same padding (the decoder cuts it off its logits) and then, on ``mesh``, fitted to its
  ``tensor`` too.
  """
  student, cfg = cfg.student, resolve_mesh(cfg)
  if not layout_class(cfg.mesh.backend).one_device:
    student = student.for_tensor(cfg.mesh.tensor)
  return student if mesh is None else student.for_tensor(mesh.shape["tensor"])


def run_teacher(cfg: Config, meta: dict, mesh, tokenizer):
  """``(teacher_dir, teacher)`` of a distillation run whose checkpoint ``meta`` is given, from its teacher source
  (`meshdistill.teachers.kinds.TeacherSource.saved_model`, read only); a source without a teacher model raises
  `meshdistill.teachers.kinds.NoTeacherModel` saying so."""
  return kinds.for_config(cfg).saved_model(meta.get("teacher_dir"), mesh, tokenizer)


def summary_table(summary: dict) -> str:
  """The final teacher / student table as text."""
  if summary.get("teachers"):  # several teachers: each one's loss and the student against each
    return multi.summary_table(summary)
  t, s = summary["teacher"], summary["student"]
  if "bpb" in s:  # a teacher of another tokenizer: losses per token do not compare, bits per byte do
    rows = [("model", "params", "val bits/byte"),
            ("teacher", f"{t['params']:,}", f"{t['bpb']:.4f}") if t else None,
            ("distilled student", f"{s['params']:,}", f"{s['bpb']:.4f}")]
    rows = [r for r in rows if r is not None]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    last = (f"student/teacher params {summary['param_ratio']:.1%}; two tokenizers: compared per byte" if t else
            "(teacher given by its cross-tokenizer top-k cache only: not evaluated)")
    return "\n".join([line(rows[0]), "  ".join("-" * w for w in widths), *map(line, rows[1:]), last])
  rows = [
    ("model", "params", "val loss", "val ppl"),
    ("teacher", f"{t['params']:,}", f"{t['loss']:.4f}", f"{t['ppl']:.3f}") if t else None,
    ("distilled student", f"{s['params']:,}", f"{s['loss']:.4f}", f"{s['ppl']:.3f}"),
  ]
  if t is None:  # distilled from a teacher cache: no teacher weights to evaluate
    rows = [r for r in rows if r is not None]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
    if summary.get("teacher_dir") is None:
      return table + "\n(no teacher: the student alone)"
    return table + "\n(teacher given by its top-k only: not evaluated)"
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
  out = [line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]]
  out.append(
    f"student/teacher params {summary['param_ratio']:.1%}; student vs teacher: KL {s['kl']:.4f}, "
    f"top-1 agreement {s['agree']:.1%}, logit correlation {s['corr']:.3f}"
  )
  return "\n".join(out)
