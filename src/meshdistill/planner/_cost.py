"""What one step costs when its blocks are scanned: XLA's counts of the whole loop, from two-depth compiles.

XLA's cost analysis (FLOPs, bytes accessed) and the program text (collectives) count a ``while`` body once, so a
model under ``scan_layers`` (its blocks one loop) reports the cost of one block. The compiled TPU program names no
trip count and prints its matmuls (``convolution``s inside fusions) without operand shapes, so counting the body
again from the text would re-implement XLA's cost model. Instead the same step is compiled *unrolled* at one and two
blocks per model and XLA's own counts are extended linearly: every block of a decoder is the same program, so a
count is ``c + L_t * b_t + L_s * b_s`` in the teacher's and student's depths, and three shallow compiles,
``(1, 1)``, ``(2, 1)`` and ``(1, 2)``, give ``c``, ``b_t`` and ``b_s`` exactly (two without a teacher). Shallow
programs compile in seconds even for 70 B-wide blocks on a pod; the scanned program itself still gives the memory.

`layer_counts` does this for FLOPs, bytes accessed and collectives (count, bytes and wire bytes per kind and axis),
and also returns the per-block FLOPs of each model (``b_t``, ``b_s``) and the rest (``c``: embeddings, logits, loss,
optimizer), from which the report splits the step's FLOPs between teacher and student.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from meshdistill.planner._compile import CompiledStep, collectives


@dataclasses.dataclass
class LayerCounts:
  """A step's XLA counts at its full depths, extended from shallow unrolled compiles (per device, per step)."""

  flops: float
  bytes_accessed: float
  collectives: list[dict[str, Any]]
  teacher_block_flops: float  # b_t: one teacher block (forward)
  student_block_flops: float  # b_s: one student block (forward, backward and recomputation)
  rest_flops: float  # c: outside the blocks (embeddings, logits and loss, optimizer update)
  compile_seconds: float  # the shallow compiles together
  depths: tuple[int, int]  # (L_t, L_s) the counts are extended to (L_t = 0 without a teacher)


def _linear(base: float, dt: float, ds: float, lt: int, ls: int) -> float:
  return base + (lt - 1) * dt + (ls - 1) * ds


def _colls(c: CompiledStep, mesh_shape: Any) -> dict[tuple[str, str], dict[str, float]]:
  return {(e["kind"], e["axis"]): e for e in collectives(c.hlo, mesh_shape)}


def layer_counts(compile_at: Callable[[int, int], CompiledStep], depths: tuple[int, int],
                 mesh_shape: Any) -> LayerCounts:
  """XLA's counts of a step whose teacher has ``depths[0]`` blocks (0: no teacher) and student ``depths[1]``.

  ``compile_at(l_t, l_s)`` compiles the step unrolled with ``l_t`` teacher and ``l_s`` student blocks (``l_t`` is
  ignored without a teacher). Raises ``ValueError`` when a shallow program does not fit the chip (the compiler gave
  no counts): plan that configuration unrolled, or with more devices.
  """
  lt, ls = depths
  points = [(1, 1), (1, 2)] + ([(2, 1)] if lt else [])
  compiled = {p: compile_at(*p) for p in points}
  for p, c in compiled.items():
    if c.flops is None:
      raise ValueError(f"the step unrolled at {p[0]} teacher / {p[1]} student block(s) gave no cost counts "
                       f"({c.oom or 'no analysis'}); the scanned step's time cannot be extended from it")
  base, more_s = compiled[(1, 1)], compiled[(1, 2)]
  more_t = compiled.get((2, 1), base)

  def extend(get: Callable[[CompiledStep], float]) -> tuple[float, float, float]:
    b, dt, ds = get(base), get(more_t) - get(base), get(more_s) - get(base)
    return _linear(b, dt, ds, max(lt, 1), ls), dt, ds

  flops, dt, ds = extend(lambda c: c.flops)
  bytes_accessed, _, _ = extend(lambda c: c.bytes_accessed or 0.0)
  cb, ct, cs = (_colls(c, mesh_shape) for c in (base, more_t, more_s))
  colls = []
  for key in sorted(set(cb) | set(ct) | set(cs)):
    entry = {"kind": key[0], "axis": key[1]}
    for field in ("count", "bytes", "wire_bytes"):
      b = cb.get(key, {}).get(field, 0)
      entry[field] = max(0.0, _linear(b, ct.get(key, {}).get(field, 0) - b, cs.get(key, {}).get(field, 0) - b,
                                      max(lt, 1), ls))
    entry["count"] = int(round(entry["count"]))
    entry["bytes"] = int(round(entry["bytes"]))
    colls.append(entry)
  colls.sort(key=lambda e: -e["bytes"])
  rest = base.flops - (dt if lt else 0.0) - ds
  return LayerCounts(flops=flops, bytes_accessed=bytes_accessed, collectives=colls,
                     teacher_block_flops=dt if lt else 0.0, student_block_flops=ds, rest_flops=rest,
                     compile_seconds=sum(c.compile_seconds + c.lower_seconds for c in compiled.values()),
                     depths=(lt, ls))


def flops_split(n_t: int, n_s: int, batch: int, seq: int, devices: int, on_policy=None,
                counts: LayerCounts | None = None) -> dict[str, float]:
  """The step's model FLOPs per device by who computes them: ``teacher_forward`` (2 N_t per token),
  ``student_forward_backward`` (6 N_s per token); with ``on_policy`` (`OnPolicySettings`, active) ``generation``:
  the expected sampling FLOPs of a step (``lambda`` of the batches, all with ``seq_kd``), 2 N per prompt token
  (prefill) and per new token (KV-cached decode), N the sampler's (the student's, the teacher's with ``seq_kd``),
  which the train step's time does not include. With ``counts`` (scanned models) also XLA's own split:
  ``compiled_teacher_blocks`` (L_t b_t), ``compiled_student_blocks`` (L_s b_s) and ``compiled_rest``."""
  tokens = batch * seq
  out = {"teacher_forward": 2.0 * n_t * tokens / devices, "student_forward_backward": 6.0 * n_s * tokens / devices}
  if on_policy is not None and getattr(on_policy, "active", False):
    rows = batch * (1.0 if on_policy.seq_kd else on_policy.lmbda)
    out["generation"] = 2.0 * (n_t if on_policy.seq_kd else n_s) * rows * (seq + 1) / devices
  if counts is not None:
    lt, ls = counts.depths
    out.update(compiled_teacher_blocks=lt * counts.teacher_block_flops,
               compiled_student_blocks=ls * counts.student_block_flops, compiled_rest=counts.rest_flops)
  return out


def mfu_split(split: dict[str, float], step_s: float | None, peak_per_device: float | None) -> dict[str, float]:
  """Each analytic share's MFU: its FLOPs over (step time x peak); teacher + student = the plan's MFU."""
  if not step_s or not peak_per_device:
    return {}
  return {k: v / (step_s * peak_per_device) for k, v in split.items()
          if k in ("teacher_forward", "student_forward_backward", "generation")}


__all__ = ["LayerCounts", "flops_split", "layer_counts", "mfu_split"]
