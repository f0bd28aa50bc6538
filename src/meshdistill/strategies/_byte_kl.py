"""Distillation across tokenizers on the next byte: both models' next-token distributions projected onto the
byte the student predicts (`meshdistill.losses.next_byte_logprobs`), compared with KL(teacher || student).

A teacher of another tokenizer predicts tokens the student never sees, but both predict the text's bytes. At each
student target position, the student's distribution over its next first byte (for a byte-level student: its own
distribution, exactly) is pulled towards the teacher's distribution over the same byte: at a teacher token's first
byte the sum of the teacher's probabilities of tokens starting with each byte (exact), inside a teacher token (up
to ``max_depth`` bytes deep) the chain rule over the tokens that continue the known prefix. Unlike ULD it keeps the
identity of what is predicted; unlike the matched vocabulary it uses the teacher's whole distribution, not the few
single-byte tokens a BPE teacher rarely predicts. ``alpha * KL + (1 - alpha) * CE``, summed over the counted
positions (a student target in a counted span, at most ``max_depth`` bytes inside its teacher token) and divided,
as every loss of the step, by the global count of the student's unmasked tokens. A student with multi-byte tokens
is compared on its tokens' first bytes only (see `meshdistill.losses._next_byte`).

The vocabulary tables (`meshdistill.losses.ByteTables`) come from the two tokenizers, once
(`meshdistill.data.alignment.byte_tables_of`, given to `ByteKL.with_tables`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from meshdistill import losses
from meshdistill.models import ModelOutput
from meshdistill.strategies._base import register
from meshdistill.strategies._cross_tokenizer import ULD
from meshdistill.losses.schedules import check_integer


@register("byte_kl")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ByteKL(ULD):
  """KL(teacher || student) on the next byte (see the module docstring).

  Args (``temperature`` and ``alpha`` as `ULD`'s; ``top_k`` is not used):
    max_depth: the deepest byte inside a teacher token that is compared (0: only the bytes where a teacher token
      starts, the exact projection; a larger depth adds the chain rule inside the teacher's tokens).

  ``tables`` (not a setting): the `meshdistill.losses.ByteTables` of the two vocabularies, set by `with_tables`.
  """

  max_depth: int = 16
  tables: losses.ByteTables | None = dataclasses.field(default=None, init=False, repr=False)

  def __post_init__(self):
    super().__post_init__()
    check_integer("ByteKL.max_depth", self.max_depth, 0, meaning=" (0: the first byte of each teacher token only)")
    if self.top_k is not None:
      raise ValueError(f"ByteKL.top_k={self.top_k} is not used: byte_kl projects the teacher's whole distribution onto "
                       "bytes; drop distill.top_k (or use distill.kind: span_kl / uld, which take it)")
    for key, default in (("merge", "bayesian"), ("teacher_temperature", None), ("skip_eos", False)):
      if getattr(self, key) != default:
        raise ValueError(f"ByteKL.{key}={getattr(self, key)!r} is not used: byte_kl compares next bytes, not merged "
                         f"spans; drop distill.options.{key} (or use distill.kind: span_kl / uld, which take it)")

  def with_tables(self, tables: losses.ByteTables) -> ByteKL:
    """This strategy with the vocabulary tables of the teacher and student tokenizers."""
    if tables.max_depth != self.max_depth:
      raise ValueError(f"ByteKL(max_depth={self.max_depth}) got tables built for max_depth={tables.max_depth}; build "
                       f"them with byte_tables_of(..., max_depth={self.max_depth})")
    new = self.replace()
    object.__setattr__(new, "tables", tables)
    return new

  def with_tokenizers(self, tokenizers) -> ByteKL:
    """This strategy with the next-byte tables of the two tokenizers, ``max_depth`` bytes deep (`with_tables`)."""
    return self.with_tables(tokenizers.byte_tables(max_depth=self.max_depth))

  def terms(self, student: ModelOutput, teacher, targets_T, mask_T, tau, teacher_tau=None) -> dict:
    tables = self.tables
    if tables is None:
      raise ValueError("ByteKL has no vocabulary tables: give them with ByteKL(...).with_tables(byte_tables_of("
                       "teacher_tokenizer, student_tokenizer, max_depth=...)) (meshdistill.data.alignment)")
    W, V = teacher.logits.shape[-1], student.logits.shape[-1]
    if tables.teacher_prefix.shape[0] != W or tables.student_first.shape[0] != V:
      raise ValueError(f"ByteKL tables are for vocabularies of {tables.teacher_prefix.shape[0]} (teacher) and "
                       f"{tables.student_first.shape[0]} (student) ids, the models have {W} and {V}; build them from "
                       "the tokenizers of these models")
    starts_T, sizes_T = losses.byte_offsets(targets_T, tables.student_lengths)
    t_TxB, ok_T = losses.next_byte_logprobs(teacher.logits, teacher.targets, starts_T, tables, tau)
    s_TxB = losses.first_byte_logprobs(student.logits, tables.student_first, tau)
    span_T = teacher.student_span
    counted_T = (span_T >= 0) & (teacher.span_bytes[jnp.maximum(span_T, 0)] > 0) & ok_T & (sizes_T > 0)
    counted_T = counted_T & (mask_T > 0)
    kl = jnp.sum(losses.byte_kl(t_TxB, s_TxB, counted_T))
    return {"term": kl, "byte_kl": kl, "byte_positions": jnp.sum(counted_T.astype(jnp.float32))}
