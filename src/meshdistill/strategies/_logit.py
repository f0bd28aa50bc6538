"""Logit distillation: a divergence at temperature tau mixed with hard-label CE."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from meshdistill import losses, schedules
from meshdistill.models import ModelOutput

Scalar = float | Callable[[jax.Array], jax.Array]


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


# setting -> (lowest allowed, highest allowed, lowest inclusive, highest inclusive, example)
_RANGES = {
    "temperature": (0.0, float("inf"), False, False, "2.0"),
    "alpha": (0.0, 1.0, True, True, "0.5"),
    "beta": (0.0, 1.0, True, True, "0.5"),
    "skew": (0.0, 1.0, True, False, "0.1"),
}


def _check_range(name: str, value: Any) -> None:
  """Raises ValueError when a constant or dict-spec setting can leave its allowed range."""
  if callable(value):
    return  # an arbitrary schedule function cannot be checked without running it
  if not isinstance(value, dict):
    try:
      value = float(value)
    except (TypeError, ValueError):
      raise ValueError(
          f"LogitKD.{name}={value!r} must be a number, a schedule function or a schedule spec dict"
      ) from None
  lo, hi = schedules.value_range(value, f"LogitKD.{name}")
  low, high, low_in, high_in, example = _RANGES[name]
  ok = (lo >= low if low_in else lo > low) and (hi <= high if high_in else hi < high)
  if not ok:
    brackets = ("[" if low_in else "(", "]" if high_in else ")")
    interval = f"> {low}" if high == float("inf") else f"in {brackets[0]}{low}, {high}{brackets[1]}"
    shown = repr(value) if not isinstance(value, dict) else f"{value} (takes values in [{lo}, {hi}])"
    raise ValueError(f"LogitKD.{name}={shown} must be {interval} (e.g. {example})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitKD:
  """Logit distillation mixed with hard labels.

  ``loss = alpha * tau^2 * D(teacher_tau, student_tau) + (1 - alpha) * CE(student, targets)``

  Args:
    temperature: tau > 0, softens both distributions (the ``tau^2`` factor keeps the
      gradient scale independent of tau).
    alpha: weight of the distillation term, in [0, 1].
    divergence: ``D``, a name in `meshdistill.losses.DIVERGENCES`: ``forward_kl``
      (default), ``reverse_kl``, ``jsd``, ``skew_kl``, ``skew_reverse_kl``, ``tvd``, ``mse``.
    beta: ``jsd`` only: the generalised JSD's interpolation in [0, 1] (TRL's convention,
      near 0 ~ forward KL, near 1 ~ reverse KL; see `meshdistill.losses.jsd`).
    skew: ``skew_kl`` / ``skew_reverse_kl`` only: mixture weight in [0, 1) (DistiLLM: 0.1).
    top_k: None for the full vocabulary, or k: compare on the teacher's top-k tokens plus
      one tail bin (`meshdistill.losses.topk_divergence`; not with ``mse``).
    capture: extra model outputs (none needed).

  ``temperature``, ``alpha``, ``beta`` and ``skew`` are each a number, a schedule (a
  function of the step, see `meshdistill.schedules`) or a schedule spec dict such as
  ``{"kind": "linear", "start": 3.0, "end": 1.0, "steps": 1000}``; schedules are
  evaluated on the traced step inside the compiled step (no recompilation).

  Metrics (token means): ``loss``, ``kl`` (forward KL at tau over the full vocabulary,
  always reported for comparability), ``ce``, ``teacher_ce``, ``corr``, ``agree``, and,
  when the optimised term is not the full forward KL, the term itself under the
  divergence's name (``reverse_kl``, ``jsd``, ...; ``topk_<name>`` with ``top_k``).
  """

  temperature: Scalar = 2.0
  alpha: Scalar = 0.5
  divergence: str = "forward_kl"
  beta: Scalar = 0.5
  skew: Scalar = 0.1
  top_k: int | None = None
  capture: tuple[str, ...] = ()

  def __post_init__(self):
    if self.divergence not in losses.DIVERGENCES:
      raise ValueError(f"LogitKD.divergence={self.divergence!r} is unknown; choose one of {sorted(losses.DIVERGENCES)}")
    for name in _RANGES:
      _check_range(name, getattr(self, name))
    if self.divergence == "jsd" and not callable(self.beta):
      lo, hi = schedules.value_range(self.beta if isinstance(self.beta, dict) else float(self.beta))
      if lo == hi and lo in (0.0, 1.0):
        other = "forward_kl" if lo == 0.0 else "reverse_kl"
        raise ValueError(
            f"LogitKD.beta={self.beta!r} makes divergence='jsd' identically 0 (its mixture collapses onto one "
            f"side); for the limit it tends to use divergence={other!r}, or choose 0 < beta < 1"
        )
    for name in _RANGES:
      if isinstance(getattr(self, name), dict):  # a YAML-style spec becomes a schedule function
        object.__setattr__(self, name, schedules.from_spec(getattr(self, name), f"LogitKD.{name}"))
    if self.top_k is not None:
      if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
        raise ValueError(f"LogitKD.top_k={self.top_k!r} must be None (full vocabulary) or a positive integer")
      if self.divergence not in losses.DISTRIBUTION_DIVERGENCES:
        raise ValueError(
            f"LogitKD.top_k={self.top_k} needs a divergence of distributions, but divergence={self.divergence!r} "
            f"compares logits; choose one of {sorted(losses.DISTRIBUTION_DIVERGENCES)} or top_k=None"
        )

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    del key
    if self.top_k is not None:
      vocab = min(student_cfg.vocab_size, teacher_cfg.vocab_size)
      if self.top_k > vocab:
        raise ValueError(f"LogitKD.top_k={self.top_k} exceeds the vocabulary size {vocab}; use top_k <= {vocab}")
    return {}

  def per_sequence(self, params, student: ModelOutput, teacher: ModelOutput, targets_T, mask_T, step):
    del params
    tau = value_at(self.temperature, step)
    alpha = value_at(self.alpha, step)
    s, t = student.logits, teacher.logits
    out = logit_metrics(student, teacher, targets_T, mask_T)
    out["kl"] = jnp.sum(losses.forward_kl(s, t, mask_T, tau))
    if self.divergence == "forward_kl" and self.top_k is None:
      term = out["kl"]
    else:
      hyper = {name: value_at(getattr(self, name), step) for name in losses.HYPERPARAMETERS[self.divergence]}
      if self.top_k is None:
        name = self.divergence
        per_token_T = losses.get_divergence(name)(s, t, mask_T, tau, **hyper)
      else:
        name = f"topk_{self.divergence}"
        indices_TxK, logprobs_TxK = losses.teacher_topk(t, self.top_k, tau)
        tail_T = losses.topk_tail(t, indices_TxK, tau)
        per_token_T = losses.topk_divergence(
            s, indices_TxK, logprobs_TxK, mask_T, tau, self.divergence, tail_T, **hyper
        )
      term = out[name] = jnp.sum(per_token_T)
    out["loss"] = alpha * tau**2 * term + (1.0 - alpha) * out["ce"]
    return out
