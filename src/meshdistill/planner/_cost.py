"""What one step costs with its loops counted whole, and the step's FLOPs split by model.

XLA's cost analysis (FLOPs, bytes accessed) and the program text (collectives) count a ``while`` body once, so a
model under ``scan_layers`` (its blocks one loop) reports the cost of one block, and the chunked loss (a
``lax.scan`` over token chunks) the cost of one chunk. `loop_counts` reads the ONE compiled program's text
(`meshdistill.planner._loops`): each loop's body is cost-analysed on its own and counted ``trip`` times (its
condition's bound), its collectives too; memory stays the compiled program's own. An earlier version compiled the
step again unrolled at one and two blocks per model and extended XLA's counts linearly (exact, but three more
compiles: 854 s of a 917 s 8B -> 1B plan on v5e-16 on a 2-core machine); the loop count needs no compile, and it
also counts the chunked loss's loop, which the linear extension left at one chunk.

`loop_counts` also returns the per-block FLOPs of each model's block loop (``b_t``, ``b_s``: a loop of the model's
depth carrying its stacked weights; the student's forward and backward loops together) and the rest (``c``:
embeddings, logits and loss, optimizer), from which the report splits the step's FLOPs between teacher and student.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from meshdistill.planner import _loops
from meshdistill.train.cost import Loop, Program, parse
from meshdistill.planner._compile import CompiledStep, collectives


@dataclasses.dataclass
class LayerCounts:
  """A step's XLA counts with every loop counted whole (per device, per step)."""

  flops: float
  bytes_accessed: float
  collectives: list[dict[str, Any]]
  teacher_block_flops: float  # b_t: one teacher block (forward)
  student_block_flops: float  # b_s: one student block (forward, backward and recomputation)
  rest_flops: float  # c: outside the blocks (embeddings, logits and loss, optimizer update)
  compile_seconds: float  # reading the text and analysing the loop bodies (no compile)
  depths: tuple[int, int]  # (L_t, L_s) (L_t = 0 without a teacher)
  loops: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # each loop: trip, per-iteration FLOPs


def _stacked(lp: Loop) -> int:
  return sum(1 for d in lp.carry_dims if len(d) >= 2 and d[0] == lp.trip)


def _owner(lp: Loop, depths: tuple[int, int]) -> str:
  """``teacher`` / ``student``: a loop of the model's depth carrying its stacked block weights (the teacher's runs
  forward only, outside any ``jvp``); ``other`` (e.g. the chunked loss's loop)."""
  lt, ls = depths
  if _stacked(lp) < 6 or lp.times != 1:
    return "other"
  differentiated = "jvp(" in lp.op_name
  if lt and lp.trip == lt and not differentiated:
    return "teacher"
  if lp.trip == ls and (differentiated or not lt):
    return "student"
  return "other"


def loop_counts(c: CompiledStep, mesh_shape: Any, depths: tuple[int, int],
                prog: Program | None = None) -> LayerCounts | None:
  """XLA's counts of compiled step ``c`` with each loop counted whole; None when the program has no loop.

  ``depths``: the teacher's and student's block counts (``L_t = 0`` without a teacher), to name their loops;
  ``prog``: ``c``'s text parsed already (`meshdistill.train.cost.parse`), else it is parsed here.
  Raises ``ValueError`` when a loop has no trip count in its condition (not a counted ``lax.scan`` loop).
  """
  if c.flops is None or " while(" not in c.hlo:
    return None
  t0 = time.perf_counter()
  prog = parse(c.hlo) if prog is None else prog
  flops, bytes_accessed = c.flops, c.bytes_accessed or 0.0
  per_block = {"teacher": 0.0, "student": 0.0}
  loops = []
  for lp, cost, extra in _loops.extra_iterations(prog):
    flops += extra * cost["flops"]
    bytes_accessed += extra * cost["bytes accessed"]
    owner = _owner(lp, depths)
    if owner in per_block:
      per_block[owner] += cost["flops"]
    loops.append({"op_name": lp.op_name, "trip": lp.trip, "times": lp.times, "flops_per_iteration": cost["flops"],
                  "owner": owner})
  merged: dict[tuple[str, str], dict[str, Any]] = {}
  for text, times in _loops.collectives_by_computation(prog):
    for e in collectives(text, mesh_shape):
      m = merged.setdefault((e["kind"], e["axis"]),
                            {"kind": e["kind"], "axis": e["axis"], "count": 0, "bytes": 0, "wire_bytes": 0.0})
      m["count"] += e["count"] * times
      m["bytes"] += e["bytes"] * times
      m["wire_bytes"] += e["wire_bytes"] * times
  lt, ls = depths
  rest = flops - lt * per_block["teacher"] - ls * per_block["student"]
  return LayerCounts(flops=flops, bytes_accessed=bytes_accessed,
                     collectives=sorted(merged.values(), key=lambda e: -e["bytes"]),
                     teacher_block_flops=per_block["teacher"], student_block_flops=per_block["student"],
                     rest_flops=rest, compile_seconds=time.perf_counter() - t0, depths=depths, loops=loops)


def flops_split(n_t: int, n_s: int, batch: int, seq: int, devices: int, on_policy=None,
                counts: LayerCounts | None = None) -> dict[str, float]:
  """The step's model FLOPs per device by who computes them: ``teacher_forward`` (2 N_t per token),
  ``student_forward_backward`` (6 N_s per token); with ``on_policy`` (`OnPolicySettings`, active) ``generation``:
  the expected sampling FLOPs of a step (``lambda`` of the batches, all with ``seq_kd``), 2 N per prompt token
  (prefill) and per new token (KV-cached decode), N the sampler's (the student's, the teacher's with ``seq_kd``),
  which the train step's time does not include. With ``counts`` holding block loops (scanned models) also XLA's
  own split:
  ``compiled_teacher_blocks`` (L_t b_t), ``compiled_student_blocks`` (L_s b_s) and ``compiled_rest``."""
  tokens = batch * seq
  out = {"teacher_forward": 2.0 * n_t * tokens / devices, "student_forward_backward": 6.0 * n_s * tokens / devices}
  if on_policy is not None and getattr(on_policy, "active", False):
    rows = batch * (1.0 if on_policy.seq_kd else on_policy.lmbda)
    out["generation"] = 2.0 * (n_t if on_policy.seq_kd else n_s) * rows * (seq + 1) / devices
  if counts is not None and (counts.teacher_block_flops or counts.student_block_flops):
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


__all__ = ["LayerCounts", "flops_split", "loop_counts", "mfu_split"]
