"""Where the teacher should live, for compiled plans of real pairs: benchmarks/results/plan_placement.md.

Reads plans already compiled into ``results/plan.jsonl`` (no compile here) and runs the planner's placement
comparison on each (`meshdistill.planner._placement.placements`, what ``meshdistill plan --placement K`` adds to a
plan): the teacher in the step, on a sub-mesh of its own, an offline top-K cache, or a remote teacher, each with
its step time (calibrated where the plan has the calibration's terms) and memory per chip, and the one recommended.

  python benchmarks/plan_placement.py            # the pairs of issue 37: 70B -> 8B on v5e-64, Qwen3-8B -> 1.7B on v5e-16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
JSONL = os.path.join(HERE, "results", "plan.jsonl")
OUT = os.path.join(HERE, "results", "plan_placement.md")
# (row name in plan.jsonl, what the row is)
ROWS = [("mesh.fsdp=true", "Llama-3.1-70B -> Llama-3.1-8B on v5e-64, mesh 8x8, mesh.fsdp=true"),
        (3, "Qwen3-8B -> Qwen3-1.7B on v5e-16, mesh 2x8")]


def plan_of(r: dict):
  """The `Plan` of a stored row, its FLOPs split and calibrated time filled in as the planner fills them now."""
  from meshdistill.planner import _calibrate  # pylint: disable=g-import-not-at-top
  from meshdistill.planner._cost import flops_split  # pylint: disable=g-import-not-at-top
  from meshdistill.planner._report import Plan  # pylint: disable=g-import-not-at-top

  fields = {f.name for f in dataclasses.fields(Plan)}
  kw = {k: v for k, v in r.items() if k in fields and k != "suggestions"}
  kw["mesh"] = (r["mesh"]["data"], r["mesh"]["tensor"])
  p = Plan(**kw)
  f = p.flops
  p.flops = {**f, "split": flops_split(f["matmul_params_teacher"], f["matmul_params_student"], p.batch, p.seq,
                                       p.devices)}
  if _calibrate.CALIBRATION is not None and p.time.get("step_s") is not None:
    p.time = {**p.time, "calibrated": _calibrate.CALIBRATION.of(p.time, p.target.split(":")[0])}
  return p


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--k", type=int, default=32, help="top-k kept per token by a cache / remote teacher")
  args = ap.parse_args()
  from meshdistill.planner import resolve_model  # pylint: disable=g-import-not-at-top
  from meshdistill.planner._hardware import TPU_CHIPS  # pylint: disable=g-import-not-at-top
  from meshdistill.planner._placement import placement_table, placements  # pylint: disable=g-import-not-at-top

  rows = {}
  with open(JSONL, encoding="utf-8") as f:
    for line in f:
      r = json.loads(line)
      rows[r["row"]] = r
  out = ["# Where the teacher should live: placement of compiled plans", "",
         f"`python benchmarks/plan_placement.py --k {args.k}`: each plan below was compiled by `benchmarks/plan.py` "
         "(its row in `plan.md`, stored in `plan.jsonl`); the placement comparison of `meshdistill plan --placement "
         f"{args.k}` is run on it here without compiling again. Step times: the calibrated estimate (the fit of "
         "`plan_calibration.md`, its band there) where the plan has one, else the roofline; the sub-mesh, cache and "
         "remote options scale the plan's own time per FLOP (teacher forward 2 N_t, student 6 N_s per token), "
         "they are not compiled. The cache's time with its pass is amortised over one epoch; the remote teacher's "
         "link is 100 Gb/s. The remote option counts no chips for the server that runs the teacher (they are not on this "
         "slice), so whenever its link carries the top-k it is the fastest on this slice; against the same chips "
         "the comparison is the offline cache with its pass.", ""]
  for key, what in ROWS:
    r = rows.get(key)
    if r is None:
      out += [f"## {what}", "", "not in plan.jsonl (run its row of `benchmarks/plan.py` first)", ""]
      continue
    p = plan_of(r)
    vocab = resolve_model(p.teacher, who="teacher")[0].vocab_size
    chip = TPU_CHIPS[p.target.split(":")[0]]
    pl = placements(p, vocab=vocab, k=args.k, ici_bytes_per_s=chip.ici_bandwidth)
    out += [f"## {what}", "", "```", placement_table(pl), "```", ""]
  out.append(f"Python {platform.python_version()}; no compile (the plans' own numbers).")
  text = "\n".join(out) + "\n"
  with open(OUT, "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
