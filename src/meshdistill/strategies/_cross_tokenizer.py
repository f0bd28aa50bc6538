"""Distillation across tokenizers: ULD and GOLD's span-aligned KL, on the spans both tokenizations agree on.

A teacher with its own tokenizer (``data.teacher_tokenizer``) runs on its own tokens; the step hands these
strategies a `meshdistill.losses.Aligned` (its logits, targets and the row's alignment) in place of the
teacher's `ModelOutput` (they declare ``cross_tokenizer = True``). Both are
``alpha * D + (1 - alpha) * CE(student, targets)`` with ``D`` summed over the counted spans
(`meshdistill.losses.span_logprobs`) and, as every loss of the step, divided by the global count of the
student's unmasked tokens.

* `ULD` (``uld``): ``D`` = the sorted-probability L1 distance (`meshdistill.losses.uld`), on each side's
  ``top_k`` (None: the whole vocabulary).
* `SpanKL` (``span_kl``): ``D`` = GOLD's hybrid (`meshdistill.losses.hybrid_uld`): GOLD's generalised JSD at
  ``beta`` (0: KL(teacher || student), 1: KL(student || teacher)) over the matched vocabulary weighted
  ``matched_weight`` (None: the matched share of the teacher's vocabulary, as TRL), ULD on the rest. The matched
  vocabulary comes from the two tokenizers, once (`meshdistill.data.alignment.matched_vocabulary`, given to
  `SpanKL.with_matched`).

TRL GOLD's ULD settings and theirs here (TRL's default / meshdistill's default):

=============================================  ==========================================================
TRL ``GOLDConfig``                             here
=============================================  ==========================================================
``uld_token_merge_strategy`` (observed)        ``merge`` (bayesian)
``uld_student_temperature`` (1.0)              ``temperature`` (1.0)
``uld_teacher_temperature`` (1.0)              ``teacher_temperature`` (None: ``temperature``)
``uld_skip_student_eos`` / ``_teacher_eos``    ``skip_eos`` (False): either TRL flag drops the end-of-text
(True / True)                                  span (the other side's lone end-of-text token pairs with
                                               nothing), so one setting covers both
``beta`` (0.5)                                 ``SpanKL.beta`` (0.0: the forward KL this strategy had)
``uld_hybrid_matched_weight`` (None)           ``SpanKL.matched_weight`` (None)
=============================================  ==========================================================

Metrics: ``loss``, ``ce``, ``uld`` (or the matched term -- ``matched_kl`` at ``beta`` 0, ``matched_reverse_kl`` at
1, ``matched_jsd`` between -- and ``unmatched_uld``), ``spans`` (counted spans), and the two sides' negative
log-likelihood of the counted spans in nats, ``span_nll`` / ``teacher_span_nll``; over ``span_bytes`` (``bytes``)
they give both models' bits per byte on the same text.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
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
    temperature: of the student's softmax, and of the teacher's unless ``teacher_temperature`` is set (> 0.01), a
      number or schedule.
    teacher_temperature: of the teacher's softmax (> 0.01), or None: ``temperature``.
    alpha: weight of the distillation term in [0, 1]; ``1 - alpha`` goes to the student's hard-label CE.
    top_k: each side's k largest span probabilities (vocabulary-parallel under a ``tensor`` split), or None:
      the whole vocabularies sorted (exact; a vocabulary split over ``tensor`` is gathered).
    merge: how a span's tokens merge into one distribution (`meshdistill.losses.span_logprobs`): ``"bayesian"``
      (the chain rule) or ``"observed"`` (TRL's default, as TRL computes it; a span ending at a row's last position
      on either side is then not counted).
    skip_eos: True: spans whose target is an end-of-text token (either side's) are not counted, as TRL's
      ``uld_skip_*_eos``; the ids come from the two tokenizers (`with_eos`).

  ``eos`` (not a setting): ``(teacher end-of-text id, student end-of-text id)``, set by `with_eos` /
  `with_tokenizers`.
  """

  temperature: Scalar = 1.0
  teacher_temperature: Scalar | None = None
  alpha: Scalar = 0.5
  top_k: int | None = None
  merge: str = "bayesian"
  skip_eos: bool = False
  capture: tuple[str, ...] = ()
  eos: tuple = dataclasses.field(default=(None, None), init=False, repr=False)
  cross_tokenizer: ClassVar[bool] = True  # the teacher runs on its own tokens (`meshdistill.losses.Aligned`)

  def __post_init__(self):
    owner = type(self).__name__
    object.__setattr__(self, "temperature", check_scalar(f"{owner}.temperature", self.temperature, low=0.01,
                                                         example="1.0"))
    if self.teacher_temperature is not None:
      object.__setattr__(self, "teacher_temperature", check_scalar(
          f"{owner}.teacher_temperature", self.teacher_temperature, low=0.01, example="1.0 (or null: temperature)"))
    object.__setattr__(self, "alpha", check_scalar(f"{owner}.alpha", self.alpha, low=0.0, high=1.0, example="0.5"))
    check_integer(f"{owner}.top_k", self.top_k, 1, allow_none=True, meaning=" (None: the whole vocabulary)")
    if self.merge not in losses.MERGES:
      raise ValueError(f"{owner}.merge={self.merge!r} is not a span merge; choose one of {list(losses.MERGES)} "
                       "(TRL's uld_token_merge_strategy)")
    if not isinstance(self.skip_eos, bool):
      raise ValueError(f"{owner}.skip_eos={self.skip_eos!r} must be true or false")

  def _keep(self, new):
    """``new`` (a `dataclasses.replace` of this strategy) with this one's values that are not settings."""
    for f in dataclasses.fields(self):
      if not f.init:
        object.__setattr__(new, f.name, getattr(self, f.name))
    return new

  def replace(self, **changes):
    return self._keep(dataclasses.replace(self, **changes))

  def with_eos(self, teacher_eos: int | None, student_eos: int | None):
    """This strategy with the two tokenizers' end-of-text ids (what ``skip_eos`` skips)."""
    new = self.replace()
    object.__setattr__(new, "eos", (teacher_eos, student_eos))
    return new

  def with_tokenizers(self, tokenizers):
    """This strategy with the end-of-text ids of the two tokenizers (`with_eos`)."""
    return self.with_eos(getattr(tokenizers.teacher, "eos_id", None), getattr(tokenizers.student, "eos_id", None))

  def fallback(self) -> ULD:
    """After a divergence: the student's hard-label CE alone (``alpha=0``), on its own tokens."""
    return self.replace(alpha=0.0)

  def distance(self, student_SxV, teacher_SxW, span_mask_S) -> dict:
    """The per-span distillation term(s): ``{"term": [S], <metric>: [S]}``."""
    d_S = losses.uld(student_SxV, teacher_SxW, span_mask_S, self.top_k)
    return {"term": d_S, "uld": d_S}

  def span_mask(self, teacher, targets_T) -> jax.Array:
    """``[S]`` float: the spans this strategy counts (of ``span_bytes``, less those ``merge`` / ``skip_eos`` drop)."""
    keep_S = teacher.span_bytes > 0
    if self.merge == "observed":
      keep_S = keep_S & losses.observed_spans(teacher.student_last, targets_T.shape[-1])
      keep_S = keep_S & losses.observed_spans(teacher.teacher_last, teacher.targets.shape[-1])
    if self.skip_eos:
      t_eos, s_eos = self.eos
      if t_eos is None or s_eos is None:
        raise ValueError(f"{type(self).__name__}(skip_eos=True) has no end-of-text ids: give them with "
                         ".with_eos(teacher_eos_id, student_eos_id) (a run gives them from its two tokenizers)")
      keep_S = keep_S & (targets_T[teacher.student_last] != s_eos) & (teacher.targets[teacher.teacher_last] != t_eos)
    return keep_S.astype(jnp.float32)

  def terms(self, student: ModelOutput, teacher, targets_T, mask_T, tau, teacher_tau=None) -> dict:
    """The distillation term summed over the sequence (``"term"``) and its metrics, scalars."""
    del mask_T
    teacher_tau = tau if teacher_tau is None else teacher_tau
    span_mask_S = self.span_mask(teacher, targets_T)
    s_SxV = losses.span_logprobs(student.logits, targets_T, teacher.student_span, teacher.student_last, tau,
                                 self.merge)
    t_SxW = losses.span_logprobs(teacher.logits, teacher.targets, teacher.teacher_span, teacher.teacher_last,
                                 teacher_tau, self.merge)
    out = {k: jnp.sum(v) for k, v in self.distance(s_SxV, t_SxW, span_mask_S).items()}
    out["spans"] = jnp.sum(span_mask_S)
    return out

  def per_sequence(self, params, student: ModelOutput, teacher, targets_T, mask_T, step):
    del params
    if not isinstance(teacher, losses.Aligned):
      raise ValueError(
          f"{type(self).__name__} distils a teacher of another tokenizer: its batches carry the teacher's tokens and "
          "the alignment (set data.teacher_tokenizer); for a teacher of the student's tokenizer use logit_kd"
      )
    tau, alpha = value_at(self.temperature, step), value_at(self.alpha, step)
    teacher_tau = None if self.teacher_temperature is None else value_at(self.teacher_temperature, step)
    terms = self.terms(student, teacher, targets_T, mask_T, tau, teacher_tau)
    ce = jnp.sum(losses.cross_entropy(student.logits, targets_T, mask_T))
    out = {"loss": alpha * terms.pop("term") + (1.0 - alpha) * ce, "ce": ce, **terms}
    out.setdefault("spans", jnp.sum((teacher.span_bytes > 0).astype(jnp.float32)))
    out["bytes"] = jnp.sum(teacher.span_bytes.astype(jnp.float32))
    out["span_nll"] = losses.span_nll(student.logits, targets_T, teacher.student_span, teacher.span_bytes)
    out["teacher_span_nll"] = losses.span_nll(teacher.logits, teacher.targets, teacher.teacher_span, teacher.span_bytes)
    return out


@register("span_kl")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SpanKL(ULD):
  """GOLD's span-aligned KL with logprob merging (see the module docstring).

  Args (besides `ULD`'s):
    matched_weight: weight of the matched-vocabulary term in [0, 1] (``1 - matched_weight`` on the unmatched ULD);
      None: the matched share of the teacher's vocabulary, as TRL.
    beta: GOLD's ``beta`` of the matched term, a number in [0, 1]: 0 the forward KL(teacher || student) (the
      default here; TRL's is 0.5), 1 the reverse KL(student || teacher), between them the generalised JSD
      (`meshdistill.losses.matched_divergence`).

  ``matched`` (not a setting): the matched vocabulary ``(teacher_ids, student_ids)``, set by `with_matched` from
  `meshdistill.data.alignment.matched_vocabulary` of the two tokenizers.
  """

  matched_weight: float | None = None
  beta: float = 0.0
  matched: tuple = dataclasses.field(default=((), ()), init=False, repr=False)

  def __post_init__(self):
    super().__post_init__()
    if self.matched_weight is not None:
      check_scalar("SpanKL.matched_weight", self.matched_weight, low=0.0, high=1.0, example="0.5")
    if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not 0.0 <= self.beta <= 1.0:
      raise ValueError(f"SpanKL.beta={self.beta!r} must be a number in [0, 1] (0: forward KL, 0.5: TRL GOLD's "
                       "default JSD, 1: reverse KL); a schedule is not taken (TRL switches to the KLs at 0 and 1)")
    object.__setattr__(self, "beta", float(self.beta))

  @property
  def matched_metric(self) -> str:
    """The metric name of the matched term at this ``beta``."""
    return {0.0: "matched_kl", 1.0: "matched_reverse_kl"}.get(self.beta, "matched_jsd")

  def with_matched(self, teacher_ids, student_ids) -> SpanKL:
    """This strategy with the matched vocabulary given as id pairs (``teacher_ids[m]`` <-> ``student_ids[m]``)."""
    if len(teacher_ids) != len(student_ids) or not len(teacher_ids):
      raise ValueError(f"SpanKL: the matched vocabulary needs equal, non-empty id lists, got {len(teacher_ids)} "
                       f"teacher and {len(student_ids)} student ids; tokenizers with no token in common: use uld")
    new = self.replace()
    object.__setattr__(new, "matched", (tuple(int(i) for i in teacher_ids), tuple(int(i) for i in student_ids)))
    return new

  def with_tokenizers(self, tokenizers) -> SpanKL:
    """This strategy with the matched vocabulary (`with_matched`) and end-of-text ids (`with_eos`) of the two
    tokenizers."""
    return super().with_tokenizers(tokenizers).with_matched(*tokenizers.matched())

  def distance(self, student_SxV, teacher_SxW, span_mask_S) -> dict:
    teacher_ids, student_ids = self.matched
    if not teacher_ids:
      raise ValueError("SpanKL has no matched vocabulary: give it with SpanKL(...).with_matched(*matched_vocabulary("
                       "teacher_tokenizer, student_tokenizer)) (meshdistill.data.alignment)")
    d_S, matched_S, uld_S = losses.hybrid_uld(
        student_SxV, teacher_SxW, student_ids, teacher_ids, span_mask_S, self.matched_weight, self.top_k, self.beta
    )
    return {"term": d_S, self.matched_metric: matched_S, "unmatched_uld": uld_S}
