"""Logit distillation: KL at temperature tau mixed with hard-label CE."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Union

import jax
import jax.numpy as jnp

from meshdistill import losses
from meshdistill.models import ModelOutput

Scalar = Union[float, Callable[[jax.Array], jax.Array]]


def value_at(x: Scalar, step: jax.Array) -> jax.Array:
  """A constant, or a schedule (a function of the step number) evaluated at ``step``."""
  return jnp.asarray(x(step) if callable(x) else x, jnp.float32)


def logit_metrics(student: ModelOutput, teacher: ModelOutput, targets_T, mask_T) -> dict[str, jax.Array]:
  """Token sums of the monitoring metrics shared by every strategy (all masked)."""
  s, t = student.logits, teacher.logits
  return {
      "ce": jnp.sum(losses.cross_entropy(s, targets_T, mask_T)),
      "teacher_ce": jnp.sum(losses.cross_entropy(t, targets_T, mask_T)),
      "corr": jnp.sum(losses.pearson(s, t, mask_T)),
      "agree": jnp.sum(losses.top1_agreement(s, t, mask_T)),
  }


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitKD:
  """Logit distillation mixed with hard labels.

  ``loss = alpha * tau^2 * KL(teacher_tau || student_tau) + (1 - alpha) * CE(student, targets)``

  ``temperature`` (tau) and ``alpha`` are constants or schedules of the step number.
  The reported ``kl`` is the KL at temperature tau (the term being optimised).
  """

  temperature: Scalar = 2.0
  alpha: Scalar = 0.5
  capture: tuple[str, ...] = ()

  def __post_init__(self):
    if not callable(self.temperature) and not float(self.temperature) > 0:
      raise ValueError(f"LogitKD.temperature={self.temperature!r} must be > 0 (e.g. 2.0)")
    if not callable(self.alpha) and not 0.0 <= float(self.alpha) <= 1.0:
      raise ValueError(f"LogitKD.alpha={self.alpha!r} must lie in [0, 1] (weight of the KD term)")

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    del student_cfg, teacher_cfg, key
    return {}

  def per_sequence(self, params, student: ModelOutput, teacher: ModelOutput, targets_T, mask_T, step):
    del params
    tau = value_at(self.temperature, step)
    alpha = value_at(self.alpha, step)
    out = logit_metrics(student, teacher, targets_T, mask_T)
    out["kl"] = jnp.sum(losses.forward_kl(student.logits, teacher.logits, mask_T, tau))
    out["loss"] = alpha * tau**2 * out["kl"] + (1.0 - alpha) * out["ce"]
    return out
