"""Preference pairs for the training loop: from a JSONL file, or built from the run's own text.

`read_preferences` reads a JSONL file of ``{prompt, chosen, rejected}`` rows and `preference_batch` makes a batch of
them; `PreferencePairs` wraps a `DataBundle` so that `meshdistill.train.loop.trainer.fit` reads preference batches:
every training batch of ``B`` rows holds ``B / 2`` (chosen, rejected) pairs, interleaved (row ``2i``
chosen, ``2i + 1`` rejected), masks on the completion targets only (`PreferenceLoss`).
Validation batches stay the bundle's own text, so evaluation measures the student's language model.

* ``source="own"`` (default): each packed training row is split at ``prompt_fraction`` of its length;
  the chosen completion is the row's own continuation, the rejected one the continuation of the next
  row of the batch (another place of the corpus): a real continuation against a corrupted one.
* ``source=<path.jsonl>``: rows ``{prompt, chosen, rejected}`` (`read_preferences`), cycled in file
  order and tokenized with the run's tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshdistill.data._wrapped import WrappedData

FIELDS = ("prompt", "chosen", "rejected")


def read_preferences(path: str) -> list[dict[str, str]]:
  """Rows of a preference JSONL file: one object per line with string fields ``prompt``, ``chosen``, ``rejected``.

  Raises:
    ValueError: a line that is not a JSON object, or lacks a field (named, with the line number).
  """
  rows = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not valid JSON ({e}); each line is {{prompt, chosen, rejected}}") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{n}: a preference row is a JSON object with keys {list(FIELDS)}")
      missing = [k for k in FIELDS if not isinstance(row.get(k), str)]
      if missing:
        raise ValueError(
            f"{path}:{n}: preference row lacks {missing} (each row needs string fields {list(FIELDS)}: the prompt, "
            "the preferred completion and the dispreferred one)"
        )
      rows.append({k: row[k] for k in FIELDS})
  if not rows:
    raise ValueError(f"{path}: no preference rows; each line is a JSON object {{prompt, chosen, rejected}}")
  return rows


def preference_batch(
    rows: Sequence[dict[str, str]], encode: Callable[[str], Sequence[int]], seq_len: int, pad_id: int = 0
) -> dict[str, np.ndarray]:
  """A host batch ``{inputs, targets, mask}: [2 * len(rows), seq_len]``, chosen then rejected per row.

  Each sequence is ``encode(prompt) + encode(completion)``, cut to ``seq_len + 1`` tokens; the mask
  is 1 on the targets that are completion tokens, 0 on prompt tokens and padding.
  """
  B = 2 * len(rows)
  inputs: np.ndarray = np.full((B, seq_len), pad_id, np.int32)
  targets: np.ndarray = np.full((B, seq_len), pad_id, np.int32)
  mask: np.ndarray = np.zeros((B, seq_len), np.float32)
  for i, row in enumerate(rows):
    prompt = list(encode(row["prompt"]))
    for j, key in enumerate(("chosen", "rejected")):
      seq = (prompt + list(encode(row[key])))[: seq_len + 1]
      n = len(seq) - 1
      if not prompt or n < 1 or len(prompt) >= len(seq):
        raise ValueError(
            f"preference row {i}: prompt ({len(prompt)} tokens) leaves no {key} token within data.seq_len={seq_len}; "
            "shorten the prompt or raise data.seq_len"
        )
      r = 2 * i + j
      inputs[r, :n], targets[r, :n] = seq[:-1], seq[1:]
      mask[r, len(prompt) - 1 : n] = 1.0  # target t is token t + 1: completion tokens start at len(prompt)
  return {"inputs": inputs, "targets": targets, "mask": mask}


def own_pairs(batch: dict[str, np.ndarray], prompt_fraction: float) -> dict[str, np.ndarray]:
  """``2 * b`` interleaved rows from a packed batch of ``b`` rows (see the module docstring)."""
  inputs, targets, mask = (np.asarray(batch[k]) for k in ("inputs", "targets", "mask"))
  b, T = inputs.shape
  if b < 2:
    raise ValueError("preference pairs from the run's own data need at least 2 rows per batch (train.batch_size >= 4)")
  p = max(1, min(T - 1, int(round(prompt_fraction * T))))  # prompt tokens: inputs[:, :p]
  completion_T = (np.arange(T) >= p - 1).astype(np.float32)  # targets t >= p - 1 are completion tokens
  other = np.roll(np.arange(b), -1)
  rej_inputs, rej_targets = inputs.copy(), targets.copy()
  rej_inputs[:, p:] = inputs[other, p:]
  rej_targets[:, p - 1:] = targets[other, p - 1:]
  chosen_mask = mask * completion_T
  rejected_mask = mask[other] * completion_T * (mask[:, p - 1:p] > 0)  # the prompt's last token must be real
  out = {}
  for key, c, r in (("inputs", inputs, rej_inputs), ("targets", targets, rej_targets),
                    ("mask", chosen_mask, rejected_mask)):
    pair = np.empty((2 * b, T), c.dtype)
    pair[0::2], pair[1::2] = c, r
    out[key] = pair
  out["mask"] = out["mask"].astype(np.float32)
  return out


class _PairIterator:
  """The bundle's train iterator, each batch turned into pairs; its position is the inner one's."""

  def __init__(self, inner, make):
    self._inner, self._make = inner, make

  def __iter__(self):
    return self

  def __next__(self):
    return self._make(next(self._inner))

  def get_state(self):
    return self._inner.get_state()

  def close(self):
    close = getattr(self._inner, "close", None)
    if close is not None:
      close()


class _JsonlIterator:
  """Preference rows from a file, ``n`` per batch, in file order, cycled; the position is a row index."""

  def __init__(self, rows, n: int, encode, seq_len: int, state: dict | None):
    self._rows, self._n, self._encode, self._seq_len = rows, n, encode, seq_len
    self._pos = int((state or {}).get("preference_row", 0))

  def __iter__(self):
    return self

  def __next__(self):
    take = [self._rows[(self._pos + i) % len(self._rows)] for i in range(self._n)]
    self._pos = (self._pos + self._n) % len(self._rows)
    return preference_batch(take, self._encode, self._seq_len)

  def get_state(self):
    return {"preference_row": self._pos}

  def close(self):
    pass


@dataclasses.dataclass
class PreferencePairs(WrappedData):
  """A `DataBundle` whose training batches are preference pairs (see the module docstring); validation batches,
  tokenizers and statistics are the bundle's (`WrappedData`).

  ``bundle`` must be built with batch size ``B / 2`` (``B`` = rows per step = 2 x pairs). ``rows``: the rows of the
  ``source`` file already read (`read_preferences`), or None to read them here.
  """

  bundle: Any
  source: str = "own"
  prompt_fraction: float = 0.5
  rows: Sequence[dict[str, str]] | None = None

  def __post_init__(self):
    self._rows = None
    if self.source != "own":
      self._rows = list(self.rows) if self.rows is not None else read_preferences(self.source)

  @property
  def global_batch_size(self) -> int:
    return 2 * self.bundle.global_batch_size

  def train_iterator(self, state: dict | None = None, **kwargs):
    if self._rows is not None:
      tok = self.bundle.tokenizer
      encode = tok.encode if hasattr(tok, "encode") else tok
      return _JsonlIterator(self._rows, self.bundle.local_batch_size, encode, self.bundle.config.seq_len, state)
    inner = self.bundle.train_iterator(state, **kwargs)
    return _PairIterator(inner, lambda batch: own_pairs(batch, self.prompt_fraction))
