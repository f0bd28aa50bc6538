"""The planner against one TPU v5e chip: the chip calibration source, fitted on steps measured there.

Each measured configuration of `benchmarks/tpu_step.py` (its ``meshdistill`` rows in ``tpu_step.jsonl``: the pair,
batch, remat policy, loss chunk and attention kernel of a `tpu_step.Setting`) is planned here with the same model
configs (`tpu_step.model_configs`) and the same distillation settings as `tpu_step.measure_plan`. libtpu refuses a
one-chip topology, so the step is compiled for one device of ``v5e:2x2`` (`TOPOLOGY`): the one-chip program, with no
collectives, as ``md.plan(..., devices="local")`` compiles it on the chip. ``--stand-in`` also compiles each for all
of ``v5e:2x2`` with mesh ``data=4`` at four times the batch (the same rows per chip, plus one gradient all-reduce the
chip does not have), stored beside the row as a check of how far that stand-in moves the terms and the memory.

The chip source fits ``a[v5e]``, the fraction of peak in ``max(compute / a, hbm)`` (`planner._calibrate`,
`calibrate_chip`), over one row per configuration (the measurement with the package's splash blocks where there is
one, else the row measured with other blocks, said in the row). The collective cost ``k`` cannot be fitted from one
chip (no collectives): it is held at `planner._calibrate.HELD_K` and does not enter a one-chip estimate.

  python benchmarks/plan_chip.py --stand-in            # compile every measured configuration not yet stored
  python benchmarks/plan_chip.py --jsonl PATH --only b=2  # measured rows from PATH; only configurations with b=2
  python benchmarks/plan_chip.py --render              # refit and print the section from the stored .json

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
TOPOLOGY = "v5e:2x2"  # the smallest v5e topology libtpu takes: one of its devices is compiled for
STAND_IN = 4  # the data-axis size of the stand-in over all of TOPOLOGY (a check: `stand_in_terms`)
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


def _planner(pair: str, setting: dict):
  """The `Planner` of a measured setting for `TOPOLOGY` (the models and distillation settings of
  `tpu_step.measure_plan`) and the setting."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import dataclasses  # pylint: disable=g-import-not-at-top

  from meshdistill.planner import make_planner  # pylint: disable=g-import-not-at-top
  from tpu_step import Setting, model_configs  # pylint: disable=g-import-not-at-top

  s = Setting(**{k: v for k, v in setting.items() if k in {f.name for f in dataclasses.fields(Setting)}})
  tcfg, scfg = model_configs(pair, s)
  pl = make_planner(tcfg, scfg, topology=TOPOLOGY, seq=s.t, remat=s.remat,
                    overrides=["distill.temperature=2.0", "distill.alpha=0.5", f"train.mu_dtype={s.mu}"])
  return pl, s


def plan_terms(pair: str, setting: dict) -> dict:
  """The planner's roofline terms and memory of the one-chip program at ``setting``: compiled for one device of
  `TOPOLOGY` (no collectives: the program `md.plan(..., devices="local")` compiles on one chip)."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  from meshdistill.planner import Knobs  # pylint: disable=g-import-not-at-top

  pl, s = _planner(pair, setting)
  pl.target = dataclasses.replace(pl.target, name=f"{TOPOLOGY}, one chip", devices=pl.target.devices[:1])
  t0 = time.perf_counter()
  p = pl.plan(Knobs(1, 1, s.remat, s.chunk, s.b))
  seconds = time.perf_counter() - t0
  if p.collectives:
    raise ValueError(f"the one-chip program of {setting} has collectives: {p.collectives}")
  return {"compiled_for": f"{TOPOLOGY}, one device", "compute_s": p.time["compute_s"], "hbm_s": p.time["hbm_s"],
          "comm_s": 0.0, "flops_per_chip": p.flops["counted"], "kernel_flops_per_chip": p.flops["kernels"],
          "planned_bytes": p.memory["total"], "planned_temp_bytes": p.memory["temp"], "fits": p.fits,
          "plan_seconds": seconds, "load_average": os.getloadavg()[0]}


def stand_in_terms(pair: str, setting: dict) -> dict:
  """The same at `STAND_IN`: all of `TOPOLOGY` over ``data``, the measured rows per chip (its one gradient
  all-reduce the chip does not have): what the per-chip terms and memory move by against the one-chip program."""
  from meshdistill.planner import Knobs  # pylint: disable=g-import-not-at-top

  pl, s = _planner(pair, setting)
  t0 = time.perf_counter()
  p = pl.plan(Knobs(STAND_IN, 1, s.remat, s.chunk, STAND_IN * s.b))
  return {"mesh": [STAND_IN, 1], "global_batch": STAND_IN * s.b, "compute_s": p.time["compute_s"],
          "hbm_s": p.time["hbm_s"], "comm_s": p.time["comm_s"],
          "wire_bytes": sum(c["wire_bytes"] for c in p.collectives), "planned_bytes": p.memory["total"],
          "plan_seconds": time.perf_counter() - t0}


ONE_CHIP_FIELDS = ("compiled_for", "compute_s", "hbm_s", "comm_s", "flops_per_chip", "kernel_flops_per_chip",
                   "planned_bytes", "planned_temp_bytes", "fits", "plan_seconds", "load_average")


def row_of(pair: str, r: dict, terms: dict, stand_in: dict | None) -> dict:
  s = r["setting"]
  return {"pair": pair, "config": config_key(s), "setting": s, "measured_label": r["label"], "tag": r.get("tag"),
          "device": r.get("device"), "package_blocks": package_blocks(s), "step_s": r["step_s"],
          "program_bytes": r["program_bytes"], **terms, "stand_in": stand_in}


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
         "`python benchmarks/plan_chip.py --stand-in`: each configuration measured by `benchmarks/tpu_step.py` on "
         "one TPU v5e chip (`tpu_step.jsonl`, the row named in the table), planned with the same models and "
         "settings. libtpu refuses a one-chip topology, so each step is compiled for one device of "
         f"{TOPOLOGY}: the one-chip program, without collectives, as `md.plan(..., devices=\"local\")` compiles it "
         f"on the chip. As a check, each is also compiled for all of {TOPOLOGY} with mesh data={STAND_IN} at "
         f"{STAND_IN}x the batch (the same rows per chip; its one gradient all-reduce is the stand-in's own): the "
         "*stand-in* columns. These rows are their own source (`planner._calibrate.CHIP_CALIBRATION`, "
         "`plan_calibration_chip.json`), kept apart from the published pod rows above (`CALIBRATION`, "
         "`plan_calibration.json`): `md.plan(..., devices=\"local\")` on one chip of a generation with chip rows "
         "takes the chip source, every other target the published one (`_calibrate.source_for`).", "",
         f"Fitted over {cal.rows} configurations of {len(pairs)} pair{'s' * (len(pairs) > 1)} ({', '.join(pairs)}): "
         f"a[{GENERATION}] = {cal.a[GENERATION]:.3f} (published source: {pub.a[GENERATION]:.3f}). Only `a` is "
         "fitted: one chip has no collectives, so `k` (held at "
         f"{cal.k:g}) has nothing to be told from and does not enter a one-chip estimate, and the rows are one "
         f"generation's. Band (largest leave-one-config-out error): +-{100 * cal.band[GENERATION]:.1f}%.", "",
         "| pair | configuration | measured row (splash blocks; tag) | measured ms | roofline ms: max(compute, HBM) | "
         "published source ms (error) | chip source, fit ms (error) | chip source, leave-one-config-out ms (error) "
         "| measured program GiB | planned GiB (error) | stand-in: roofline ms, planned GiB (error) |",
         "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  fitted = cal.predict(terms, [GENERATION] * len(rows))
  old = pub.predict(terms, [GENERATION] * len(rows))
  for r, f, o, l, m in zip(rows, fitted, old, loo, measured):
    blocks = r["setting"].get("blocks", "default") if r["setting"]["attn"] == "splash" else "n/a"
    own = "" if r["package_blocks"] else ", not the package's"
    si = r.get("stand_in")
    stand = "not compiled" if not si else (
        f"{1e3 * max(si['compute_s'], si['hbm_s']):.0f}, {si['planned_bytes'] / GIB:.2f} "
        f"({_pct(si['planned_bytes'] / r['program_bytes'] - 1)})")
    out.append(f"| {r['pair']} | {r['config']} | {blocks}{own}; {r['tag']} | {1e3 * m:.0f} | "
               f"{1e3 * max(r['compute_s'], r['hbm_s']):.0f}: max({1e3 * r['compute_s']:.0f}, "
               f"{1e3 * r['hbm_s']:.0f}) | {1e3 * o:.0f} ({_pct(o / m - 1)}) | {1e3 * f:.0f} ({_pct(f / m - 1)}) | "
               f"{'n/a' if l != l else f'{1e3 * l:.0f}'} ({_pct(l / m - 1)}) | {r['program_bytes'] / GIB:.2f} | "
               f"{r['planned_bytes'] / GIB:.2f} ({_pct(r['planned_bytes'] / r['program_bytes'] - 1)}) | {stand} |")
  errs = [abs(l / m - 1) for l, m in zip(loo, measured)]
  worst = max(range(len(rows)), key=lambda i: errs[i]) if len(rows) >= 2 else None
  mem = [abs(r["planned_bytes"] / r["program_bytes"] - 1) for r in rows]
  within = sum(e <= 0.10 for e in errs)
  out += ["", f"Step time: {within} of {len(rows)} configurations within 10% left out (the target); largest "
          + ("n/a" if worst is None else f"{_pct(loo[worst] / measured[worst] - 1)} ({rows[worst]['config']})")
          + f". Memory: planned per-chip bytes against the measured program's (arguments + outputs + temporaries, "
          f"donated buffers once), largest error {_pct(max(mem))}."]
  bound = [r["config"] for r in rows if r["hbm_s"] > r["compute_s"] / cal.a[GENERATION]]
  if bound:
    out += ["", "HBM-bound under the fit (HBM at full bandwidth above compute / a): " + ", ".join(bound) + ". The "
            "model takes HBM traffic at the chip's full bandwidth; a fraction of it would be a second parameter, told "
            "only by these rows, so it is not fitted."]
  out += ["", f"Pairs measured: {len(pairs)} ({', '.join(pairs)}). The target is every pair; with one pair, "
          "\"every pair\" cannot be checked yet, and the leave-one-config-out errors above are within one pair: "
          "they do not show how the chip source carries to another pair's shapes.",
          "", f"Compiled on {os.cpu_count()} CPU cores shared with other jobs; plan seconds per row (one chip): "
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


def _old_stand_in(row: dict) -> dict | None:
  """A row stored by the first version of this script (terms of the stand-in only) as its ``stand_in``."""
  if "stand_in_wire_bytes" not in row:
    return row.get("stand_in")
  return {"mesh": row["mesh"], "global_batch": row["global_batch"], "compute_s": row["compute_s"],
          "hbm_s": row["hbm_s"], "comm_s": row["stand_in_comm_s"], "wire_bytes": row["stand_in_wire_bytes"],
          "planned_bytes": row["planned_bytes"], "plan_seconds": row["plan_seconds"]}


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--render", action="store_true", help="refit from the stored .json (no compile)")
  ap.add_argument("--jsonl", default=MEASURED, help="the measured rows (tpu_step.py's jsonl)")
  ap.add_argument("--only", default=None, help="compile only configurations whose key contains this text")
  ap.add_argument("--recompile", action="store_true", help="compile configurations already stored too")
  ap.add_argument("--stand-in", action="store_true", help=f"also compile the stand-in over all of {TOPOLOGY} "
                  f"(data={STAND_IN}) where a row has none")
  args = ap.parse_args()
  sys.path.insert(0, os.path.join(HERE, "..", "src"))
  stored = load()
  if not args.render:
    have = {(r["pair"], r["config"]): r for r in stored}
    for (pair, key), r in measured_configs(args.jsonl).items():
      old = have.get((pair, key))
      done = old is not None and "stand_in_wire_bytes" not in old and not args.recompile
      if done and (old.get("stand_in") or not args.stand_in) or args.only and args.only not in key:
        continue
      terms = ({k: old[k] for k in ONE_CHIP_FIELDS} if done else plan_terms(pair, r["setting"]))
      stand_in = None if old is None else _old_stand_in(old)
      if stand_in is None and args.stand_in:
        stand_in = stand_in_terms(pair, r["setting"])
      row = row_of(pair, r, terms, stand_in)
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
