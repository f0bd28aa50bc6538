"""What the step gets from the teacher, decided once when a `Distiller` is built: `TeacherOutput` (`decide`), and
`TopKTeacher`, a teacher known by its top-k per token (an offline cache, a teacher on other devices or behind a
server, several teachers combined), whose top-k every batch brings under `meshdistill.core.batch.TOPK_KEYS`. The
teacher sources (`meshdistill.teachers`) build a `TopKTeacher`; the `Distiller` decides, the step reads the decision."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from meshdistill.core.batch import TOPK_KEYS
from meshdistill.strategies import Strategy, label


class TeacherKind(enum.StrEnum):
  """What a teacher gives the step: THE one set of teacher kinds, asked of the decided teacher
  (``distiller.teacher_output.kind is TeacherKind.TOPK``) and declared by every teacher source
  (`meshdistill.teachers.kinds.TeacherSource.gives`); never worked out from which attributes happen to be set.

  ``MODEL``: the step runs the teacher's weights; ``TOPK``: every batch brings the teacher's top-k
  (`meshdistill.core.batch.TOPK_KEYS`), no weights; ``NONE``: no teacher (the strategy needs none)."""

  MODEL = "model"
  TOPK = "topk"
  NONE = "none"


# The kinds under their short names (``teachers.kinds`` names ``NONE`` ``NOTHING``: the same member).
MODEL, TOPK, NONE = TeacherKind.MODEL, TeacherKind.TOPK, TeacherKind.NONE


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopKTeacher:
  """A teacher known only by its top-k (no weights): what a `Distiller` needs to train from it.

  Attributes:
    cfg: the teacher's `ModelConfig` (vocabulary and length; its weights are not loaded).
    k: tokens kept per position.
    temperature: the temperature its log-probabilities were taken at.
    vocab: the token range ``[0, vocab)`` the top-k was taken over.
    source: where it comes from (a cache directory, a sub-mesh), for messages.
    names: several teachers combined into this top-k (`meshdistill.teachers.multi`), in the order their own
      top-k come in every batch (`meshdistill.core.batch.MULTI_KEYS`); () for one teacher.
    cross: the top-k is per TEACHER token of the teacher's own tokenizer (a cross-tokenizer cache): only a
      ``cross_tokenizer`` strategy reads it (over the teacher's whole vocabulary, `meshdistill.losses.topk_logprobs`).
  """

  cfg: Any
  k: int
  temperature: float
  vocab: int
  source: str = "top-k teacher"
  names: tuple[str, ...] = ()
  cross: bool = False

  def check_strategy(self, strategy: Strategy) -> None:
    """Raises a clear error unless ``strategy`` can train from this teacher's top-k alone: a strategy of another
    tokenizer (``cross_tokenizer``) from a cache of the teacher's own tokens and any other one from a top-k of the
    student's tokens; one that declares ``accepts_topk`` then checks this teacher itself (`check_topk_teacher`: by
    default a top-k of at most ``k`` tokens at this teacher's temperature). Messages name it by its ``label``."""
    name = label(strategy)
    aligns = strategy.cross_tokenizer
    if aligns and not self.cross:
      raise ValueError(f"{self.source} holds the teacher's top-{self.k} per token of the student's own tokenizer, but "
                       f"strategy {name} distils a teacher of another tokenizer; write the cache with "
                       "data.teacher_tokenizer set (`meshdistill cache-teacher`), or use distill.kind=logit_kd")
    if self.cross and not aligns:
      raise ValueError(f"{self.source} holds the top-{self.k} of a teacher of another tokenizer, per teacher token, "
                       f"but strategy {name} compares the models token by token over one vocabulary; use "
                       "distill.kind: byte_kl, span_kl or uld")
    if aligns:  # reads the top-k spread over the teacher's vocabulary, at any temperature and top_k of its own
      return
    if not strategy.accepts_topk:
      raise ValueError(
          f"{self.source} gives the teacher's top-{self.k} tokens only, but strategy {name} "
          "needs a live teacher (its logits, hidden states, attention maps or LM head); use distill.kind=logit_kd "
          f"with distill.top_k <= {self.k}, or a live teacher (remove teacher.cache)"
      )
    strategy.check_topk_teacher(self)


@dataclasses.dataclass(frozen=True)
class TeacherOutput:
  """What the step gets from the teacher: decided once, by `decide`, when a `Distiller` is built, and handed to the
  step (its ``teacher_output`` keyword), which reads it and nothing else to choose the teacher's part.

  Attributes:
    kind: a `TeacherKind`: `MODEL` (the step runs the teacher's weights), `TOPK` (every batch brings the teacher's
      top-k, `meshdistill.core.batch.TOPK_KEYS`; no weights) or `NONE` (no teacher: the strategy needs none). The
      jobs, the evaluation, the guard and the loop ask it (``teacher_output.kind is TeacherKind.MODEL``).
    own_tokenizer: the teacher reads its own tokens (a strategy with ``cross_tokenizer``): a model teacher runs on
      the batch's `meshdistill.core.batch.CROSS_KEYS` and its output is aligned on spans; a top-k teacher is a
      cross-tokenizer cache, spread over its vocabulary.
    topk: the `TopKTeacher` when ``kind is TOPK``.
    cache_rows: a `MODEL` teacher some of whose batches bring its top-k instead (an off-policy cache of
      `meshdistill.train.onpolicy.OnPolicyDistiller`): the step reads the top-k of a batch that carries it
      (`TOPK_KEYS`) and runs the teacher on the others.
  """

  kind: TeacherKind
  own_tokenizer: bool = False
  topk: TopKTeacher | None = None
  cache_rows: bool = False

  def __post_init__(self):
    object.__setattr__(self, "kind", TeacherKind(self.kind))  # "model" -> TeacherKind.MODEL; a wrong name raises

  @property
  def gives(self) -> TeacherKind:
    """The former name of ``kind``."""
    return self.kind

  def reads_topk(self, batch: dict) -> bool:
    """Whether the step reads the teacher's top-k from ``batch`` (and runs no teacher on it)."""
    return self.kind is TeacherKind.TOPK or (self.cache_rows and TOPK_KEYS[0] in batch)

  def for_strategy(self, strategy: Strategy | None) -> TeacherOutput:
    """The same teacher for another strategy (a `Distiller.with_strategy` variant): `decide` again."""
    return _decided(self.kind, self.topk, strategy, self.cache_rows)


def decide(teacher: Any, strategy: Strategy | None, *, cache_rows: bool = False) -> TeacherOutput:
  """THE place that decides what a teacher gives the step: ``teacher`` (a model, a `TopKTeacher` or None) for
  ``strategy`` (None: the default `LogitKD`; its declared ``cross_tokenizer``); ``cache_rows``: a model teacher
  whose off-policy batches bring its top-k from a cache. No check here: the `Distiller` checks the pair."""
  if teacher is None:
    return TeacherOutput(NONE)
  if isinstance(teacher, TopKTeacher):
    return _decided(TOPK, teacher, strategy, False)
  return _decided(MODEL, None, strategy, cache_rows)


def _decided(kind: TeacherKind, topk: TopKTeacher | None, strategy: Strategy | None,
             cache_rows: bool) -> TeacherOutput:
  own = kind is not TeacherKind.NONE and strategy is not None and strategy.cross_tokenizer
  return TeacherOutput(kind, bool(own), topk, cache_rows)
