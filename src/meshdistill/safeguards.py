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
* `fit_guarded` -- a small loop that runs steps, restores the last good state on
  divergence and switches the distillation term to logit MSE (`fallback_strategy`) for
  the rest of the current freezing stage. A trainer can call it or mirror it.

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

from meshdistill import losses
from meshdistill.freezing import freeze_status
from meshdistill.strategies import LogitKD, logit_metrics, value_at

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


def _check_scale(scale) -> None:
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not np.isfinite(scale) or scale <= 0:
    raise ValueError(f"loss_scale={scale!r} must be a finite number > 0 (e.g. 1024.0), or None for no scaling")


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

  A `LogitKD` becomes the same `LogitKD` with ``divergence="mse"`` (full vocabulary) when
  the losses provide it; anything else becomes `LogitMSE` with the strategy's ``alpha``
  (0.5 when it has none). A `ScaledLoss` keeps its scale.
  """
  if isinstance(strategy, ScaledLoss):
    return ScaledLoss(fallback_strategy(strategy.strategy), strategy.scale)
  fields = {f.name for f in dataclasses.fields(strategy)} if dataclasses.is_dataclass(strategy) else set()
  has_mse = "mse" in getattr(losses, "DIVERGENCES", {})
  if isinstance(strategy, LogitKD) and {"divergence", "top_k"} <= fields and has_mse:
    return dataclasses.replace(strategy, divergence="mse", top_k=None)
  alpha = getattr(strategy, "alpha", 0.5)
  return LogitMSE(alpha=alpha if callable(alpha) or isinstance(alpha, (int, float)) else 0.5)


# ------------------------------------------------------------------ divergence guard
def copy_state(state):
  """A device copy of ``state`` (same shardings), safe from the donation of the original."""
  return jax.tree.map(jnp.copy, state)


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

  ``observe(step, loss)`` returns True on divergence (the loss is then NOT added to the
  history). ``keep(state)`` stores a device copy (`copy_state`) of a state known to be
  good; ``good_state`` / ``good_step`` give it back. A trainer with checkpoints may instead
  call only ``observe`` and restore its own last checkpoint.
  """

  def __init__(self, *, window: int = 50, factor: float = 4.0, min_history: int = 5, max_restores: int = 3):
    if not isinstance(window, int) or window < 1:
      raise ValueError(f"DivergenceGuard window={window!r} must be a positive integer (e.g. 50)")
    if not factor > 1.0:
      raise ValueError(f"DivergenceGuard factor={factor!r} must be > 1 (e.g. 4.0: loss above 4x its median)")
    if not isinstance(min_history, int) or not 1 <= min_history <= window:
      raise ValueError(f"DivergenceGuard min_history={min_history!r} must be an integer in [1, window={window}]")
    self.window, self.factor, self.min_history, self.max_restores = window, float(factor), min_history, max_restores
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

  Per batch: if the state's step is a multiple of ``keep_every`` a copy of it is taken
  (it is donated to the step); the step runs; if its loss is good that copy becomes the
  guard's good state. On divergence the good state is restored, the strategy switches to
  ``fallback`` (default `fallback_strategy(distiller.strategy)`, compiled once on first
  use via `Distiller.with_strategy`) and the guard's history is reset. The fallback lasts
  for the rest of the current `progressive_freeze` stage (the whole run without one);
  then the original strategy (already compiled) resumes.

  Each record holds the step's metrics as floats plus ``step`` (the state's step before
  it), ``strategy`` (``"primary"``/``"fallback"``), ``skipped`` (`skipped_updates`),
  ``stage`` (when freezing) and, when something happened, ``events`` (`DivergenceEvent`s
  as dicts; also appended to ``guard.events``). The batch that diverged is not retried.
  Raises RuntimeError after ``guard.max_restores`` divergences.
  """
  guard = guard if guard is not None else DivergenceGuard()
  if not isinstance(keep_every, int) or keep_every < 1:
    raise ValueError(f"fit_guarded keep_every={keep_every!r} must be a positive integer")
  runners = {"primary": distiller, "fallback": None}
  active, fallback_stage = "primary", None
  if guard.good_state is None:
    guard.keep(state)
  records = []
  for batch in batches:
    step = int(np.asarray(jax.device_get(state.step)).reshape(-1)[0])
    events = []
    if active == "fallback" and fallback_stage is not None:
      next_stage = freeze_status(state.opt_state)["next_stage"]
      if next_stage != fallback_stage:
        events.append(DivergenceEvent(step=step, kind="fallback_end", reason=f"stage {next_stage + 1} begins",
                                      strategy="primary"))
        log.info("freezing stage %d begins at step %d: back to the primary strategy", next_stage + 1, step)
        active = "primary"
        guard.reset_history()
    candidate = copy_state(state) if step % keep_every == 0 else None
    state, metrics = runners[active].step(state, batch)
    rec = {"step": step, "strategy": active, **_host(metrics), "skipped": skipped_updates(state.opt_state)}
    status = freeze_status(state.opt_state)
    if status is not None:
      rec["stage"] = status["stage"]
    reason = guard.check(rec["loss"])
    if guard.observe(step, rec["loss"]):
      event = DivergenceEvent(step=step, kind="diverged", loss=rec["loss"], reason=reason or "",
                              restored_step=guard.good_step, strategy="fallback")
      events.append(event)
      n_diverged = sum(e.kind == "diverged" for e in guard.events) + 1
      log.warning("divergence at step %d (%s); restoring step %s, distilling with logit MSE", step, reason,
                  guard.good_step)
      if n_diverged > guard.max_restores:
        guard.events.extend(events)
        raise RuntimeError(
            f"training diverged {n_diverged} times (last at step {step}: {reason}); lower the learning "
            "rate, check the data, or raise DivergenceGuard(max_restores=...)"
        )
      state = guard.restore()
      if runners["fallback"] is None:
        backup = fallback if fallback is not None else fallback_strategy(distiller.strategy)
        runners["fallback"] = distiller.with_strategy(backup)
      restored = freeze_status(state.opt_state)
      active, fallback_stage = "fallback", (None if restored is None else restored["next_stage"])
      guard.reset_history()
    elif candidate is not None:
      guard.good_state, guard.good_step = candidate, step
    if events:
      guard.events.extend(events)
      rec["events"] = [dataclasses.asdict(e) for e in events]
    records.append(rec)
    if on_step is not None:
      on_step(rec)
  return state, records
