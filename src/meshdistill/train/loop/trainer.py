"""The training loop: data -> step -> metrics -> evaluation -> checkpoints. The only loop.

`fit` drives a `meshdistill.Distiller` -- with a teacher for distillation, without one
(`meshdistill.train.hardlabel.HardLabelTrainer`) for teacher pretraining and hard-label baselines.
Its settings are one `FitOptions`; what happens besides the step is a list of hooks
(`meshdistill.train.loop.hooks`: train metrics, evaluation, checkpoints, profiling, the memory check), like
nanodo's periodic actions. The loop itself, step by step, is `meshdistill.train.loop.run.Run`.

Resume is exact: when the checkpoint directory holds a finished checkpoint, `fit` restores
the train state (parameters, optimizer state, step) onto the current layout and the data
iterator's position, then continues. The run's step and data order from there are those
of an uninterrupted run, so the result is bitwise identical (tested).

Under `meshdistill.train.loop.stopping.stop_on_signals` (the CLI), a SIGTERM lets the step in flight finish, checkpoints
it and raises `meshdistill.train.loop.stopping.Stopped`. A (re)started run first drops the ``metrics.jsonl`` rows past its
start step (`Monitor.rewind`), so a resumed run logs each step once. It resumes from the newest checkpoint whose
checksums hold (damaged newer ones are named in a warning and set aside on restore).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from meshdistill.train.loop import hooks as hooks_lib
from meshdistill.storage.checkpoint import COMPUTE_FIELDS, Checkpointer
from meshdistill.parallel.distributed import agree_on
from meshdistill.train.loop.evaluate import Evaluator
from meshdistill.train.loop.guard import DivergenceGuard, Recovery
from meshdistill.train.loop.monitor import Monitor, ProfileWindow
from meshdistill.train.loop.run import Run
from meshdistill.train.optimizers import lr_schedule, make_optimizer  # noqa: F401 -- re-exported
from meshdistill.core.state import TrainState
from meshdistill.train.teacher import TeacherKind

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class FitOptions:
  """The settings of one `fit` call.

  Attributes:
    steps: the run's total number of steps (a resumed run continues up to it); None runs until
      the data end. Data that ends first ends the run there, with what a run does at its end (the
      last train log, the final evaluation, the final checkpoint) and a message saying so.
    kind: a label stored in checkpoints (``distill`` / ``pretrain``); resuming checks it.
    eval_every: evaluate every N steps (0: only at the end); ``eval_batches`` bounds the batches.
    log_every: average, write and display the train metrics every N steps.
    lr: the learning-rate schedule, logged with the train metrics.
    stop_after: stop (as if interrupted) once this step is done, without the final evaluation.
    meta: extra JSON-serializable facts stored in every checkpoint.
    guard: a `DivergenceGuard` to run under (None: no guard; see `meshdistill.train.loop.run`).
    keep_every: with a guard, steps between copies of the good state, or ``"auto"`` (`state_copy.KEEP_EVERY`: 10 on
      the devices, 100 in host memory).
    keep_in: with a guard, where those copies live: ``device``, ``host`` or ``auto`` (`guard.keep_place`).
    fallback: the strategy after a divergence (default `fallback_strategy(trainer.strategy)`);
      a trainer without a teacher (hard labels) only restores.
    guard_lag: 1 reads step ``s``'s loss after dispatching step ``s + 1`` (one more step is
      thrown away after a divergence); 0 reads it right after step ``s``.
    auto_remat: measure the step's memory before the first step and turn remat on if needed (settings the trainer
      leaves at ``auto``: decided there, `meshdistill.train.tuning`).
    memory_budget_bytes: per-device budget for ``auto_remat`` (default: the device's memory;
      without either -- a CPU device -- nothing is measured).
    memory_headroom: fraction of the budget the step may use.
    metrics_light: after the first logged step, run the trainer's metrics-light step
      (`meshdistill.Distiller.metrics_light`: the same update, only ``loss``, ``grad_norm`` and ``tokens``)
      on the steps whose metrics no hook reads (`meshdistill.train.loop.hooks.Hook.wants_metrics`: the train log
      reads every ``log_every``-th). The logged means of the other metrics are then over the logged
      steps (all steps in the first window). A run that never gets past its first log compiles one
      step. Which steps run light depends on the step number and the settings only, so a resumed run
      runs the same program as the uninterrupted one at every step and resumes bit for bit whether or
      not a compiler rounds the two programs' updates alike (a run stopped between two logs, by
      ``stop_after`` or a signal, logs what its light steps computed: ``loss``, ``grad_norm``, ``tokens``).
      False: every step computes every metric.
  """

  steps: int | None
  kind: str = "distill"
  eval_every: int = 0
  eval_batches: int = 8
  log_every: int = 10
  lr: Callable[[int], Any] | None = None
  stop_after: int | None = None
  meta: dict | None = None
  guard: DivergenceGuard | None = None
  keep_every: int | str = "auto"
  keep_in: str = "auto"
  fallback: Any = None
  guard_lag: int = 1
  auto_remat: bool = False
  memory_budget_bytes: int | None = None
  memory_headroom: float = 0.9
  metrics_light: bool = True

  def __post_init__(self):
    if self.guard_lag not in (0, 1):
      raise ValueError(f"guard_lag={self.guard_lag!r} must be 0 (read each loss at once) or 1 (one step later)")


@dataclasses.dataclass
class FitResult:
  """What `fit` returns: the final state, its step, the last validation metrics and timing.

  ``trainer`` is the trainer that ran (another object than the one given when ``auto_remat``
  turned remat on); ``remat`` the `meshdistill.train.memory.RematChoice`, or the `meshdistill.train.tuning.Tuning`
  of settings left at ``auto`` (None when not measured);
  ``events`` the divergence-guard events (`DivergenceEvent` as dicts) of this call.
  """

  state: TrainState
  step: int
  eval: dict[str, float]
  resumed_from: int | None
  seconds: float
  train_seconds: float
  trainer: Any = None
  remat: Any = None
  events: list = dataclasses.field(default_factory=list)


def run_meta(trainer, kind: str, extra: dict | None = None) -> dict:
  """What a checkpoint records about the run that wrote it: ``kind``, the layout, the mesh, both model configs and
  ``extra`` (e.g. ``teacher_dir``); `check_resumable` compares a checkpoint's record with this run's."""
  meta = {"kind": kind, "backend": trainer.backend}
  if trainer.mesh is not None:
    meta["mesh"] = dict(trainer.mesh.shape)
  meta["student"] = dataclasses.asdict(trainer.student_cfg)
  if trainer.teacher_output.kind is not TeacherKind.NONE:  # a model, or its top-k: the teacher's config
    meta["teacher"] = dataclasses.asdict(trainer.teacher_cfg)
  meta.update(extra or {})
  return meta


def check_resumable(meta: dict, expected: dict, directory: str, steps: int | None) -> None:
  """Raises unless the checkpoint in ``directory`` (its record ``meta``) can resume this run: at most ``steps`` steps,
  and the same ``kind``, models and ``teacher_dir`` as ``expected`` (`run_meta`; settings that change no parameter
  may differ)."""
  if steps is not None and int(meta["step"]) > steps:
    raise ValueError(
      f"the checkpoint in {directory} is at step {meta['step']}, past this run's {steps} steps; raise the number "
      "of steps or use a fresh run.run_dir (or checkpoint.dir)"
    )
  for key in ("kind", "student", "teacher", "teacher_dir"):
    if key in expected and _same_params(meta.get(key)) != _same_params(expected[key]):
      raise ValueError(
        f"checkpoint in {directory} was written by another run ({key}: saved {meta.get(key)!r}, now "
        f"{expected[key]!r}); use a fresh run.run_dir (or checkpoint.dir), or the settings that wrote it"
      )


def _same_params(model: Any) -> Any:
  """A model config dict without the settings that change no parameter (remat, compute dtype)."""
  if not isinstance(model, dict):
    return model
  return {k: v for k, v in model.items() if k not in COMPUTE_FIELDS}


def fit(
  trainer: Any,
  data: Any,
  options: FitOptions | None = None,
  *,
  checkpointer: Checkpointer | None = None,
  monitor: Monitor | None = None,
  evaluator: Evaluator | None = None,
  profile: ProfileWindow | None = None,
  hooks: Sequence[hooks_lib.Hook] = (),
  state: TrainState | None = None,
  **settings,
) -> FitResult:
  """Trains ``trainer`` on ``data``, resuming from ``checkpointer`` if it holds a run.

  Args:
    trainer: a `Distiller` (with or without a teacher).
    data: a `meshdistill.data.DataBundle` (its batch size is the global batch size), or anything
      with ``train_iterator(position)`` (an iterator with ``get_state``) and ``val_batches(max_batches)``.
    options: the `FitOptions`; or give its fields as keywords (``steps=..., guard=...``).
    checkpointer: where to save / resume; None trains without checkpoints.
    monitor: metrics writer and progress line (default: one that only logs).
    evaluator: validation metrics (default: `Evaluator.for_trainer`).
    profile: a profiler window over some steps.
    hooks: more `meshdistill.train.loop.hooks.Hook`s, run after the built-in ones.
    state: the state to start from (default ``trainer.init_state()``; a checkpoint overrides both).

  Returns:
    A `FitResult` with the final state and the last validation metrics.
  """
  opts = dataclasses.replace(options, **settings) if options is not None else FitOptions(**settings)
  t0 = time.perf_counter()
  monitor = monitor or Monitor(None, opts.steps or 0)
  evaluator = evaluator or Evaluator.for_trainer(trainer)
  val = data.val_batches(max_batches=opts.eval_batches)
  if opts.eval_every and not val:
    raise ValueError("evaluation needs validation batches, but the data has none: set data.val_fraction > 0")
  meta = run_meta(trainer, opts.kind, opts.meta)

  state = trainer.init_state() if state is None else state
  start = int(np.asarray(jax.device_get(trainer.unreplicate(state).step)))
  data_state, resumed, saved = None, None, {}
  latest = agree_on(checkpointer.intact_step(), "the latest checkpoint") if checkpointer is not None else None
  if latest is not None:
    check_resumable(checkpointer.read_meta(latest), meta, checkpointer.directory, opts.steps)
    state, data_state, saved = checkpointer.restore(trainer, state)  # `latest`, or an older step if it fails
    start = resumed = int(saved["step"])
    got = int(np.asarray(jax.device_get(trainer.unreplicate(state).step)))
    if got != start:
      raise ValueError(f"checkpoint step {start} holds a train state at step {got}; the checkpoint is inconsistent")
    monitor.message(f"resumed from step {start} ({checkpointer.directory})")
  monitor.rewind(start)  # rows past the start are from work that is redone now
  last = float("inf") if opts.steps is None else opts.steps
  last = min(last, opts.stop_after) if opts.stop_after is not None else last
  actions: list[hooks_lib.Hook] = []
  if opts.auto_remat:
    actions.append(hooks_lib.AutoRemat(opts.memory_budget_bytes, opts.memory_headroom))
  actions += [hooks_lib.LogTrain(opts.log_every, opts.lr), hooks_lib.Evaluate(evaluator, val, opts.eval_every)]
  if checkpointer is not None:
    actions.append(hooks_lib.Checkpoint(checkpointer, meta))
  if profile is not None:
    actions.append(hooks_lib.Profile(profile))
  actions += list(hooks)
  it = data.train_iterator(data_state)
  run = Run(trainer, state, start=start, last=last, steps=opts.steps, it=it, monitor=monitor, hooks=actions,
            lag=opts.guard_lag, light=opts.metrics_light)
  t_train = time.perf_counter()
  try:
    for h in actions:
      h.before_loop(run)
    if opts.guard is not None:
      run.guard_with(Recovery(run.trainer, opts.guard, opts.keep_every, opts.fallback, keep_in=opts.keep_in,
                              say=monitor.message,
                              on_event=lambda s, kind, fields: monitor.event(s, kind, **fields),
                              checkpoints=getattr(checkpointer, "all_steps", None)), saved.get("guard"))
    t_train = time.perf_counter()
    run.run()
  finally:
    it.close()
    for h in actions:
      h.close()
  if start >= last and val and not run.last_eval:  # nothing left to train: report the restored state
    run.last_eval = evaluator(run.trainer.unreplicate(run.state.params)["student"], val)
  train_seconds = time.perf_counter() - t_train
  return FitResult(run.state, run.step, run.last_eval, resumed, time.perf_counter() - t0, train_seconds, run.trainer,
                   run.remat, run.recovery.events)
