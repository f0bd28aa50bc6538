"""Distillation across tokenizers: ULD and GOLD's span-aligned KL, on the spans both tokenizations agree on.

A teacher with its own tokenizer (``data.teacher_tokenizer``) runs on its own tokens; the step hands these
strategies a `meshdistill.losses.Aligned` (its logits, targets and the row's alignment) in place of the
teacher's `ModelOutput` (they declare ``cross_tokenizer = True``). Both are
``alpha * D + (1 - alpha) * CE(student, targets)`` with ``D`` summed over the counted spans
(`meshdistill.losses.span_logprobs`) and, as every loss of the step, divided by the global count of the
student's unmasked tokens.

* `ULD` (``uld``): ``D`` = the sorted-probability L1 distance (`meshdistill.losses.uld`), on each side's
  ``top_k`` (None: the whole vocabulary).
* `SpanKL` (``span_kl``): ``D`` = GOLD's hybrid (`meshdistill.losses.hybrid_uld`): KL(teacher || student) over
  the matched vocabulary weighted ``matched_weight`` (None: the matched share of the teacher's vocabulary), ULD on
  the rest. The matched vocabulary comes from the two tokenizers, once
  (`meshdistill.data.alignment.matched_vocabulary`, given to `SpanKL.with_matched`).

Metrics: ``loss``, ``ce``, ``uld`` (or ``matched_kl`` and ``unmatched_uld``), ``spans`` (counted spans), and the
two sides' negative log-likelihood of the counted spans in nats, ``span_nll`` / ``teacher_span_nll``; over
``span_bytes`` (``bytes``) they give both models' bits per byte on the same text.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from meshdistill import losses
from meshdistill.models import ModelOutput
from meshdistill.strategies._base import SequenceStrategy, register
from meshdistill.losses.schedules import Scalar, check_integer, check_scalar, value_at


@register("uld")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ULD(SequenceStrategy):
  """Universal Logit Distillation across tokenizers (see the module docstring).

  Args:
    temperature: of both sides' softmax (> 0.01), a number or schedule.
    alpha: weight of the distillation term in [0, 1]; ``1 - alpha`` goes to the student's hard-label CE.
    top_k: each side's k largest span probabilities (vocabulary-parallel under a ``tensor`` split), or None:
      the whole vocabularies sorted (exact; a vocabulary split over ``tensor`` is gathered).
  """

  temperature: Scalar = 1.0
  alpha: Scalar = 0.5
  top_k: int | None = None
  capture: tuple[str, ...] = ()
  cross_tokenizer: ClassVar[bool] = True  # the teacher runs on its own tokens (`meshdistill.losses.Aligned`)

  def __post_init__(self):
    owner = type(self).__name__
    object.__setattr__(self, "temperature", check_scalar(f"{owner}.temperature", self.temperature, low=0.01,
                                                         example="1.0"))
    object.__setattr__(self, "alpha", check_scalar(f"{owner}.alpha", self.alpha, low=0.0, high=1.0, example="0.5"))
    check_integer(f"{owner}.top_k", self.top_k, 1, allow_none=True, meaning=" (None: the whole vocabulary)")

  def fallback(self) -> ULD:
    """After a divergence: the student's hard-label CE alone (``alpha=0``), on its own tokens."""
    return dataclasses.replace(self, alpha=0.0)

  def distance(self, student_SxV, teacher_SxW, span_mask_S) -> dict:
    """The per-span distillation term(s): ``{"term": [S], <metric>: [S]}``."""
    d_S = losses.uld(student_SxV, teacher_SxW, span_mask_S, self.top_k)
    return {"term": d_S, "uld": d_S}

  def terms(self, student: ModelOutput, teacher, targets_T, mask_T, tau) -> dict:
    """The distillation term summed over the sequence (``"term"``) and its metrics, scalars."""
    del mask_T
    span_mask_S = (teacher.span_bytes > 0).astype(jnp.float32)
    s_SxV = losses.span_logprobs(student.logits, targets_T, teacher.student_span, teacher.student_last, tau)
    t_SxW = losses.span_logprobs(teacher.logits, teacher.targets, teacher.teacher_span, teacher.teacher_last, tau)
    return {k: jnp.sum(v) for k, v in self.distance(s_SxV, t_SxW, span_mask_S).items()}

  def per_sequence(self, params, student: ModelOutput, teacher, targets_T, mask_T, step):
    del params
    if not isinstance(teacher, losses.Aligned):
      raise ValueError(
          f"{type(self).__name__} distils a teacher of another tokenizer: its batches carry the teacher's tokens and "
          "the alignment (set data.teacher_tokenizer); for a teacher of the student's tokenizer use logit_kd"
      )
    tau, alpha = value_at(self.temperature, step), value_at(self.alpha, step)
    terms = self.terms(student, teacher, targets_T, mask_T, tau)
    ce = jnp.sum(losses.cross_entropy(student.logits, targets_T, mask_T))
    out = {"loss": alpha * terms.pop("term") + (1.0 - alpha) * ce, "ce": ce, **terms}
    out["spans"] = jnp.sum((teacher.span_bytes > 0).astype(jnp.float32))
    out["bytes"] = jnp.sum(teacher.span_bytes.astype(jnp.float32))
    out["span_nll"] = losses.span_nll(student.logits, targets_T, teacher.student_span, teacher.span_bytes)
    out["teacher_span_nll"] = losses.span_nll(teacher.logits, teacher.targets, teacher.teacher_span, teacher.span_bytes)
    return out


@register("span_kl")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SpanKL(ULD):
  """GOLD's span-aligned KL with logprob merging (see the module docstring).

  Args (besides `ULD`'s):
    matched_weight: weight of the matched-vocabulary KL in [0, 1] (``1 - matched_weight`` on the unmatched ULD);
      None: the matched share of the teacher's vocabulary, as TRL.

  ``matched`` (not a setting): the matched vocabulary ``(teacher_ids, student_ids)``, set by `with_matched` from
  `meshdistill.data.alignment.matched_vocabulary` of the two tokenizers.
  """

  matched_weight: float | None = None
  matched: tuple = dataclasses.field(default=((), ()), init=False, repr=False)

  def __post_init__(self):
    super().__post_init__()
    if self.matched_weight is not None:
      check_scalar("SpanKL.matched_weight", self.matched_weight, low=0.0, high=1.0, example="0.5")

  def with_matched(self, teacher_ids, student_ids) -> SpanKL:
    """This strategy with the matched vocabulary given as id pairs (``teacher_ids[m]`` <-> ``student_ids[m]``)."""
    if len(teacher_ids) != len(student_ids) or not len(teacher_ids):
      raise ValueError(f"SpanKL: the matched vocabulary needs equal, non-empty id lists, got {len(teacher_ids)} "
                       f"teacher and {len(student_ids)} student ids; tokenizers with no token in common: use uld")
    new = dataclasses.replace(self)
    object.__setattr__(new, "matched", (tuple(int(i) for i in teacher_ids), tuple(int(i) for i in student_ids)))
    return new

  def with_tokenizers(self, tokenizers) -> SpanKL:
    """This strategy with the matched vocabulary of the two tokenizers (`with_matched`)."""
    return self.with_matched(*tokenizers.matched())

  def fallback(self) -> SpanKL:
    return super().fallback().with_matched(*self.matched)

  def distance(self, student_SxV, teacher_SxW, span_mask_S) -> dict:
    teacher_ids, student_ids = self.matched
    if not teacher_ids:
      raise ValueError("SpanKL has no matched vocabulary: give it with SpanKL(...).with_matched(*matched_vocabulary("
                       "teacher_tokenizer, student_tokenizer)) (meshdistill.data.alignment)")
    d_S, kl_S, uld_S = losses.hybrid_uld(
        student_SxV, teacher_SxW, student_ids, teacher_ids, span_mask_S, self.matched_weight, self.top_k
    )
    return {"term": d_S, "matched_kl": kl_S, "unmatched_uld": uld_S}
