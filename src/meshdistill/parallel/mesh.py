"""Mesh construction, simulated CPU devices, and placing host data on a mesh.

Every layout in meshdistill is a `jax.sharding.Mesh` with two named axes:

* ``data``   -- the batch is split across it; gradients are summed across it.
* ``tensor`` -- weights of teacher and student are split across it (attention heads,
  MLP hidden units, vocabulary), so a teacher too large for one device still fits.

Both axes use ``AxisType.Auto``: inside the train step ``data`` is made manual by
`jax.shard_map` and ``tensor`` stays compiler-managed (see `meshdistill.train.step`).
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshdistill.distributed.platforms import backend_started

DATA = "data"
TENSOR = "tensor"
AXES = (DATA, TENSOR)

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


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


def make_mesh(data: int = 2, tensor: int = 4, devices: Any = None) -> Mesh:
  """Builds a ``(data, tensor)`` mesh over ``devices`` (default: all devices).

  Args:
    data: size of the ``data`` axis (batch split).
    tensor: size of the ``tensor`` axis (weights split).
    devices: optional sequence of devices; must hold exactly ``data * tensor``.

  Raises:
    ValueError: when the sizes are not positive or ``data * tensor`` differs from
      the number of devices; the message lists layouts that would work.
  """
  for name, v in ((DATA, data), (TENSOR, tensor)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"mesh {name}={v!r} must be a positive integer")
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if data * tensor != n:
    options = ", ".join(f"{d}x{n // d}" for d in _divisors(n))
    raise ValueError(
        f"mesh data={data} x tensor={tensor} needs {data * tensor} devices but {n} are "
        f"available; choose data x tensor in {{{options}}}"
        + (
            f", or call meshdistill.simulate_cpu_devices({data * tensor}) before JAX starts"
            if jax.default_backend() == "cpu"
            else ""
        )
    )
  grid = np.asarray(devices).reshape(data, tensor)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


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
  """Turns a pytree of `PartitionSpec` (from ``nnx.get_partition_spec``) into shardings."""
  return jax.tree.map(
      lambda s: NamedSharding(mesh, s if isinstance(s, P) else P()),
      specs,
      is_leaf=lambda x: isinstance(x, P) or x is None,
  )
