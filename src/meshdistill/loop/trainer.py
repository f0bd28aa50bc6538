"""The training loop: data -> step -> metrics -> evaluation -> checkpoints. The only loop.

`fit` drives a `meshdistill.Distiller` -- with a teacher for distillation, without one
(`meshdistill.train.hardlabel.HardLabelTrainer`) for teacher pretraining and hard-label baselines.
Its settings are one `FitOptions`; what happens besides the step is a list of hooks
(`meshdistill.loop.hooks`: train metrics, evaluation, checkpoints, profiling, the memory check), like
nanodo's periodic actions.

Resume is exact: when the checkpoint directory holds a finished checkpoint, `fit` restores
the train state (parameters, optimizer state, step) onto the current layout and the data
iterator's position, then continues. The run's step and data order from there are those
of an uninterrupted run, so the result is bitwise identical (tested).

One step, in order: read the next host batch; dispatch the compiled step (metrics stay on
device); judge the previous step's loss (the divergence guard); every ``log_every`` steps
fetch and average the metrics (`Monitor`); every ``eval_every`` steps (and at the end)
evaluate on the fixed validation batches; every ``checkpoint.every`` steps (and at the end) save.
After the first logged step, steps whose metrics nothing reads run the trainer's metrics-light step
(same update; ``FitOptions.metrics_light``).

With a `DivergenceGuard` (``guard``) the loop reads every step's loss. A non-finite loss, or one
far above its running median, restores the last good train state and, for distillation,
switches to the fallback loss (logit MSE by default) for the rest of the freezing stage; both
are ``event`` rows. The good state is a device copy of the state before step ``s + 1``, taken
when ``s`` is a multiple of ``keep_every`` or a checkpoint step, and kept once step ``s + 1``'s
loss is good; checkpoints are written from such copies (`meshdistill.loop.hooks.Checkpoint`). The
guard's history, restore count and fallback state travel in the checkpoint, so resuming is exact.

Lagged check (``guard_lag=1``, the default): the loss of step ``s`` is read after step ``s + 1``
has been dispatched, so reading it never stalls the device queue. When step ``s`` diverged,
step ``s + 1`` already ran on the diverged state and is thrown away too: after a divergence
the batches of the diverged step AND of the one after it are spent (never retried), whether
the loss happened to be read at once (before logging, evaluating or saving at ``s``, the loop
reads it first) or one step later, so a run's numbers do not depend on those cadences.
``guard_lag=0`` reads each loss right after its step and spends only the diverged batch.
With no guard the loop reads no loss at all (`meshdistill.loop.guard.NoRecovery`).

Under `meshdistill.loop.stopping.stop_on_signals` (the CLI), a SIGTERM lets the step in flight finish,
checkpoints it and raises `Stopped`. A (re)started run first drops the ``metrics.jsonl`` rows past
its start step (`Monitor.rewind`), so a resumed run logs each step once. It resumes from the newest
checkpoint whose checksums hold (damaged newer ones are named in a warning and set aside on restore).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from meshdistill.loop import hooks as hooks_lib
from meshdistill.storage.checkpoint import COMPUTE_FIELDS, Checkpointer
from meshdistill.distributed import agree_on
from meshdistill.loop.evaluate import Evaluator
from meshdistill.loop.guard import DivergenceGuard, NoRecovery, Recovery, copy_state
from meshdistill.loop.monitor import Monitor, ProfileWindow
from meshdistill.train.optimizers import lr_schedule, make_optimizer  # noqa: F401 -- re-exported
from meshdistill.train.step import TrainState
from meshdistill.loop.stopping import Stopped, requested

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
    guard: a `DivergenceGuard` to run under (None: no guard; see the module docstring).
    keep_every: with a guard, steps between copies of the good state.
    fallback: the strategy after a divergence (default `fallback_strategy(trainer.strategy)`);
      a trainer without a teacher (hard labels) only restores.
    guard_lag: 1 reads step ``s``'s loss after dispatching step ``s + 1`` (one more step is
      thrown away after a divergence); 0 reads it right after step ``s``.
    auto_remat: measure the step's memory before the first step and turn remat on if needed.
    memory_budget_bytes: per-device budget for ``auto_remat`` (default: the device's memory;
      without either -- a CPU device -- nothing is measured).
    memory_headroom: fraction of the budget the step may use.
    metrics_light: after the first logged step, run the trainer's metrics-light step
      (`meshdistill.Distiller.metrics_light`: the same update, only ``loss``, ``grad_norm`` and ``tokens``)
      on the steps whose metrics no hook reads (`meshdistill.loop.hooks.Hook.wants_metrics`: the train log
      reads every ``log_every``-th). The logged means of the other metrics are then over the logged
      steps (all steps in the first window). A run that never gets past its first log compiles one
      step. False: every step computes every metric.
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
  keep_every: int = 10
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
  turned remat on); ``remat`` the `meshdistill.train.memory.RematChoice` (None when not measured);
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


def _meta(trainer, kind: str, extra: dict | None) -> dict:
  meta = {"kind": kind, "backend": trainer.backend}
  if trainer.mesh is not None:
    meta["mesh"] = dict(trainer.mesh.shape)
  meta["student"] = dataclasses.asdict(trainer.student_cfg)
  if getattr(trainer, "teacher_cfg", None) is not None:
    meta["teacher"] = dataclasses.asdict(trainer.teacher_cfg)
  meta.update(extra or {})
  return meta


def _check_resumable(meta: dict, expected: dict, directory: str, steps: int | None) -> None:
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


def _trained_tokens(batch: dict, metrics: dict) -> float:
  """The tokens a step trained on: its own count where it is a host number (a trainer that builds the
  batch it trains on, e.g. `meshdistill.train.onpolicy.OnPolicyDistiller`), else the mask of the batch it was
  given (read on the host: no wait for the device)."""
  tokens = metrics.get("tokens")
  if isinstance(tokens, (np.ndarray, np.generic)):
    return float(tokens)
  return float(np.sum(batch["mask"]))


class StepInfo(NamedTuple):
  """A dispatched step whose loss the guard has not judged yet."""

  step: int  # the state's step after it
  metrics: dict  # on device
  tokens: float
  candidate: Any  # a copy of the state before it, or None
  position: Any  # the data position before its batch
  guard: dict | None  # the guard's snapshot that goes with ``candidate``
  strategy: str  # "primary" / "fallback"


class Run:
  """The loop's state as hooks see it, and the loop itself (`run`)."""

  def __init__(self, trainer, state, *, start: int, last: float, steps: int | None, it, monitor: Monitor,
               hooks: Sequence[hooks_lib.Hook], lag: int, light: bool = False):
    self.trainer, self.state, self.it, self.monitor, self.hooks, self.lag = trainer, state, it, monitor, hooks, lag
    self.light = light  # metrics-light steps where no hook reads the metrics, once one step was logged
    self._logged = False
    self.start, self.step, self.last, self.steps = start, start, last, steps
    self.recovery: Any = NoRecovery(trainer)
    self.pending: StepInfo | None = None
    self.ahead = None  # a batch read before the loop (for the memory check) and the data position before it
    self.ended = False  # the data ran out
    self.last_eval: dict[str, float] = {}
    self.remat = None
    self._guard_snapshot = None

  def read_ahead(self) -> dict:
    """The first batch of the loop, read now (it is still the first step's batch)."""
    if self.ahead is None:
      position = self.it.get_state()
      self.ahead = (next(self.it), position)
    return self.ahead[0]

  def guard_with(self, recovery: Recovery, saved: dict | None) -> None:
    self.recovery = recovery
    recovery.load(saved)
    recovery.start(self.state, self.start)
    self._guard_snapshot = recovery.snapshot()

  def run(self) -> None:
    self.monitor.start(self.start)
    while self.step < self.last and not self.ended:
      self._advance()
    if self.pending is not None:  # the data ended before the last step's loss was read
      self._settle()
    if self.ended and self.step > self.start:
      self._end_with_the_data()

  def _end_with_the_data(self) -> None:
    """The data ran out before the run's last step: the step reached ends the run, so what a run does at its
    end (the last train log, the final evaluation, the final checkpoint) happens now, once: the hooks already
    due at this step acted on it in `_advance`."""
    step = self.step
    done = [h for h in self.hooks if h.due(self, step)]
    if self.steps is not None:
      self.monitor.message(f"the data ran out after step {step} of {self.steps}; the run ends there")
    self.last = self.steps = step
    t_aside = time.perf_counter()
    for h in self.hooks:
      if h not in done and h.due(self, step):
        h.after_step(self, step)
    self.monitor.exclude(time.perf_counter() - t_aside)

  def _next_batch(self):
    if self.ahead is not None:
      (batch, position), self.ahead = self.ahead, None
      return batch, position
    position = self.it.get_state() if self.recovery.guarded else None
    return next(self.it), position

  def _advance(self) -> None:
    rec = self.recovery
    if self.pending is not None and rec.needs_settled() and not self._settle():
      return
    step = self.step
    for h in self.hooks:
      h.before_step(self, step + 1)
    try:
      batch, position = self._next_batch()
    except StopIteration:
      self.ended = True
      return
    rec.before_step(step, self.state)
    candidate = None
    if rec.wants_copy(step, any(h.wants_copy(step) for h in self.hooks)):
      candidate = copy_state(self.state)  # the state is donated to the step
    strategy = rec.active
    runner = rec.runner
    wanted = any(h.wants_metrics(self, step + 1) for h in self.hooks)
    if self.light and self._logged and not wanted and hasattr(runner, "metrics_light"):
      runner = runner.metrics_light()
    self._logged = self._logged or wanted
    self.state, metrics = runner.step(self.state, batch)
    if self.pending is not None and not self._settle(dispatched=True):
      return  # the step just dispatched ran on a diverged state: thrown away, its batch spent
    self.pending = StepInfo(step + 1, metrics, _trained_tokens(batch, metrics), candidate, position,
                            self._guard_snapshot, strategy)
    self.step = step + 1
    for h in self.hooks:
      h.after_dispatch(self, self.step, metrics)
    due = [h for h in self.hooks if h.due(self, self.step)]
    if (due or self.lag == 0) and not self._settle():
      return
    t_aside = time.perf_counter()
    for h in due:
      h.after_step(self, self.step)
    self.monitor.exclude(time.perf_counter() - t_aside)
    if requested() is not None and self.step < self.last:
      self._stop()

  def _stop(self) -> None:
    """A SIGTERM (`meshdistill.loop.stopping`): the step in flight is judged (restored if it diverged), then
    the hooks checkpoint and log the state, and `Stopped` ends the run."""
    if self.pending is not None:
      self._settle()
    for h in self.hooks:
      h.on_stop(self, self.step)
    saved = [h.checkpointer.directory for h in self.hooks if isinstance(h, hooks_lib.Checkpoint)]
    raise Stopped(requested(), self.step, saved[0] if saved else None)

  def _settle(self, dispatched: bool = False) -> bool:
    """Judges the pending step's loss; on divergence restores the good state. Returns whether it was good.

    ``dispatched``: another step was already dispatched after the pending one (it is discarded on
    divergence); otherwise, with ``lag=1``, the next batch is skipped so that the same batches are spent.
    """
    info, self.pending = self.pending, None
    after = None if dispatched else self.state
    reason = self.recovery.diverged(info.step, info.metrics["loss"], info.metrics.get("grad_norm"))
    if reason is None:
      if info.candidate is not None:  # the state before this step produced a good loss: keep it
        self.recovery.keep(info.candidate, info.step - 1)
        for h in self.hooks:
          h.on_confirmed(self, info.step - 1, info.candidate, info.position, info.guard)
      self.monitor.step(info.step, info.metrics, info.tokens)
    else:
      self.state, self.step = self.recovery.recover(info.step, reason)
      if self.lag and not dispatched:
        try:
          next(self.it)
        except StopIteration:
          self.ended = True
    self._guard_snapshot = self.recovery.snapshot()
    for h in self.hooks:
      h.on_settled(self, info, after, reason)
    return reason is None


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
    hooks: more `meshdistill.loop.hooks.Hook`s, run after the built-in ones.
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
  meta = _meta(trainer, opts.kind, opts.meta)

  state = trainer.init_state() if state is None else state
  start = int(np.asarray(jax.device_get(trainer.unreplicate(state).step)))
  data_state, resumed, saved = None, None, {}
  latest = agree_on(checkpointer.intact_step(), "the latest checkpoint") if checkpointer is not None else None
  if latest is not None:
    _check_resumable(checkpointer.read_meta(latest), meta, checkpointer.directory, opts.steps)
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
      run.guard_with(Recovery(run.trainer, opts.guard, opts.keep_every, opts.fallback, say=monitor.message,
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
