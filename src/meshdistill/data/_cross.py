"""Two tokenizations of one text: rows for a student and a teacher that do not share a tokenizer.

Each document is tokenized by both tokenizers; every token keeps its byte END offset in one common
coordinate: the documents' UTF-8 bytes laid end to end, each document preceded by an end-of-text
marker that counts as ONE byte on both sides (the tokenizers' own EOS ids)::

  bytes     EOS d0 d0 d0 EOS d1 d1 EOS ...
  student   [EOS][d0 tokens ...][EOS][d1 tokens ...][EOS]
  teacher   [EOS][d0 tokens ......][EOS][d1 tokens .][EOS]

A row is a byte range ``[a, b)`` whose ends are token boundaries of BOTH tokenizations (the packer
only cuts where both agree), holding at most ``seq_len`` student and ``teacher_seq_len`` teacher
tokens; rows follow each other with no gap, so every byte is a target of exactly one row. On each
side the row's ``targets`` are the tokens covering ``[a, b)`` and its ``inputs`` the same shifted by
one (the first input is the token ending at ``a``), as in `meshdistill.data.PackedSequences`; both are
padded to their own length. ``mask`` / ``teacher_mask`` are 0 on padding and on a document's first
token (its input is the previous document's EOS), as in the single-tokenizer packer.

The alignment of the targets (`meshdistill.data.alignment.RowAlignment`) rides along as small int
arrays: a span counts when all its tokens on both sides are trained. `PackedPairs.rows` gives the
batch: the student's ``inputs``, ``targets``, ``mask`` and `meshdistill.train.step.CROSS_KEYS` (the teacher's
tokens and the alignment); `TrainIterator` and `validation_batches` read it like packed rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from meshdistill.data.alignment import row_alignment, token_byte_lengths
from meshdistill.core.batch import CROSS_KEYS


@dataclasses.dataclass(frozen=True, eq=False)
class CrossStream:
  """One side's tokens of all documents: ``tokens`` [L] int32 (an EOS first, then each document and its EOS),
  ``ends`` [L] int64 byte END offsets in the common coordinate, ``first`` [L] bool (a document's first token)."""

  tokens: np.ndarray
  ends: np.ndarray
  first: np.ndarray


def tokenize_side(texts: Sequence[str], tokenizer, *, setting: str = "data.tokenizer") -> CrossStream:
  """``texts`` through ``tokenizer`` as a `CrossStream` (empty documents are dropped).

  Raises:
    ValueError: the token bytes of a document do not add up to its UTF-8 length (a tokenizer that
      normalizes text, or whose vocabulary does not spell its bytes), naming ``setting``.
  """
  lengths = token_byte_lengths(tokenizer)
  eos = np.asarray([tokenizer.eos_id], np.int32)
  pieces, sizes, firsts = [eos], [np.ones(1, np.int64)], [np.zeros(1, bool)]
  texts = [t for t in texts if t]
  for start in range(0, len(texts), 512):
    chunk = texts[start : start + 512]
    for text, ids in zip(chunk, tokenizer.encode_batch(chunk)):
      ids = np.asarray(ids, np.int32)
      size = lengths[ids]
      if int(size.sum()) != len(text.encode("utf-8")):
        raise ValueError(
            f"{setting} ({tokenizer!r}) gives tokens of {int(size.sum())} bytes for a document of "
            f"{len(text.encode('utf-8'))} bytes (it normalizes the text, or its vocabulary does not spell bytes); "
            "cross-tokenizer rows need byte offsets: use 'byte', 'bpe' or a byte-level tokenizer.json"
        )
      first = np.zeros(ids.size + 1, bool)
      first[0] = ids.size > 0
      pieces += [ids, eos]
      sizes += [size, np.ones(1, np.int64)]
      firsts.append(first)
  tokens = np.concatenate(pieces)
  return CrossStream(tokens, np.cumsum(np.concatenate(sizes)), np.concatenate(firsts))


@dataclasses.dataclass(frozen=True, eq=False)
class PackedPairs:
  """Rows of two tokenizations of the same documents (see the module docstring).

  Attributes:
    student, teacher: the two `CrossStream`s.
    bounds: ``[N, 4]`` int64: each row's target token ranges ``[s_lo, s_hi)`` and ``[t_lo, t_hi)``.
    seq_len, teacher_seq_len: Ts and Tt, the padded row lengths.
    pad_id, teacher_pad_id: each side's padding id.
    num_docs: documents in the streams.
  """

  student: CrossStream
  teacher: CrossStream
  bounds: np.ndarray
  seq_len: int
  teacher_seq_len: int
  pad_id: int
  teacher_pad_id: int
  num_docs: int

  def __len__(self) -> int:
    return int(self.bounds.shape[0])

  @property
  def num_tokens(self) -> int:
    """Student tokens in the stream (the loader's identity of the data)."""
    return int(self.student.tokens.size)

  @property
  def num_targets(self) -> int:
    """Trained student targets over all rows."""
    return int(self.student.tokens.size - 1 - self.student.first.sum())

  @property
  def spans(self) -> int:
    """S, spans per row after padding: ``min(Ts, Tt)`` (every span holds a token of each side)."""
    return min(self.seq_len, self.teacher_seq_len)

  def rows(self, indices: Sequence[int] | np.ndarray, *, segments: bool = False) -> dict[str, np.ndarray]:
    """Rows ``indices`` as a batch: ``inputs``/``targets``/``mask`` [B, Ts] and `CROSS_KEYS`."""
    if segments:
      raise ValueError("segment ids are not produced for cross-tokenizer rows (data.teacher_tokenizer is set)")
    idx_B = np.asarray(indices, np.int64).reshape(-1)
    if idx_B.size and (idx_B.min() < 0 or idx_B.max() >= len(self)):
      raise IndexError(f"row indices must be in [0, {len(self)}), got {idx_B.min()}..{idx_B.max()}")
    Ts, Tt, S = self.seq_len, self.teacher_seq_len, self.spans
    out = {k: [] for k in ("inputs", "targets", "mask", *CROSS_KEYS)}
    for i in idx_B:
      s_lo, s_hi, t_lo, t_hi = (int(x) for x in self.bounds[i])
      s_in, s_tgt, s_mask, s_ends = _side_row(self.student, s_lo, s_hi, Ts, self.pad_id)
      t_in, t_tgt, t_mask, t_ends = _side_row(self.teacher, t_lo, t_hi, Tt, self.teacher_pad_id)
      n_s, n_t = s_hi - s_lo, t_hi - t_lo
      align = row_alignment(s_ends, t_ends, s_mask[:n_s], t_mask[:n_t], student_len=Ts, teacher_len=Tt, spans=S)
      values = (s_in, s_tgt, s_mask, t_in, t_tgt, t_mask, *align)
      for key, value in zip(out, values):
        out[key].append(value)
    return {k: np.stack(v) if v else np.zeros((0, 0), np.int32) for k, v in out.items()}

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    return {k: v[0] for k, v in self.rows([i]).items()}

  def arrays(self, *, segments: bool = False) -> dict[str, np.ndarray]:
    """All rows (small corpora and tests)."""
    return self.rows(np.arange(len(self)), segments=segments)


def _side_row(stream: CrossStream, lo: int, hi: int, length: int, pad_id: int):
  """One side of a row: ``(inputs [T], targets [T], mask [T] float32, ends of the real targets from the row's
  first byte)``."""
  n = hi - lo
  inputs = np.full(length, pad_id, np.int32)
  targets = np.full(length, pad_id, np.int32)
  mask = np.zeros(length, np.float32)
  inputs[:n] = stream.tokens[lo - 1 : hi - 1]
  targets[:n] = stream.tokens[lo:hi]
  mask[:n] = ~stream.first[lo:hi]
  return inputs, targets, mask, stream.ends[lo:hi] - stream.ends[lo - 1]


def pack_pairs(
    student: CrossStream, teacher: CrossStream, seq_len: int, teacher_seq_len: int, *, pad_id: int,
    teacher_pad_id: int, num_docs: int,
) -> PackedPairs:
  """Cuts both streams into rows at byte offsets where both have a token boundary (see the module docstring);
  each row as long as both sides' lengths allow.

  Raises:
    ValueError: the streams cover different bytes, or a stretch between two common boundaries is longer than
      ``seq_len`` student or ``teacher_seq_len`` teacher tokens (naming the settings to raise).
  """
  for name, v in (("data.seq_len", seq_len), ("data.teacher_seq_len", teacher_seq_len)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name}={v!r} must be a positive integer, e.g. 128")
  if student.ends[-1] != teacher.ends[-1]:
    raise ValueError(f"the two tokenizations cover {student.ends[-1]} and {teacher.ends[-1]} bytes; they must agree")
  common = np.intersect1d(student.ends, teacher.ends)
  s_count = np.searchsorted(student.ends, common, side="right")  # tokens up to each common boundary
  t_count = np.searchsorted(teacher.ends, common, side="right")
  rows, s_lo, t_lo = [], 1, 1
  while s_lo < student.tokens.size:
    j = min(np.searchsorted(s_count, s_lo + seq_len, "right"), np.searchsorted(t_count, t_lo + teacher_seq_len, "right"))
    j -= 1
    if j < 0 or s_count[j] <= s_lo:
      nxt = np.searchsorted(common, student.ends[s_lo], "left")
      raise ValueError(
          f"from byte {int(student.ends[s_lo - 1])} the next boundary both tokenizers share is "
          f"{int(s_count[nxt] - s_lo)} student / {int(t_count[nxt] - t_lo)} teacher tokens away, more than a row holds "
          f"(data.seq_len={seq_len}, data.teacher_seq_len={teacher_seq_len}); raise them"
      )
    rows.append((s_lo, s_count[j], t_lo, t_count[j]))
    s_lo, t_lo = int(s_count[j]), int(t_count[j])
  bounds = np.asarray(rows, np.int64).reshape(-1, 4)
  return PackedPairs(student, teacher, bounds, seq_len, teacher_seq_len, int(pad_id), int(teacher_pad_id), num_docs)


def pack_texts(texts: Sequence[str], student_tokenizer, teacher_tokenizer, seq_len: int,
               teacher_seq_len: int | None = None) -> PackedPairs:
  """`tokenize_side` with both tokenizers, then `pack_pairs` (``teacher_seq_len`` None: ``seq_len``)."""
  texts = [t for t in texts if t]
  return pack_pairs(
      tokenize_side(texts, student_tokenizer, setting="data.tokenizer"), tokenize_side(texts, teacher_tokenizer, setting="data.teacher_tokenizer"),
      seq_len, seq_len if teacher_seq_len is None else teacher_seq_len, pad_id=student_tokenizer.pad_id,
      teacher_pad_id=teacher_tokenizer.pad_id, num_docs=len(texts),
  )
