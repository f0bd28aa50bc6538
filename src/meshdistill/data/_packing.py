"""Packing tokenized documents into fixed-length training rows ``[N, T]``.

Documents are tokenized and joined into one stream, each followed by EOS::

  stream  = d0 d0 d0 EOS d1 d1 EOS d2 ...            (length L)

Row ``i`` is the window ``stream[i*T : i*T + T + 1]``: ``inputs`` are its first ``T`` tokens and
``targets`` its last ``T`` (inputs shifted by one). Windows overlap by one token, so every stream
position ``j >= 1`` is a target in exactly one row and nothing is lost between rows. The final
window is filled with ``pad_id``; ``N = ceil((L - 1) / T)``.

``mask`` (float32) is 1 for a target that is trained on and 0 for:

* padding (past the end of the stream), never trained on;
* the first token of a document, whose input is the previous document's EOS. Documents are
  independent, so guessing the next one's first token from the end of another is noise; the
  model still learns to END documents (the EOS target is trained).

So the trained targets are exactly the real tokens that are not a document's first token
(see `PackedSequences.num_targets`).

``segment_ids`` (1, 2, ... per document within the row, 0 for padding) and ``positions`` (index
within its document's part of the row: a row that starts inside a document starts it at 0) are
produced on request (``rows(..., segments=True)``; ``data.packing: documents`` asks for them in
every batch). With them the models keep each document to itself: attention within a document,
RoPE restarting at each (`meshdistill.models.decoder.Decoder`). Without them (``data.packing:
stream``) a token may attend to the end of the previous document in its row, as in standard
causal-LM packing, and only the loss mask above knows the boundaries.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenStream:
  """Tokenized documents: ``tokens`` [L] int32 (each document followed by EOS), ``doc_lengths`` [D].

  ``doc_lengths`` count the EOS, so they sum to L.
  """

  tokens: np.ndarray
  doc_lengths: np.ndarray

  def __post_init__(self):
    if int(self.doc_lengths.sum()) != self.tokens.size:
      raise ValueError(f"doc_lengths sum to {int(self.doc_lengths.sum())} but there are {self.tokens.size} tokens")

  @property
  def num_docs(self) -> int:
    return int(self.doc_lengths.size)


def join_documents(token_arrays: Sequence[Sequence[int] | np.ndarray], eos_id: int) -> TokenStream:
  """One stream from per-document token ids: each document followed by ``eos_id``.

  Documents with no tokens are dropped.
  """
  arrays = [np.asarray(a, np.int32).reshape(-1) for a in token_arrays]
  arrays = [a for a in arrays if a.size]
  if not arrays:
    return TokenStream(np.zeros(0, np.int32), np.zeros(0, np.int64))
  eos = np.asarray([eos_id], np.int32)
  tokens = np.concatenate([piece for a in arrays for piece in (a, eos)])
  lengths = np.asarray([a.size + 1 for a in arrays], np.int64)
  return TokenStream(tokens, lengths)


def tokenize_documents(texts: Sequence[str], tokenizer, *, chunk: int = 512) -> TokenStream:
  """Tokenizes ``texts`` with ``tokenizer`` (a `Tokenizer`) into a `TokenStream`."""
  arrays: list[np.ndarray] = []
  for start in range(0, len(texts), chunk):
    arrays += tokenizer.encode_batch(texts[start : start + chunk])
    if start and start // chunk % 20 == 0:
      log.info("tokenized %d / %d documents", start, len(texts))
  return join_documents(arrays, tokenizer.eos_id)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedSequences:
  """A `TokenStream` seen as ``N`` rows of ``seq_len`` (inputs, targets, mask); see module docstring.

  Rows are cut on demand (`rows`), so memory is one int32 and one bool per token.

  Attributes:
    tokens: [N*T + 1] int32, the stream followed by ``pad_id``.
    doc_start: [N*T + 1] bool, True at the first token of each document.
    num_tokens: L, real tokens in the stream (EOS included).
    num_docs: documents in the stream.
    seq_len: T.
    pad_id: the padding id.
  """

  tokens: np.ndarray
  doc_start: np.ndarray
  num_tokens: int
  num_docs: int
  seq_len: int
  pad_id: int

  def __len__(self) -> int:
    return (self.tokens.size - 1) // self.seq_len

  @property
  def num_targets(self) -> int:
    """Targets with mask 1 over all rows: real tokens minus one per document start."""
    return self.num_tokens - self.num_docs

  def rows(self, indices: Sequence[int] | np.ndarray, *, segments: bool = False) -> dict[str, np.ndarray]:
    """Rows ``indices`` as a batch dict of [len(indices), T] arrays.

    ``inputs``/``targets`` int32, ``mask`` float32 (1 = trained target); with ``segments=True``
    also ``segment_ids`` and ``positions`` (int32, 0 on padding).
    """
    idx_B = np.asarray(indices, np.int64).reshape(-1)
    if idx_B.size and (idx_B.min() < 0 or idx_B.max() >= len(self)):
      raise IndexError(f"row indices must be in [0, {len(self)}), got {idx_B.min()}..{idx_B.max()}")
    T = self.seq_len
    pos_BxTp1 = idx_B[:, None] * T + np.arange(T + 1)[None, :]
    window_BxTp1 = self.tokens[pos_BxTp1]
    tgt_pos_BxT = pos_BxTp1[:, 1:]
    mask_BxT = (tgt_pos_BxT < self.num_tokens) & ~self.doc_start[tgt_pos_BxT]
    out = {
        "inputs": window_BxTp1[:, :-1].astype(np.int32, copy=False),
        "targets": window_BxTp1[:, 1:].astype(np.int32, copy=False),
        "mask": mask_BxT.astype(np.float32),
    }
    if segments:
      real_BxT = pos_BxTp1[:, :-1] < self.num_tokens
      starts_BxT = self.doc_start[pos_BxTp1[:, :-1]].copy()
      starts_BxT[:, 0] = True
      seg_BxT = np.cumsum(starts_BxT, axis=1)
      t_T = np.arange(T)
      last_start_BxT = np.maximum.accumulate(np.where(starts_BxT, t_T, 0), axis=1)
      out["segment_ids"] = np.where(real_BxT, seg_BxT, 0).astype(np.int32)
      out["positions"] = np.where(real_BxT, t_T - last_start_BxT, 0).astype(np.int32)
    return out

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    """Row ``i`` as a dict of [T] arrays."""
    return {k: v[0] for k, v in self.rows([i]).items()}

  def arrays(self, *, segments: bool = False) -> dict[str, np.ndarray]:
    """All rows as [N, T] arrays (small corpora and tests)."""
    return self.rows(np.arange(len(self)), segments=segments)


def pack(stream: TokenStream, seq_len: int, pad_id: int) -> PackedSequences:
  """Packs ``stream`` into rows of ``seq_len`` tokens (see the module docstring).

  Raises:
    ValueError: ``seq_len`` < 1, or the stream has fewer than 2 tokens (nothing to predict).
  """
  if not isinstance(seq_len, int) or seq_len < 1:
    raise ValueError(f"data.seq_len={seq_len!r} must be a positive integer, e.g. 128")
  L = stream.tokens.size
  if L < 2:
    raise ValueError(f"cannot pack {L} token(s): at least 2 are needed to have one target; add text to the corpus")
  n_rows = -(-(L - 1) // seq_len)
  size = n_rows * seq_len + 1
  tokens = np.full(size, pad_id, np.int32)
  tokens[:L] = stream.tokens
  doc_start = np.zeros(size, bool)
  doc_start[np.concatenate([[0], np.cumsum(stream.doc_lengths)[:-1]]).astype(np.int64)] = True
  return PackedSequences(tokens, doc_start, int(L), stream.num_docs, seq_len, int(pad_id))


def pack_documents(token_arrays: Sequence[Sequence[int] | np.ndarray], seq_len: int, *, eos_id: int, pad_id: int):
  """`join_documents` then `pack`: per-document token ids -> `PackedSequences`."""
  return pack(join_documents(token_arrays, eos_id), seq_len, pad_id)
