"""Mesh construction, simulated CPU devices, and placing host data on a mesh.

Every layout in meshdistill is a `jax.sharding.Mesh` with (at least) two named axes:

* ``data``   -- the batch is split across it; gradients are summed across it.
* ``tensor`` -- weights of teacher and student are split across it (attention heads,
  MLP hidden units, vocabulary), so a teacher too large for one device still fits.

A mesh may name more axes between them (``EXTRA_AXES``: ``expert``, ``context``); the rules tables
(`meshdistill.parallel.rules`) say which logical dimensions each axis splits (``expert``: the experts of
mixture-of-experts weights), and whatever no rule splits over an axis holds replicas on it. ``context`` splits no
weight: the step splits each row's tokens over it (context parallelism, `context_ways`;
`meshdistill.parallel.backends.ShardMapLayout`). All axes use ``AxisType.Auto``: inside the train step ``data`` is made manual by
`jax.shard_map` and ``tensor`` stays compiler-managed (see `meshdistill.train.step`).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshdistill.parallel.distributed.platforms import backend_started

DATA = "data"
TENSOR = "tensor"
AXES = (DATA, TENSOR)  # the axes every mesh has (size 1 where unused)
EXPERT = "expert"  # mixture-of-experts weights split over it (rule experts -> expert in `meshdistill.parallel.rules`)
# The sequence split over it: each device holds a slice of every row's tokens, attention gathers keys and values over it
# (context parallelism: `context_ways`, `meshdistill.models._context.ContextShard`).
CONTEXT = "context"
EXTRA_AXES = (EXPERT, CONTEXT)  # axes a mesh may add between `data` and `tensor` (`make_mesh(axes=...)`, `mesh.axes`)

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def target_platform() -> str:
  """The platform the program being traced (or the model being built) is compiled for.

  Where there is a mesh in context, it says: the abstract mesh of a layout's ``shard_map`` (or of ``pmap``,
  built on one, or of ``jax.set_mesh`` around initialisation and evaluation) carries its devices' platform, which
  is ``tpu`` when the planner compiles for a TPU topology's abstract devices from a CPU host. Without one (the
  single-device layout, a plain ``jit``) the program runs on the default device, so the default backend is the
  target. `jax.default_backend()` alone would be wrong while planning: it is ``cpu`` there.
  """
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return jax.default_backend() if device is None else device.platform


def platform_of(mesh: Mesh | None) -> str:
  """The platform of ``mesh``'s devices (the default backend's without a mesh)."""
  return jax.default_backend() if mesh is None else mesh.devices.flat[0].platform


def compiler_tensor_size() -> int:
  """The size of the mesh's ``tensor`` axis in context where the compiler splits over it (1 where it is manual,
  absent, or there is no mesh): how many ways a tensor-split weight is cut in the program being traced."""
  mesh = jax.sharding.get_abstract_mesh()
  if TENSOR not in getattr(mesh, "axis_names", ()) or TENSOR in set(getattr(mesh, "manual_axes", ())):
    return 1
  return int(mesh.shape[TENSOR])


def context_ways() -> int:
  """Into how many slices the tokens of a row are split in the program being traced: the size of the mesh's
  ``context`` axis where it is manual (inside the step's ``shard_map``, which hands each device its slice), else 1
  (no mesh, no such axis, or the axis compiler-managed: evaluation and generation see whole rows)."""
  mesh = jax.sharding.get_abstract_mesh()
  if CONTEXT not in getattr(mesh, "axis_names", ()) or CONTEXT not in set(getattr(mesh, "manual_axes", ())):
    return 1
  return int(mesh.shape[CONTEXT])


def simulate_cpu_devices(n: int) -> None:
  """Makes the CPU platform expose ``n`` devices (for meshes on a machine without accelerators).

  Must run before JAX starts a backend (before any array is created or
  ``jax.devices()`` is called). Calling it again with the device count JAX already
  has is a no-op. Uses the same mechanism as ``chex.set_n_cpu_devices``.

  Raises:
    ValueError: ``n`` is not a positive integer.
    RuntimeError: JAX already started with a different number of CPU devices.
  """
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"simulate_cpu_devices: n={n!r} must be a positive integer")
  if backend_started():
    have = jax.local_device_count()
    if have == n or jax.default_backend() != "cpu":
      return
    raise RuntimeError(
        f"simulate_cpu_devices({n}) was called after JAX started with {have} CPU device(s). "
        "Call it before any JAX computation (first thing in the program), or start Python "
        f"with XLA_FLAGS=--xla_force_host_platform_device_count={n}."
    )
  flags = _DEVICE_COUNT_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).split()
  os.environ["XLA_FLAGS"] = " ".join([f"--xla_force_host_platform_device_count={n}", *flags])


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def make_mesh(data: int = 2, tensor: int = 4, devices: Any = None, axes: dict[str, int] | None = None) -> Mesh:
  """Builds a ``(data, *axes, tensor)`` mesh over ``devices`` (default: all devices).

  Args:
    data: size of the ``data`` axis (batch split).
    tensor: size of the ``tensor`` axis (weights split).
    devices: optional sequence of devices; must hold exactly the product of all axis sizes.
    axes: more named axes and their sizes, between ``data`` and ``tensor`` (names from ``EXTRA_AXES``, e.g.
      ``{"expert": 4}``: experts split over 4 devices). What no rule splits over an axis
      (`meshdistill.parallel.rules`) holds replicas on it; an axis of size 1 costs nothing.

  Raises:
    ValueError: when a size is not positive, an axis name is unknown, or the product of the sizes differs from
      the number of devices; the message lists layouts that would work.
  """
  extra = dict(axes or {})
  check_axes(extra)
  for name, v in ((DATA, data), (TENSOR, tensor)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"mesh {name}={v!r} must be a positive integer")
  devices = list(jax.devices() if devices is None else devices)
  n, need = len(devices), data * tensor * math.prod(extra.values())
  if need != n:
    sizes = " x ".join(f"{k}={v}" for k, v in ((DATA, data), *extra.items(), (TENSOR, tensor)))
    options = ", ".join(f"{d}x{n // d}" for d in _divisors(n))
    raise ValueError(
        f"mesh {sizes} needs {need} devices but {n} are available; choose sizes whose product is {n} "
        f"(data x tensor in {{{options}}} with the other axes 1)"
        + (f", or call meshdistill.simulate_cpu_devices({need}) before JAX starts" if jax.default_backend() == "cpu"
           else "")
    )
  names = (DATA, *extra, TENSOR)
  grid = np.asarray(devices).reshape(data, *extra.values(), tensor)
  return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def check_axes(axes: dict, setting: str = "mesh.axes") -> None:
  """Raises a clear error for extra mesh axes (``{name: size}``) with an unknown name or a size that is not a
  positive integer."""
  if not isinstance(axes, dict):
    raise ValueError(f"{setting}={axes!r}; give a mapping of axis name to size, e.g. {{expert: 2}}")
  for name, v in axes.items():
    if name in AXES:
      raise ValueError(f"{setting} names {name!r}; set its size with mesh.{name} (the axes here are the others: "
                       f"{list(EXTRA_AXES)})")
    if name not in EXTRA_AXES:
      raise ValueError(f"{setting}: unknown mesh axis {name!r}; choose from {list(EXTRA_AXES)} (data and tensor are "
                       "mesh.data and mesh.tensor)")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{setting}.{name}={v!r} must be a positive integer")


def mesh_shape(spec: Any, setting: str = "mesh") -> dict[str, int]:
  """``{axis: size}`` in mesh order (``data``, the `EXTRA_AXES`, ``tensor``; ``data`` / ``tensor`` 1 when left out,
  an extra axis only when given) of a mesh written as ``"DATAxTENSOR"`` (``"2x4"``), ``"axis=size,..."``
  (``"data=2,expert=2,tensor=2"``), a ``(data, tensor)`` pair or a mapping; a clear error naming ``setting``
  otherwise."""
  example = "e.g. 2x4 (data x tensor) or data=2,expert=2,tensor=2"
  given = spec
  if isinstance(spec, str):
    text = spec.strip().lower()
    if "=" in text:
      try:
        spec = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(",") if part.strip())}
      except ValueError:
        raise ValueError(f"{setting}={given!r}; give axis=size pairs joined by commas, {example}") from None
    else:
      parts = text.split("x")
      if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{setting}={given!r}; {example}")
      spec = (int(parts[0]), int(parts[1]))
  if isinstance(spec, (tuple, list)):
    if len(spec) != 2:
      raise ValueError(f"{setting}={given!r}; a pair is (data, tensor); name other axes: {example}")
    spec = {DATA: spec[0], TENSOR: spec[1]}
  if not isinstance(spec, dict):
    raise ValueError(f"{setting}={given!r}; {example}")
  unknown = [k for k in spec if k not in (*AXES, *EXTRA_AXES)]
  if unknown:
    raise ValueError(f"{setting}: unknown mesh axis {unknown[0]!r}; the axes are {[DATA, *EXTRA_AXES, TENSOR]}")
  for name, v in spec.items():
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{setting}.{name}={v!r} must be a positive integer")
  return {DATA: spec.get(DATA, 1), **{a: spec[a] for a in EXTRA_AXES if a in spec}, TENSOR: spec.get(TENSOR, 1)}


def shape_label(shape: dict[str, int]) -> str:
  """How messages and tables write a mesh `mesh_shape`: ``2x4`` (data x tensor) when it has no other axis of size
  above 1, else every axis (``data=2,expert=2,tensor=2``)."""
  if all(v == 1 for k, v in shape.items() if k not in AXES):
    return f"{shape.get(DATA, 1)}x{shape.get(TENSOR, 1)}"
  return ",".join(f"{k}={v}" for k, v in shape.items())


def mesh_of(shape: dict[str, int], devices: Any = None) -> Mesh:
  """`make_mesh` of a `mesh_shape` mapping."""
  extra = {k: v for k, v in shape.items() if k not in AXES}
  return make_mesh(shape.get(DATA, 1), shape.get(TENSOR, 1), devices, axes=extra or None)


def check_batch(batch_size: int, mesh: Mesh | None, what: str = "batch") -> None:
  """Raises a clear error when ``batch_size`` cannot be split over the ``data`` axis."""
  if mesh is None:
    return
  n = mesh.shape[DATA]
  if batch_size % n:
    ok = [d for d in _divisors(batch_size) if d <= mesh.size]
    raise ValueError(
        f"{what} size {batch_size} is not divisible by mesh data={n}; use a {what} size "
        f"that is a multiple of {n}, or a mesh with data in {ok}"
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of a batch array: leading axis over ``data``, replicated over ``tensor``."""
  return NamedSharding(mesh, P(DATA))


def host_to_global(batch: Any, mesh: Mesh) -> Any:
  """Places a host (numpy) batch pytree on ``mesh``, leading axis split over ``data``.

  Each process passes the rows it holds for its addressable devices; in a
  single-process run that is the whole global batch.
  """
  sharding = batch_sharding(mesh)
  if jax.process_count() == 1:
    return jax.device_put(batch, sharding)

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(sharding, x, (global_batch_size(x.shape[0], mesh), *x.shape[1:]))

  return jax.tree.map(one, batch)


def compiler_axes():
  """The mesh of the program being traced and its compiler-managed (not manual) axes, size 1 too: the TPU compiler
  refuses a Mosaic kernel under any auto-partitioned axis, so the package's kernels run in a ``shard_map`` manual
  over all of them."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()))
  return mesh, {a for a in mesh.axis_names if a not in manual}


def auto_tensor_size() -> int:
  """The number of devices of ``tensor`` in the mesh of the program being traced, where the compiler manages
  that axis (auto): arrays may then be split over it. 1 with no mesh in scope, no ``tensor`` axis, or ``tensor``
  manual (inside a ``shard_map`` over it, where each device holds its own block whole)."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.shape[TENSOR] if not mesh.empty and TENSOR in mesh.auto_axes else 1


def global_batch_size(rows: int, mesh: Mesh) -> int:
  """The global batch size of ``rows`` rows held by this process (`host_to_global`): the rows held here cover this
  process's ``data`` indices (several processes may share them); one process holds the whole batch."""
  if jax.process_count() == 1:
    return rows
  me = jax.process_index()
  rows_here = {index[0] for index, d in np.ndenumerate(mesh.devices) if d.process_index == me}
  return rows * (mesh.shape[DATA] // len(rows_here))


def param_shardings(specs: Any, mesh: Mesh) -> Any:
  """Turns a pytree of `PartitionSpec` (from ``nnx.get_partition_spec``) into shardings; a mesh axis ``mesh`` does
  not have (a rule for an axis of another mesh) leaves its dimension unsplit."""
  def fit(s):
    return P(*(a if a is None or a in mesh.shape else None for a in s)) if isinstance(s, P) else P()

  return jax.tree.map(
      lambda s: NamedSharding(mesh, fit(s)),
      specs,
      is_leaf=lambda x: isinstance(x, P) or x is None,
  )
