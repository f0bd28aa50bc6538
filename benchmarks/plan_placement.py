"""Where the teacher should live, for compiled plans of real pairs: benchmarks/results/plan_placement.md.

Reads plans already compiled into ``results/plan.jsonl`` (no compile here) and runs the planner's placement
comparison on each (`meshdistill.planner._placement.placements`, what ``meshdistill plan --placement K`` adds to a
plan): the teacher in the step, on a sub-mesh of its own, an offline top-K cache, or a remote teacher, each with
its step time (calibrated where the plan has the calibration's terms) and memory per chip, and the one recommended.

  python benchmarks/plan_placement.py            # the pairs of issue 37: 70B -> 8B on v5e-64, Qwen3-8B -> 1.7B on v5e-16
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from bench.results import newest_rows

HERE = os.path.dirname(os.path.abspath(__file__))
JSONL = os.path.join(HERE, "results", "plan.jsonl")
OUT = os.path.join(HERE, "results", "plan_placement.md")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--k", type=int, default=32, help="top-k kept per token by a cache / remote teacher")
  args = ap.parse_args()
  from bench import placement  # pylint: disable=g-import-not-at-top

  rows = newest_rows(JSONL)
  if not rows:
    raise SystemExit(f"no plans in {JSONL}: run `python benchmarks/plan.py` first")
  intro = placement.INTRO.format(k=args.k)
  out = ["# Where the teacher should live: placement of compiled plans", "",
         f"`python benchmarks/plan_placement.py --k {args.k}`: {intro}", ""]
  out += placement.sections(rows, args.k)
  out.append(f"Python {platform.python_version()}; no compile (the plans' own numbers).")
  text = "\n".join(out) + "\n"
  with open(OUT, "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
