"""The loss a divergence switches to (`LogitMSE`, `fallback_strategy`: the steadier loss
`meshdistill.train.loop.guard.Recovery` distils with), and `label`, how messages name a strategy.

Static loss scaling is not a strategy: it is a setting of the step (``Distiller(..., loss_scale=S)``,
`meshdistill.train.step.scale_gradient`), so every strategy reaches the step, a top-k teacher and the guard as itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from meshdistill.losses.schedules import value_at
from meshdistill.strategies._base import SequenceStrategy, Strategy, label  # noqa: F401 -- label: also read here
from meshdistill.strategies._logit import logit_metrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitMSE(SequenceStrategy):
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

  def per_sequence(self, params, student, teacher, targets_T, mask_T, step):
    del params  # a fallback keeps the state of the strategy it replaces, and ignores it
    alpha = value_at(self.alpha, step)
    s, t = student.logits.astype(jnp.float32), teacher.logits.astype(jnp.float32)
    d_TxV = (s - jnp.mean(s, -1, keepdims=True)) - (t - jnp.mean(t, -1, keepdims=True))
    out = logit_metrics(student, teacher, targets_T, mask_T)
    out["mse"] = jnp.sum(jnp.mean(d_TxV * d_TxV, axis=-1) * mask_T)
    out["loss"] = alpha * out["mse"] + (1.0 - alpha) * out["ce"]
    return out


def fallback_strategy(strategy: Strategy) -> Strategy:
  """The strategy that replaces ``strategy`` after a divergence: its own ``fallback()``, else logit MSE.

  `LogitKD` / `ChunkedLogitKD` keep their recipe with ``divergence="mse"`` (and no top-k): a
  chunked loss stays chunked, so the fallback needs no more memory than the loss it replaces. A
  strategy whose ``fallback()`` is None (or that does not derive from `Strategy`) becomes
  `LogitMSE` with its ``alpha`` (0.5 when it has none).
  """
  own = strategy.fallback() if isinstance(strategy, Strategy) else None
  if own is not None:
    return own
  alpha = getattr(strategy, "alpha", 0.5)
  return LogitMSE(alpha=alpha if callable(alpha) or isinstance(alpha, (int, float)) else 0.5)
