"""The training loop: data -> step -> metrics -> evaluation -> checkpoints. The only loop.

`fit` drives any step object with the `Distiller` interface (`init_state`, `step`,
`unreplicate`, ``student_def``, ``mesh``, ``backend``): the `Distiller` itself for
distillation, `meshdistill.hardlabel.HardLabelTrainer` for teacher pretraining and
hard-label baselines.

Resume is exact: when the checkpoint directory holds a finished checkpoint, `fit` restores
the train state (parameters, optimizer state, step) onto the current layout and the data
iterator's position, then continues. The run's step and data order from there are those
of an uninterrupted run, so the result is bitwise identical (tested).

One step, in order: read the next host batch; run the compiled step (metrics stay on
device); every ``log_every`` steps fetch and average them (`Monitor`); every ``eval_every``
steps (and at the end) evaluate on the fixed validation batches; every
``checkpoint.every`` steps (and at the end) save.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from meshdistill.checkpoint import Checkpointer
from meshdistill.evaluate import Evaluator
from meshdistill.monitor import Monitor, ProfileWindow
from meshdistill.step import TrainState

log = logging.getLogger(__name__)


def lr_schedule(settings) -> optax.Schedule:
  """Linear warm-up from 0 to ``lr`` over ``warmup`` steps, then cosine decay to ``lr * final_lr_fraction``."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=settings.lr,
    warmup_steps=settings.warmup,
    decay_steps=settings.steps,
    end_value=settings.lr * settings.final_lr_fraction,
  )


def make_optimizer(settings, n_layers: int | None = None) -> optax.GradientTransformation:
  """AdamW on `lr_schedule`, behind global-norm clipping and a skip of non-finite updates.

  ``settings`` is a `meshdistill.config.TrainSettings` (or anything with ``lr``, ``warmup``,
  ``steps``, ``final_lr_fraction``, ``weight_decay``, ``clip``). With a freezing schedule
  (``settings.freeze``; needs the model's ``n_layers``) the AdamW runs inside
  `meshdistill.freezing.progressive_freeze`: each stage's blocks are frozen bit for bit and the
  stage's learning rate replaces the schedule; clipping then covers the trainable gradients only.
  """
  from meshdistill.safeguards import safeguarded  # pylint: disable=g-import-not-at-top

  stages = settings.stages() if hasattr(settings, "stages") else None
  if stages is not None:
    from meshdistill.freezing import progressive_freeze  # pylint: disable=g-import-not-at-top

    if n_layers is None:
      raise ValueError("make_optimizer: a freezing schedule needs the model's n_layers")
    frozen = progressive_freeze(
      stages, n_layers, optax.adamw(1.0, weight_decay=settings.weight_decay), clip=settings.clip
    )
    return safeguarded(frozen, clip=None)
  inner = optax.adamw(lr_schedule(settings), weight_decay=settings.weight_decay)
  return safeguarded(inner, clip=settings.clip)


@dataclasses.dataclass
class FitResult:
  """What `fit` returns: the final state, its step, the last validation metrics and timing."""

  state: TrainState
  step: int
  eval: dict[str, float]
  resumed_from: int | None
  seconds: float
  train_seconds: float


def _meta(trainer, kind: str, extra: dict | None) -> dict:
  meta = {"kind": kind, "backend": trainer.backend}
  if trainer.mesh is not None:
    meta["mesh"] = dict(trainer.mesh.shape)
  meta["student"] = dataclasses.asdict(trainer.student_cfg)
  if getattr(trainer, "teacher_cfg", None) is not None:
    meta["teacher"] = dataclasses.asdict(trainer.teacher_cfg)
  meta.update(extra or {})
  return meta


def _check_resumable(meta: dict, expected: dict, directory: str, steps: int) -> None:
  if int(meta["step"]) > steps:
    raise ValueError(
      f"the checkpoint in {directory} is at step {meta['step']}, past this run's {steps} steps; raise the number "
      "of steps or use a fresh run.run_dir (or checkpoint.dir)"
    )
  for key in ("kind", "student", "teacher", "teacher_dir"):
    if key in expected and meta.get(key) != expected[key]:
      raise ValueError(
        f"checkpoint in {directory} was written by another run ({key}: saved {meta.get(key)!r}, now "
        f"{expected[key]!r}); use a fresh run.run_dir (or checkpoint.dir), or the settings that wrote it"
      )


def _schedule_metrics(state: TrainState, step: int, lr) -> dict[str, float]:
  """The learning rate of the step just taken and, with progressive freezing, the stage."""
  from meshdistill.freezing import freeze_status  # pylint: disable=g-import-not-at-top

  status = freeze_status(state.opt_state)
  if status is not None:
    return {"lr": float(status["lr"]), "freeze_stage": float(status["stage"])}
  return {"lr": float(lr(step - 1))} if lr is not None else {}


def fit(
  trainer: Any,
  data: Any,
  *,
  steps: int,
  kind: str = "distill",
  eval_every: int = 0,
  eval_batches: int = 8,
  log_every: int = 10,
  checkpointer: Checkpointer | None = None,
  monitor: Monitor | None = None,
  evaluator: Evaluator | None = None,
  profile: ProfileWindow | None = None,
  lr: Callable[[int], Any] | None = None,
  stop_after: int | None = None,
  meta: dict | None = None,
) -> FitResult:
  """Trains ``trainer`` for ``steps`` steps on ``data``, resuming from ``checkpointer`` if it holds a run.

  Args:
    trainer: a `Distiller` or `HardLabelTrainer`.
    data: a `meshdistill.data.DataBundle` (its batch size is the global batch size).
    steps: the run's total number of steps (a resumed run continues up to it).
    kind: a label stored in checkpoints (``distill`` / ``pretrain``); resuming checks it.
    eval_every: evaluate every N steps (0: only at the end); ``eval_batches`` bounds the batches.
    log_every: average, write and display the train metrics every N steps.
    checkpointer: where to save / resume; None trains without checkpoints.
    monitor: metrics writer and progress line (default: one that only logs).
    evaluator: validation metrics (default: `Evaluator.for_trainer`).
    profile: a profiler window over some steps.
    lr: the learning-rate schedule, logged with the train metrics.
    stop_after: stop (as if interrupted) once this step is done, without the final evaluation.
    meta: extra JSON-serializable facts stored in every checkpoint.

  Returns:
    A `FitResult` with the final state and the last validation metrics.
  """
  t0 = time.perf_counter()
  monitor = monitor or Monitor(None, steps)
  evaluator = evaluator or Evaluator.for_trainer(trainer)
  val = data.val_batches(max_batches=eval_batches)
  if eval_every and not val:
    raise ValueError("evaluation needs validation batches, but the data has none: set data.val_fraction > 0")
  meta = _meta(trainer, kind, meta)

  state = trainer.init_state()
  start, data_state, resumed = 0, None, None
  if checkpointer is not None and checkpointer.latest_step() is not None:
    _check_resumable(checkpointer.read_meta(), meta, checkpointer.directory, steps)
    state, data_state, saved = checkpointer.restore(trainer, state)
    start = resumed = int(saved["step"])
    got = int(np.asarray(jax.device_get(trainer.unreplicate(state).step)))
    if got != start:
      raise ValueError(f"checkpoint step {start} holds a train state at step {got}; the checkpoint is inconsistent")
    monitor.message(f"resumed from step {start} ({checkpointer.directory})")
  it = data.train_iterator(data_state)
  last = min(steps, stop_after) if stop_after is not None else steps
  last_eval: dict[str, float] = {}
  monitor.start(start)
  t_train = time.perf_counter()
  try:
    for step in range(start + 1, last + 1):
      if profile is not None:
        profile.before_step(step)
      batch = next(it)
      state, metrics = trainer.step(state, batch)
      monitor.step(step, metrics, float(np.sum(batch["mask"])))
      if profile is not None:
        profile.after_step(step, metrics)
      if step % log_every == 0 or step == last:
        monitor.flush_train(step, _schedule_metrics(state, step, lr))
      done = step == steps
      t_aside = time.perf_counter()
      if val and ((eval_every and step % eval_every == 0) or done):
        last_eval = evaluator(trainer.unreplicate(state.params)["student"], val)
        monitor.eval(step, last_eval)
      if checkpointer is not None:
        checkpointer.maybe_save(step, trainer, state, it.get_state(), meta, final=done)
      monitor.exclude(time.perf_counter() - t_aside)
  finally:
    it.close()
    if profile is not None:
      profile.close()
  if start >= last and val and not last_eval:  # nothing left to train: report the restored state
    last_eval = evaluator(trainer.unreplicate(state.params)["student"], val)
  train_seconds = time.perf_counter() - t_train
  return FitResult(state, last, last_eval, resumed, time.perf_counter() - t0, train_seconds)
