"""Strategy wrappers: static loss scaling, and the logit-MSE fallback a divergence switches to.

* `ScaledLoss(strategy, S)` multiplies the gradient of the loss by ``S`` while leaving its VALUE
  (and so every reported metric) unchanged; pair it with
  ``meshdistill.train.optimizers.safeguarded(..., loss_scale=S)``, which divides the gradients by ``S``
  first. The step needs no change: the loss is ``stop_gradient(l) + S * (l - stop_gradient(l))``.
* `LogitMSE` and `fallback_strategy`: the steadier loss `meshdistill.loop.guard.Recovery` distils with
  after a divergence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from meshdistill.train.optimizers import check_loss_scale
from meshdistill.train.schedules import value_at
from meshdistill.strategies._base import SequenceStrategy, Strategy
from meshdistill.strategies._logit import logit_metrics


class ScaledLoss(Strategy):
  """``strategy`` whose loss gradient is multiplied by a static ``scale`` (value unchanged).

  Use with ``safeguarded(..., loss_scale=scale)``. Its capabilities (the strategy contract's
  `meshdistill.strategies.CONTRACT`) are the wrapped strategy's, each declared here; it forwards no other
  attribute, so nothing needs to unwrap it: a top-k teacher reads ``accepts_topk`` / ``top_k`` /
  ``temperature`` and names it by `label`.
  """

  def __init__(self, strategy: Any, scale: float):
    check_loss_scale(scale)
    self.strategy, self.scale = strategy, float(scale)

  capture = property(lambda self: self.strategy.capture)
  needs_logits = property(lambda self: self.strategy.needs_logits)
  needs_head = property(lambda self: self.strategy.needs_head)
  needs_teacher = property(lambda self: self.strategy.needs_teacher)
  accepts_topk = property(lambda self: self.strategy.accepts_topk)
  count = property(lambda self: self.strategy.count)
  top_k = property(lambda self: getattr(self.strategy, "top_k", None))
  temperature = property(lambda self: getattr(self.strategy, "temperature", None))

  @property
  def label(self) -> str:
    """How messages name it: ``ScaledLoss(scale=S) wrapping <the wrapped strategy's label>``."""
    return f"ScaledLoss(scale={self.scale}) wrapping {label(self.strategy)}"

  def init_params(self, student_cfg, teacher_cfg, key):
    return self.strategy.init_params(student_cfg, teacher_cfg, key)

  def settings(self) -> tuple[str, ...]:
    """The wrapped strategy's settings."""
    return self.strategy.settings()

  def replace(self, **changes) -> ScaledLoss:
    """The wrapped strategy with ``changes`` (`Strategy.replace`), at the same scale."""
    return ScaledLoss(self.strategy.replace(**changes), self.scale)

  def _scaled(self, sums: dict) -> dict:
    loss = sums["loss"]
    kept = jax.lax.stop_gradient(loss)
    return {**sums, "loss": kept + self.scale * (loss - kept)}

  def per_sequence(self, *args):
    return self._scaled(self.strategy.per_sequence(*args))

  def per_batch(self, *args, **kw):
    return self._scaled(self.strategy.per_batch(*args, **kw))

  def fallback(self) -> ScaledLoss:
    """The wrapped strategy's fallback, at the same scale."""
    return ScaledLoss(fallback_strategy(self.strategy), self.scale)


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


def label(strategy: Any) -> str:
  """How messages name ``strategy``: its own ``label`` when it has one, else its class name."""
  return getattr(strategy, "label", None) or type(strategy).__name__


def fallback_strategy(strategy: Any) -> Any:
  """The strategy that replaces ``strategy`` after a divergence: its own ``fallback()``, else logit MSE.

  `LogitKD` / `ChunkedLogitKD` keep their recipe with ``divergence="mse"`` (and no top-k): a
  chunked loss stays chunked, so the fallback needs no more memory than the loss it replaces. A
  strategy whose ``fallback()`` is None (or that does not derive from `Strategy`) becomes
  `LogitMSE` with its ``alpha`` (0.5 when it has none). A `ScaledLoss` keeps its scale.
  """
  own = strategy.fallback() if isinstance(strategy, Strategy) else None
  if own is not None:
    return own
  alpha = getattr(strategy, "alpha", 0.5)
  return LogitMSE(alpha=alpha if callable(alpha) or isinstance(alpha, (int, float)) else 0.5)
