"""One training run's loop, step by step: `Run` is what `meshdistill.train.loop.trainer.fit` sets up and runs, and what
the hooks (`meshdistill.train.loop.hooks`) see (``run.state``, ``run.step``, ``run.trainer``, ...).

One step, in order: read the next host batch; dispatch the compiled step (metrics stay on
device); judge the previous step's loss (the divergence guard); every ``log_every`` steps
fetch and average the metrics (`Monitor`); every ``eval_every`` steps (and at the end)
evaluate on the fixed validation batches; every ``checkpoint.every`` steps (and at the end) save.
After the first logged step, steps whose metrics nothing reads run the trainer's metrics-light step
(same update; `meshdistill.train.loop.trainer.FitOptions.metrics_light`).

With a `meshdistill.train.loop.guard.DivergenceGuard` (``FitOptions.guard``) the loop reads every step's loss. A
non-finite loss, or one far above its running median, restores the last good train state and, for distillation,
switches to the fallback loss (logit MSE by default) for the rest of the freezing stage; both
are ``event`` rows. The good state is a copy of the state before step ``s + 1`` (on the devices or in host
memory: ``keep_in``), taken when ``s`` is a multiple of ``keep_every`` or a checkpoint step (where the state is
the kept one, at the loop's start and after a restore, the kept copy serves), and kept once step ``s + 1``'s
loss is good; checkpoints are written from such copies (`meshdistill.train.loop.hooks.Checkpoint`). The
guard's history, restore count and fallback state travel in the checkpoint, so resuming is exact.

Lagged check (``guard_lag=1``, the default): the loss of step ``s`` is read after step ``s + 1``
has been dispatched, so reading it never stalls the device queue. When step ``s`` diverged,
step ``s + 1`` already ran on the diverged state and is thrown away too: after a divergence
the batches of the diverged step AND of the one after it are spent (never retried), whether
the loss happened to be read at once (before logging, evaluating or saving at ``s``, the loop
reads it first) or one step later, so a run's numbers do not depend on those cadences.
``guard_lag=0`` reads each loss right after its step and spends only the diverged batch.
With no guard the loop reads no loss at all (`meshdistill.train.loop.guard.NoRecovery`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from meshdistill.parallel.distributed import any_process, process_count
from meshdistill.train.loop import hooks as hooks_lib
from meshdistill.train.loop.guard import NoRecovery, Recovery
from meshdistill.train.loop.monitor import Monitor
from meshdistill.train.loop.stopping import Stopped, requested, wait_for

# With several processes a stop request is agreed (`any_process`) where a hook is due and at least this often:
# one small host collective, at the same steps on every process.
STOP_AGREE_EVERY = 8


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
    self.start, self.step, self.last, self.steps = start, start, last, steps
    self._logged = light and self._logged_before(start)
    self.recovery: Any = NoRecovery(trainer)
    self.pending: StepInfo | None = None
    self.ahead = None  # a batch read before the loop (for the memory check) and the data position before it
    self.ended = False  # the data ran out
    self.last_eval: dict[str, float] = {}
    self.remat = None
    self._guard_snapshot = None

  def _logged_before(self, start: int) -> bool:
    """Whether a step up to ``start`` read every metric: a resumed run then goes on with light steps where the
    uninterrupted run would, so both run the same program at every step (exact resume does not rest on the full and
    the light program rounding alike). Stops at the first such step (the first train log)."""
    return any(h.wants_metrics(self, n) for n in range(1, start + 1) for h in self.hooks)

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
    ready = getattr(self.it, "ready", None)  # an iterator that waits for a teacher: a stop is not held up by it
    if ready is not None and process_count() == 1 and not wait_for(ready):
      self._stop()
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
      candidate = rec.copy(self.state, step)  # the state is donated to the step
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
    if self.step < self.last and self._stop_requested(bool(due)):
      self._stop()

  def _stop_requested(self, due: bool) -> bool:
    """Whether to stop after this step. One process: whether a signal asked it to. Several: whether one
    reached ANY process, asked at the same steps on all of them (where a hook is due, and every
    `STOP_AGREE_EVERY` steps), so they all stop after the same step and save the same checkpoint instead
    of one leaving while the others wait in the next step's collectives."""
    if process_count() == 1:
      return requested() is not None
    if not due and self.step % STOP_AGREE_EVERY:
      return False
    return any_process(requested() is not None, "a stop request")

  def _stop(self) -> None:
    """A SIGTERM (`meshdistill.train.loop.stopping`): the step in flight is judged (restored if it diverged), then
    the hooks checkpoint and log the state, and `Stopped` ends the run."""
    if self.pending is not None:
      self._settle()
    for h in self.hooks:
      h.on_stop(self, self.step)
    saved = [h.checkpointer.directory for h in self.hooks if isinstance(h, hooks_lib.Checkpoint)]
    # A process the signal did not reach stops on another's request: name it as the scheduler's SIGTERM.
    raise Stopped(requested() or "SIGTERM", self.step, saved[0] if saved else None)

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
