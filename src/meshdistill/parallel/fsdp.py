"""Fully sharded data parallelism (ZeRO-3 style) over the ``data`` axis: which weights split, and their gathers.

With ``mesh.fsdp: true`` (``Distiller(..., fsdp=True)``, `meshdistill.parallel.backends.ShardMapLayout` only) every
weight of the student -- and so its optimizer moments, which follow their parameter's sharding -- and
every weight of the teacher is split over ``data`` as well as ``tensor``: the teacher over the whole
mesh, the student's parameters and AdamW moments over ``data x tensor``.

How it is expressed:

* **Which dimension.** A rule of the table `meshdistill.parallel.rules.FSDP`: the logical dimension ``embed``
  (the model dimension D of projections, embeddings and norm scales; ``head_dim`` for a per-head norm scale)
  is split over ``data`` where ``data`` divides it. Weights without such a dimension (a bias split over
  ``tensor``, a LoRA factor's rank) stay replicated over ``data``. The layout applies the table once, on the
  models it is given (`meshdistill.parallel.backends.ShardMapLayout.fit_model`); from then on the resolved specs
  are the one source: placement, optimizer moments, checkpoint targets and the step's ``shard_map`` specs
  (`data_specs`) all read them. Model code names logical dimensions only.
* **Explicit gathers per layer.** The step stays ONE per-device function under a ``shard_map``
  manual over ``data`` only (``tensor`` compiler-managed). Inside it, the weights of a data-split
  module arrive as local shards, and `gathered_for` all-gathers them over ``data``
  (``jax.lax.all_gather(tiled=True)``) right where the module runs, once its input exists (an
  optimization barrier, else the compiler may start every layer's gather at the beginning): the
  decoder calls it once per block and for the embedding, final norm and LM head. The transpose of an
  all-gather is a reduce-scatter, so the gradient of a data-split weight comes out of the backward
  pass already summed over ``data`` and split like its weight: the step must not sum it again
  (`meshdistill.train.step.sum_over_data`). Each collective runs in a nested ``shard_map`` manual over
  ``tensor`` too, on the local ``tensor`` block: left to the compiler in a ``data``-manual region, XLA
  gathers the operand over ``tensor`` first and every device would hold whole weights.
* **Blocks under ``remat="full"``** run through `gathered_call` (a `jax.custom_vjp`): only the block's
  input and its weight shards are saved; the backward pass gathers the weights again once the block's
  output cotangent exists, runs the block's backward and reduce-scatters the gradients, in that order.
  `jax.checkpoint` alone would recompute (and gather) from saved inputs with nothing tying the
  recomputation to the backward pass reaching the block. Other remat policies gather inside the
  block's `nnx.remat` region (with ``"none"`` the gathered copy is kept for the backward pass).
  Why explicit collectives at all: the step is manual over ``data`` already, and only explicit
  gathers can be placed, and ordered, per block.
* **The update runs on the global arrays.** Global-norm clipping, the ``grad_norm`` metric and AdamW
  need whole gradients, not a device's shard: `meshdistill.parallel.backends.ShardMapLayout.compile` runs the
  gradient half of the step (`meshdistill.train.step.per_device_gradients`) under the ``shard_map`` and the
  update half (`meshdistill.train.step.apply_gradients`) at ``jit`` level on the globally sharded arrays,
  in the same program; the moments stay split over ``data x tensor``.

Outside a ``shard_map`` manual over ``data`` (evaluation, generation, export) `gathered` does nothing:
the arrays are global there and the compiler partitions them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshdistill.parallel import rules as rules_lib
from meshdistill.parallel.mesh import DATA

SETTING = "mesh.fsdp"


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _names(v: nnx.Variable) -> tuple:
  """The mesh axis of each dimension of a variable (None: not split), its layout's rules applied."""
  return rules_lib.mesh_names(v)


def data_dim(v: Any) -> int | None:
  """The dimension of variable ``v`` split over ``data`` (None: replicated over ``data``, or not a variable)."""
  if not _is_var(v):
    return None
  names = _names(v)
  return names.index(DATA) if DATA in names else None


def data_specs(tree: Any) -> Any:
  """``shard_map`` specs of a parameter tree over the manual ``data`` axis: ``P(..., 'data', ...)`` on the data-split
  dimension of each variable, ``P()`` (replicated over ``data``) for the rest."""
  def one(v):
    dim = data_dim(v)
    return P() if dim is None else P(*(DATA if i == dim else None for i in range(dim + 1)))
  return jax.tree.map(one, tree, is_leaf=_is_var)


def any_split(tree: Any) -> bool:
  """Whether any variable of ``tree`` is split over ``data``."""
  return any(data_dim(v) is not None for v in jax.tree.leaves(tree, is_leaf=_is_var))


def _tensor_spec(v: nnx.Variable) -> P:
  """The variable's split over the compiler-managed axes (``data`` dropped): what its gathered copy keeps."""
  return P(*(None if a == DATA else a for a in _names(v)))


def _over_tensor(fn, v: nnx.Variable):
  """``fn`` with ``tensor`` (and any other compiler-managed axis ``v`` is split over: ``expert``) manual as well: a
  collective over ``data`` then runs on the local block. (In a ``shard_map`` manual over ``data`` only, XLA first
  gathers the operand of such a collective over ``tensor``: every device would hold whole weights.)"""
  spec = _tensor_spec(v)
  axes = {a for a in spec if a is not None}
  if not axes:
    return fn
  return jax.shard_map(fn, in_specs=spec, out_specs=spec, axis_names=axes, check_vma=False)


def _gather(shard, v: nnx.Variable):
  """All-gather over ``data`` of a weight's shard; the copy stays split over ``tensor``."""
  return _over_tensor(lambda w: jax.lax.all_gather(w, DATA, axis=data_dim(v), tiled=True), v)(shard)


def _scatter(grad, v: nnx.Variable):
  """The transpose of `_gather` for a gradient: summed over ``data``, this device's shard kept."""
  return _over_tensor(lambda g: jax.lax.psum_scatter(g, DATA, scatter_dimension=data_dim(v), tiled=True), v)(grad)


def _data_is_manual() -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  return DATA in getattr(mesh, "manual_axes", ())


def gathered(module):
  """``module`` with every weight split over ``data`` all-gathered whole (a copy; ``module`` is not changed).

  Only inside a ``shard_map`` manual over ``data`` do such weights arrive as shards (their specs from
  `data_specs`); elsewhere the module comes back as it is. The gradient of the gather is a reduce-scatter
  over ``data``. See `gathered_for` to gather a module only once its input exists.
  """
  return gathered_for(module, None)[0]


def gathered_for(module, x_BxTxD):
  """``(gathered(module), x_BxTxD)``, the gather ordered after ``x_BxTxD`` (the module's input) is computed.

  The one hook of the models: the decoder calls it for each block, inside the block's remat region, and
  for the final norm and LM head. The order is an `jax.lax.optimization_barrier` joining the input and
  the weight shards: without it the compiler may start every layer's gather at the beginning of the
  program (to hide their latency) and keep all gathered copies alive at once -- the whole model per
  device again. With it, one block's gathered weights exist at a time (the price: a gather is not
  overlapped with the previous block's compute).
  """
  if module is None or not _data_is_manual():
    return module, x_BxTxD
  graphdef, state = nnx.split(module)
  if not any_split(state):
    return module, x_BxTxD
  flat = list(nnx.to_flat_state(state))
  split = [i for i, (_, v) in enumerate(flat) if data_dim(v) is not None]
  shards = [flat[i][1].get_value() for i in split]
  if x_BxTxD is not None:
    x_BxTxD, shards = jax.lax.optimization_barrier((x_BxTxD, shards))
  for i, shard in zip(split, shards):
    path, v = flat[i]
    flat[i] = (path, v.replace(_gather(shard, v)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat)), x_BxTxD


def gathered_call(call, module, x_BxTxD, *static):
  """``call(gathered(module), x_BxTxD, *static)`` rematerialised by hand: only ``x_BxTxD`` and the weight SHARDS
  are kept for the backward pass, which gathers the weights again once the output's cotangent exists, runs
  ``call``'s backward and reduce-scatters the weight gradients over ``data`` (a `jax.custom_vjp`).

  The decoder's blocks run this way under ``remat="full"`` when their weights are split over ``data`` (None
  otherwise: the caller then runs its usual path). `jax.checkpoint` alone recomputes a block from its
  saved input, and nothing ties that recomputation (and its gather) to the backward pass reaching the
  block: the compiler may gather every block's weights at the start of the backward pass. Here the
  gather, the block's backward and the reduce-scatter wait for the cotangent (optimization barriers),
  so one block's gathered weights and full gradients exist at a time, forward and backward.
  """
  if module is None or not _data_is_manual():
    return None
  graphdef, state = nnx.split(module)
  flat = list(nnx.to_flat_state(state))
  split = [i for i, (_, v) in enumerate(flat) if data_dim(v) is not None]
  if not split:
    return None
  rest = [i for i in range(len(flat)) if i not in split]
  variables = [flat[i][1] for i in split]

  def gather(shards):
    return [_gather(w, v) for w, v in zip(shards, variables)]

  def apply(full, others, x):
    values = dict(zip(split, full)) | dict(zip(rest, others))
    merged = nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(values[i])) for i, (p, v) in enumerate(flat)]))
    return call(merged, x, *static)

  @jax.custom_vjp
  def run(shards, others, x):
    x, shards = jax.lax.optimization_barrier((x, shards))
    return apply(gather(shards), others, x)

  def forward(shards, others, x):
    return run(shards, others, x), (shards, others, x)

  def backward(saved, ct):
    shards, others, x, ct = jax.lax.optimization_barrier((*saved, ct))
    _, vjp = jax.vjp(apply, gather(shards), others, x)
    d_full, d_others, d_x = vjp(ct)
    d_shards = [_scatter(g, v) if g.dtype != jax.dtypes.float0 else np.zeros(w.shape, g.dtype)  # integer storage
                for g, v, w in zip(d_full, variables, shards)]
    return jax.lax.optimization_barrier((d_shards, d_others, d_x))

  run.defvjp(forward, backward)
  return run([flat[i][1].get_value() for i in split], [flat[i][1].get_value() for i in rest], x_BxTxD)


def unsupported(layout: str) -> str:
  """The error for ``mesh.fsdp`` on a layout that cannot split weights over ``data``."""
  return (
      f"{SETTING}=true (Distiller(fsdp=True)) splits weights over the data axis of a shard_map mesh, but "
      f"mesh.backend={layout!r} keeps a whole replica per device; use mesh.backend='shard_map' (backend='shard_map' "
      "with a mesh from make_mesh), or set mesh.fsdp=false"
  )
