"""Rows cut on a teacher's tokens alone, and any student's rows rebuilt from their bytes: the rows of a
cross-tokenizer teacher cache.

The two-tokenization packer (`meshdistill.data._cross`) cuts a row where BOTH tokenizations cut, so another student
tokenizer moves the rows, and the teacher's context with them. A cache that serves students of any tokenizer cuts
its rows on the teacher's tokens only (`cut_teacher_rows`): at most ``seq_len`` teacher tokens of the teacher's
`CrossStream`, the row ending at a teacher token boundary where a character starts (the next token does not begin
with a UTF-8 continuation byte) after a token that holds the start of its last character (the token before the row
then spells the whole character the student's first input is made of). Rows follow each other with no gap.

`StudentRows` rebuilds the student's side of such a row from its bytes (the teacher tokens' bytes, read through the
teacher's vocabulary): the row's text, split at the end-of-text markers into its documents' pieces, is tokenized by
the student's tokenizer (each piece on its own, so a piece cut from a longer document is tokenized as it stands);
the student's first input is its last token of the character before the row (its end-of-text id after a document);
a document's first token is masked on both sides, as in the other packers. The student's tokens are padded to its
own ``seq_len``, or cut there (its tokens past it are dropped). The alignment (`row_alignment`) covers the bytes both
sides hold up to the last boundary they share; a student token past it still trains on its hard label.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from meshdistill.data._cross import CrossStream
from meshdistill.data.alignment import row_alignment, token_bytes
from meshdistill.core.batch import CROSS_KEYS

# The teacher's part of a cached row: ids of the token before the row and of its targets [B, 1 + Tt], and the
# targets' byte END offsets from the row's first byte [B, Tt] (padding: the row's last offset).
TEACHER_ROW_KEYS = ("teacher_tokens", "teacher_ends")


def _continuation(b: int) -> bool:
  return 0x80 <= b < 0xC0


def _vocab_tables(teacher_tokenizer) -> tuple[list[bytes | None], np.ndarray, np.ndarray, np.ndarray]:
  """``(bytes per id, byte lengths [W], starts_char [W], holds_lead [W])`` of the teacher's vocabulary (the
  end-of-text id: one byte, starts and holds a character)."""
  table = token_bytes(teacher_tokenizer)
  lengths = np.asarray([len(b or b"") for b in table], np.int64)
  starts = np.asarray([bool(b) and not _continuation(b[0]) for b in table], bool)
  lead = np.asarray([bool(b) and any(not _continuation(x) for x in b) for b in table], bool)
  eos = teacher_tokenizer.eos_id
  lengths[eos], starts[eos], lead[eos] = 1, True, True
  return table, lengths, starts, lead


@dataclasses.dataclass(frozen=True, eq=False)
class TeacherRows:
  """Rows of the teacher's tokens alone (see the module docstring).

  Attributes:
    stream: the teacher's `CrossStream` of all documents.
    bounds: ``[N, 2]`` int64: each row's target token range ``[lo, hi)`` in the stream.
    seq_len: Tt, the padded row length; pad_id, eos_id: the teacher's.
  """

  stream: CrossStream
  bounds: np.ndarray
  seq_len: int
  pad_id: int
  eos_id: int

  def __len__(self) -> int:
    return int(self.bounds.shape[0])

  @property
  def num_tokens(self) -> int:
    return int(self.stream.tokens.size)

  def rows(self, indices, *, segments: bool = False) -> dict[str, np.ndarray]:
    """Rows ``indices`` [B]: ``inputs`` / ``targets`` / ``mask`` [B, Tt] (the teacher's: what it runs on and is
    scored on) and `TEACHER_ROW_KEYS`."""
    if segments:
      raise ValueError("segment ids are not produced for a cross-tokenizer teacher cache's rows")
    idx_B = np.asarray(indices, np.int64).reshape(-1)
    if idx_B.size and (idx_B.min() < 0 or idx_B.max() >= len(self)):
      raise IndexError(f"row indices must be in [0, {len(self)}), got {idx_B.min()}..{idx_B.max()}")
    T, s = self.seq_len, self.stream
    B = idx_B.size
    tokens = np.full((B, T + 1), self.pad_id, np.int32)
    ends = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), np.float32)
    for r, i in enumerate(idx_B):
      lo, hi = (int(x) for x in self.bounds[i])
      n = hi - lo
      tokens[r, : n + 1] = s.tokens[lo - 1 : hi]
      ends[r, :n] = s.ends[lo:hi] - s.ends[lo - 1]
      ends[r, n:] = ends[r, n - 1] if n else 0
      mask[r, :n] = ~s.first[lo:hi]
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask, "teacher_tokens": tokens,
            "teacher_ends": ends}


def cut_teacher_rows(stream: CrossStream, teacher_tokenizer, seq_len: int) -> TeacherRows:
  """`TeacherRows` of ``stream`` (the teacher's `CrossStream`), each at most ``seq_len`` teacher tokens.

  Raises:
    ValueError: ``seq_len`` teacher tokens hold no place to cut (naming ``data.teacher_seq_len``).
  """
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
    raise ValueError(f"data.teacher_seq_len={seq_len!r} must be a positive integer, e.g. 128")
  _, _, starts, lead = _vocab_tables(teacher_tokenizer)
  tok = stream.tokens
  L = tok.size
  # a cut after token i (before token i + 1): i + 1 starts a character and i holds the start of its last one
  ok = np.zeros(L + 1, bool)
  ok[1:L] = starts[tok[1:]] & lead[tok[:-1]]
  ok[L] = True
  cuts = np.flatnonzero(ok)  # candidate row ends (exclusive token indices)
  rows, lo = [], 1
  while lo < L:
    j = np.searchsorted(cuts, lo + seq_len, "right") - 1
    if j < 0 or cuts[j] <= lo:
      raise ValueError(f"teacher tokens {lo}..{lo + seq_len} of the stream hold no place where a row may end (a "
                       f"character boundary); raise data.teacher_seq_len={seq_len}")
    rows.append((lo, int(cuts[j])))
    lo = int(cuts[j])
  bounds = np.asarray(rows, np.int64).reshape(-1, 2)
  return TeacherRows(stream, bounds, seq_len, int(teacher_tokenizer.pad_id), int(teacher_tokenizer.eos_id))


class StudentRows:
  """The student's side of teacher rows (see the module docstring): `batch` turns a batch of `TEACHER_ROW_KEYS`
  into the batch a cross-tokenizer strategy reads (``inputs`` / ``targets`` / ``mask`` [B, Ts] and `CROSS_KEYS`).

  Args:
    teacher_tokenizer, student_tokenizer: the two tokenizers (the teacher's spells the row's bytes).
    seq_len: Ts, the student's padded row length.
  """

  def __init__(self, teacher_tokenizer, student_tokenizer, seq_len: int):
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
      raise ValueError(f"data.seq_len={seq_len!r} must be a positive integer, e.g. 128")
    self.teacher_bytes, self.teacher_lengths, _, _ = _vocab_tables(teacher_tokenizer)
    self.teacher_eos, self.teacher_pad = int(teacher_tokenizer.eos_id), int(teacher_tokenizer.pad_id)
    self.student = student_tokenizer
    _, self.student_lengths, _, _ = _vocab_tables(student_tokenizer)
    self.seq_len = seq_len

  def _pieces(self, prev: int, targets: np.ndarray) -> tuple[list[tuple[str, bool]], str | None]:
    """The row's text as ``[(piece text or "" for an end of text, piece starts a document)]`` and the character
    before the row (None: an end of text)."""
    pieces, buf, doc_start = [], [], prev == self.teacher_eos
    for t in targets:
      if t == self.teacher_eos:
        if buf:
          pieces.append((b"".join(buf).decode("utf-8"), doc_start))
        pieces.append(("", False))
        buf, doc_start = [], True
      else:
        buf.append(self.teacher_bytes[t] or b"")
    if buf:
      pieces.append((b"".join(buf).decode("utf-8"), doc_start))
    if prev == self.teacher_eos:
      return pieces, None
    b = self.teacher_bytes[prev] or b""
    lead = max((i for i, x in enumerate(b) if not _continuation(x)), default=None)
    return pieces, (b[lead:].decode("utf-8", errors="replace") if lead is not None else "")

  def _row(self, tokens: np.ndarray, ends: np.ndarray, spans: int):
    Ts, Tt = self.seq_len, tokens.size - 1
    targets_t = tokens[1:]
    # real targets: every one spells at least one byte, padding repeats the last end offset
    n_t = int(np.searchsorted(ends, ends[-1], "left")) + 1 if Tt and ends[-1] > 0 else 0
    pieces, before = self._pieces(int(tokens[0]), targets_t[:n_t])
    texts = [t for t, _ in pieces if t] + ([before] if before else [])
    encoded = iter(self.student.encode_batch(texts)) if texts else iter(())
    eos = self.student.eos_id
    ids, first = [], []
    for text, doc_start in pieces:
      if not text:
        ids.append(np.asarray([eos], np.int32))
        first.append(np.zeros(1, bool))
        continue
      piece = np.asarray(next(encoded), np.int32)
      f = np.zeros(piece.size, bool)
      f[0] = doc_start
      ids.append(piece)
      first.append(f)
    ids_s = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    first_s = np.concatenate(first) if first else np.zeros(0, bool)
    if before is None:
      prev_s = eos
    elif before:
      prev_s = int(np.asarray(next(encoded))[-1])
    else:  # never with `cut_teacher_rows`: the token before a row holds its character's start
      prev_s = self.student.pad_id
      first_s[:1] = True
    ends_s = np.cumsum(self.student_lengths[ids_s])
    if ends_s.size and ends_s[-1] != (ends[n_t - 1] if n_t else 0):
      raise ValueError(f"data.tokenizer ({self.student!r}) gives tokens of {int(ends_s[-1])} bytes for a row of "
                       f"{int(ends[n_t - 1])}; cross-tokenizer rows need a tokenizer whose tokens spell the text's "
                       "bytes: use 'byte', 'bpe' or a byte-level tokenizer.json")
    ids_s, first_s, ends_s = ids_s[:Ts], first_s[:Ts], ends_s[:Ts]
    n_s = ids_s.size
    inputs = np.full(Ts, self.student.pad_id, np.int32)
    targets = np.full(Ts, self.student.pad_id, np.int32)
    mask = np.zeros(Ts, np.float32)
    inputs[:n_s] = np.concatenate([[prev_s], ids_s[:-1]]) if n_s else []
    targets[:n_s] = ids_s
    mask[:n_s] = ~first_s
    t_mask = np.zeros(Tt, np.float32)
    t_mask[:n_t] = tokens[:n_t] != self.teacher_eos  # a document's first token (its input: end of text)
    ends_t = ends[:n_t].astype(np.int64)
    common = np.intersect1d(ends_s, ends_t)
    last = common[-1] if common.size else 0  # the bytes both sides hold, to their last shared boundary
    ks, kt = int(np.searchsorted(ends_s, last, "right")), int(np.searchsorted(ends_t, last, "right"))
    align = row_alignment(ends_s[:ks], ends_t[:kt], mask[:ks], t_mask[:kt], student_len=Ts, teacher_len=Tt,
                          spans=spans)
    return (inputs, targets, mask, tokens[:-1], tokens[1:], t_mask, *align)

  def batch(self, teacher: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The full batch of rows whose teacher part is ``teacher`` (`TEACHER_ROW_KEYS`, e.g. from a cache)."""
    tokens, ends = np.asarray(teacher["teacher_tokens"]), np.asarray(teacher["teacher_ends"])
    spans = min(self.seq_len, tokens.shape[1] - 1)
    keys = ("inputs", "targets", "mask", *CROSS_KEYS)
    rows = [self._row(tokens[r], ends[r], spans) for r in range(tokens.shape[0])]
    return {k: np.stack([row[i] for row in rows]).astype(np.float32 if k in ("mask", "teacher_mask") else np.int32)
            for i, k in enumerate(keys)}

