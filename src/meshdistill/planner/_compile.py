"""Lowering and compiling the distillation step for a target without allocating any array.

`abstract_distiller` is the one adapter between the planner and the trainer's step: a
`meshdistill.Distiller` whose teacher, student and train state are `jax.ShapeDtypeStruct`s carrying
their shardings. Everything else -- the per-device step, its ``shard_map`` wrapper, the state
shardings (optimizer moments follow their parameters), output pinning and donation -- is the
Distiller's own code, so the compiled program is the one ``meshdistill distill`` runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshdistill.train.distiller import Distiller
from meshdistill.parallel.backends import ShardMapLayout
from meshdistill.parallel.collectives import replica_groups
from meshdistill.train.memory import MemoryReport
from meshdistill.train.cost import HLO_SHAPE, shape_bytes
from meshdistill.parallel.mesh import TENSOR, batch_sharding
from meshdistill.models import abstract_params
from meshdistill.models.decoder import ModelConfig
from meshdistill.models.lora import abstract_lora
from meshdistill.models.compress.qat import abstract_quantize_aware
from meshdistill.models.quantize import abstract_quantized


@functools.lru_cache(maxsize=8)
def _abstract_model(cfg: ModelConfig, lora=None, quantize: str | None = None, quantize_aware=None):
  """An abstract decoder of ``cfg``; with ``lora`` (a `LoraConfig`) holding adapters (and its quantized base), with
  ``quantize`` its projections stored quantized (a quantized teacher, `meshdistill.models.quantize`), with
  ``quantize_aware`` (a `QuantizeAware`) training through fake quantization (`meshdistill.models.compress.qat`)."""
  if lora is not None and lora.enabled:
    graphdef, state, _ = abstract_lora(cfg, lora)
  elif quantize_aware is not None and quantize_aware.enabled:
    graphdef, state = abstract_quantize_aware(cfg, quantize_aware)
  elif quantize is not None:
    graphdef, state = abstract_quantized(cfg, quantize)
  else:
    graphdef, state, _ = abstract_params(cfg)
  return nnx.merge(graphdef, state)


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class _AbstractLayout(ShardMapLayout):
  """The shard_map layout on abstract arrays: placement gives shapes with shardings, never buffers."""

  def place_params(self, params):
    return _abstract(params, self._device_shardings(params)[0])

  def fresh_state(self, optimizer, params, trainable=None):
    fresh, _, state_shardings = self.state_plan(optimizer, params, trainable)
    return _abstract(jax.eval_shape(fresh, params), state_shardings)


class _AbstractDistiller(Distiller):
  """A `Distiller` on abstract arrays: weights and state are shapes with shardings, never allocated."""

  def init_state(self, student=None):
    """The abstract train state of `Distiller.init_state` (same shardings, nothing allocated)."""
    extra = jax.eval_shape(
        lambda: self.strategy.init_params(self.student_cfg, self.teacher_cfg, jax.random.key(self.seed))
    )
    return self.layout.fresh_state(self.optimizer, {"student": self._student_init, "strategy": extra}, self.trainable)


# `plan --fast-compile`: XLA's least effort on the program's execution time (an `ExecutableBuildOptions` field; jax
# passes it from `compiler_options`). On libtpu 0.0.42.1 it cut the TPU compile of the scanned Llama-3.1-8B ->
# Llama-3.2-1B step on v5e:4x4 from 89.5 to 29.7 CPU seconds, but the program it makes is another one: per-chip memory
# moved by -13% to +3% and XLA's bytes accessed by up to -41% on the pairs measured (FLOPs and collectives within
# 0.5%): benchmarks/results/plan_speed.md. The default compile is the program `distill` runs.
FAST_COMPILE = {"exec_time_optimization_effort": -1.0}


def abstract_distiller(teacher: ModelConfig | None, student: ModelConfig, strategy, optimizer, mesh: Mesh,
                       compiler_options: dict | None = None, lora=None, teacher_quantize: str | None = None,
                       fsdp: bool = False, student_split: str = "tensor", loss_scale: float | None = None,
                       quantize_aware=None) -> Distiller:
  """The Distiller ``meshdistill distill`` would build for these models on ``mesh``, on abstract arrays.

  ``lora``: the student's `meshdistill.models.lora.LoraConfig` (``student.lora``: adapters, only they train);
  ``teacher_quantize``: ``teacher.quantize`` (the teacher's projections stored int8 / int4 / nf4);
  ``fsdp``: weights and optimizer moments split over ``data`` too (``mesh.fsdp``); ``student_split``:
  ``mesh.student_split`` (``batch``: the student replicated, its weights and moments whole on every device).
  ``loss_scale``: ``safeguards.loss_scale`` (the step's static loss scaling). ``quantize_aware``:
  ``student.quantize_aware`` (a `meshdistill.models.compress.QuantizeAware`: the student's fake-quantized forward).
  ``teacher=None``: the student trained alone (its ``strategy`` a hard-label one, e.g. ``NextTokenCE``).
  """
  tensor = mesh.shape[TENSOR]
  qat = quantize_aware is not None and quantize_aware.enabled
  if (lora is not None and lora.enabled) or qat:  # adapters / fake quantization wrap a student fitted to the mesh
    student = student.for_tensor(tensor)
  if teacher_quantize is not None and teacher is not None:
    teacher = teacher.for_tensor(tensor)
  d = _AbstractDistiller(_abstract_model(student, lora, None, quantize_aware),
                         None if teacher is None else _abstract_model(teacher, None, teacher_quantize),
                         strategy=strategy, optimizer=optimizer, mesh=mesh,
                         backend=_AbstractLayout(mesh, fsdp=fsdp, student_split=student_split), fsdp=fsdp,
                         student_split=student_split, loss_scale=loss_scale)
  return d.with_compiler_options(compiler_options) if compiler_options else d


def abstract_batch(mesh: Mesh, batch: int, seq: int) -> dict:
  """``{inputs, targets, mask}`` [batch, seq] as the data loader makes them (int32, int32, float32), split over data."""
  sharding = batch_sharding(mesh)
  return {
      "inputs": jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=sharding),
      "targets": jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=sharding),
      "mask": jax.ShapeDtypeStruct((batch, seq), jnp.float32, sharding=sharding),
  }


_4BIT = (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4))


def shard_bytes(tree, packed_4bit: bool = False) -> int:
  """Bytes one device holds of an abstract tree (each leaf's shard shape times its item size); with
  ``packed_4bit`` (TPU) 4-bit values (int4 / nf4 weights) take half a byte, otherwise one (CPU)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    n = math.prod(shape)
    total += (n + 1) // 2 if packed_4bit and jnp.dtype(x.dtype) in _4BIT else n * jnp.dtype(x.dtype).itemsize
  return total


def leaf_count(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


@dataclasses.dataclass
class CompiledStep:
  """What the compiler says about one step (per device) and how long it took to compile.

  A TPU compilation whose buffers exceed the chip's HBM fails; then ``memory`` is None, ``oom`` holds
  the compiler's message and ``oom_bytes`` the (temp, available) sizes it names, when it names them.
  """

  memory: MemoryReport | None
  flops: float | None
  bytes_accessed: float | None
  hlo: str
  compile_seconds: float
  lower_seconds: float
  parts: dict[str, int]  # per-device bytes of the step's inputs, by kind
  params: dict[str, int]  # parameter counts (teacher, student)
  oom: str | None = None
  oom_bytes: tuple[int | None, int | None] = (None, None)


def _compile(lowered, mesh: Mesh):
  """``lowered.compile()``; for devices this process has no client for (a TPU topology compiled for from this host)
  nothing is written to JAX's persistent compilation cache: such an executable can be written but never read back
  without that client (JAX warns "PjRtCompiler must be constructed with a Client" and compiles again), so an entry
  would only take disk space and warn on every later plan of the same program. JAX decides once per process whether
  the cache is used; what it writes is decided per program by the minimum compile time, raised here for the call."""
  local = {(d.platform, d.id) for d in jax.local_devices()}
  if all((d.platform, d.id) in local for d in mesh.devices.flat):
    return lowered.compile()
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
  try:
    return lowered.compile()
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def compile_step(distiller: Distiller, batch: int, seq: int, report=None) -> CompiledStep:
  """Lowers and compiles ``distiller``'s step for a [batch, seq] batch; nothing runs, nothing is allocated.

  ``report(message)``, when given, hears each phase as it starts and ends (lowering, compiling, with seconds).
  """
  report = report or (lambda message: None)
  state = distiller.init_state()
  inputs = abstract_batch(distiller.mesh, batch, seq)
  distiller.check_batch(inputs)
  t0 = time.perf_counter()
  report("lowering the step")
  lowered = distiller.compiled_step(state).lower(state, distiller.teacher_params, inputs)
  t1 = time.perf_counter()
  report(f"lowered in {t1 - t0:.1f} s; compiling")
  packed = distiller.mesh.devices.flat[0].platform == "tpu"  # the TPU packs 4-bit types two per byte
  parts = {
      "teacher_weights": shard_bytes(distiller.teacher_params, packed),
      "student_weights": shard_bytes(state.params["student"], packed),
      "optimizer_state": shard_bytes(state.opt_state),
      "other_state": shard_bytes((state.step, state.params["strategy"])),
      "batch": shard_bytes(inputs),
  }
  params = {"teacher": leaf_count(distiller.teacher_params), "student": leaf_count(state.params["student"])}
  if distiller.trainable is not None:  # e.g. LoRA: only the adapters train
    params["student_trained"] = leaf_count(nnx.filter_state(state.params["student"], distiller.trainable))
  try:
    compiled = _compile(lowered, distiller.mesh)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    message = str(e).strip().splitlines()[0]
    report(f"the compiler ran out of memory after {time.perf_counter() - t1:.1f} s")
    return CompiledStep(None, None, None, "", time.perf_counter() - t1, t1 - t0, parts, params, message,
                        _oom_sizes(message))
  t2 = time.perf_counter()
  report(f"compiled in {t2 - t1:.1f} s")
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  cost = cost or {}
  return CompiledStep(
      memory=MemoryReport.of(compiled),
      flops=_num(cost.get("flops")),
      bytes_accessed=_num(cost.get("bytes accessed")),
      hlo=compiled.as_text() or "",
      compile_seconds=t2 - t1,
      lower_seconds=t1 - t0,
      parts=parts,
      params=params,
  )


_SIZE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _oom_sizes(message: str) -> tuple[int | None, int | None]:
  """(temporaries, available HBM) in bytes from a TPU out-of-memory message, e.g. ``... the total memory
  required for HLO temporaries (17.55G) exceeds available HBM (15.75G)``."""
  def find(pattern):
    m = re.search(pattern + r"\s*\(([\d.]+)\s*([KMGT]?)i?B?\)", message)
    return None if m is None else int(float(m.group(1)) * _SIZE[m.group(2)])
  return find(r"HLO temporaries"), find(r"available HBM")


def _num(x) -> float | None:
  return None if x is None or x < 0 else float(x)


# --------------------------------------------------------------------------- collectives
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(?P<type>.*?)\s(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\(")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,{} ]*\})\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(  # XLA's named form: mesh['axis_0'=4,'axis_1'=2] {'axis_0'} (`replica_groups` reads it)
    r"replica_groups=(mesh\[[^\]]*\](?:, device_ids=\(\[[\d,]+\](?:T\([\d,]+\))?\))? \{[^}]*\})")
_PAIRS = re.compile(r"source_target_pairs=\{(\{[\d,{} ]*\})\}")
def _groups(line: str) -> list[list[int]] | None:
  m = _GROUPS_IOTA.search(line)
  if m:
    g, s = int(m.group(1)), int(m.group(2))
    dims = [int(v) for v in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(v) for v in m.group(4).split(",")])
    return ids.reshape(g, s).tolist()
  m = _GROUPS_MESH.search(line)
  if m:
    return [sorted(g) for g in replica_groups(m.group(1))]
  m = _GROUPS_LIST.search(line) or _PAIRS.search(line)
  if m:
    return [[int(v) for v in grp.split(",") if v.strip()] for grp in re.findall(r"\{([\d, ]*)\}", m.group(1))]
  return None


def _named(mesh_shape: Any) -> dict[str, int]:
  """``{axis: size}`` in mesh order of a mesh given as that mapping or as a ``(data, tensor)`` pair."""
  if hasattr(mesh_shape, "items"):  # a dict or the mesh's own ``mesh.shape``
    return dict(mesh_shape.items())
  return {"data": mesh_shape[0], "tensor": mesh_shape[1]}


def _spanned(ids_per_group: list[list[int]], shape: dict[str, int]) -> str:
  """The mesh axes along which some group's devices differ, joined by ``+`` in mesh order (``none``: no axis);
  axes of size 1 never differ."""
  sizes = tuple(shape.values())
  varying = set()
  for g in ids_per_group:
    coords = np.asarray(np.unravel_index(np.asarray(g, dtype=int), sizes)).T  # [members, axes]
    varying |= {i for i in range(len(sizes)) if len(set(coords[:, i])) > 1}
  return "+".join(name for i, name in enumerate(shape) if i in varying) or "none"


def _axis(groups: list[list[int]] | None, mesh_shape: Any) -> str:
  """Which mesh axes a collective's device groups run over (ids are positions in the mesh's device order): ``data``,
  ``tensor``, ``data+tensor``, ``expert``, ...; ``mesh_shape``: ``{axis: size}`` in mesh order, or ``(data,
  tensor)``. No groups: all devices, every axis (``data+tensor`` on a two-axis mesh)."""
  shape = _named(mesh_shape)
  if not groups or all(len(g) == 0 for g in groups):
    return "+".join(shape)
  return _spanned([g for g in groups if g], shape)


def collectives(hlo: str, mesh_shape: Any) -> list[dict[str, Any]]:
  """Collective ops of a compiled module's HLO text, grouped by (kind, mesh axis).

  Each entry: ``kind``, ``axis``, ``count`` (ops in the program text; an op inside a loop body
  counts once), ``bytes`` (their result sizes per device; for an asynchronous all-gather or
  permute the gathered / received buffer) and ``wire_bytes`` (bytes each device sends in a
  ring algorithm: all-reduce 2(n-1)/n of the size, all-gather and all-to-all (n-1)/n,
  reduce-scatter (n-1) times its result, permute its size).
  """
  out: dict[tuple[str, str], dict[str, Any]] = {}
  for line in hlo.splitlines():
    m = _OP.search(line)
    if not m or "-done(" in line:
      continue
    kind = m.group("op")
    shapes = [shape_bytes(t, d) for t, d in HLO_SHAPE.findall(m.group("type"))]
    if not shapes:
      continue
    size = max(shapes) if m.group("start") and kind in ("all-gather", "collective-permute") else sum(shapes)
    groups = _groups(line)
    n = max((len(g) for g in groups), default=0) if groups else math.prod(_named(mesh_shape).values())
    n = max(n, 1)
    wire = {
        "all-reduce": 2 * (n - 1) / n * size,
        "all-gather": (n - 1) / n * size,
        "all-to-all": (n - 1) / n * size,
        "reduce-scatter": (n - 1) * size,
        "collective-permute": float(size),
    }[kind]
    axis = _permute_axis(groups, mesh_shape) if kind == "collective-permute" else _axis(groups, mesh_shape)
    entry = out.setdefault((kind, axis), {"kind": kind, "axis": axis, "count": 0, "bytes": 0, "wire_bytes": 0.0})
    entry["count"] += 1
    entry["bytes"] += size
    entry["wire_bytes"] += wire
  return sorted(out.values(), key=lambda e: -e["bytes"])


def _permute_axis(pairs: list[list[int]] | None, mesh_shape: Any) -> str:
  """The mesh axes a collective permute's (source, target) pairs cross (as `_axis`)."""
  shape, pairs = _named(mesh_shape), [p for p in pairs or () if len(p) == 2]
  return _spanned(pairs, shape) if pairs else "+".join(shape)
