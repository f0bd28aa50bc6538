"""Several named corpora in one set of rows, each row from one corpus: `PackedCorpora` (``data.corpora``).

Each corpus is packed on its own (`meshdistill.data._packing.pack`), so a row never holds text of two corpora; the
rows of the corpora follow one another, and every batch carries ``domain`` ``[B]`` int32, the index of its rows'
corpus in ``names`` (the order ``data.corpora`` gives them). Several teachers routed by the data
(``teachers.combine: route``, ``route_by: domain``) read it; everything else reads the rows as it reads one corpus.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshdistill.data._packing import PackedSequences

DOMAIN_KEY = "domain"


class PackedCorpora:
  """The rows of ``parts`` (one `PackedSequences` per corpus, same ``seq_len`` and ``pad_id``) one after another;
  ``domains[i]`` is the index in ``names`` of part ``i``'s corpus (a corpus without rows in a split has no part)."""

  def __init__(self, parts: Sequence[PackedSequences], domains: Sequence[int], names: Sequence[str]):
    if not parts or len(parts) != len(domains):
      raise ValueError(f"PackedCorpora needs one domain per part, got {len(parts)} parts and {len(domains)} domains")
    if len({(p.seq_len, p.pad_id) for p in parts}) != 1:
      raise ValueError("PackedCorpora: every corpus must be packed with the same seq_len and pad_id")
    self.parts, self.domains, self.names = tuple(parts), tuple(int(d) for d in domains), tuple(names)
    self._starts = np.cumsum([0] + [len(p) for p in parts])
    self.seq_len, self.pad_id = parts[0].seq_len, parts[0].pad_id

  def __len__(self) -> int:
    return int(self._starts[-1])

  @property
  def num_tokens(self) -> int:
    return sum(p.num_tokens for p in self.parts)

  @property
  def num_docs(self) -> int:
    return sum(p.num_docs for p in self.parts)

  @property
  def num_targets(self) -> int:
    return sum(p.num_targets for p in self.parts)

  @property
  def tokens(self) -> np.ndarray:
    """Every part's tokens, one after another (what names the rows, e.g. for a teacher cache)."""
    return np.concatenate([p.tokens for p in self.parts])

  def domain_rows(self) -> np.ndarray:
    """``[N]`` int32: the domain of every row."""
    return np.repeat(np.asarray(self.domains, np.int32), np.diff(self._starts))

  def rows(self, indices: Sequence[int] | np.ndarray, *, segments: bool = False) -> dict[str, np.ndarray]:
    """Rows ``indices`` as `PackedSequences.rows` gives them, plus ``domain`` ``[B]`` int32."""
    idx_B = np.asarray(indices, np.int64).reshape(-1)
    if idx_B.size and (idx_B.min() < 0 or idx_B.max() >= len(self)):
      raise IndexError(f"row indices must be in [0, {len(self)}), got {idx_B.min()}..{idx_B.max()}")
    part_B = np.searchsorted(self._starts, idx_B, side="right") - 1
    out = None
    for i in np.unique(part_B):
      at = np.flatnonzero(part_B == i)
      got = self.parts[i].rows(idx_B[at] - self._starts[i], segments=segments)
      if out is None:
        out = {k: np.empty((idx_B.size, *v.shape[1:]), v.dtype) for k, v in got.items()}
      for k, v in got.items():
        out[k][at] = v
    if out is None:  # no rows asked
      out = self.parts[0].rows(idx_B, segments=segments)
    out[DOMAIN_KEY] = np.asarray(self.domains, np.int32)[part_B] if idx_B.size else np.zeros(0, np.int32)
    return out

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    return {k: v[0] for k, v in self.rows([i]).items()}

  def arrays(self, *, segments: bool = False) -> dict[str, np.ndarray]:
    return self.rows(np.arange(len(self)), segments=segments)
