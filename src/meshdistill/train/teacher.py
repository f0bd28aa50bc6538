"""The teacher a `Distiller` trains from when it has no weights here: `TopKTeacher`, known by its top-k per token
(an offline cache, a teacher on other devices or behind a server, several teachers combined); every batch brings
that top-k under `meshdistill.core.batch.TOPK_KEYS`. The teacher sources (`meshdistill.teachers`) build one; the
`Distiller` and the step read it."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshdistill.strategies import label


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
      top-k come in every batch (`meshdistill.train.step.MULTI_KEYS`); () for one teacher.
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

  def check_strategy(self, strategy: Any) -> None:
    """Raises a clear error unless ``strategy`` can train from this teacher's top-k alone: it declares
    ``accepts_topk`` (the strategy contract's capability) and reads a top-k of at most ``k`` tokens at this
    teacher's temperature; messages name it by its ``label``. A strategy with a ``check_topk_teacher(teacher)``
    method (`SampledTokenKD`: it needs only the sampled token's log-probability) checks this teacher itself."""
    name = label(strategy)
    aligns = getattr(strategy, "cross_tokenizer", False)
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
    if strategy.accepts_topk and hasattr(strategy, "check_topk_teacher"):
      strategy.check_topk_teacher(self)
      return
    if not strategy.accepts_topk:
      raise ValueError(
          f"{self.source} gives the teacher's top-{self.k} tokens only, but strategy {name} "
          "needs a live teacher (its logits, hidden states, attention maps or LM head); use distill.kind=logit_kd "
          f"with distill.top_k <= {self.k}, or a live teacher (remove teacher.cache)"
      )
    if strategy.top_k is None or strategy.top_k > self.k:
      raise ValueError(
          f"{self.source} holds the teacher's top-{self.k}, but {name}.top_k={strategy.top_k}; set "
          f"distill.top_k to an integer in [1, {self.k}] (the full-vocabulary loss needs a live teacher)"
      )
    tau = strategy.temperature
    if callable(tau) or float(tau) != float(self.temperature):
      raise ValueError(
          f"{self.source} holds log-probabilities at temperature {self.temperature}, but {name}.temperature="
          f"{tau!r}; set distill.temperature={self.temperature} (a constant), or write a cache at "
          "the temperature you want"
      )
