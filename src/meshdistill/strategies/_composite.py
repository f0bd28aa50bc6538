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
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp

from meshdistill import losses
from meshdistill.models import ModelOutput
from meshdistill.losses.schedules import Scalar, check_scalar, value_at
from meshdistill.strategies._base import SequenceStrategy, check, register


@register("hard_label_ce")
@dataclasses.dataclass(frozen=True, kw_only=True)
class HardLabelCE(SequenceStrategy):
  """Cross-entropy of the student on the targets (no teacher term): ``loss`` = masked CE sum."""

  needs_teacher: ClassVar[bool] = False

  def per_sequence(self, params, student: ModelOutput, teacher: ModelOutput, targets_T, mask_T, step):
    del params, teacher, step
    return {"loss": jnp.sum(losses.cross_entropy(student.logits, targets_T, mask_T))}


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Composite(SequenceStrategy):
  """A weighted sum of strategies.

  ``loss = sum_name weights[name] * terms[name].loss``; every value a term returns is
  reported as ``"<name>/<key>"`` (e.g. ``"kd/loss"``, ``"kd/kl"``, ``"attn/loss"``), each
  term's own loss unweighted. ``capture`` is the union of the terms' captures;
  parameters are namespaced per term (``params[name]``), each term getting its own key.

  Attributes:
    terms: ``{name: strategy}``; names are non-empty and contain no ``"/"``.
    weights: ``{name: weight}``; a weight is a non-negative constant, a schedule (a
      function of the step) or a schedule spec dict. Terms without a weight get 1.0.
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
      if check(term, f"Composite.terms[{name!r}]") != "per_sequence":
        raise ValueError(
            f"Composite.terms[{name!r}]={type(term).__name__} computes its loss over whole batches from the LM "
            "heads (needs_head), which a composite cannot combine per sequence; use LogitKD as the term instead"
        )
    unknown = sorted(set(self.weights) - set(self.terms))
    if unknown:
      raise ValueError(f"Composite.weights names {unknown}, which are not terms; terms are {sorted(self.terms)}")
    weights = {
        name: check_scalar(f"Composite.weights[{name!r}]", w, 0.0, math.inf, high_open=True, example="1.0")
        for name, w in self.weights.items()
    }
    object.__setattr__(self, "terms", dict(self.terms))
    object.__setattr__(self, "weights", weights)

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
