"""The placement comparison of compiled plans (`meshdistill plan --placement K`) rendered from ``results/plan.jsonl``
without compiling: what ``plan_placement.py`` writes alone and ``plan.py`` adds to ``plan.md``."""

from __future__ import annotations

import dataclasses

# (row name in plan.jsonl, what the row is): the pairs whose placement the results show
ROWS = [("mesh.fsdp=true", "Llama-3.1-70B -> Llama-3.1-8B on v5e-64, mesh 8x8, mesh.fsdp=true"),
        (3, "Qwen3-8B -> Qwen3-1.7B on v5e-16, mesh 2x8")]

INTRO = ("the placement comparison of `meshdistill plan --placement {k}` run on each plan below as compiled by "
         "`benchmarks/plan.py` (its row in `plan.md`, stored in `plan.jsonl`), without compiling again. Step times: the "
         "calibrated estimate (the fit of `plan_calibration.md`, its band there) where the plan has one, else the "
         "roofline; the sub-mesh, cache and remote options scale the plan's own time per FLOP (teacher forward 2 N_t, "
         "student 6 N_s per token), they are not compiled. The cache's time with its pass is amortised over one epoch; "
         "the remote teacher's link is 100 Gb/s. The remote option counts no chips for the server that runs the "
         "teacher (they are not on this slice), so whenever its link carries the top-k it is the fastest on this "
         "slice; against the same chips the comparison is the offline cache with its pass.")


def plan_of(r: dict):
  """The `Plan` of a stored row, its FLOPs split and calibrated time filled in as the planner fills them now."""
  from meshdistill.planner import _calibrate  # pylint: disable=g-import-not-at-top
  from meshdistill.planner._cost import flops_split  # pylint: disable=g-import-not-at-top
  from meshdistill.planner import Plan  # pylint: disable=g-import-not-at-top

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


def sections(rows: dict, k: int, level: str = "##") -> list[str]:
  """Markdown lines: for each of `ROWS`, its heading and the placement table of its stored plan."""
  from meshdistill.planner import resolve_model  # pylint: disable=g-import-not-at-top
  from meshdistill.planner import TPU_CHIPS  # pylint: disable=g-import-not-at-top
  from meshdistill.planner._placement import placement_table, placements  # pylint: disable=g-import-not-at-top

  out = []
  for key, what in ROWS:
    r = rows.get(key)
    if r is None:
      out += [f"{level} {what}", "", "not in plan.jsonl (run its row of `benchmarks/plan.py` first)", ""]
      continue
    p = plan_of(r)
    vocab = resolve_model(p.teacher, who="teacher")[0].vocab_size
    chip = TPU_CHIPS[p.target.split(":")[0]]
    pl = placements(p, vocab=vocab, k=k, ici_bytes_per_s=chip.ici_bandwidth)
    out += [f"{level} {what}", "", "```", placement_table(pl), "```", ""]
  return out
