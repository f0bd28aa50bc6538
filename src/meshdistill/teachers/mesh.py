"""A live teacher on its own devices: a teacher mesh beside the student's, one batch ahead.

The devices are split in two (`split_meshes`): the teacher's weights live only on the teacher
mesh (its own ``data`` x ``tensor``), the student's state only on the student mesh. For every
training batch the teacher computes its top-k (`meshdistill.teachers.cache.TeacherTopK`, the same
program a live top-k step runs) and the result is moved to the student mesh with
`jax.device_put` onto the student's batch sharding; the student step then reads it as it reads
an offline cache (`meshdistill.losses.TopK` in the batch, see `meshdistill.train.step`).

Overlap comes from JAX's asynchronous dispatch: `TeacherOnMesh.batches` issues the teacher's work
for batch ``s + 1`` before it hands out batch ``s``, so while the student mesh runs step ``s`` the
teacher mesh is already busy with ``s + 1`` (disjoint devices, no wait between them). The
student's step is unchanged; ``dispatch_log`` records when each teacher call was issued.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshdistill.parallel.mesh import DATA, mesh_of, mesh_shape, shape_label
from meshdistill.core.batch import TOPK_KEYS
from meshdistill.data import WrappedData
from meshdistill.teachers.ahead import AheadIterator
from meshdistill.teachers.cache import TeacherTopK, TopKTeacher


def split_meshes(teacher: Any, student: Any, devices=None) -> tuple[Mesh, Mesh]:
  """Two meshes on disjoint devices: the first devices for the teacher's mesh, the next for the student's. Each
  mesh is a ``(data, tensor)`` pair or an ``{axis: size}`` mapping (`meshdistill.parallel.mesh.mesh_shape`: e.g.
  ``{data: 1, expert: 2, tensor: 2}``).

  Raises:
    ValueError: naming ``teacher.devices`` when the split leaves the student too few devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  t, s = mesh_shape(teacher, "teacher.devices"), mesh_shape(student, "mesh")
  n_teacher, n_student = math.prod(t.values()), math.prod(s.values())
  if n_teacher + n_student > len(devices):
    left = len(devices) - n_teacher
    raise ValueError(
        f"teacher.devices={shape_label(t)} takes {n_teacher} of the {len(devices)} devices and leaves the student "
        f"{max(left, 0)}, "
        f"but mesh {shape_label(s)} ({' x '.join(s)}) needs {n_student}; give the teacher at most "
        f"{len(devices) - n_student} devices, or the student a mesh of at most {max(left, 0)}"
    )
  return mesh_of(t, devices[:n_teacher]), mesh_of(s, devices[n_teacher:n_teacher + n_student])


class TeacherOnMesh:
  """A teacher `Decoder` placed on ``teacher_mesh`` whose top-k feeds a student on ``student_mesh``.

  Args:
    teacher: the teacher (its weights are put on ``teacher_mesh`` only).
    k, temperature, vocab: as `TeacherTopK` (the student's `LogitKD` must use the same ``top_k`` and
      ``temperature``; `Distiller` checks it through `spec`).
    teacher_mesh, student_mesh: disjoint meshes (`split_meshes`).
  """

  def __init__(self, teacher, *, k: int, temperature: float, vocab: int | None = None, teacher_mesh: Mesh,
               student_mesh: Mesh):
    shared = set(teacher_mesh.devices.flat) & set(student_mesh.devices.flat)
    if shared:
      raise ValueError(f"teacher and student meshes share {len(shared)} devices; split them with split_meshes")
    self.program = TeacherTopK(teacher, k=k, temperature=temperature, vocab=vocab, mesh=teacher_mesh)
    self.student_sharding = NamedSharding(student_mesh, P(DATA))
    self.dispatch_log: list[tuple[str, int, float]] = []  # (event, batch index, time.perf_counter())

  def spec(self) -> TopKTeacher:
    """The teacher as the student's `Distiller` sees it (no weights)."""
    return self.program.spec("a teacher on its own devices")

  def dispatch(self, batch: dict, index: int = -1) -> dict[str, jax.Array]:
    """Issues the teacher's top-k of ``batch`` and its move to the student mesh; returns at once (async)."""
    topk = self.program(np.asarray(batch["inputs"]))
    moved = jax.device_put(tuple(topk), self.student_sharding)
    self.dispatch_log.append(("teacher", index, time.perf_counter()))
    return dict(zip(TOPK_KEYS, moved))

  def batches(self, host_batches: Iterable[dict]) -> Iterator[dict]:
    """``host_batches`` with the teacher's top-k added, the teacher working one batch ahead."""
    it = iter(host_batches)
    try:
      current = next(it)
    except StopIteration:
      return
    pending = self.dispatch(current, 0)
    index = 0
    for following in it:
      ahead = self.dispatch(following, index + 1)  # batch s+1's teacher work is issued before s is handed out
      yield {**current, **pending}
      current, pending, index = following, ahead, index + 1
    yield {**current, **pending}


def addressable_bytes(tree, devices) -> dict:
  """Bytes of ``tree``'s arrays held on each of ``devices`` (``{device: bytes}``)."""
  out = {d: 0 for d in devices}
  for leaf in jax.tree.leaves(tree):
    for shard in getattr(leaf, "addressable_shards", ()):
      if shard.device in out:
        out[shard.device] += shard.data.nbytes
  return out


class TeacherMeshData(WrappedData):
  """A `meshdistill.data.DataBundle` whose training batches carry the top-k of a `TeacherOnMesh`, the
  teacher working one batch ahead; the iterator's state is the position of the next batch it hands out,
  so checkpoints and resume are those of the plain data. Validation batches, tokenizers and stats are the bundle's
  (`meshdistill.data.WrappedData`)."""

  def __init__(self, bundle, on_mesh: TeacherOnMesh):
    super().__init__(bundle)
    self.on_mesh = on_mesh

  def train_iterator(self, state: dict | None = None, **kw) -> _AheadIterator:
    return _AheadIterator(self.bundle.train_iterator(state, **kw), self.on_mesh)


class _AheadIterator(AheadIterator):
  def __init__(self, it, on_mesh: TeacherOnMesh):
    super().__init__(it)
    self._on = on_mesh

  def dispatch(self, batch: dict, index: int) -> dict:
    return self._on.dispatch(batch, index)

  def collect(self, batch: dict, work: dict, index: int) -> dict:
    return {**batch, **work}
