"""Weighted sums of strategies, and the plain hard-label cross-entropy strategy.

>>> from meshdistill.strategies import AttentionTransfer, Composite, HardLabelCE, LogitKD
>>> s = Composite(
...     terms={"kd": LogitKD(), "attn": AttentionTransfer(), "ce": HardLabelCE()},
...     weights={"kd": 1.0, "attn": 0.5, "ce": 0.1},
... )
>>> s.capture
('attn',)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from meshdistill import losses
from meshdistill.models import ModelOutput
from meshdistill.strategies._logit import Scalar, value_at


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardLabelCE:
  """Cross-entropy of the student on the targets (no teacher term): ``loss`` = masked CE sum."""

  @property
  def capture(self) -> tuple[str, ...]:
    return ()

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    del student_cfg, teacher_cfg, key
    return {}

  def per_sequence(self, params, student: ModelOutput, teacher: ModelOutput, targets_T, mask_T, step):
    del params, teacher, step
    return {"loss": jnp.sum(losses.cross_entropy(student.logits, targets_T, mask_T))}


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Composite:
  """A weighted sum of strategies.

  ``loss = sum_name weights[name] * terms[name].loss``; every value a term returns is
  reported as ``"<name>/<key>"`` (e.g. ``"kd/loss"``, ``"kd/kl"``, ``"attn/loss"``), each
  term's own loss unweighted. ``capture`` is the union of the terms' captures;
  parameters are namespaced per term (``params[name]``), each term getting its own key.

  Attributes:
    terms: ``{name: strategy}``; names are non-empty and contain no ``"/"``.
    weights: ``{name: weight}``; a weight is a non-negative constant or a schedule (a
      function of the step). Terms without a weight get 1.0.
  """

  terms: Mapping[str, Any]
  weights: Mapping[str, Scalar] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.terms, Mapping) or not self.terms:
      raise ValueError(
          f"Composite.terms={self.terms!r} must be a non-empty dict of name -> strategy, "
          "e.g. {'kd': LogitKD(), 'attn': AttentionTransfer()}"
      )
    if not isinstance(self.weights, Mapping):
      raise ValueError(f"Composite.weights={self.weights!r} must be a dict of term name -> weight")
    for name, term in self.terms.items():
      if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"Composite.terms name {name!r} must be a non-empty string without '/'")
      missing = [a for a in ("capture", "init_params", "per_sequence") if not hasattr(term, a)]
      if getattr(term, "needs_head", False) or not getattr(term, "needs_logits", True):
        raise ValueError(
            f"Composite.terms[{name!r}]={type(term).__name__} computes its loss over whole batches from the LM "
            "heads (needs_head), which a composite cannot combine per sequence; use LogitKD as the term instead"
        )
      if missing:
        raise ValueError(f"Composite.terms[{name!r}]={term!r} is not a strategy: it lacks {missing}")
    unknown = sorted(set(self.weights) - set(self.terms))
    if unknown:
      raise ValueError(f"Composite.weights names {unknown}, which are not terms; terms are {sorted(self.terms)}")
    for name, w in self.weights.items():
      if callable(w):
        continue
      try:
        ok = math.isfinite(float(w)) and float(w) >= 0.0
      except (TypeError, ValueError):
        ok = False
      if not ok:
        raise ValueError(
            f"Composite.weights[{name!r}]={w!r} must be a finite number >= 0 or a schedule (a function of the step)"
        )
    object.__setattr__(self, "terms", dict(self.terms))
    object.__setattr__(self, "weights", dict(self.weights))

  @property
  def capture(self) -> tuple[str, ...]:
    out: list[str] = []
    for term in self.terms.values():
      out.extend(c for c in term.capture if c not in out)
    return tuple(out)

  def weight(self, name: str, step: jax.Array) -> jax.Array:
    """The weight of term ``name`` at ``step``."""
    return value_at(self.weights.get(name, 1.0), step)

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    return {
        name: term.init_params(student_cfg, teacher_cfg, jax.random.fold_in(key, i))
        for i, (name, term) in enumerate(self.terms.items())
    }

  def per_sequence(self, params, student: ModelOutput, teacher: ModelOutput, targets_T, mask_T, step):
    out: dict[str, jax.Array] = {}
    total = jnp.zeros((), jnp.float32)
    for name, term in self.terms.items():
      values = term.per_sequence(params[name], student, teacher, targets_T, mask_T, step)
      out.update({f"{name}/{k}": v for k, v in values.items()})
      total = total + self.weight(name, step) * values["loss"]
    out["loss"] = total
    return out
