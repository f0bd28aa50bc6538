"""The planner against one TPU v5e chip: the chip calibration source, fitted on steps measured there.

Each measured configuration of `benchmarks/tpu_step.py` (its ``meshdistill`` rows in ``tpu_step.jsonl``: the pair,
batch, remat policy, loss chunk and attention kernel of a `tpu_step.Setting`) is planned here with the same model
configs (`tpu_step.model_configs`) and the same distillation settings as `tpu_step.measure_plan`. libtpu refuses a
one-chip topology, so each is compiled for ``v5e:2x2`` with mesh ``data=4``, four times the measured batch: the same
rows per chip, the same per-chip program but for one gradient all-reduce over ``data``. That all-reduce is the
stand-in's, not the chip's: the collective term is left out (``comm_s = 0``, as `md.plan(..., devices="local")` on one
chip has none), and its wire bytes are stored beside the row to show what was dropped.

The chip source fits ``a[v5e]``, the fraction of peak of ``max(compute / a, hbm)`` (`planner._calibrate`), over one
row per configuration (the measurement with the package's splash blocks where there is one, else the row measured
with other blocks, said in the row). The collective cost ``k`` cannot be fitted from one chip (no collectives): it
is held at `planner._calibrate.HELD_K` and does not enter a one-chip estimate (its collective term is 0).

  python benchmarks/plan_chip.py                       # compile every measured configuration not yet stored
  python benchmarks/plan_chip.py --jsonl PATH --only b=2  # measured rows from PATH; compile only labels with b=2
  python benchmarks/plan_chip.py --render              # refit and rewrite the section from the stored .json

Writes ``benchmarks/results/plan_calibration_chip.json`` (per configuration: the measured step and program bytes,
the planner's terms and memory) and prints the `CHIP_CALIBRATION` literal (`planner/_calibrate.py` holds it;
tests/test_plan_cost.py refits it from the json). ``plan_calibration.py --render`` writes its section into
``plan_calibration.md`` (`section`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
JSON = os.path.join(HERE, "results", "plan_calibration_chip.json")
MEASURED = os.path.join(HERE, "results", "tpu_step.jsonl")
STAND_IN = ("v5e:2x2", 4)  # topology and data-axis size compiled for one chip's program
GENERATION = "v5e"
GIB = 2**30


def config_key(setting: dict) -> str:
  """What the planner sees of a measured setting: pair-independent batch, sequence, remat, chunk, attention (the
  splash blocks and AdamW's first-moment dtype of `tpu_step.Setting` besides)."""
  mu = setting.get("mu", "float32")
  return (f"b={setting['b']},t={setting['t']},remat={setting['remat']},chunk={setting['chunk']},"
          f"attn={setting['attn']}" + ("" if mu == "float32" else f",mu={mu}"))


def package_blocks(setting: dict) -> bool:
  """Whether a row was measured with the package's own splash blocks (`_attention._splash_block_sizes`)."""
  return setting.get("attn") != "splash" or setting.get("blocks") in ("default", "q512-kv1024-c512-fused")


def measured_configs(path: str = MEASURED) -> dict[tuple[str, str], dict]:
  """One measured row per (pair, `config_key`) of the successful ``meshdistill`` rows at ``path``: the newest with
  the package's splash blocks, else the newest measured with other blocks."""
  out: dict[tuple[str, str], dict] = {}
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  for r in rows:
    if r.get("system", "meshdistill") != "meshdistill" or "step_s" not in r or "setting" not in r:
      continue
    key = (r["pair"], config_key(r["setting"]))
    have = out.get(key)
    if have is None or package_blocks(r["setting"]) or not package_blocks(have["setting"]):
      out[key] = r
  return out


def plan_terms(pair: str, setting: dict) -> dict:
  """The planner's roofline terms and memory of one chip's program at ``setting`` (compiled for `STAND_IN`)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import dataclasses  # pylint: disable=g-import-not-at-top

  import meshdistill as md  # pylint: disable=g-import-not-at-top
  from tpu_step import Setting, model_configs  # pylint: disable=g-import-not-at-top

  s = Setting(**{k: v for k, v in setting.items() if k in {f.name for f in dataclasses.fields(Setting)}})
  tcfg, scfg = model_configs(pair, s)
  topology, data = STAND_IN
  t0 = time.perf_counter()
  p = md.plan(tcfg, scfg, topology=topology, mesh=(data, 1), batch=data * s.b, seq=s.t, chunk_size=s.chunk,
              remat=s.remat, suggest=0,
              overrides=["distill.temperature=2.0", "distill.alpha=0.5", f"train.mu_dtype={s.mu}"])
  seconds = time.perf_counter() - t0
  t = p.time
  return {"compiled_for": topology, "mesh": [data, 1], "global_batch": data * s.b,
          "compute_s": t["compute_s"], "hbm_s": t["hbm_s"], "comm_s": 0.0,
          "stand_in_comm_s": t["comm_s"], "stand_in_wire_bytes": sum(c["wire_bytes"] for c in p.collectives),
          "flops_per_chip": p.flops["counted"], "kernel_flops_per_chip": p.flops["kernels"],
          "planned_bytes": p.memory["total"], "planned_temp_bytes": p.memory["temp"], "fits": p.fits,
          "plan_seconds": seconds, "load_average": os.getloadavg()[0]}


def row_of(pair: str, r: dict, terms: dict) -> dict:
  s = r["setting"]
  return {"pair": pair, "config": config_key(s), "setting": s, "measured_label": r["label"], "tag": r.get("tag"),
          "device": r.get("device"), "package_blocks": package_blocks(s), "step_s": r["step_s"],
          "program_bytes": r["program_bytes"], **terms}


def fit_rows(rows: list[dict]):
  """The chip calibration over ``rows`` and each row's leave-one-config-out step time (NaN with one row)."""
  from meshdistill.planner import _calibrate  # pylint: disable=g-import-not-at-top

  terms = [(r["compute_s"], r["hbm_s"], r["comm_s"]) for r in rows]
  measured = [r["step_s"] for r in rows]
  gens = [GENERATION] * len(rows)
  cal = _calibrate.calibrate_chip(terms, measured, [r["config"] for r in rows])
  loo = (_calibrate.leave_one_out(terms, measured, gens, k=cal.k) if len(rows) >= 2 else [math.nan] * len(rows))
  return cal, loo, terms, measured


def _pct(x: float) -> str:
  return "n/a" if x != x else f"{100 * x:+.1f}%"


def section(rows: list[dict]) -> str:
  """The chip section of ``plan_calibration.md``: per measured configuration, the planner's estimates (published
  source, chip source fit and leave-one-out) beside the measured step time, and planned against measured memory."""
  from meshdistill.planner import _calibrate  # pylint: disable=g-import-not-at-top

  if not rows:
    return "## The chip source\n\nNo measured configuration compiled yet (`python benchmarks/plan_chip.py`).\n"
  cal, loo, terms, measured = fit_rows(rows)
  pub = _calibrate.CALIBRATION
  pairs = sorted({r["pair"] for r in rows})
  out = ["## The chip source: steps measured on one TPU v5e chip", "",
         "`python benchmarks/plan_chip.py`: each configuration measured by `benchmarks/tpu_step.py` on one TPU v5e "
         "chip (`tpu_step.jsonl`, the row named in the table), planned with the same models and settings. libtpu "
         f"refuses a one-chip topology, so each program is compiled for {STAND_IN[0]} with mesh data={STAND_IN[1]} "
         "at four times the measured batch (the same rows per chip); its one gradient all-reduce is the stand-in's, "
         "so the collective term is left out (0, as a one-chip plan has none). These rows are their own source "
         "(`planner._calibrate.CHIP_CALIBRATION`), kept apart from the published pod rows above "
         "(`CALIBRATION`): `md.plan(..., devices=\"local\")` on one chip uses the chip source, every other target "
         "the published one.", "",
         f"Fitted (over {cal.rows} configurations of {len(pairs)} pair{'s' * (len(pairs) > 1)}: "
         f"{', '.join(pairs)}): a[{GENERATION}] = {cal.a[GENERATION]:.3f} (published source: "
         f"{pub.a[GENERATION]:.3f}); k held at {cal.k:.3f} (no collectives on one chip: k cannot be fitted and "
         f"does not enter a one-chip estimate). Band (largest leave-one-config-out error): "
         f"+-{100 * cal.band[GENERATION]:.1f}%. Only `a` is fitted: the rows are one chip's, so the published fit's "
         "other parameters (k, one a per generation) have nothing to be told from.", "",
         "| pair | configuration | measured row (splash blocks, tag) | measured ms | roofline ms (compute, HBM) | "
         "published source ms (error) | chip source, fit ms (error) | chip source, LOO ms (LOO error) | "
         "measured program GiB | planned GiB (error) |",
         "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  fitted = cal.predict(terms, [GENERATION] * len(rows))
  old = pub.predict(terms, [GENERATION] * len(rows))
  for r, f, o, l, m in zip(rows, fitted, old, loo, measured):
    blocks = r["setting"].get("blocks", "default") if r["setting"]["attn"] == "splash" else "n/a"
    own = "" if r["package_blocks"] else ", not the package's blocks"
    mem = r["planned_bytes"] / r["program_bytes"] - 1
    out.append(f"| {r['pair']} | {r['config']} | {blocks}{own}, {r['tag']} | {1e3 * m:.0f} | "
               f"{1e3 * max(r['compute_s'], r['hbm_s']):.0f} ({1e3 * r['compute_s']:.0f}, {1e3 * r['hbm_s']:.0f}) | "
               f"{1e3 * o:.0f} ({_pct(o / m - 1)}) | {1e3 * f:.0f} ({_pct(f / m - 1)}) | "
               f"{'n/a' if l != l else f'{1e3 * l:.0f}'} ({_pct(l / m - 1)}) | {r['program_bytes'] / GIB:.2f} | "
               f"{r['planned_bytes'] / GIB:.2f} ({_pct(mem)}) |")
  worst_t = max(abs(l / m - 1) for l, m in zip(loo, measured)) if len(rows) >= 2 else math.nan
  worst_m = max(abs(r["planned_bytes"] / r["program_bytes"] - 1) for r in rows)
  dropped = ", ".join(f"{r['stand_in_wire_bytes'] / GIB:.2f} GiB" for r in rows)
  out += ["", f"Step time: largest leave-one-config-out error {_pct(worst_t)} (target: within 10%). Memory: the "
          f"planned per-chip bytes against the measured program's (arguments + outputs + temporaries, donated "
          f"buffers once), largest error {_pct(worst_m)}. The stand-in's all-reduce left out, wire bytes per chip: "
          f"{dropped}.",
          "", f"Pairs measured: {len(pairs)} ({', '.join(pairs)}). The target is every pair; with one pair, "
          "\"every pair\" cannot be checked yet, and the leave-one-config-out errors above are within one pair: "
          "they do not show how the chip source carries to another pair's shapes.",
          "", f"Compiled on {os.cpu_count()} CPU cores shared with other jobs; plan seconds per row: "
          + ", ".join(f"{r['plan_seconds']:.0f}" for r in rows) + "."]
  return "\n".join(out) + "\n"


def calibration_literal(rows: list[dict]) -> str:
  """`planner._calibrate.CHIP_CALIBRATION`'s source for the stored rows (printed; pasted into `_calibrate.py`)."""
  cal = fit_rows(rows)[0]
  names = ",\n        ".join(f'"{n}"' for n in cal.row_names)
  return (f"CHIP_CALIBRATION = Calibration(\n    a={{\"{GENERATION}\": {cal.a[GENERATION]:.6f}}}, "
          f"a_pooled={cal.a_pooled:.6f}, k={cal.k:.6f},\n    band={{\"{GENERATION}\": {cal.band[GENERATION]:.6f}}}, "
          f"rows={cal.rows}, comm_share=0.0, source=\"chip\",\n    row_names=(\n        {names}))")


def load() -> list[dict]:
  return json.load(open(JSON, encoding="utf-8")) if os.path.exists(JSON) else []


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--render", action="store_true", help="refit from the stored .json (no compile)")
  ap.add_argument("--jsonl", default=MEASURED, help="the measured rows (tpu_step.py's jsonl)")
  ap.add_argument("--only", default=None, help="compile only configurations whose key contains this text")
  ap.add_argument("--recompile", action="store_true", help="compile configurations already stored too")
  args = ap.parse_args()
  sys.path.insert(0, os.path.join(HERE, "..", "src"))
  stored = load()
  if not args.render:
    have = {(r["pair"], r["config"]) for r in stored}
    for (pair, key), r in measured_configs(args.jsonl).items():
      if (pair, key) in have and not args.recompile or args.only and args.only not in key:
        continue
      row = row_of(pair, r, plan_terms(pair, r["setting"]))
      print(json.dumps(row), flush=True)
      stored = [s for s in stored if (s["pair"], s["config"]) != (pair, key)] + [row]
      stored.sort(key=lambda s: (s["pair"], s["setting"]["b"], s["config"]))
      with open(JSON, "w", encoding="utf-8") as f:
        json.dump(stored, f, indent=1)
  print(section(stored))
  print(calibration_literal(stored))
  return 0


if __name__ == "__main__":
  sys.exit(main())
