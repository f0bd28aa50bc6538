"""Logical axis names and THE rules table: which mesh axis each named dimension of a weight or activation is split
over, per layout option.

Model code names the dimensions of its weights with logical names only (`annotate`, ``LOGICAL``): ``vocab``,
``embed`` (the model dimension D), ``heads`` (query heads x head_dim), ``kv_heads`` (``kv_replicated`` where a
model keeps its key/value heads whole: fewer of them than ``tensor``), ``head_dim`` (a per-head vector, the q/k
norm scales), ``mlp`` (the MLP hidden units), ``layers`` (the stacked layer axis of scanned blocks)
and ``experts`` (the stacked experts of mixture-of-experts weights); activations name ``batch`` too. A `Rules` table maps
each name to a mesh axis or None (not split):

* `TENSOR_PARALLEL` -- Megatron-style over ``tensor``: vocabulary, heads, key/value heads, MLP units; experts over
  ``expert`` (expert parallelism on a mesh with that axis, ``mesh.axes: {expert: n}``; `meshdistill.models.moe`);
* `FSDP` -- the same plus the model dimension (and a per-head vector) over ``data``: with ``mesh.fsdp`` every
  projection, embedding and norm scale is split over ``data`` on D (`meshdistill.parallel.fsdp` gathers them);
* `REPLICATED` -- nothing split (one device; the pmap layout keeps whole replicas).

A layout declares its table (`meshdistill.parallel.layout.Layout.rules`) and `apply` writes it into a model's
variables once (`Layout.fit_model`); from then on placement, optimizer moments, checkpoint restore targets, the
step's ``shard_map`` specs (`meshdistill.parallel.fsdp.data_specs`), the per-layer gathers and the planner read
the resolved specs. Expert parallelism is one rule, ``("experts", "expert")``, and a mesh with an ``expert`` axis
(`meshdistill.parallel.mesh.make_mesh`); a mesh without one drops the rule.

Mechanism: flax's own. Weights are annotated with ``nnx.with_partitioning(init, names)`` (logical names in the
variable's ``out_sharding``), and the rules travel in each variable's ``sharding_rules`` metadata, which
``nnx.get_partition_spec`` (``nnx.spmd.get_var_pspec``) composes with the names to give mesh-axis specs. Every
existing reader of specs therefore needs no change. flax's other carrier, the ``flax.core.spmd.logical_axis_rules``
context manager, is a thread-local global: settings read from one are invisible at the call site and differ between
threads, so it is not used. flax renames names only; what it does not do is done here, per variable, when a
layout applies its table to a mesh: a name keeps its axis only where that axis exists in the mesh with more than
one device (a size-1 axis splits nothing, and then costs nothing: no gather, no nested ``shard_map``), divides the
dimension, and is not used by an earlier dimension of the same weight (an axis can split one dimension only).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshdistill.parallel.mesh import DATA, EXPERT, TENSOR

# The logical names model code may use (weights), plus ``batch`` (activations).
LOGICAL = ("vocab", "embed", "heads", "kv_heads", "kv_replicated", "head_dim", "mlp", "layers", "experts")
ACTIVATION = ("batch",)


class Rules(tuple):
  """A rules table: ``((logical name, mesh axis or None), ...)``, one pair per name of ``LOGICAL`` and
  ``ACTIVATION``; the flax ``sharding_rules`` form as it stands."""

  def __new__(cls, name: str, pairs: dict[str, str | None]):
    missing = set(LOGICAL + ACTIVATION) - set(pairs)
    unknown = set(pairs) - set(LOGICAL + ACTIVATION)
    if missing or unknown:
      raise ValueError(f"rules {name!r}: every logical name needs a rule; missing {sorted(missing)}, unknown "
                       f"{sorted(unknown)} (names: {LOGICAL + ACTIVATION})")
    out = super().__new__(cls, tuple(pairs.items()))
    out.name = name
    return out

  def __getnewargs__(self):
    return (self.name, dict(self))

  def axis(self, logical: str) -> str | None:
    """The mesh axis ``logical`` is split over under this table (None: not split)."""
    return dict(self)[logical]

  def axes(self) -> tuple[str, ...]:
    """The mesh axes this table splits anything over, in first-use order."""
    return tuple(dict.fromkeys(a for _, a in self if a is not None))

  def replace(self, name: str, **changes: str | None) -> Rules:
    """A new table named ``name`` with the rules of ``changes`` (logical name = mesh axis) replaced."""
    return Rules(name, {**dict(self), **changes})


TENSOR_PARALLEL = Rules("tensor", {
    "vocab": TENSOR, "embed": None, "heads": TENSOR, "kv_heads": TENSOR, "kv_replicated": None, "head_dim": None,
    "mlp": TENSOR,
    "layers": None,
    "experts": EXPERT,  # expert parallelism: a mesh with an `expert` axis (`mesh.axes: {expert: n}`) splits experts
    "batch": DATA,
})
# Every dimension `tensor` leaves whole but `layers` over `data`; a weight with two such (a projection's D and its
# kept-whole key/value heads) splits the first, D.
FSDP = TENSOR_PARALLEL.replace("fsdp", embed=DATA, head_dim=DATA, kv_replicated=DATA)
REPLICATED = Rules("replicated", dict.fromkeys(LOGICAL + ACTIVATION))
DEFAULT = TENSOR_PARALLEL  # what a model carries before a layout applies its own


def annotate(init, *names: str | None):
  """``init`` whose variable's dimensions are named ``names`` (logical names, or None) and carry the default
  rules (`TENSOR_PARALLEL`) until a layout applies its own."""
  unknown = [n for n in names if n is not None and n not in LOGICAL]
  if unknown:
    raise ValueError(f"logical axis names {unknown}: not in {LOGICAL}; add a name there and a rule per table")
  return nnx.with_partitioning(init, names, sharding_rules=DEFAULT)


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _logical(v: nnx.Variable) -> tuple:
  return tuple(v.get_metadata().get("out_sharding") or ())


def _fitted(v: nnx.Variable, rules: Rules, mesh: Mesh) -> tuple:
  """``rules`` for variable ``v`` on ``mesh``: a name's axis kept only where the mesh has it with more than one
  device, it divides the dimension and no earlier dimension of ``v`` uses it."""
  names, shape = _logical(v), v.shape
  names = names[len(names) - len(shape):] if len(names) > len(shape) else names  # a scanned slice: [L] dropped
  table, used = dict(rules), set()
  for name, n in zip(names, shape):
    axis = table.get(name) if name is not None else None
    if axis is None:
      continue
    if axis not in mesh.shape or mesh.shape[axis] == 1 or n % mesh.shape[axis] or axis in used:
      table[name] = None
    else:
      used.add(axis)
  # A name repeated with different fates (an axis used once) cannot be expressed by renaming: drop to None.
  return tuple(table.items())


def apply(state: Any, rules: Rules, mesh: Mesh | None) -> Any:
  """``state`` (an ``nnx.State`` or a model) with ``rules`` fitted to ``mesh`` in each annotated variable's
  ``sharding_rules``; variables named in mesh axes (a tunix model's) or not annotated are kept. With no mesh
  nothing is split whatever the table says: the state comes back unchanged."""
  if mesh is None:
    return state
  if not isinstance(state, nnx.State):
    graphdef, st = nnx.split(state)
    new = apply(st, rules, mesh)
    return state if jax.tree.structure(new) == jax.tree.structure(st) else nnx.merge(graphdef, new)

  def one(v):
    if not _is_var(v) or "sharding_rules" not in v.get_metadata() or not v.shape:
      return v
    fitted = _fitted(v, rules, mesh)
    return v if fitted == tuple(v.get_metadata()["sharding_rules"]) else v.replace(sharding_rules=fitted)

  return jax.tree.map(one, state, is_leaf=_is_var)


def mesh_names(v: nnx.Variable) -> tuple:
  """The mesh axis of each dimension of variable ``v`` (None: not split), its rules applied. Inside a scan over
  stacked blocks a variable holds one layer's slice but keeps the stacked ``[L, ...]`` names: the leading ones are
  dropped."""
  spec = tuple(nnx.spmd.get_var_pspec(v) or ())
  rank = len(v.shape)
  return spec[len(spec) - rank:] if len(spec) > rank else spec + (None,) * (rank - len(spec))


def spec(names: tuple[str | None, ...], rules: Rules = DEFAULT, mesh: Mesh | None = None) -> P:
  """The `PartitionSpec` of an array (an activation) whose dimensions are named ``names``; with ``mesh``, axes it
  lacks are left out."""
  table = dict(rules)
  axes = [table[n] if n is not None else None for n in names]
  return P(*(a if mesh is None or a in mesh.shape else None for a in axes))


def split_ways(mesh: Mesh | None, logical: str, rules: Rules = DEFAULT) -> int:
  """Into how many parts ``rules`` split dimension ``logical`` on ``mesh`` (1 with no mesh, or not split)."""
  axis = rules.axis(logical)
  return 1 if mesh is None or axis is None or axis not in mesh.shape else mesh.shape[axis]


def fitted_shardings(state: Any, mesh: Mesh) -> Any:
  """Shardings from the partition metadata of ``state``, dropping a mesh axis on dimensions it does not
  divide (per-channel quantization scales have a size-1 dimension where their weight is split)."""
  specs = nnx.get_partition_spec(state)

  def fit(spec, x):
    spec = spec if isinstance(spec, P) else P()
    dims = tuple(a if a is None or jnp.shape(x)[i] % mesh.shape[a] == 0 else None for i, a in enumerate(spec))
    return NamedSharding(mesh, P(*dims))

  return jax.tree.map(fit, specs, state, is_leaf=lambda x: isinstance(x, P) or x is None)
