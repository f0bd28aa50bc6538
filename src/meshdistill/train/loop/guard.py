"""The divergence guard: detection, good-state copies, restores and the fallback loss.

* `DivergenceGuard` -- the settings and the test: ``observe(step, loss)`` says whether the run
  diverged (non-finite loss, or loss above ``factor`` times the median of the last ``window`` good
  losses) and keeps a copy of the last state whose loss was good; ``events`` records what happened.
* `Recovery` -- the host side of a guarded loop (`meshdistill.train.loop.trainer.fit`): good-state copies,
  restores, the switch to the fallback strategy (`meshdistill.strategies.fallback_strategy`: logit
  MSE) for the rest of the freezing stage, events, and a JSON snapshot for checkpoints.
* The copies themselves, on the devices or in host memory: `meshdistill.train.loop.state_copy`.
* `NoRecovery` -- the same interface when the guard is off: it never reads a loss, copies nothing
  and never restores, so the loop has one code path.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable

import jax
import numpy as np

from meshdistill.train.freezing import freeze_status
from meshdistill.train.optimizers import consecutive_skips
from meshdistill.strategies import Strategy, fallback_strategy
from meshdistill.train.teacher import TeacherKind
from meshdistill.train.loop.state_copy import check_keep_in, copy_state, keep_every_steps, keep_place

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DivergenceEvent:
  """What the guard saw and did: ``kind`` is ``"diverged"`` or ``"fallback_end"``."""

  step: int
  kind: str
  loss: float | None = None
  reason: str = ""
  restored_step: int | None = None
  strategy: str = ""


# The guard's defaults, one home: `DivergenceGuard` and the config's ``safeguards.guard`` section
# (`meshdistill.config.sections.GuardSettings`) both read them.
WINDOW, FACTOR, MIN_HISTORY, MAX_RESTORES = 50, 4.0, 10, 3


class DivergenceGuard:
  """Detects a diverging loss and keeps the last good train state.

  Args:
    window: number of recent good losses whose median is the reference.
    factor: a loss above ``factor * median`` counts as divergence.
    min_history: losses needed before the ratio test applies (non-finite always counts).
    max_restores: the loop raises after this many divergences.

  ``observe(step, loss)`` returns True on divergence (the loss is then NOT added to the
  history). ``keep(state)`` stores a device copy (`copy_state`) of a state known to be
  good; ``good_state`` / ``good_step`` give it back. A trainer with checkpoints may instead
  call only ``observe`` and restore its own last checkpoint.
  """

  def __init__(self, *, window: int = WINDOW, factor: float = FACTOR, min_history: int = MIN_HISTORY,
               max_restores: int = MAX_RESTORES, max_skips: int = 8):
    if not isinstance(window, int) or window < 1:
      raise ValueError(f"DivergenceGuard window={window!r} must be a positive integer (e.g. 50)")
    if not factor > 1.0:
      raise ValueError(f"DivergenceGuard factor={factor!r} must be > 1 (e.g. 4.0: loss above 4x its median)")
    if not isinstance(min_history, int) or not 1 <= min_history <= window:
      raise ValueError(f"DivergenceGuard min_history={min_history!r} must be an integer in [1, window={window}]")
    if not isinstance(max_skips, int) or isinstance(max_skips, bool) or max_skips < 1:
      raise ValueError(f"DivergenceGuard max_skips={max_skips!r} must be a positive integer (e.g. 8)")
    self.window, self.factor, self.min_history, self.max_restores = window, float(factor), min_history, max_restores
    self.max_skips = max_skips
    self._stall_losses: collections.deque[float] = collections.deque(maxlen=max_skips)
    self._nonfinite_norms = 0
    self._applied = 0  # updates seen applied (finite gradient norm, not skipped) since this guard was made
    self.history: collections.deque[float] = collections.deque(maxlen=window)
    self.events: list[DivergenceEvent] = []
    self.good_state, self.good_step = None, None

  def check(self, loss: float) -> str | None:
    """The reason ``loss`` counts as divergence, or None."""
    if not np.isfinite(loss):
      return f"non-finite loss {loss}"
    if len(self.history) >= self.min_history:
      median = float(np.median(self.history))
      if loss > self.factor * median:
        return f"loss {loss:.4g} > {self.factor:g} x running median {median:.4g}"
    return None

  def check_updates(self, step: int, opt_state, loss: float, grad_norm: float | None = None) -> str | None:
    """Why the updates stopped, or None. Call once per step, after it.

    Updates stop, while the loss stays finite (so `check` sees nothing), when the gradient norm was
    non-finite on the last ``max_skips`` steps (`meshdistill.train.optimizers.safeguarded` skips such updates;
    clipping alone scales them to zero), or -- given ``opt_state`` -- when its non-finite skip counted
    ``max_skips`` skips in a row. The loop passes only ``grad_norm`` (a metric of the step, so nothing
    more is read from the device). The reason names the likely cause: with no update applied yet the
    gradients overflow from the start (a loss scale too large, non-finite data or teacher outputs);
    after good updates the weights grew until their gradients overflow (a learning rate too large).
    """
    self._stall_losses.append(float(loss))
    finite_norm = grad_norm is None or bool(np.isfinite(grad_norm))
    self._nonfinite_norms = 0 if finite_norm else self._nonfinite_norms + 1
    in_a_row = 0 if opt_state is None else consecutive_skips(opt_state)[0]
    self._applied += int(finite_norm and in_a_row == 0)
    if max(in_a_row, self._nonfinite_norms) < self.max_skips:
      return None
    lo, hi = min(self._stall_losses), max(self._stall_losses)
    what = (f"the last {in_a_row} updates were all skipped for non-finite gradients" if in_a_row >= self.max_skips
            else f"the gradient norm was non-finite on the last {self._nonfinite_norms} steps (every update skipped "
            "or clipped to zero)")
    head = (f"updates stopped at step {step}: {what} while the loss stayed finite ({lo:.4g} to {hi:.4g}), so nothing "
            "is being trained. ")
    if not self._applied:
      return head + ("No update has been applied since the run (re)started: the gradients overflow from the start. "
                     "Likely cause: a loss scale too large for float32 (safeguards.loss_scale; try 1024 or null), or "
                     "NaN/Inf in the data or the teacher's outputs")
    return head + (f"{self._applied} update(s) were applied first: the weights grew until their gradients "
                   "overflow. Likely cause: a learning rate too large (train.lr / pretrain.lr; the usual range is "
                   "1e-4 to 3e-3), or too little clipping (train.clip)")

  def observe(self, step: int, loss: float) -> bool:
    """True when ``loss`` (of step ``step``) diverged; otherwise it joins the history."""
    del step
    loss = float(loss)
    if self.check(loss) is not None:
      return True
    self.history.append(loss)
    return False

  def keep(self, state, step: int | None = None) -> None:
    """Stores a copy of a good ``state`` (the caller's state may then be donated)."""
    self.good_state = copy_state(state)
    self.good_step = int(np.asarray(jax.device_get(state.step)).reshape(-1)[0]) if step is None else step

  def restore(self):
    """A fresh copy of the last good state (the kept one stays for later restores)."""
    if self.good_state is None:
      raise RuntimeError("DivergenceGuard.restore: no good state kept yet; call keep(state) before training")
    return copy_state(self.good_state)

  def reset_history(self) -> None:
    """Forgets the loss history (after the loss changes meaning, e.g. a strategy switch)."""
    self.history.clear()
    self._stall_losses.clear()
    self._nonfinite_norms = 0


class Recovery:
  """The host side of a guarded training loop: good-state copies, restores, the fallback strategy.

  Used by `meshdistill.train.loop.trainer.fit`. Per step the loop calls ``before_step`` (ends the fallback
  when a new freezing stage begins), takes a copy of the state when ``wants_copy``, runs
  ``runner.step``, then -- at once or one step later -- ``diverged(step, loss)``: on a reason it
  calls ``recover`` (restored state and its step), otherwise ``keep`` on the copy. While the
  fallback waits for a stage change (``needs_settled``) the loop reads each loss before the next
  ``before_step``, so the order of events is the same with or without the lagged check.
  ``snapshot`` / ``load`` carry the guard's history, restore count and fallback state through
  a checkpoint (plain JSON).

  Args:
    trainer: the primary runner (a `Distiller`, or any trainer with ``step``).
    guard: the `DivergenceGuard`.
    keep_every: steps between good-state copies (each costs one train state of memory while kept), or ``"auto"``:
      `state_copy.KEEP_EVERY` of where ``keep_in`` puts them (10 on the devices, 100 in host memory).
    fallback: the strategy after a divergence (default `fallback_strategy(trainer.strategy)`);
      a trainer without a teacher (hard labels) only restores.
    on_event: ``on_event(step, kind, fields)`` for each event (e.g. a metrics row).
    say: ``say(text)`` for a human-readable line per event.
    checkpoints: ``checkpoints()`` -> the steps saved so far (`meshdistill.storage.checkpoint.Checkpointer.all_steps`),
      for the final error to say which is kept; None: the run writes no checkpoints.
  """

  def __init__(self, trainer, guard: DivergenceGuard, keep_every: int | str = 1, fallback: Strategy | None = None, *,
               on_event: Callable[[int, str, dict], None] | None = None, say: Callable[[str], None] | None = None,
               checkpoints: Callable[[], list[int]] | None = None, keep_in: str = "auto"):
    check_keep_in(keep_in)
    self.guard, self.keep_every, self.keep_in = guard, keep_every, keep_in
    self.every = keep_every_steps(keep_every, "device")  # checks it; `start` decides ``auto`` from where copies go
    self.place, self._shardings = "device", None  # where copies go and the state's shardings: set by `start`
    self.runners = {"primary": trainer, "fallback": None}
    self.fallback = fallback
    self.can_fall_back = fallback is not None or trainer.teacher_output.kind is not TeacherKind.NONE
    self.active, self.stage = "primary", None
    self.restores, self.last_loss = 0, None
    self.events: list[dict] = []
    self._on_event = on_event or (lambda step, kind, fields: None)
    self.guarded = True
    self._say = say or log.info
    self._checkpoints = checkpoints

  # ---------------------------------------------------------------- checkpointed
  def snapshot(self) -> dict:
    """The guard's loss history, restore count and fallback state (JSON)."""
    return {"history": list(self.guard.history), "restores": self.restores, "active": self.active, "stage": self.stage}

  def load(self, snap: dict | None) -> None:
    """Continues from a `snapshot` (None: nothing to load)."""
    if not snap:
      return
    self.guard.history.clear()
    self.guard.history.extend(float(x) for x in snap["history"])
    self.restores, self.stage = int(snap["restores"]), snap["stage"]
    if snap["active"] == "fallback":
      self._use_fallback()

  # ---------------------------------------------------------------- the loop's calls
  @property
  def runner(self):
    """The trainer to run the next step with (primary or fallback)."""
    return self.runners[self.active]

  def _use_fallback(self) -> None:
    if self.runners["fallback"] is None:
      primary = self.runners["primary"]
      strategy = self.fallback if self.fallback is not None else fallback_strategy(primary.strategy)
      self.runners["fallback"] = primary.with_strategy(strategy)  # compiles once, on first use
    self.active = "fallback"

  def before_step(self, step: int, state) -> None:
    """Ends the fallback when the next update of ``state`` (at ``step``) starts a new freezing stage."""
    if self.active != "fallback" or self.stage is None:
      return
    next_stage = freeze_status(state.opt_state)["next_stage"]
    if next_stage != self.stage:
      self.active = "primary"
      self.guard.reset_history()
      self._record(step, "fallback_end", reason=f"freezing stage {next_stage + 1} begins", strategy="primary")
      self._say(f"step {step}: freezing stage {next_stage + 1} begins; back to the primary loss")

  def wants_copy(self, step: int, checkpoint_due: bool = False) -> bool:
    """Whether to copy the state before the step from ``step`` (every ``keep_every`` steps, checkpoint steps)."""
    return step % self.every == 0 or checkpoint_due

  def keep(self, state, step: int) -> None:
    """``state`` (a copy, at ``step``) is good: the state a divergence returns to."""
    self.guard.good_state, self.guard.good_step = state, step

  def needs_settled(self) -> bool:
    """Whether ``before_step`` may act: the loop then reads the last loss before calling it."""
    return self.active == "fallback" and self.stage is not None

  def start(self, state, step: int) -> None:
    """Keeps a copy of the state the loop starts from (restored from a checkpoint or given), where ``keep_in``
    puts it (`keep_place`)."""
    self.place = keep_place(self.keep_in, state)
    self.every = keep_every_steps(self.keep_every, self.place)
    self._shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), state)
    self.keep(self.copy(state), step)

  def copy(self, state, step: int | None = None):
    """A copy of ``state`` where this run keeps them (`start` decided: the devices or host memory). At ``step`` equal
    to the kept state's (the loop's start, or the step a restore went back to) the loop's state is the kept one, and
    the kept copy is the copy (never written to: no second copy taken, which in host memory costs seconds)."""
    if step is not None and step == self.guard.good_step and self.guard.good_state is not None:
      return self.guard.good_state
    return copy_state(state, self.place)

  def diverged(self, step: int, loss, grad_norm=None) -> str | None:
    """Why ``loss`` (a device scalar or float; read here) counts as divergence, or None (then it joins the
    guard's history). With ``grad_norm`` (the step's metric) updates that stopped count too
    (`DivergenceGuard.check_updates`)."""
    # Replicated outputs: every process reads the same bits (see meshdistill.parallel.distributed).
    loss, norm = jax.device_get((loss, grad_norm))
    loss = self.last_loss = float(np.asarray(loss).reshape(-1)[0])
    reason = self.guard.check(loss)
    if reason is None and norm is not None:
      reason = self.guard.check_updates(step, None, loss, float(np.asarray(norm).reshape(-1)[0]))
      if reason is not None:
        return reason
    self.guard.observe(step, loss)
    return reason

  def log_fields(self) -> dict[str, float]:
    """Fields of a train metrics row: restores so far, whether the fallback is active."""
    return {"restores": float(self.restores), "fallback": float(self.active == "fallback")}

  def recover(self, step: int, reason: str, loss: float | None = None):
    """``(state, step)`` to continue from after step ``step`` diverged; raises after ``max_restores``."""
    loss = self.last_loss if loss is None else loss
    self.restores += 1
    good = self.guard.good_step
    if self.restores > self.guard.max_restores:
      self._record(step, "diverged", loss=loss, reason=reason, restored_step=None, strategy=self.active)
      raise RuntimeError(
          f"training diverged {self.restores} times (last at step {step}: {reason}), more than max_restores="
          f"{self.guard.max_restores} (safeguards.guard.max_restores); {self._kept()}."
          + ("" if reason.startswith("updates stopped") else " Lower the learning rate, check the data, or allow more "
             "restores")
      )
    if self.can_fall_back:
      self._use_fallback()
      status = freeze_status(self.guard.good_state.opt_state)
      self.stage = None if status is None else status["next_stage"]
    self.guard.reset_history()
    self._record(step, "diverged", loss=loss, reason=reason, restored_step=good, strategy=self.active)
    self._say(f"step {step}: divergence ({reason}); restored step {good}"
              + ("; distilling with the fallback loss" if self.active == "fallback" else ""))
    log.warning("step %d diverged (%s); restored the state of step %s, strategy %s", step, reason, good, self.active)
    return copy_state(self.guard.good_state, "device", self._shardings), good

  def _kept(self) -> str:
    """What a stopped run leaves to resume from, for its error."""
    if self._checkpoints is None:
      return "this run writes no checkpoints"
    steps = self._checkpoints()
    return f"checkpoint step {max(steps)} is kept" if steps else "no checkpoint was written before it diverged"

  def _record(self, step: int, kind: str, **fields) -> None:
    event = DivergenceEvent(step=int(step), kind=kind, **fields)
    self.guard.events.append(event)
    row = dataclasses.asdict(event)
    if row["loss"] is not None and not np.isfinite(row["loss"]):
      row["loss"] = str(row["loss"])  # JSON has no NaN / Infinity
    self.events.append(row)
    self._on_event(step, kind, {k: v for k, v in row.items() if k not in ("step", "kind")})


class NoRecovery:
  """`Recovery`'s interface with the guard off: reads no loss, copies nothing, never restores."""

  guarded = False
  active = "primary"
  restores = 0

  def __init__(self, trainer):
    self.runner = trainer
    self.events: list[dict] = []

  def snapshot(self) -> None:
    return None

  def load(self, snap) -> None:
    del snap

  def start(self, state, step: int) -> None:
    del state, step

  def needs_settled(self) -> bool:
    return False

  def before_step(self, step: int, state) -> None:
    del step, state

  def copy(self, state, step: int | None = None):
    del step
    return copy_state(state)

  def wants_copy(self, step: int, checkpoint_due: bool = False) -> bool:
    del step, checkpoint_due
    return False

  def keep(self, state, step: int) -> None:
    del state, step

  def diverged(self, step: int, loss, grad_norm=None) -> None:
    del step, loss, grad_norm
    return None

  def log_fields(self) -> dict[str, float]:
    return {}
