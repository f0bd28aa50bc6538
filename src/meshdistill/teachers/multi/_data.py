"""Training batches of several teachers: each teacher's top-k per batch, combined (`MultiTeacherData`).

A teacher is one of two kinds of producer:

* `FromBatches`: a source that gives `TOPK` (an offline cache, later a served teacher) prepared as it is for one
  teacher: its data bundle yields the corpus batches with its top-k; the batches of all such bundles come from the
  same rows in the same order (same data, same seed), so they are read side by side;
* `Live`: a source that gives a model, run as `meshdistill.teachers.cache.TeacherTopK` on the student's mesh (the
  program a live ``LogitKD(top_k=k)`` step runs for its teacher) at its own temperature. Under ``combine: mix`` it
  runs on every row; under ``combine: route`` on its own rows only (`Live.on_rows`): they are gathered into a block
  of a fixed size -- the mesh's ``data`` size times a power of two, the whole batch at most -- so the program
  compiles for a few sizes, never per batch, and a teacher that serves half the rows does about half the work.
  Its work for batch ``s + 1`` is issued before batch ``s`` is handed out (asynchronous dispatch).

`combine` narrows every top-k to ``k``, routes or mixes them (`meshdistill.losses.route_topk` /
`meshdistill.losses.mix_topk`) and adds each teacher's own top-k and the rows it serves (`MULTI_KEYS`) for the
per-teacher metrics (under route a live teacher's entries on rows it does not serve are another row's top-k, a
placeholder: those rows weigh 0 in its metrics). The iterator's state is that of the plain data, so checkpoints and
resume are unchanged. `MultiTeacherData.score` gives rows no data source holds (generated on-policy) their target.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshdistill import losses
from meshdistill.data import DOMAIN_KEY, WrappedData
from meshdistill.core.batch import MULTI_KEYS, TOPK_KEYS


class Live:
  """A teacher model as a producer of top-k: ``program`` (a `TeacherTopK`) called on the batch's inputs."""

  def __init__(self, program):
    self.program = program
    mesh = getattr(program, "mesh", None)
    self.row_multiple = 1 if mesh is None else int(mesh.shape["data"])  # rows per call: a multiple of it

  def __call__(self, batch: dict) -> losses.TopK:
    return self.program(np.asarray(batch["inputs"]))

  def block_rows(self, n: int, batch_rows: int) -> int:
    """The rows of the block ``n`` rows are run in: ``row_multiple`` times a power of two, ``batch_rows`` at most."""
    size = self.row_multiple
    while size < n:
      size *= 2
    return min(size, batch_rows)

  def on_rows(self, batch: dict, rows: np.ndarray) -> losses.TopK:
    """The top-k of ``batch``'s rows ``rows`` (indices), in the batch's shape ``[B, ...]``: the program runs on those
    rows alone (padded to `block_rows` with copies of the first); every other row holds a copy of one of them."""
    inputs_BxT = np.asarray(batch["inputs"])
    B = inputs_BxT.shape[0]
    size = self.block_rows(len(rows), B)
    if size >= B:
      return self(batch)
    first = rows[0] if len(rows) else 0
    block = np.concatenate([rows, np.full(size - len(rows), first, rows.dtype)]).astype(np.int64)
    out = self.program(inputs_BxT[block])
    at_B = np.zeros(B, np.int32)
    at_B[rows] = np.arange(len(rows), dtype=np.int32)
    return losses.TopK(*(jnp.take(x, at_B, axis=0) for x in out))


class FromBatches:
  """A `TOPK` source's prepared data bundle: its batches carry the teacher's top-k under `TOPK_KEYS`."""

  def __init__(self, bundle):
    self.bundle = bundle


@functools.partial(jax.jit, static_argnames=("k", "weights"))
def combine(topks: Sequence[losses.TopK], teacher_B: jax.Array | None, *, k: int, weights: tuple[float, ...] | None):
  """The batch's target and each teacher's own top-k: ``teacher_B`` [B] routes rows (None: mix with ``weights``)."""
  narrowed = [losses.narrow_topk(losses.TopK(t.indices.astype(jnp.int32), *(x.astype(jnp.float32) for x in t[1:])),
                                 k) for t in topks]
  n, b = len(narrowed), narrowed[0].tail.shape[0]
  if teacher_B is None:
    target, rows = losses.mix_topk(narrowed, weights), jnp.ones((b, n), jnp.float32)
  else:
    target, rows = losses.route_topk(narrowed, teacher_B), jax.nn.one_hot(teacher_B, n, dtype=jnp.float32)
  each = [jnp.stack([getattr(t, f) for t in narrowed], axis=1) for f in losses.TopK._fields]
  return dict(zip(TOPK_KEYS, target)) | dict(zip(MULTI_KEYS, (*each, rows)))


class MultiTeacherData(WrappedData):
  """A data bundle whose training batches carry several teachers' combined top-k (see the module docstring);
  validation batches, tokenizers and stats are the plain data's (`meshdistill.data.WrappedData`).

  Args:
    bundle: the plain data.
    producers: one `Live` or `FromBatches` per teacher, in the order of ``names``.
    k: tokens per position of the target.
    route: ``[number of domains]`` teacher index of each domain (``combine: route``), or None (``combine: mix``).
    weights: each teacher's share of a mix.
  """

  def __init__(self, bundle, producers: Sequence, *, k: int, route: Sequence[int] | None, weights: Sequence[float]):
    super().__init__(bundle)
    self.producers, self.k = tuple(producers), k
    self.route = None if route is None else np.asarray(route, np.int32)
    self.weights = tuple(float(w) for w in weights)

  def train_iterator(self, state: dict | None = None, **kw):
    readers = [p.bundle.train_iterator(state, **kw) for p in self.producers if isinstance(p, FromBatches)]
    return _Iterator(self, readers or [self.bundle.train_iterator(state, **kw)])

  def with_teachers(self, host: dict) -> dict:
    """``host`` (a batch with every `FromBatches` teacher's top-k, in order, under ``topk``) with the combined
    target: issued asynchronously; `np.asarray` of its values waits."""
    given = iter(host.pop("topk"))
    if self.route is None:
      topks = [p(host) if isinstance(p, Live) else next(given) for p in self.producers]
      return host | combine(topks, None, k=self.k, weights=self.weights)
    if DOMAIN_KEY not in host:
      raise ValueError("teachers.combine=route needs every batch to carry its rows' domain: set data.corpora")
    teacher_B = self.route[np.asarray(host[DOMAIN_KEY])]
    topks = [p.on_rows(host, np.flatnonzero(teacher_B == n)) if isinstance(p, Live) else next(given)
             for n, p in enumerate(self.producers)]  # a live teacher on its own rows alone
    return host | combine(topks, jnp.asarray(teacher_B), k=self.k, weights=None)

  def score(self, host: dict) -> dict:
    """``host`` (rows no data source holds: generated by the student, on-policy) with the combined target and
    each teacher's own top-k, every teacher asked for its rows now (host arrays): a `Live` one runs its program, a
    top-k source that answers for any rows (a served teacher: its bundle's ``fetch``) is asked; a cache cannot."""
    fetched = []
    for i, p in enumerate(self.producers):
      if isinstance(p, Live):
        continue
      if not hasattr(p.bundle, "fetch"):
        raise ValueError(f"teacher {i} gives the top-k of the data's rows only (a cache), not of new rows: on-policy "
                         "runs need every teacher to run a model or to be served")
      got = p.bundle.fetch(host)
      fetched.append(losses.TopK(*(got[key] for key in TOPK_KEYS)))
    return {k: np.asarray(v) for k, v in self.with_teachers({**host, "topk": fetched}).items()}


class _Iterator:
  """The batches of ``data`` one ahead: batch ``s + 1``'s teacher work is issued before batch ``s`` is returned."""

  def __init__(self, data: MultiTeacherData, readers: list):
    self._data, self._readers, self._ahead = data, readers, None

  def __iter__(self):
    return self

  def _read(self) -> dict:
    batches = [dict(next(r)) for r in self._readers]
    host = batches[0]
    if any(not np.array_equal(b["inputs"], host["inputs"]) for b in batches[1:]):
      raise ValueError("teachers: the top-k sources read different rows in the same step (their data differs); "
                       "give every teacher's cache the run's data section")
    host["topk"] = [losses.TopK(*(b.pop(key) for key in TOPK_KEYS)) for b in batches if TOPK_KEYS[0] in b]
    for key in TOPK_KEYS:
      host.pop(key, None)
    return self._data.with_teachers(host)

  def __next__(self) -> dict:
    current = self._ahead if self._ahead is not None else self._read()
    try:
      self._ahead = self._read()
    except StopIteration:
      self._ahead = None
    return {k: np.asarray(v) for k, v in current.items()}

  def get_state(self):
    # the position of the batch handed out next (one is read ahead): the readers' state minus that batch
    state = dict(self._readers[0].get_state())
    if self._ahead is not None and "next_batch" in state:
      state["next_batch"] -= 1
    return state

  def set_state(self, state):
    for r in self._readers:
      r.set_state(state)
    self._ahead = None

  def close(self):
    for r in self._readers:
      r.close()
