"""A compiled program's loops counted whole: each ``while`` body's cost times its trip count, from the program's text.

XLA's cost analysis (FLOPs, bytes accessed) and the program text (collectives) count a ``while`` body once, so a
model under ``scan_layers`` (its blocks one loop) and the chunked loss (a ``lax.scan`` over token chunks) report
one iteration. The compiled program itself holds what is needed to count them whole: each loop's body computation
and its trip count (``lax.scan``'s counter compared against a constant in the loop's condition). This module reads
the compiled (optimised, partitioned, per-device) HLO text, cost-analyses each loop body on its own with XLA's
``HloCostAnalysis`` (the module parsed back and each body made the entry of a module of its own, analysed through
the CPU client: on the scanned tiny pair of tests/test_plan_cost.py, v5e:2x2, that analysis of the whole TPU
program's text gave the TPU compiler's own FLOP count exactly and its bytes accessed 5% lower) and adds
``(trip - 1)`` more copies of each body, nested loops multiplied through. The counted step then equals the
unrolled program's count (tests/test_plan_cost.py: within 0.5%).

No second compile: reading the text and analysing the bodies takes seconds even for pod-sized programs.
"""

from __future__ import annotations

import dataclasses
import re

_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*?condition=%([^\s,]+), body=%([^\s,]+)")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"(?:calls|to_apply|condition|body)=%([^\s,)]+)|(?:branch_computations|called_computations)="
                     r"\{([^}]*)\}")
_BOUND = re.compile(r"compare\(%[^,]+, %([^\s,)]+)\), direction=(LT|LE)")
_CONST = re.compile(r"^\s*%(\S+) = s(?:32|64)\[\][^=]*constant\((-?\d+)\)")
_KNOWN = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_FRAME = re.compile(r" stack_frame_id=\d+")
_TUPLE_SHAPES = re.compile(r"\b(?:pred|[suf]\d+|bf16|f8\w+)\[([\d,]+)\]")


@dataclasses.dataclass
class Loop:
  """One ``while`` of the program: its body, trip count, how many times its parent runs, and what it carries."""

  body: str
  parent: str
  trip: int
  times: int  # runs of the computation holding this loop (the product of the enclosing loops' trip counts)
  op_name: str
  carry_dims: list[tuple[int, ...]]  # shapes in the loop's carried tuple


@dataclasses.dataclass
class Program:
  """The compiled text split into computations (name -> text), the entry's name and the loops."""

  header: str
  computations: dict[str, str]
  entry: str
  loops: list[Loop]
  times: dict[str, int]  # runs of each computation per step (1 outside loops)


def _split(hlo: str) -> tuple[str, dict[str, str], str]:
  header, comps, entry, name, lines = "", {}, "", None, []
  for line in hlo.splitlines():
    if name is None:
      m = _HEADER.match(line)
      if m:
        name, lines = m.group(2), [line]
        if m.group(1):
          entry = name
      elif line.startswith("HloModule"):
        header = line
      continue
    lines.append(line)
    if line.rstrip() == "}":
      comps[name], name = "\n".join(lines), None
  if not entry:
    raise ValueError("the program text names no ENTRY computation")
  return header, comps, entry


def _trip(line: str, condition: str) -> int | None:
  """The trip count of a counted loop (``i = 0; while i < N``): XLA's ``known_trip_count`` where the compiler
  wrote it on the ``while`` (XLA:CPU), else the bound its condition compares the counter with (XLA:TPU), directly
  or through a fused compare of the counter and one integer constant."""
  known = _KNOWN.search(line)
  if known:
    return int(known.group(1))
  consts = {m.group(1): int(m.group(2)) for m in map(_CONST.match, condition.splitlines()) if m}
  m = _BOUND.search(condition)
  if m is not None and m.group(1) in consts:
    return consts[m.group(1)] + (m.group(2) == "LE")
  root = next((ln for ln in condition.splitlines() if ln.lstrip().startswith("ROOT")), "")
  if " fusion(" in root and len(consts) == 1 and "compare" in root.split("calls=")[-1]:
    return next(iter(consts.values()))
  return None


def parse(hlo: str) -> Program:
  """The program's computations and loops, with how many times each computation runs in one step."""
  header, comps, entry = _split(hlo)
  times: dict[str, int] = {entry: 1}
  loops: list[Loop] = []
  order = [entry]
  while order:  # callers before callees: a computation's count is its caller's (times the trip, for a loop body)
    name = order.pop()
    text = comps.get(name, "")
    bodies = {}
    for line in text.splitlines():
      w = _WHILE.search(line)
      if w:
        trip = _trip(line, comps.get(w.group(1), ""))
        if trip is None:
          raise ValueError(f"loop {w.group(2)!r}: no trip count in its condition (not a counted loop)")
        op = _OPNAME.search(line)
        carry = line.split("=", 1)[1].split(" while(")[0]
        dims = [tuple(int(d) for d in s.split(",")) for s in _TUPLE_SHAPES.findall(carry)]
        loops.append(Loop(w.group(2), name, trip, times[name], op.group(1) if op else "", dims))
        bodies[w.group(2)] = trip
    for m in _CALLED.finditer(text):
      for callee in ([m.group(1)] if m.group(1) else [c.strip().lstrip("%") for c in m.group(2).split(",")]):
        if callee in comps and callee not in times:
          times[callee] = times[name] * bodies.get(callee, 1)
          order.append(callee)
  return Program(header, comps, entry, loops, times)


def _module_of(prog: Program, body: str):
  """An XLA ``HloModule`` whose entry is computation ``body`` (with every computation it may call)."""
  from jax._src.lib import xla_client  # XLA's HLO parser (not part of jax's public API)

  parts = []
  for name, text in prog.computations.items():
    if name == prog.entry:
      continue
    parts.append("ENTRY " + text if name == body else text)
  text = _FRAME.sub("", "\n\n".join(parts))  # the stack-frame table is not carried over
  return xla_client.hlo.hlo_module_from_text("HloModule loop_body\n\n" + text)


def body_cost(prog: Program, body: str) -> dict[str, float]:
  """XLA's cost analysis of one iteration of loop ``body`` (FLOPs, bytes accessed; its nested loops counted once)."""
  import jax
  from jax._src.lib import _jax

  cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, _module_of(prog, body))
  return {"flops": float(cost.get("flops", 0.0)), "bytes accessed": float(cost.get("bytes accessed", 0.0))}


def extra_iterations(prog: Program) -> list[tuple[Loop, dict[str, float], int]]:
  """Each loop, its body's cost per iteration, and how many iterations the flat count leaves out
  (``times x (trip - 1)``: the flat analysis of the program counts each body once per count of its parent)."""
  return [(lp, body_cost(prog, lp.body), lp.times * (lp.trip - 1)) for lp in prog.loops]


def collectives_by_computation(prog: Program) -> list[tuple[str, int]]:
  """(computation text, runs per step) of each computation, for counting collectives whole."""
  return [(text, prog.times.get(name, 1)) for name, text in prog.computations.items()]


_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
# instructions whose computations are part of their caller's cost (a fusion's, a reduction's combiner): the TPU
# compiler estimates the caller; a loop body, a branch or a called computation runs its own instructions
_INNER = re.compile(r"\s(?:fusion|reduce|reduce-window|scatter|sort|map|select-and-scatter|all-reduce|reduce-scatter|"
                    r"all-reduce-start|reduce-scatter-start)\(.*?(?:calls|to_apply)=%([^\s,)]+)")
_CALLS = re.compile(r"calls=%([^\s,)]+)")
_MATMUL = (" convolution(", " dot(")


def estimated_cycles(prog: Program) -> dict[str, int] | None:
  """The TPU compiler's own estimate of the step: the ``estimated_cycles`` it writes on each instruction it
  schedules (XLA:TPU's backend config; other backends write none), summed over every computation that runs its
  own instructions, each times its runs per step (loops counted whole, as `parse` counts them), in two parts:
  ``matmul`` (a dot or convolution, or a fusion around one) and ``other`` (elementwise work, reductions, copies,
  layout changes). ``kernel_calls``: the runs of Mosaic kernels (``tpu_custom_call``: the splash attention kernel,
  the package's Pallas kernels), which carry no estimate. None where no instruction carries one."""
  inner = set()
  for text in prog.computations.values():
    inner.update(_INNER.findall(text))
  out, seen = {"matmul": 0, "other": 0, "kernel_calls": 0}, False
  for name, text in prog.computations.items():
    runs = prog.times.get(name)
    if runs is None or name in inner:
      continue
    for line in text.splitlines():
      m = _CYCLES.search(line)
      if m is None:
        out["kernel_calls"] += runs * ('custom_call_target="tpu_custom_call"' in line)
        continue
      seen = True
      called = _CALLS.search(line)
      body = prog.computations.get(called.group(1), "") if called else line
      out["matmul" if any(op in body for op in _MATMUL) else "other"] += int(m.group(1)) * runs
  return out if seen else None


__all__ = ["Loop", "Program", "body_cost", "collectives_by_computation", "estimated_cycles", "extra_iterations",
           "parse"]
