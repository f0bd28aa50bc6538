"""Periodic actions of the training loop (`meshdistill.train.loop.trainer.fit`): logging, evaluation, checkpoints,
profiling and the memory check, each a `Hook`.

A hook sees the loop's `meshdistill.train.loop.run.Run` (``run.state``, ``run.step``, ``run.trainer``,
``run.monitor``, ``run.recovery``, ...) at fixed points:

* ``before_loop(run)`` -- once, before the first step (may replace ``run.trainer``);
* ``before_step(run, step)`` -- before step ``step`` (1-based) is dispatched;
* ``after_dispatch(run, step, metrics)`` -- right after dispatch, without waiting for the result;
* ``wants_metrics(run, step)`` -- whether step ``step`` must report all its metrics (else it may run
  metrics-light: ``loss``, ``grad_norm``, ``tokens`` only); a function of the step and the run's settings alone, not
  of where the run was interrupted or resumed, so that a resumed run runs the same program at each step as the
  uninterrupted one;
* ``due(run, step)`` / ``after_step(run, step)`` -- an action on the state after ``step``. Before it
  runs, the loop reads the divergence guard's verdict on that step, so a hook never acts on a
  state the guard would throw away;
* ``wants_copy(step)`` / ``on_confirmed(run, step, state, position, guard)`` -- under the guard,
  ``state`` (a copy of the state after ``step``, with the data position and guard snapshot that
  go with it) once the next step's loss confirmed it;
* ``on_settled(run, step_info, state_after, reason)`` -- each step, once its loss was judged;
* ``close()`` -- when the loop ends, also on error.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
from meshdistill.train.freezing import freeze_status
from meshdistill.train.memory import CPU_MEMORY_SCHEDULER, REMAT_ORDER, device_memory_limit, fit_remat
from meshdistill.train.tuning import auto_tune, pending
from meshdistill.train.optimizers import skipped_updates

log = logging.getLogger(__name__)


class Hook:
  """A periodic action; every method is optional (the defaults do nothing)."""

  def before_loop(self, run) -> None:
    del run

  def before_step(self, run, step: int) -> None:
    del run, step

  def after_dispatch(self, run, step: int, metrics: dict) -> None:
    del run, step, metrics

  def due(self, run, step: int) -> bool:
    del run, step
    return False

  def wants_metrics(self, run, step: int) -> bool:
    """Whether this hook reads all of step ``step``'s metrics (otherwise the loop may run the metrics-light
    step, whose metrics are ``loss``, ``grad_norm`` and ``tokens`` only)."""
    del run, step
    return False

  def after_step(self, run, step: int) -> None:
    del run, step

  def wants_copy(self, step: int) -> bool:
    del step
    return False

  def on_confirmed(self, run, step: int, state, position: Any, guard: dict | None) -> None:
    del run, step, state, position, guard

  def on_settled(self, run, info, state_after, reason: str | None) -> None:
    del run, info, state_after, reason

  def on_stop(self, run, step: int) -> None:
    """The run stops after ``step`` on a signal (SIGTERM; `meshdistill.train.loop.stopping`); its loss is judged."""
    del run, step

  def close(self) -> None:
    pass


class LogTrain(Hook):
  """Every ``every`` steps (and at the last): the mean train metrics, learning rate / freezing stage,
  skipped updates and the guard's counts, written and shown by the monitor."""

  def __init__(self, every: int, lr=None):
    self.every, self.lr = every, lr

  def due(self, run, step):
    return step % self.every == 0 or step == run.last

  def wants_metrics(self, run, step):
    # every ``every``-th step and the run's last: not the step an interrupted run stops at (its log holds what that
    # step computed), so which steps compute every metric does not depend on where a run is interrupted
    return step % self.every == 0 or step == run.steps

  def after_step(self, run, step):
    status = freeze_status(run.state.opt_state)
    if status is not None:
      extra = {"lr": float(status["lr"]), "freeze_stage": float(status["stage"])}
    else:
      extra = {"lr": float(self.lr(step - 1))} if self.lr is not None else {}
    extra["skipped"] = float(skipped_updates(run.state.opt_state))
    extra.update(run.recovery.log_fields())
    run.monitor.flush_train(step, extra)

  def on_stop(self, run, step):
    self.after_step(run, step)


class Evaluate(Hook):
  """Validation metrics every ``every`` steps (0: only at the end of the run)."""

  def __init__(self, evaluator, batches, every: int):
    self.evaluator, self.batches, self.every = evaluator, batches, every

  def due(self, run, step):
    return bool(self.batches) and ((self.every and step % self.every == 0) or step == run.steps)

  def after_step(self, run, step):
    run.last_eval = self.evaluator(run.trainer.unreplicate(run.state.params)["student"], self.batches)
    run.monitor.eval(step, run.last_eval)


class Checkpoint(Hook):
  """Saves every ``checkpointer.every`` steps and at the end of the run (orbax, `meshdistill.storage.checkpoint`).

  Without the guard the state after step ``s`` is saved at once. Under the guard a checkpoint of
  step ``s`` is written only once step ``s + 1``'s loss is good, from the copy taken before it, so
  every checkpoint holds a state the guard accepted; the last step of a run is saved at once
  (nothing follows to confirm it). The guard's snapshot travels in ``meta["guard"]``.
  """

  def __init__(self, checkpointer, meta: dict):
    self.checkpointer, self.meta = checkpointer, meta

  def _every(self, step: int) -> bool:
    return bool(self.checkpointer.every) and step % self.checkpointer.every == 0

  def wants_copy(self, step):
    return self._every(step)

  def due(self, run, step):
    final = step == run.last and (step == run.steps or self._every(step))
    return final or (not run.recovery.guarded and self._every(step))

  def after_step(self, run, step):
    self._save(run, step, run.state, run.it.get_state(), run.recovery.snapshot())

  def on_confirmed(self, run, step, state, position, guard):
    if self._every(step) and step > run.start:
      self._save(run, step, state, position, guard)

  def on_stop(self, run, step):
    self._save(run, step, run.state, run.it.get_state(), run.recovery.snapshot())

  def _save(self, run, step, state, position, guard) -> None:
    if step in self.checkpointer.all_steps():
      return
    meta = self.meta if guard is None else {**self.meta, "guard": guard}
    self.checkpointer.save(step, run.trainer, state, position, meta)


class Profile(Hook):
  """A profiler trace of the steps of a `meshdistill.train.loop.monitor.ProfileWindow`."""

  def __init__(self, window):
    self.window = window

  def before_step(self, run, step):
    self.window.before_step(step)

  def after_dispatch(self, run, step, metrics):
    self.window.after_step(step, metrics)

  def close(self):
    self.window.close()


class AutoRemat(Hook):
  """Before the first step: compiles the step once, compares its per-device memory with the device's (or
  ``budget_bytes``) and, when it would not fit, turns the student's rematerialisation on
  (`meshdistill.train.memory.fit_remat`); reported on the progress line and as an ``event`` row. A trainer with
  settings left at ``auto`` (remat, micro-batch, chunk) has them decided here instead, with the same budget
  (`meshdistill.train.tuning.auto_tune`: its one line on the progress line, an ``auto`` event row)."""

  def __init__(self, budget_bytes: int | None, headroom: float):
    self.budget_bytes, self.headroom = budget_bytes, headroom

  def before_loop(self, run):
    if run.start >= run.last:
      return

    trainer, monitor = run.trainer, run.monitor
    devices = trainer.mesh.devices.flat if trainer.mesh is not None else jax.devices()[:1]
    if self.budget_bytes is None and device_memory_limit(next(iter(devices))) is None:
      log.info("memory check skipped: the %s device reports no memory limit (set a budget to check)",
               jax.default_backend())
      return
    before = trainer.student_cfg.remat
    options = None
    if jax.default_backend() == "cpu" and trainer.layout.takes_compiler_options:
      # XLA's default CPU scheduler favours concurrency and hides what remat saves; with a memory
      # budget asked for on CPU, measure and run the step under the memory-optimised scheduler.
      options = CPU_MEMORY_SCHEDULER
    if pending(trainer):  # settings left at auto: decided together (`tuning.auto_tune`), said in one line
      # a remat given explicitly may still be made leaner where the step would not fit (as `fit_remat` would)
      remats = None if before == "auto" else REMAT_ORDER[REMAT_ORDER.index(before):] if before in REMAT_ORDER \
          else (before,)
      chosen, tuning = auto_tune(trainer, run.state, run.read_ahead(), budget_bytes=self.budget_bytes,
                                 headroom=self.headroom, compiler_options=options, remats=remats,
                                 say=monitor.message)
      c = tuning.chosen
      monitor.event(run.start, "auto", remat=c.remat, micro_batch=c.micro_batch, chunk=c.chunk, fits=tuning.fits,
                    cached=tuning.cached, compiled=len(tuning.measured), headroom=self.headroom,
                    budget_mib=None if tuning.budget_bytes is None else round(tuning.budget_bytes / 2**20, 3),
                    step_mib={name: round(r.need_bytes / 2**20, 3) for name, r in tuning.reports.items()})
      run.trainer, run.remat = chosen, tuning
      return
    chosen, choice = fit_remat(trainer, run.state, run.read_ahead(), budget_bytes=self.budget_bytes,
                               headroom=self.headroom, compiler_options=options)
    mib = {name: round(r.total_bytes / 2**20, 3) for name, r in choice.reports.items()}
    monitor.event(run.start, "remat", remat=choice.remat, previous=before, fits=choice.fits,
                  budget_mib=round(choice.budget_bytes / 2**20, 3), headroom=self.headroom, step_mib=mib)
    budget = f"{self.headroom:.0%} of {choice.budget_bytes / 2**20:.4g} MiB"
    if choice.remat != before:
      monitor.message(
        f"memory: the step needs {mib[before]:.4g} MiB per device with remat={before!r}, over {budget}; turned on "
        f"remat={choice.remat!r} ({mib[choice.remat]:.4g} MiB)"
        + ("" if choice.fits else ", the leanest, which still does not fit")
      )
    else:
      log.info("memory: the step needs %.4g MiB per device (%s): remat=%r kept", mib[before], budget, before)
    run.trainer, run.remat = chosen, choice
