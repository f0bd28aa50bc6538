"""A compiled program's loops counted whole: each ``while`` body's cost times its trip count, from the program's text.

XLA's cost analysis (FLOPs, bytes accessed) and the program text (collectives) count a ``while`` body once, so a
model under ``scan_layers`` (its blocks one loop) and the chunked loss (a ``lax.scan`` over token chunks) report
one iteration. The compiled program itself holds what is needed to count them whole: each loop's body computation
and its trip count (``lax.scan``'s counter compared against a constant in the loop's condition). This module takes
the compiled (optimised, partitioned, per-device) HLO text as `meshdistill.train.cost.parse` reads it, cost-analyses
each loop body on its own with XLA's ``HloCostAnalysis`` (the module parsed back and each body made the entry of a
module of its own, analysed through the CPU client: on the scanned tiny pair of tests/test_plan_cost.py, v5e:2x2,
that analysis of the whole TPU program's text gave the TPU compiler's own FLOP count exactly and its bytes accessed
5% lower) and adds ``(trip - 1)`` more copies of each body, nested loops multiplied through. The counted step then
equals the unrolled program's count (tests/test_plan_cost.py: within 0.5%).

No second compile: reading the text and analysing the bodies takes seconds even for pod-sized programs.
"""

from __future__ import annotations

import re

from meshdistill.train.cost import Loop, Program

_FRAME = re.compile(r" stack_frame_id=\d+")


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


__all__ = ["body_cost", "collectives_by_computation", "extra_iterations"]
