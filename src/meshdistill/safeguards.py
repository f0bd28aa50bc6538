"""Training safeguards: clipping, skipping non-finite updates, loss scaling, divergence fallback.

Optimizer side (pure optax, inside the one compiled step):

* `safeguarded(inner)` -- ``[unscale by S] -> skip if non-finite -> clip global norm -> inner``.
  An update whose gradients hold a NaN/Inf is skipped: parameters and ``inner`` state
  stay as they were, and the skip is counted (`skipped_updates` reads the count out of
  the optimizer state for logging).
* Static loss scaling (off by default), for low-precision activations whose backward
  values could underflow: `ScaledLoss(strategy, S)` multiplies the gradient of the loss
  by ``S`` while leaving its VALUE (and so every reported metric) unchanged; pair it with
  ``safeguarded(..., loss_scale=S)``, which divides the gradients by ``S`` first. An
  overflowing backward pass gives Inf gradients, which are then skipped. `step.py` needs no
  change: the strategy returns ``stop_gradient(l) + S * (l - stop_gradient(l))``.

Host side (between steps):

* `DivergenceGuard` -- ``observe(step, loss)`` says whether the run diverged (non-finite
  loss, or loss above ``factor`` times the median of the last ``window`` good losses) and
  keeps a copy of the last state whose loss was good; ``events`` records what happened.
  ``check_updates`` also calls it divergence when updates stop while the loss stays finite (a
  run of skipped updates, or of non-finite gradient norms that clipping turns into zero updates).
* `Recovery` -- the bookkeeping of a guarded loop: good-state copies, restores, the switch
  to the fallback strategy (`fallback_strategy`: logit MSE) for the rest of the freezing
  stage, events, and a JSON snapshot for checkpoints. `meshdistill.trainer.fit` (the CLI's
  loop) and `fit_guarded` (a minimal loop over a list of batches) both run on it.

Compute dtype: ``ModelConfig(dtype="bfloat16")`` runs activations in bf16 while master
weights, gradients, optimizer state and the loss stay float32 (the decoder keeps float32
parameters and returns float32 logits).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshdistill.freezing import freeze_status
from meshdistill.strategies import logit_metrics, value_at

log = logging.getLogger(__name__)

_NEVER_GIVE_UP = 2**30  # apply_if_finite applies a non-finite update after this many consecutive skips


# ------------------------------------------------------------------ optimizer side
def unscale_gradients(scale: float) -> optax.GradientTransformation:
  """Divides gradients by a static loss scale ``scale`` (pairs with `ScaledLoss`)."""
  _check_scale(scale)

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda g: g / jnp.asarray(scale, g.dtype), updates), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def safeguarded(
    inner: optax.GradientTransformation,
    *,
    clip: float | None = 1.0,
    skip_nonfinite: bool = True,
    loss_scale: float | None = None,
) -> optax.GradientTransformation:
  """``inner`` behind global-norm clipping, a non-finite-gradient skip and optional loss unscaling.

  Args:
    inner: the optimizer (e.g. ``optax.adamw(1e-4)`` or a `progressive_freeze`).
    clip: max global gradient norm (default 1.0); ``None`` turns clipping off. With a
      `progressive_freeze` inner use ``clip=None`` and its own ``clip``, which clips the
      trainable gradients only.
    skip_nonfinite: skip (and count) updates whose gradients hold NaN or Inf. Skips
      never give up: a run whose every gradient is non-finite is left to `DivergenceGuard`.
    loss_scale: the static scale ``S`` of a `ScaledLoss` strategy (``None``: off).
  """
  if clip is not None and not clip > 0:
    raise ValueError(f"safeguarded clip={clip!r} must be > 0 or None (no clipping)")
  body = inner if clip is None else optax.chain(optax.clip_by_global_norm(clip), inner)
  if skip_nonfinite:
    body = optax.apply_if_finite(body, max_consecutive_errors=_NEVER_GIVE_UP)
  return body if loss_scale is None else optax.chain(unscale_gradients(loss_scale), body)


def skipped_updates(opt_state) -> int:
  """Number of updates skipped for non-finite gradients so far (0 when nothing skips)."""
  found = [
      x
      for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ApplyIfFiniteState))
      if isinstance(x, optax.ApplyIfFiniteState)
  ]
  return sum(int(np.asarray(jax.device_get(s.total_notfinite)).reshape(-1)[0]) for s in found)


def consecutive_skips(opt_state) -> tuple[int, int]:
  """``(skipped in a row up to now, skipped in total)`` of the non-finite skip in ``opt_state`` (0s without one)."""
  found = [
      x
      for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ApplyIfFiniteState))
      if isinstance(x, optax.ApplyIfFiniteState)
  ]
  if not found:
    return 0, 0
  first = lambda a: int(np.asarray(jax.device_get(a)).reshape(-1)[0])
  return first(found[0].notfinite_count), first(found[0].total_notfinite)


def _check_scale(scale) -> None:
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not np.isfinite(scale) or scale <= 0:
    raise ValueError(f"loss_scale={scale!r} must be a finite number > 0 (e.g. 1024.0), or None for no scaling")
  if scale > 2.0**32:  # the scaled gradients of any ordinary loss overflow float32
    raise ValueError(f"loss_scale={scale!r} overflows float32 gradients; use at most 2**32 (e.g. 1024.0)")


# ------------------------------------------------------------------ strategies
class ScaledLoss:
  """``strategy`` whose loss gradient is multiplied by a static ``scale`` (value unchanged).

  Use with ``safeguarded(..., loss_scale=scale)``. Every other attribute (``capture``,
  ``init_params``, ...) is the wrapped strategy's.
  """

  def __init__(self, strategy: Any, scale: float):
    _check_scale(scale)
    self.strategy, self.scale = strategy, float(scale)

  def __getattr__(self, name):
    return getattr(self.strategy, name)

  def _scaled(self, sums: dict) -> dict:
    loss = sums["loss"]
    kept = jax.lax.stop_gradient(loss)
    return {**sums, "loss": kept + self.scale * (loss - kept)}

  def per_sequence(self, *args):
    return self._scaled(self.strategy.per_sequence(*args))

  def per_batch(self, *args):
    return self._scaled(self.strategy.per_batch(*args))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitMSE:
  """``loss = alpha * MSE(centred logits) + (1 - alpha) * CE``: the divergence fallback.

  The MSE is per token ``mean_v (c(z_s) - c(z_t))^2`` with ``c(z) = z - mean_v z``
  (softmax ignores a per-token offset). Its gradient is bounded by the logit gap, not by
  ratios of small probabilities, which makes it steadier than KL when a run blows up.
  """

  alpha: float = 0.5
  capture: tuple[str, ...] = ()

  def __post_init__(self):
    if callable(self.alpha):
      return
    if not 0.0 <= float(self.alpha) <= 1.0:
      raise ValueError(f"LogitMSE.alpha={self.alpha!r} must lie in [0, 1] (weight of the MSE term)")

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    del student_cfg, teacher_cfg, key
    return {}

  def per_sequence(self, params, student, teacher, targets_T, mask_T, step):
    del params  # a fallback keeps the state of the strategy it replaces, and ignores it
    alpha = value_at(self.alpha, step)
    s, t = student.logits.astype(jnp.float32), teacher.logits.astype(jnp.float32)
    d_TxV = (s - jnp.mean(s, -1, keepdims=True)) - (t - jnp.mean(t, -1, keepdims=True))
    out = logit_metrics(student, teacher, targets_T, mask_T)
    out["mse"] = jnp.sum(jnp.mean(d_TxV * d_TxV, axis=-1) * mask_T)
    out["loss"] = alpha * out["mse"] + (1.0 - alpha) * out["ce"]
    return out


def fallback_strategy(strategy: Any) -> Any:
  """The logit-MSE strategy that replaces ``strategy`` after a divergence.

  A strategy with a ``divergence`` setting (`LogitKD`, `ChunkedLogitKD`) keeps its recipe with
  ``divergence="mse"`` (and no top-k): a chunked loss stays chunked, so the fallback needs no
  more memory than the loss it replaces. Anything else becomes `LogitMSE` with the strategy's
  ``alpha`` (0.5 when it has none). A `ScaledLoss` keeps its scale.
  """
  if isinstance(strategy, ScaledLoss):
    return ScaledLoss(fallback_strategy(strategy.strategy), strategy.scale)
  fields = {f.name for f in dataclasses.fields(strategy)} if dataclasses.is_dataclass(strategy) else set()
  if "divergence" in fields:
    return dataclasses.replace(strategy, divergence="mse", **({"top_k": None} if "top_k" in fields else {}))
  alpha = getattr(strategy, "alpha", 0.5)
  return LogitMSE(alpha=alpha if callable(alpha) or isinstance(alpha, (int, float)) else 0.5)


# ------------------------------------------------------------------ divergence guard
_COPIERS: dict = {}  # one compiled copy per (tree structure, shardings)


def copy_state(state):
  """A device copy of ``state`` (same shardings), safe from the donation of the original.

  One compiled program copies every leaf (a train state has ~100 leaves: copying them one
  by one costs a dispatch each: 27 ms against 3.3 ms for the main job's state on 2 CPU cores). Leaves that are not
  `jax.Array`s with a mesh or single-device sharding (e.g. stacked ``pmap`` states) are copied
  one by one.
  """
  leaves, treedef = jax.tree.flatten(state)
  shardings = tuple(getattr(x, "sharding", None) for x in leaves)
  if not leaves or not all(isinstance(sh, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding))
                           for sh in shardings):
    return jax.tree.map(jnp.copy, state)
  key = (treedef, shardings)
  if key not in _COPIERS:
    _COPIERS[key] = jax.jit(lambda *xs: [jnp.copy(x) for x in xs], out_shardings=list(shardings))
  copies = _COPIERS[key](*leaves)
  if any(c is x for c, x in zip(copies, leaves)):  # never hand back the original buffers
    return jax.tree.map(jnp.copy, state)
  return jax.tree.unflatten(treedef, copies)


@dataclasses.dataclass
class DivergenceEvent:
  """What the guard saw and did: ``kind`` is ``"diverged"`` or ``"fallback_end"``."""

  step: int
  kind: str
  loss: float | None = None
  reason: str = ""
  restored_step: int | None = None
  strategy: str = ""


class DivergenceGuard:
  """Detects a diverging loss and keeps the last good train state.

  Args:
    window: number of recent good losses whose median is the reference.
    factor: a loss above ``factor * median`` counts as divergence.
    min_history: losses needed before the ratio test applies (non-finite always counts).
    max_restores: `fit_guarded` raises after this many divergences.
    max_skips: this many updates in a row skipped for non-finite gradients count as divergence
      ("updates stopped"; see `check_updates`).

  ``observe(step, loss)`` returns True on divergence (the loss is then NOT added to the
  history). ``keep(state)`` stores a device copy (`copy_state`) of a state known to be
  good; ``good_state`` / ``good_step`` give it back. A trainer with checkpoints may instead
  call only ``observe`` and restore its own last checkpoint.
  """

  def __init__(self, *, window: int = 50, factor: float = 4.0, min_history: int = 5, max_restores: int = 3,
               max_skips: int = 8):
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

  # ---------------------------------------------------------------- stalled updates
  def check_updates(self, step: int, opt_state, loss: float, grad_norm: float | None = None) -> str | None:
    """Why the updates stopped, or None. Call once per step, after it, with the state's optimizer state.

    Updates stop, while the loss stays finite (so `check` sees nothing), when the last ``max_skips``
    updates were all skipped for non-finite gradients, or when the gradient norm was non-finite on
    the last ``max_skips`` steps (clipping then scales every update to zero). The reason names the
    likely cause: from the first update on, the gradients overflow from the start (a loss scale
    too large, non-finite data or teacher outputs); after good updates, the weights grew until
    their gradients overflow (a learning rate too large).
    """
    self._stall_losses.append(float(loss))
    finite_norm = grad_norm is None or bool(np.isfinite(grad_norm))
    self._nonfinite_norms = 0 if finite_norm else self._nonfinite_norms + 1
    in_a_row, _ = consecutive_skips(opt_state)
    self._applied += int(finite_norm and in_a_row == 0)
    stalled = max(in_a_row, self._nonfinite_norms)
    if stalled < self.max_skips:
      return None
    lo, hi = min(self._stall_losses), max(self._stall_losses)
    what = (f"the last {in_a_row} updates were all skipped for non-finite gradients" if in_a_row >= self.max_skips
            else f"the gradient norm was non-finite on the last {self._nonfinite_norms} steps (every update clipped "
            "to zero)")
    head = (f"updates stopped at step {step}: {what} while the loss stayed finite ({lo:.4g} to {hi:.4g}), so nothing "
            "is being trained. ")
    if not self._applied:
      return head + ("No update has been applied since the run (re)started: the gradients overflow from the start. "
                     "Likely cause: a loss "
                     "scale too large for float32 (safeguards.loss_scale; try 1024 or null), or NaN/Inf in the data "
                     "or the teacher's outputs")
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

  Used by `fit_guarded` and by `meshdistill.trainer.fit`. Per step a loop calls
  ``before_step`` (ends the fallback when a new freezing stage begins), takes a copy of the
  state when ``wants_copy``, runs ``runner.step``, then ``diverged(step, loss)``: on a
  reason it calls ``recover`` (restored state and its step), otherwise ``keep`` on the copy.
  ``snapshot`` / ``load`` carry the guard's history, restore count and fallback state through
  a checkpoint (plain JSON).

  Args:
    trainer: the primary runner (a `Distiller`, or any trainer with ``step``).
    guard: the `DivergenceGuard`.
    keep_every: steps between good-state copies (each costs one train state of memory while kept).
    fallback: the strategy after a divergence (default `fallback_strategy(trainer.strategy)`);
      a trainer without ``with_strategy`` (hard labels) only restores.
    on_event: ``on_event(step, kind, fields)`` for each event (e.g. a metrics row).
    say: ``say(text)`` for a human-readable line per event.
  """

  def __init__(self, trainer, guard: DivergenceGuard, keep_every: int = 1, fallback: Any = None, *,
               on_event: Callable[[int, str, dict], None] | None = None, say: Callable[[str], None] | None = None):
    if not isinstance(keep_every, int) or isinstance(keep_every, bool) or keep_every < 1:
      raise ValueError(f"keep_every={keep_every!r} must be a positive integer (steps between good-state copies)")
    self.guard, self.keep_every = guard, keep_every
    self.runners = {"primary": trainer, "fallback": None}
    self.fallback = fallback
    self.can_fall_back = fallback is not None or hasattr(trainer, "with_strategy")
    self.active, self.stage = "primary", None
    self.restores = 0
    self.events: list[dict] = []
    self._on_event = on_event or (lambda step, kind, fields: None)
    self._say = say or log.info

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
    return step % self.keep_every == 0 or checkpoint_due

  def keep(self, state, step: int) -> None:
    """``state`` (a copy, at ``step``) is good: the state a divergence returns to."""
    self.guard.good_state, self.guard.good_step = state, step

  def diverged(self, step: int, loss: float, state=None, metrics: dict | None = None) -> str | None:
    """Why ``loss`` counts as divergence, or None (then it joins the guard's history).

    With ``state`` (the state after the step; ``metrics`` its metrics, for ``grad_norm``) updates that
    stopped count too (`DivergenceGuard.check_updates`).
    """
    reason = self.guard.check(loss)
    if reason is None and state is not None:
      norm = None if metrics is None or "grad_norm" not in metrics else _first(metrics["grad_norm"])
      reason = self.guard.check_updates(step, state.opt_state, loss, norm)
      if reason is not None:
        return reason
    self.guard.observe(step, loss)
    return reason

  def recover(self, step: int, loss: float, reason: str):
    """``(state, step)`` to continue from after step ``step`` diverged; raises after ``max_restores``."""
    self.restores += 1
    good = self.guard.good_step
    if self.restores > self.guard.max_restores:
      self._record(step, "diverged", loss=loss, reason=reason, restored_step=None, strategy=self.active)
      raise RuntimeError(
          f"training diverged {self.restores} times (last at step {step}: {reason}), more than max_restores="
          f"{self.guard.max_restores} (safeguards.guard.max_restores); the last checkpoint is kept."
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
    return copy_state(self.guard.good_state), good

  def _record(self, step: int, kind: str, **fields) -> None:
    event = DivergenceEvent(step=int(step), kind=kind, **fields)
    self.guard.events.append(event)
    row = dataclasses.asdict(event)
    if row["loss"] is not None and not np.isfinite(row["loss"]):
      row["loss"] = str(row["loss"])  # JSON has no NaN / Infinity
    self.events.append(row)
    self._on_event(step, kind, {k: v for k, v in row.items() if k not in ("step", "kind")})


def _first(x) -> float:
  return float(np.asarray(jax.device_get(x)).reshape(-1)[0])


def _host(metrics: dict) -> dict[str, float]:
  return {k: float(np.asarray(jax.device_get(v)).reshape(-1)[0]) for k, v in metrics.items()}


def fit_guarded(
    distiller,
    state,
    batches: Iterable[dict],
    guard: DivergenceGuard | None = None,
    *,
    fallback: Any = None,
    keep_every: int = 1,
    on_step: Callable[[dict], None] | None = None,
):
  """Trains on ``batches`` with divergence recovery; returns ``(state, records)``.

  A minimal loop around `Recovery` (the CLI's loop, `meshdistill.trainer.fit`, adds data,
  checkpoints and metrics). Per batch: if the state's step is a multiple of ``keep_every`` a
  copy of it is taken (it is donated to the step); the step runs; if its loss is good that copy
  becomes the guard's good state. On divergence the good state is restored, the strategy
  switches to ``fallback`` (default `fallback_strategy(distiller.strategy)`, compiled once on
  first use via `Distiller.with_strategy`) and the guard's history is reset. The fallback lasts
  for the rest of the current `progressive_freeze` stage (the whole run without one); then the
  original strategy (already compiled) resumes.

  Each record holds the step's metrics as floats plus ``step`` (the state's step before
  it), ``strategy`` (``"primary"``/``"fallback"``), ``skipped`` (`skipped_updates`),
  ``stage`` (when freezing) and, when something happened, ``events`` (`DivergenceEvent`s
  as dicts; also appended to ``guard.events``). The batch that diverged is not retried.
  Raises RuntimeError after ``guard.max_restores`` divergences.
  """
  guard = guard if guard is not None else DivergenceGuard()
  recovery = Recovery(distiller, guard, keep_every, fallback)
  if guard.good_state is None:
    guard.keep(state)
  records = []
  for batch in batches:
    step = int(np.asarray(jax.device_get(state.step)).reshape(-1)[0])
    seen = len(recovery.events)
    recovery.before_step(step, state)
    candidate = copy_state(state) if recovery.wants_copy(step) else None
    active = recovery.active
    state, metrics = recovery.runner.step(state, batch)
    rec = {"step": step, "strategy": active, **_host(metrics), "skipped": skipped_updates(state.opt_state)}
    status = freeze_status(state.opt_state)
    if status is not None:
      rec["stage"] = status["stage"]
    reason = recovery.diverged(step + 1, rec["loss"], state, rec)
    if reason is not None:
      state, _ = recovery.recover(step, rec["loss"], reason)
    elif candidate is not None:
      recovery.keep(candidate, step)
    if len(recovery.events) > seen:
      rec["events"] = recovery.events[seen:]
    records.append(rec)
    if on_step is not None:
      on_step(rec)
  return state, records
