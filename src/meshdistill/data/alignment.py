"""Aligning two tokenizations of one text: byte lengths per token, and the spans both sides agree on.

A teacher and a student with different tokenizers cut the same text into different tokens. Each
token covers a run of the text's UTF-8 bytes; its END offset (bytes from the start of the text) is
where the tokenizer put a cut. A byte offset where both tokenizations cut is a common boundary; the
tokens between two consecutive common boundaries form an aligned SPAN: a maximal group of student
tokens and a group of teacher tokens that cover exactly the same bytes::

  text      "héllo world"      (é is two bytes: 12 bytes in all)
  student   h|é|l|l|o| |w|o|r|l|d          ends 1 3 4 5 6 7 8 9 10 11 12
  teacher   hé|llo| world                  ends 3 6 12
  spans     [h é][l l o][ w o r l d]       student 0 0 1 1 1 2 2 2 2 2 2; teacher 0 1 2

This is the grouping TRL's GOLD trainer walks token by token (advance the side whose token ends
first; a group closes when both ends meet); `align_spans` computes it at once with a sorted search.

Byte lengths per token id (`token_byte_lengths`) come from the vocabulary itself: the byte
tokenizer's ids are bytes; a byte-level BPE (GPT-2 alphabet: the project's `train_bpe`, and the
``tokenizer.json`` of GPT-2, Llama 3, Qwen and most recent models) spells each token's bytes in its
string; a SentencePiece-style vocabulary (``▁`` for a space, ``<0x41>`` byte fallback) is read the same way.
Special tokens get the lengths the packer gives them (see `meshdistill.data._cross`).

Everything here is numpy on the host: the loader computes alignments while it cuts rows, and ships
them to the step as small int arrays (`row_alignment`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, NamedTuple

import numpy as np

from meshdistill.losses import ByteTables, byte_tables

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
  """GPT-2's byte alphabet, reversed: the printable character standing for each byte -> the byte."""
  visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
  chars, extra = {}, 0
  for b in range(256):
    if b in visible:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


def token_bytes(tokenizer) -> list[bytes | None]:
  """The bytes each id of ``tokenizer`` (a `meshdistill.data.Tokenizer`) stands for, by id; None for special and
  unused ids (padding rows of ``vocab_size``).

  Raises:
    ValueError: a Hugging Face vocabulary whose tokens are neither byte-level (GPT-2 alphabet) nor
      SentencePiece-style, naming the token that could not be read.
  """
  size = tokenizer.vocab_size
  hf = getattr(tokenizer, "hf_tokenizer", None)
  if hf is None:  # the byte tokenizer: ids 0..255 are the bytes
    return [bytes([i]) if i < 256 else None for i in range(size)]
  spec = json.loads(hf.to_str())
  special = {t["id"] for t in spec.get("added_tokens", ()) if t.get("special", True)}
  decoder = _byte_level_decoder()
  byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {}) or "ByteLevel" in json.dumps(
      spec.get("pre_tokenizer") or {})
  out: list[bytes | None] = [None] * size
  for text, i in hf.get_vocab(with_added_tokens=True).items():
    if i in special or i >= size:
      continue
    if byte_level and all(c in decoder for c in text):
      out[i] = bytes(decoder[c] for c in text)
      continue
    fallback = _BYTE_FALLBACK.match(text)
    if fallback:
      out[i] = bytes([int(fallback.group(1), 16)])
    elif byte_level:
      raise ValueError(f"tokenizer token {text!r} (id {i}) is not in the byte-level alphabet; cannot read its bytes")
    else:
      out[i] = text.replace("\u2581", " ").encode("utf-8")
  return out


def token_byte_lengths(tokenizer) -> np.ndarray:
  """``[vocab_size]`` int64: the UTF-8 byte count of each id (`token_bytes`); 0 for special and unused ids."""
  return np.asarray([0 if b is None else len(b) for b in token_bytes(tokenizer)], np.int64)


def matched_vocabulary(teacher_tokenizer, student_tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """The matched vocabulary of two tokenizers: ``(teacher_ids [M], student_ids [M])`` int32, the pairs of ids that
  stand for the same bytes (GOLD's matched tokens), in increasing teacher id. Special ids never match."""
  by_bytes: dict[bytes, int] = {}
  for i, b in enumerate(token_bytes(student_tokenizer)):
    if b is not None and b not in by_bytes:
      by_bytes[b] = i
  pairs = [(i, by_bytes[b]) for i, b in enumerate(token_bytes(teacher_tokenizer)) if b is not None and b in by_bytes]
  ids = np.asarray(pairs, np.int32).reshape(-1, 2)
  return ids[:, 0].copy(), ids[:, 1].copy()


def byte_tables_of(teacher_tokenizer, student_tokenizer, *, max_depth: int) -> ByteTables:
  """The next-byte tables (`meshdistill.losses.ByteTables`) of a teacher and a student tokenizer: each side's bytes
  per id (`token_bytes`) and end-of-text id; teacher tokens read up to ``max_depth`` bytes deep."""
  return byte_tables(token_bytes(teacher_tokenizer), token_bytes(student_tokenizer),
                     teacher_eos=teacher_tokenizer.eos_id, student_eos=student_tokenizer.eos_id, max_depth=max_depth)


class TokenizerPair(NamedTuple):
  """A teacher's and a student's tokenizer, as a strategy of two tokenizers is given them
  (`meshdistill.strategies.Strategy.with_tokenizers`): what it needs of them, computed on demand."""

  teacher: Any
  student: Any

  def matched(self) -> tuple[np.ndarray, np.ndarray]:
    """`matched_vocabulary` of the two."""
    return matched_vocabulary(self.teacher, self.student)

  def byte_tables(self, *, max_depth: int) -> ByteTables:
    """`byte_tables_of` the two, ``max_depth`` bytes deep."""
    return byte_tables_of(self.teacher, self.student, max_depth=max_depth)


def align_spans(student_ends: np.ndarray, teacher_ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The aligned spans of two tokenizations of one text.

  Args:
    student_ends, teacher_ends: ``[Ns]`` / ``[Nt]`` byte END offsets of each token (non-decreasing).

  Returns:
    ``(student_span [Ns], teacher_span [Nt], span_ends [S])``: the span index of each token (0, 1, ... in text
    order) and each span's end offset. A span ends at a common boundary, except a last one past the final
    common boundary when the two ends differ (text covered by one side only): it gets index ``S - 1`` and
    the larger end.
  """
  s_ends = np.asarray(student_ends, np.int64).reshape(-1)
  t_ends = np.asarray(teacher_ends, np.int64).reshape(-1)
  common = np.intersect1d(s_ends, t_ends)
  s_span = np.searchsorted(common, s_ends, side="left")
  t_span = np.searchsorted(common, t_ends, side="left")
  ends = common
  if (s_span.size and s_span[-1] == common.size) or (t_span.size and t_span[-1] == common.size):
    last = max(s_ends[-1] if s_ends.size else 0, t_ends[-1] if t_ends.size else 0)
    ends = np.append(common, last)
  return s_span, t_span, ends


class RowAlignment(NamedTuple):
  """The alignment of one row's targets, padded: what the step needs to compare spans.

  ``student_span [Ts]`` / ``teacher_span [Tt]`` int32: the span of each target position, -1 where the target is not
  in a counted span (padding, or a span with a masked token on either side); ``student_last [S]`` /
  ``teacher_last [S]`` int32: the position of each span's last target (0 for padding spans); ``span_bytes [S]``
  int32: the bytes each span covers (0 for padding and uncounted spans). A span counts when ``span_bytes > 0``.
  """

  student_span: np.ndarray
  teacher_span: np.ndarray
  student_last: np.ndarray
  teacher_last: np.ndarray
  span_bytes: np.ndarray


def row_alignment(
    student_ends: np.ndarray,
    teacher_ends: np.ndarray,
    student_mask: np.ndarray,
    teacher_mask: np.ndarray,
    *,
    student_len: int,
    teacher_len: int,
    spans: int,
) -> RowAlignment:
  """`RowAlignment` of one row whose targets are ``Ns`` student and ``Nt`` teacher tokens covering the same bytes.

  Args:
    student_ends, teacher_ends: byte END offsets of the real targets (before padding), counted from the row's
      first byte (so the first span starts at 0).
    student_mask, teacher_mask: 1 for a trained target, 0 for one that never counts (a document's first token),
      of the same lengths; a span counts only when every token in it, on both sides, is trained.
    student_len, teacher_len: Ts, Tt, the padded row lengths.
    spans: S, the padded span count (at least the row's spans; ``min(Ts, Tt)`` always suffices).
  """
  s_span, t_span, ends = align_spans(student_ends, teacher_ends)
  n = ends.size
  if n > spans:
    raise ValueError(f"row has {n} aligned spans but only {spans} are kept; use spans >= {n}")
  starts = np.concatenate([[0], ends[:-1]])
  ok = np.ones(n, bool)
  np.logical_and.at(ok, s_span, np.asarray(student_mask) > 0)
  np.logical_and.at(ok, t_span, np.asarray(teacher_mask) > 0)
  out_s = np.full(student_len, -1, np.int32)
  out_t = np.full(teacher_len, -1, np.int32)
  out_s[: s_span.size] = np.where(ok[s_span], s_span, -1)
  out_t[: t_span.size] = np.where(ok[t_span], t_span, -1)
  last_s = np.zeros(spans, np.int32)
  last_t = np.zeros(spans, np.int32)
  last_s[s_span] = np.arange(s_span.size)  # the later position of a span overwrites the earlier
  last_t[t_span] = np.arange(t_span.size)
  nbytes = np.zeros(spans, np.int32)
  nbytes[:n] = np.where(ok, ends - starts, 0)
  return RowAlignment(out_s, out_t, last_s, last_t, nbytes)

