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

Before the first step (``auto_remat``) the step is compiled once and its per-device memory
compared with the device's (or a given budget); when it would not fit, the student's
rematerialisation is turned on (`meshdistill.memory.fit_remat`), logged and written to
``metrics.jsonl`` as an ``event`` row.

With a `DivergenceGuard` (``guard``) the loop reads every step's loss. A non-finite loss, or one
far above its running median, restores the last good train state and, for distillation,
switches to the fallback loss (logit MSE by default) for the rest of the freezing stage; both
are ``event`` rows. The batch that diverged is not retried: data keep moving forward. The good
state is a device copy of the state before step ``s + 1``, taken when ``s`` is a multiple of
``keep_every`` or a checkpoint step, and kept once step ``s + 1``'s loss is good. Under the guard a
checkpoint of step ``s`` is written only then, from that copy, so every checkpoint holds a state
the guard accepted and no checkpoint is newer than the state a restore returns to (the last
step of a run is saved at once: nothing follows to confirm it). The guard's history, restore
count and fallback state travel in the checkpoint, so resuming is still exact.
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

from meshdistill.checkpoint import COMPUTE_FIELDS, Checkpointer
from meshdistill.distributed import agree_on
from meshdistill.evaluate import Evaluator
from meshdistill.monitor import Monitor, ProfileWindow
from meshdistill.safeguards import DivergenceGuard, Recovery, copy_state, skipped_updates
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


def make_optimizer(
  settings, n_layers: int | None = None, loss_scale: float | None = None
) -> optax.GradientTransformation:
  """AdamW on `lr_schedule`, behind global-norm clipping and a skip of non-finite updates.

  ``settings`` is a `meshdistill.config.TrainSettings` (or anything with ``lr``, ``warmup``,
  ``steps``, ``final_lr_fraction``, ``weight_decay``, ``clip``). With a freezing schedule
  (``settings.freeze``; needs the model's ``n_layers``) the AdamW runs inside
  `meshdistill.freezing.progressive_freeze`: each stage's blocks are frozen bit for bit and the
  stage's learning rate replaces the schedule; clipping then covers the trainable gradients only.
  ``loss_scale`` divides the gradients first (pair it with `meshdistill.safeguards.ScaledLoss`).
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
    return safeguarded(frozen, clip=None, loss_scale=loss_scale)
  inner = optax.adamw(lr_schedule(settings), weight_decay=settings.weight_decay)
  return safeguarded(inner, clip=settings.clip, loss_scale=loss_scale)


@dataclasses.dataclass
class FitResult:
  """What `fit` returns: the final state, its step, the last validation metrics and timing.

  ``trainer`` is the trainer that ran (another object than the one given when ``auto_remat``
  turned remat on); ``remat`` the `meshdistill.memory.RematChoice` (None when not measured);
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


def _check_resumable(meta: dict, expected: dict, directory: str, steps: int) -> None:
  if int(meta["step"]) > steps:
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


def _schedule_metrics(state: TrainState, step: int, lr) -> dict[str, float]:
  """The learning rate of the step just taken and, with progressive freezing, the stage."""
  from meshdistill.freezing import freeze_status  # pylint: disable=g-import-not-at-top

  status = freeze_status(state.opt_state)
  if status is not None:
    return {"lr": float(status["lr"]), "freeze_stage": float(status["stage"])}
  return {"lr": float(lr(step - 1))} if lr is not None else {}


def _measure_remat(trainer, state, batch, budget_bytes, headroom, monitor: Monitor, step: int):
  """`fit_remat` before the first step, reported on the progress line and as an event row."""
  from meshdistill.memory import device_memory_limit, fit_remat  # pylint: disable=g-import-not-at-top

  devices = trainer.mesh.devices.flat if trainer.mesh is not None else jax.devices()[:1]
  if budget_bytes is None and device_memory_limit(next(iter(devices))) is None:
    log.info("memory check skipped: the %s device reports no memory limit (set a budget to check)",
             jax.default_backend())
    return trainer, None
  before = trainer.student_cfg.remat
  options = None
  if jax.default_backend() == "cpu" and trainer.backend != "pmap":
    # XLA's default CPU scheduler favours concurrency and hides what remat saves; with a memory
    # budget asked for on CPU, measure and run the step under the memory-optimised scheduler.
    from meshdistill.memory import CPU_MEMORY_SCHEDULER  # pylint: disable=g-import-not-at-top

    options = CPU_MEMORY_SCHEDULER
  chosen, choice = fit_remat(trainer, state, batch, budget_bytes=budget_bytes, headroom=headroom,
                             compiler_options=options)
  mib = {name: round(r.total_bytes / 2**20, 3) for name, r in choice.reports.items()}
  monitor.event(step, "remat", remat=choice.remat, previous=before, fits=choice.fits,
                budget_mib=round(choice.budget_bytes / 2**20, 3), headroom=headroom, step_mib=mib)
  budget = f"{headroom:.0%} of {choice.budget_bytes / 2**20:.4g} MiB"
  if choice.remat != before:
    monitor.message(
      f"memory: the step needs {mib[before]:.4g} MiB per device with remat={before!r}, over {budget}; turned on "
      f"remat={choice.remat!r} ({mib[choice.remat]:.4g} MiB)"
      + ("" if choice.fits else ", the leanest, which still does not fit")
    )
  else:
    log.info("memory: the step needs %.4g MiB per device (%s): remat=%r kept", mib[before], budget, before)
  return chosen, choice


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
  guard: DivergenceGuard | None = None,
  keep_every: int = 10,
  fallback: Any = None,
  auto_remat: bool = False,
  memory_budget_bytes: int | None = None,
  memory_headroom: float = 0.9,
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
    guard: a `DivergenceGuard` to run under (None: no guard; see the module docstring).
    keep_every: with a guard, steps between copies of the good state.
    fallback: the strategy after a divergence (default `fallback_strategy(trainer.strategy)`);
      a trainer without strategies (hard labels) only restores.
    auto_remat: measure the step's memory before the first step and turn remat on if needed.
    memory_budget_bytes: per-device budget for ``auto_remat`` (default: the device's memory;
      without either -- a CPU device -- nothing is measured).
    memory_headroom: fraction of the budget the step may use.

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
  start, data_state, resumed, saved = 0, None, None, {}
  latest = agree_on(checkpointer.latest_step(), "the latest checkpoint") if checkpointer is not None else None
  if latest is not None:
    _check_resumable(checkpointer.read_meta(latest), meta, checkpointer.directory, steps)
    state, data_state, saved = checkpointer.restore(trainer, state, latest)
    start = resumed = int(saved["step"])
    got = int(np.asarray(jax.device_get(trainer.unreplicate(state).step)))
    if got != start:
      raise ValueError(f"checkpoint step {start} holds a train state at step {got}; the checkpoint is inconsistent")
    monitor.message(f"resumed from step {start} ({checkpointer.directory})")
  it = data.train_iterator(data_state)
  last = min(steps, stop_after) if stop_after is not None else steps
  last_eval: dict[str, float] = {}
  remat, recovery = None, None
  ahead = None  # a batch read before the loop (for the memory check) and the data position before it
  t_train = time.perf_counter()
  try:
    if auto_remat and start < last:
      position = it.get_state()
      ahead = (next(it), position)
      trainer, remat = _measure_remat(trainer, state, ahead[0], memory_budget_bytes, memory_headroom, monitor, start)
    if guard is not None:
      recovery = Recovery(trainer, guard, keep_every, fallback, say=monitor.message,
                          on_event=lambda s, kind, fields: monitor.event(s, kind, **fields))
      recovery.load(saved.get("guard"))
      recovery.keep(copy_state(state), start)

    def due(s: int) -> bool:  # a checkpoint is due after step s
      return checkpointer is not None and bool(checkpointer.every) and s % checkpointer.every == 0

    monitor.start(start)
    t_train = time.perf_counter()
    step = start
    while step < last:
      if profile is not None:
        profile.before_step(step + 1)
      if ahead is not None:
        (batch, position), ahead = ahead, None
      else:
        position = it.get_state() if recovery is not None else None
        batch = next(it)
      candidate = None
      if recovery is not None:
        snapshot = recovery.snapshot()
        recovery.before_step(step, state)
        if recovery.wants_copy(step, due(step)):
          candidate = copy_state(state)  # the state is donated to the step
      runner = recovery.runner if recovery is not None else trainer
      state, metrics = runner.step(state, batch)
      if recovery is not None:
        # A replicated output: every process reads the same bits (see meshdistill.distributed).
        loss = float(np.asarray(jax.device_get(metrics["loss"])).reshape(-1)[0])
        reason = recovery.diverged(step + 1, loss)
        if reason is not None:
          state, step = recovery.recover(step + 1, loss, reason)
          continue
        if candidate is not None:  # the state before this step produced a good loss: keep it
          recovery.keep(candidate, step)
          if due(step) and step > start and step not in checkpointer.all_steps():
            checkpointer.save(step, trainer, candidate, position, {**meta, "guard": snapshot})
      step += 1
      monitor.step(step, metrics, float(np.sum(batch["mask"])))
      if profile is not None:
        profile.after_step(step, metrics)
      if step % log_every == 0 or step == last:
        extra = _schedule_metrics(state, step, lr)
        extra["skipped"] = float(skipped_updates(state.opt_state))
        if recovery is not None:
          extra.update(restores=float(recovery.restores), fallback=float(recovery.active == "fallback"))
        monitor.flush_train(step, extra)
      done = step == steps
      t_aside = time.perf_counter()
      if val and ((eval_every and step % eval_every == 0) or done):
        last_eval = evaluator(trainer.unreplicate(state.params)["student"], val)
        monitor.eval(step, last_eval)
      if checkpointer is not None:
        if recovery is None:
          checkpointer.maybe_save(step, trainer, state, it.get_state(), meta, final=done)
        elif step == last and (done or due(step)):  # nothing follows to confirm this state: save it now
          checkpointer.maybe_save(step, trainer, state, it.get_state(), {**meta, "guard": recovery.snapshot()},
                                  final=True)
      monitor.exclude(time.perf_counter() - t_aside)
  finally:
    it.close()
    if profile is not None:
      profile.close()
  if start >= last and val and not last_eval:  # nothing left to train: report the restored state
    last_eval = evaluator(trainer.unreplicate(state.params)["student"], val)
  train_seconds = time.perf_counter() - t_train
  events = recovery.events if recovery is not None else []
  return FitResult(state, last, last_eval, resumed, time.perf_counter() - t0, train_seconds, trainer, remat, events)
