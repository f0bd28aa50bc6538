"""The teacher as top-k: `TeacherTopK` (a placed teacher
compiled to return its `TopK` for a batch of rows, the program `write_cache` and `meshdistill.teachers.mesh` run);
`process_mesh` / `on_process_mesh`: the rows of a job's mesh one process runs alone (a cache writer per process)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshdistill import losses
from meshdistill.parallel.fsdp import data_specs
from meshdistill.parallel.mesh import DATA, TENSOR, host_to_global, param_shardings
from meshdistill.train.teacher import TopKTeacher


def _topk_rows(teacher_params, inputs_BxT, *, teacher_def, k, temperature, vocab):
  """Per-device: the teacher's `TopK` for rows ``inputs_BxT`` (as a live `LogitKD(top_k=k)` computes it)."""
  teacher = nnx.merge(teacher_def, teacher_params)
  logits_BxTxV = jax.lax.stop_gradient(teacher(inputs_BxT).logits)[..., :vocab]

  def one(logits_TxV):
    ids_TxK, logprobs_TxK = losses.teacher_topk(logits_TxV, k, temperature)
    return losses.TopK(ids_TxK, logprobs_TxK, losses.topk_tail(logits_TxV, ids_TxK, temperature))

  return jax.vmap(one)(logits_BxTxV)


def _topk_rows_targets(teacher_params, inputs_BxT, targets_BxT, *, teacher_def, k, temperature, vocab):
  """Per-device: `_topk_rows` and the log-probability of each position's target ``[B, T]`` (at ``temperature``)."""
  teacher = nnx.merge(teacher_def, teacher_params)
  logits_BxTxV = jax.lax.stop_gradient(teacher(inputs_BxT).logits)[..., :vocab]

  def one(logits_TxV, targets_T):
    ids_TxK, logprobs_TxK = losses.teacher_topk(logits_TxV, k, temperature)
    own_T = losses.target_logprobs(losses.log_softmax(logits_TxV, temperature), targets_T)
    return losses.TopK(ids_TxK, logprobs_TxK, losses.topk_tail(logits_TxV, ids_TxK, temperature)), own_T

  return jax.vmap(one)(logits_BxTxV, targets_BxT)


@functools.lru_cache(maxsize=64)
def _program(rows_fn, graphdef, k, temperature, vocab, mesh, spec_leaves, spec_tree):
  """The jitted program ``rows_fn`` (`_topk_rows` or `_topk_rows_targets`) of a teacher of ``graphdef`` on ``mesh``:
  one per architecture and settings, so several teachers of one shape (`meshdistill.teachers.multi`) compile it
  once."""
  fn = functools.partial(rows_fn, teacher_def=graphdef, k=k, temperature=temperature, vocab=vocab)
  if mesh is None:
    return jax.jit(fn)
  specs = jax.tree_util.tree_unflatten(spec_tree, spec_leaves)
  n_rows = 2 if rows_fn is _topk_rows_targets else 1
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, *(P(DATA),) * n_rows), out_specs=P(DATA),
                               axis_names={DATA}, check_vma=False))


class TeacherTopK:
  """A teacher placed on ``mesh`` (or one device) and compiled to return its `TopK` for a batch of rows.

  The program is the one a live top-k step runs for its teacher: `jax.shard_map` manual over ``data``,
  the vocabulary split over ``tensor`` (vocabulary-parallel top-k selection). Calls dispatch
  asynchronously; the result stays on ``mesh``, rows split over ``data``.
  """

  def __init__(self, teacher, *, k: int, temperature: float = 1.0, vocab: int | None = None,
               mesh: Mesh | None = None):
    vocab = teacher.cfg.vocab_size if vocab is None else vocab
    if not 1 <= k <= vocab:
      raise ValueError(f"k={k} must be in [1, {vocab}] (the teacher's vocabulary range)")
    self.cfg, self.k, self.temperature, self.vocab, self.mesh = teacher.cfg, k, float(temperature), vocab, mesh
    graphdef, params = nnx.split(teacher)
    self.graphdef = graphdef  # with ``params``: the teacher model itself (its validation loss, its size)
    if mesh is None:
      self.params = jax.device_put(params, jax.devices()[0])
    else:
      teacher.cfg.check_tensor_split(mesh.shape["tensor"])
      self.params = jax.device_put(params, param_shardings(nnx.get_partition_spec(params), mesh))
    specs = (None, None) if mesh is None else jax.tree_util.tree_flatten(data_specs(self.params))
    settings = (graphdef, k, self.temperature, vocab, mesh, None if mesh is None else tuple(specs[0]), specs[1])
    self._fn = _program(_topk_rows, *settings)
    self._with_targets = _program(_topk_rows_targets, *settings)

  def _place(self, rows_BxT):
    if self.mesh is None:
      return jax.device_put(rows_BxT, jax.devices()[0])
    if not isinstance(rows_BxT, jax.Array) or rows_BxT.sharding.mesh != self.mesh:
      return host_to_global(np.asarray(rows_BxT), self.mesh)
    return rows_BxT

  def with_targets(self, inputs_BxT, targets_BxT) -> tuple[losses.TopK, jax.Array]:
    """``(TopK, log-probability of each target [B, T])``: what a cross-tokenizer cache stores per teacher token."""
    return self._with_targets(self.params, self._place(inputs_BxT), self._place(targets_BxT))

  def __call__(self, inputs_BxT) -> losses.TopK:
    """The teacher's top-k of host or device rows ``[B, T]`` (B a multiple of the mesh's ``data``)."""
    return self._fn(self.params, self._place(inputs_BxT))

  def spec(self, source: str) -> TopKTeacher:
    return TopKTeacher(cfg=self.cfg, k=self.k, temperature=self.temperature, vocab=self.vocab, source=source)


# --------------------------------------------------------------------------- one process's part of a job's mesh
def process_mesh(mesh: Mesh) -> Mesh:
  """The rows of ``mesh`` (its ``data`` indices) whose devices all belong to this process, as a mesh of their own.

  A program on it involves no other process, so each process of a job can run the teacher on different
  rows (`write_cache` with one writer per process). Its ``tensor`` size is ``mesh``'s, so a device computes
  the same program on the same number of rows as on ``mesh``. ``mesh`` itself with one process.

  Raises:
    ValueError: this process's devices do not form whole rows of ``mesh`` (``tensor`` spans processes).
  """
  if jax.process_count() == 1:
    return mesh
  owners_DxT = np.vectorize(lambda d: d.process_index)(mesh.devices)
  mine = owners_DxT == jax.process_index()
  rows = np.flatnonzero(mine.all(axis=1))
  if rows.size == 0 or rows.size != np.count_nonzero(mine.any(axis=1)):
    raise ValueError(
        f"mesh data={mesh.shape[DATA]} x tensor={mesh.shape[TENSOR]}: the devices of process "
        f"{jax.process_index()} do not form whole rows of the data axis, so it cannot run the teacher on rows of its "
        f"own; use mesh.tensor at most the devices of one process ({jax.local_device_count()}) and mesh.data a "
        f"multiple of the {jax.process_count()} processes"
    )
  return Mesh(mesh.devices[rows], mesh.axis_names, axis_types=mesh.axis_types)


def on_process_mesh(params: Any, mesh: Mesh) -> Any:
  """``params`` (arrays on a job's mesh, replicated over ``data``) as arrays on its `process_mesh` ``mesh``.

  No copy: each array of the result is made of this process's shards of the input.

  Raises:
    ValueError: an array is split over ``data`` (this process's rows do not hold all of it).
  """

  def one(path, x):
    if not isinstance(x.sharding, NamedSharding):
      raise ValueError(f"teacher parameter {jax.tree_util.keystr(path)} is not on a mesh ({x.sharding})")
    sharding = NamedSharding(mesh, x.sharding.spec)
    have = x.sharding.devices_indices_map(x.shape)
    want = sharding.devices_indices_map(x.shape)
    if any(have[d] != idx for d, idx in want.items()):
      raise ValueError(
          f"teacher parameter {jax.tree_util.keystr(path)} is split as {x.sharding.spec} over the job's mesh, so the "
          "rows of one process do not hold all of it; shard the teacher over tensor only to write the cache as "
          "several processes"
      )
    by_device = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [by_device[d] for d in want])

  return jax.tree_util.tree_map_with_path(one, params)
