"""Sums over a mesh axis with few collectives, and a census of the collectives in a compiled step.

The step sums its gradients and its loss / metric token sums over ``data``. Written leaf by leaf,
that is one all-reduce per leaf; `psum_bundled` sums a whole tree in at most one all-reduce per
kind of leaf:

* every scalar (token counts, metric sums) of one dtype is stacked into ONE vector, summed, and
  unstacked (the same additions as one psum per scalar, so the same numbers);
* the arrays (gradients) are handed to ONE ``psum`` call. XLA's all-reduce combiner fuses
  independent all-reduces of one replica group into one tuple all-reduce (on CPU, GPU and TPU),
  so they leave as one collective -- up to the combiner's byte threshold, past which a large
  model's gradients leave in a few buckets that overlap with the backward pass. They are not
  concatenated by hand: a flat buffer would copy every gradient and, for leaves split over
  ``tensor``, could force a re-layout over ``tensor``.

`all_reduce_census` counts the all-reduces of a compiled program's HLO text by the mesh axis they
reduce over (``data``, ``tensor``, both, or a part of one), which is what the benchmark prints and
the tests check.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def psum_bundled(tree: Any, axis: str | tuple[str, ...] | None) -> Any:
  """``jax.lax.psum(tree, axis)`` in at most one all-reduce for all scalars of a dtype plus one for the arrays.

  ``tree``: the leaves to sum (the caller selects them: e.g. leaves already reduce-scattered are not
  passed). ``axis=None`` (one device, or a size-1 axis) returns ``tree`` unchanged.
  """
  if axis is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  out = list(leaves)
  scalars: dict[Any, list[int]] = collections.defaultdict(list)
  arrays = []
  for i, x in enumerate(leaves):
    (scalars[jnp.result_type(x)] if jnp.ndim(x) == 0 else arrays).append(i)
  for idx in scalars.values():
    if len(idx) == 1:
      arrays.append(idx[0])
      continue
    summed_S = jax.lax.psum(jnp.stack([leaves[i] for i in idx]), axis)
    for j, i in enumerate(idx):
      out[i] = summed_S[j]
  if arrays:
    for i, x in zip(arrays, jax.lax.psum([leaves[i] for i in arrays], axis)):
      out[i] = x
  return jax.tree.unflatten(treedef, out)


# -------------------------------------------------------------------------------------------- census
_ALL_REDUCE = re.compile(r"\ball-reduce(?:-start)?\(")
_GROUPS = re.compile(
    r"replica_groups=(\{[\d,{} ]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
    r"|mesh\[[^\]]*\](?:, device_ids=\(\[[\d,]+\](?:T\([\d,]+\))?\))? \{[^}]*\})"
)
# the device ids are optional: without them the devices are in order (XLA:CPU writes the form so)
_MESH_FORM = re.compile(r"mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}")


def _iota(dims: str, perm: str | None) -> np.ndarray:
  ids = np.arange(int(np.prod([int(v) for v in dims.split(",")]))).reshape([int(v) for v in dims.split(",")])
  return ids.transpose([int(v) for v in perm.split(",")]) if perm else ids


def replica_groups(text: str) -> list[frozenset[int]]:
  """The device groups of an HLO ``replica_groups=`` value: ``{{0,4},{1,5}}``; the iota form
  ``[4,2]<=[2,2,2]T(0,2,1)`` (iota over the reshape dims, transposed, cut into groups); or the mesh form
  of programs partitioned outside a shard_map, ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}``
  (the devices laid out on the named mesh axes, grouped along the axes in braces; without ``device_ids`` in
  order)."""
  m = _MESH_FORM.fullmatch(text)
  if m:
    axes = [(name.strip("'"), int(size)) for name, size in (a.split("=") for a in m.group(1).split(","))]
    sizes = [size for _, size in axes]
    ids = (_iota(m.group(2), m.group(3)) if m.group(2) else np.arange(int(np.prod(sizes)))).reshape(sizes)
    reduced = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m.group(4)]
    kept = [i for i in range(len(axes)) if i not in reduced]
    moved = ids.transpose(kept + reduced)
    return [frozenset(int(v) for v in row) for row in moved.reshape(-1, int(np.prod([axes[i][1] for i in reduced])))]
  if text.startswith("{"):
    return [frozenset(int(v) for v in g.split(",") if v) for g in re.findall(r"\{([\d, ]*)\}", text[1:-1])]
  m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  shape = [int(v) for v in m.group(1).split(",")]
  ids = _iota(m.group(2), m.group(3))
  return [frozenset(int(v) for v in row) for row in ids.reshape(shape)]


def mesh_axis_groups(mesh, axes: tuple[str, ...]) -> set[frozenset[int]]:
  """The groups of devices that reduce together over ``axes`` of ``mesh``, each device named as the
  compiled program names it: by its position in ``mesh.devices.flat`` (its partition id)."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  names = list(mesh.axis_names)
  keep = [i for i, n in enumerate(names) if n not in axes]
  moved = np.moveaxis(ids, keep, list(range(len(keep))))
  per_group = moved.reshape(int(np.prod([ids.shape[i] for i in keep], dtype=int)), -1)
  return {frozenset(int(v) for v in row) for row in per_group}


def all_reduce_instructions(hlo: str) -> list[tuple[set[frozenset[int]], str]]:
  """Each all-reduce instruction of ``hlo`` as (its device groups, its ``op_name`` metadata: the JAX
  operation it came from, ``""`` if none). An instruction inside a loop body counts once."""
  out = []
  for line in hlo.splitlines():
    if _ALL_REDUCE.search(line):
      groups = _GROUPS.search(line)
      op = re.search(r'op_name="([^"]*)"', line)
      out.append((set(replica_groups(groups.group(1))) if groups else set(), op.group(1) if op else ""))
  return out


def all_reduce_census(hlo: str, mesh=None) -> dict[str, int]:
  """How many all-reduce instructions ``hlo`` (a compiled program's ``as_text()``) holds, by what they reduce over.

  Keys: ``"total"``; with ``mesh``, also one key per mesh axis and per pair of axes (``"data"``,
  ``"tensor"``, ``"data+tensor"``) and ``"other"`` (a part of an axis: e.g. devices holding
  different key/value heads). An instruction inside a loop body counts once.
  """
  instructions = all_reduce_instructions(hlo)
  census = {"total": len(instructions)}
  if mesh is None:
    return census
  names = tuple(mesh.axis_names)
  kinds = {name: mesh_axis_groups(mesh, (name,)) for name in names}
  kinds["+".join(names)] = mesh_axis_groups(mesh, names)
  census.update({k: 0 for k in kinds}, other=0)
  for groups, _ in instructions:
    match = [k for k, want in kinds.items() if groups == want]
    census[match[0] if match else "other"] += 1
  return census
