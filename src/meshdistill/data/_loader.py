"""Batches for training and evaluation, read with grain and split over processes.

Training (`TrainIterator`): the row indices ``0..N-1`` are shuffled by ``seed`` (a new
permutation each epoch, also fixed by ``seed``), repeated for ``num_epochs`` epochs (``None`` =
forever) and cut into GLOBAL batches of ``global_batch_size`` rows, full batches only. A global
batch may span an epoch boundary; there are ``N * num_epochs // global_batch_size`` of them.

Processes: every process sees the same global batches and reads only its own contiguous slice
of rows, ``[p * B/P, (p+1) * B/P)`` for process ``p`` of ``P``; the trainer hands that slice to
`meshdistill.host_to_global`, which assembles the global array split over ``data``. Batch
contents depend only on the data, ``seed`` and the GLOBAL batch size, never on the number of
processes, so a run can resume on another topology.

State: ``get_state()`` is a small JSON-serializable dict (the index of the next global batch,
plus what it depends on); ``set_state`` on an iterator over the same data continues with
exactly the batches the saved one would have produced.

Evaluation (`validation_batches`): every validation row once, in an order shuffled by a fixed
seed (so the first ``max_batches`` are a sample of the whole set, not its alphabetical head);
the last batch is filled with padding rows whose mask is 0, so no row is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from meshdistill.data._packing import PackedSequences

log = logging.getLogger(__name__)

STATE_VERSION = 1


def process_slice(global_batch_size: int, process_index: int | None, process_count: int | None) -> tuple[int, int]:
  """Rows ``[lo, hi)`` of each global batch read by this process (default: this JAX process).

  Raises:
    ValueError: ``global_batch_size`` is not a multiple of ``process_count``, or bad indices.
  """
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not isinstance(global_batch_size, int) or global_batch_size < 1:
    raise ValueError(f"batch size {global_batch_size!r} must be a positive integer")
  if not isinstance(process_count, int) or process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index!r} must be in [0, process_count={process_count!r})")
  if global_batch_size % process_count:
    raise ValueError(
        f"batch size {global_batch_size} is not divisible by the {process_count} processes; each process reads an "
        f"equal share, so use a batch size that is a multiple of {process_count}"
    )
  per = global_batch_size // process_count
  return process_index * per, (process_index + 1) * per


class _ReadRows:
  """grain map: a global batch of row indices -> this process's rows as a batch dict."""

  def __init__(self, packed: PackedSequences, lo: int, hi: int, segments: bool, row_ids: bool = False):
    self._packed, self._lo, self._hi, self._segments, self._row_ids = packed, lo, hi, segments, row_ids

  def __call__(self, indices_B: np.ndarray) -> dict[str, np.ndarray]:
    rows = self._packed.rows(indices_B[self._lo : self._hi], segments=self._segments)
    if self._row_ids:  # which packed rows these are (an offline teacher cache is indexed by them)
      rows["row_ids"] = np.asarray(indices_B[self._lo : self._hi], np.int64)
    return rows


class TrainIterator(Iterator[dict[str, np.ndarray]]):
  """Shuffled, repeated, process-sharded training batches with an exact, JSON-serializable state.

  Each item is a dict ``{"inputs", "targets", "mask"}`` of ``[B/P, T]`` arrays (int32, int32,
  float32), plus ``"segment_ids"``/``"positions"`` with ``segments=True``.

  Args:
    packed: the training rows.
    global_batch_size: B, rows per step over all processes.
    seed: shuffling seed.
    num_epochs: passes over the data; ``None`` = forever.
    process_index, process_count: which slice of each batch this process reads (default: JAX's).
    segments: also yield ``segment_ids`` and ``positions``.
    row_ids: also yield ``row_ids`` [B/P] int64, the packed rows' indices.
    prefetch: batches prepared ahead in a background thread (0 = none).

  Raises:
    ValueError: bad settings, or ``num_epochs`` too small for a single full batch.
  """

  def __init__(
      self,
      packed: PackedSequences,
      *,
      global_batch_size: int,
      seed: int = 0,
      num_epochs: int | None = None,
      process_index: int | None = None,
      process_count: int | None = None,
      segments: bool = False,
      prefetch: int = 2,
      row_ids: bool = False,
  ):
    lo, hi = process_slice(global_batch_size, process_index, process_count)
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
      raise ValueError(f"num_epochs={num_epochs!r} must be a positive integer or None (repeat forever)")
    if not isinstance(seed, int):
      raise ValueError(f"data.seed={seed!r} must be an integer")
    n = len(packed)
    if num_epochs is not None and n * num_epochs < global_batch_size:
      raise ValueError(
          f"the training set has {n} rows of data.seq_len={packed.seq_len}, fewer than one batch of "
          f"{global_batch_size} in {num_epochs} epoch(s); use more data, a smaller batch or seq_len, or more epochs"
      )
    self.packed = packed
    self.global_batch_size = global_batch_size
    self.seed = seed
    self.num_epochs = num_epochs
    self.batches_per_epoch = n / global_batch_size
    ds = (
        grain.MapDataset.range(n)
        .shuffle(seed=seed)
        .repeat(num_epochs, reseed_each_epoch=True)
        .batch(global_batch_size, drop_remainder=True)
        .map(_ReadRows(packed, lo, hi, segments, row_ids))
    )
    self.num_batches = None if num_epochs is None else len(ds)
    options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=max(prefetch, 1))
    self._it = iter(ds.to_iter_dataset(options))

  def __iter__(self) -> TrainIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._it)

  def _identity(self) -> dict[str, Any]:
    return {
        "seed": self.seed,
        "global_batch_size": self.global_batch_size,
        "num_rows": len(self.packed),
        "seq_len": self.packed.seq_len,
        "num_tokens": self.packed.num_tokens,
    }

  def get_state(self) -> dict[str, Any]:
    """JSON-serializable position: ``next_batch`` (global batches consumed) and what it depends on."""
    return {"version": STATE_VERSION, "next_batch": int(self._it.get_state()["next_index"]), **self._identity()}

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from a ``get_state()`` of an iterator over the same data, seed and batch size.

    Raises:
      ValueError: the state was saved for other data or settings (resuming would not be exact).
    """
    have = self._identity()
    diff = {k: (state.get(k), v) for k, v in have.items() if state.get(k) != v}
    if diff:
      detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
      raise ValueError(
          f"data iterator state does not match this data ({detail}); resume with the same data settings and "
          "batch size, or start the data from the beginning"
      )
    self._it.set_state({"next_index": int(state["next_batch"])})

  def close(self) -> None:
    """Stops the prefetch thread."""
    close = getattr(self._it, "close", None)
    if close is not None:
      close()


def validation_batches(
    packed: PackedSequences,
    global_batch_size: int,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    max_batches: int | None = None,
    seed: int = 0,
    segments: bool = False,
) -> list[dict[str, np.ndarray]]:
  """This process's slice of the fixed validation batches (see the module docstring).

  Returns ``ceil(N / B)`` batches (at most ``max_batches``), each a dict of ``[B/P, T]`` arrays;
  padding rows at the end have ``mask`` 0 and ``inputs``/``targets`` equal to the pad id.
  """
  lo, hi = process_slice(global_batch_size, process_index, process_count)
  if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 1):
    raise ValueError(f"max_batches={max_batches!r} must be a positive integer or None (all)")
  n = len(packed)
  order = np.fromiter(grain.MapDataset.range(n).shuffle(seed=seed), np.int64, count=n)
  num = -(-n // global_batch_size)
  if max_batches is not None:
    num = min(num, max_batches)
  batches = []
  for b in range(num):
    idx = order[b * global_batch_size : (b + 1) * global_batch_size][lo:hi]
    rows = packed.rows(idx, segments=segments)
    short = (hi - lo) - idx.size
    if short:
      fill = {k: np.full((short, *v.shape[1:]), _fill_value(k, packed.pad_id), v.dtype) for k, v in rows.items()}
      rows = {k: np.concatenate([v, fill[k]]) for k, v in rows.items()}
    batches.append(rows)
  return batches


def _fill_value(key: str, pad_id: int) -> int:
  """What a padding row holds under ``key``: the pad id for tokens, -1 for span ids (no span), else 0 (masked)."""
  if key in ("inputs", "targets"):
    return pad_id
  return -1 if key.endswith("_span") else 0
