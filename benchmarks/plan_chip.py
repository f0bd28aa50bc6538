"""The planner against one TPU v5e chip: the chip calibration source, fitted on steps measured there.

Each measured configuration of `benchmarks/tpu_step.py` (its ``meshdistill`` rows in ``tpu_step.jsonl``: the pair,
batch, remat policy, loss chunk and attention kernel of a `tpu_step.Setting`) is planned here with the same model
configs (`tpu_step.model_configs`) and the same distillation settings as `tpu_step.measure_plan`, compiled for the
one-chip topology ``v5e:1x1`` (`bench.chip_pairs.pair_planner`'s ``one_chip``): the one-chip program, with no
collectives, as ``md.plan(..., devices="local")`` compiles it on the chip. ``--stand-in`` also compiles each for all
of ``v5e:2x2`` with mesh ``data=4`` at four times the batch (the same rows per chip, plus one gradient all-reduce the
chip does not have), stored beside the row as a check of how far that stand-in moves the terms and the memory.

The chip source (`train.cost.ChipCalibration`, `calibrate_chip`) is fitted over one row per configuration
(the measurement with the package's splash blocks where there is one, else the row measured with other blocks, said
in the row): the TPU compiler's estimated cycles of the program (matmul fusions and the rest) and the attention
kernels' executed FLOPs, against the measured step.

  python benchmarks/plan_chip.py --stand-in            # compile every measured configuration not yet stored
  python benchmarks/plan_chip.py --jsonl PATH --only b=2  # measured rows from PATH; only configurations with b=2
  python benchmarks/plan_chip.py --recompile --pair gemma3  # compile that pair's stored configurations again
  python benchmarks/plan_chip.py --recompile --pair qwen3 --config b=4,t=2048,remat=dots_no_batch,chunk=1024,attn=splash
  python benchmarks/plan_chip.py --render              # refit and print the section from the stored .json

Writes ``benchmarks/results/plan_calibration_chip.json`` (per configuration: the measured step and program bytes,
the planner's terms and memory) and prints the `CHIP_CALIBRATION` literal (`train/cost.py` holds it;
tests/test_plan_cost.py refits it from the json). ``plan_calibration.py --render`` writes its section into
``plan_calibration.md`` (`bench.chip_calibration.section`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.chip_calibration import (JSON, MEASURED, STAND_IN, TOPOLOGY, calibration_literal,
                                    config_key, load, measured_configs, package_blocks, section)


def _planner(pair: str, setting: dict, one_chip: bool = False):
  """The `Planner` of a measured setting for `TOPOLOGY` (``one_chip``: for one chip of its family; the models and
  distillation settings of `tpu_step.measure_plan`: `bench.chip_pairs.pair_planner`) and the setting."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import dataclasses  # pylint: disable=g-import-not-at-top

  from bench.chip_pairs import Setting, pair_planner  # pylint: disable=g-import-not-at-top

  s = Setting(**{k: v for k, v in setting.items() if k in {f.name for f in dataclasses.fields(Setting)}})
  return pair_planner(pair, s, TOPOLOGY, one_chip=one_chip), s


def plan_terms(pair: str, setting: dict) -> dict:
  """The planner's roofline terms and memory of the one-chip program at ``setting``: compiled for ``v5e:1x1`` (no
  collectives: the program `md.plan(..., devices="local")` compiles on one chip)."""
  from meshdistill.planner import Knobs  # pylint: disable=g-import-not-at-top

  pl, s = _planner(pair, setting, one_chip=True)
  t0 = time.perf_counter()
  p = pl.plan(Knobs(1, 1, s.remat, s.chunk_size, s.b))
  seconds = time.perf_counter() - t0
  if p.collectives:
    raise ValueError(f"the one-chip program of {setting} has collectives: {p.collectives}")
  if "cycles" not in p.time:
    raise ValueError(f"the one-chip program of {setting} carries no estimated cycles of the TPU compiler")
  return {"compiled_for": pl.target.name, "compute_s": p.time["compute_s"], "hbm_s": p.time["hbm_s"],
          "comm_s": 0.0, "flops_per_chip": p.flops["counted"], "kernel_flops_per_chip": p.flops["kernels"],
          "cycles": p.time["cycles"], "kernel_s": p.time["kernel_s"],
          "planned_bytes": p.memory["total"], "planned_temp_bytes": p.memory["temp"],
          "planned_peak_bytes": p.memory["compiler_peak"], "fits": p.fits,
          "plan_seconds": seconds, "load_average": os.getloadavg()[0]}


def stand_in_terms(pair: str, setting: dict) -> dict:
  """The same at `STAND_IN`: all of `TOPOLOGY` over ``data``, the measured rows per chip (its one gradient
  all-reduce the chip does not have): what the per-chip terms and memory move by against the one-chip program."""
  from meshdistill.planner import Knobs  # pylint: disable=g-import-not-at-top

  pl, s = _planner(pair, setting)
  t0 = time.perf_counter()
  p = pl.plan(Knobs(STAND_IN, 1, s.remat, s.chunk_size, STAND_IN * s.b))
  return {"mesh": [STAND_IN, 1], "global_batch": STAND_IN * s.b, "compute_s": p.time["compute_s"],
          "hbm_s": p.time["hbm_s"], "comm_s": p.time["comm_s"],
          "wire_bytes": sum(c["wire_bytes"] for c in p.collectives), "planned_bytes": p.memory["total"],
          "plan_seconds": time.perf_counter() - t0}


ONE_CHIP_FIELDS = ("compiled_for", "compute_s", "hbm_s", "comm_s", "flops_per_chip", "kernel_flops_per_chip",
                   "cycles", "kernel_s", "planned_bytes", "planned_temp_bytes", "planned_peak_bytes", "fits",
                   "plan_seconds", "load_average")


def row_of(pair: str, r: dict, terms: dict, stand_in: dict | None) -> dict:
  s = r["setting"]
  return {"pair": pair, "config": config_key(s), "setting": s, "measured_label": r["label"], "tag": r.get("tag"),
          "device": r.get("device"), "package_blocks": package_blocks(s), "step_s": r["step_s"],
          "program_bytes": r["program_bytes"], "measured_peak_bytes": r.get("compiler_peak_bytes"), **terms,
          "stand_in": stand_in}


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
  ap.add_argument("--pair", default=None, help="compile only this pair's configurations (e.g. gemma3)")
  ap.add_argument("--config", default=None, help="compile only the configuration of exactly this key")
  ap.add_argument("--recompile", action="store_true", help="compile configurations already stored too")
  ap.add_argument("--stand-in", action="store_true", help=f"also compile the stand-in over all of {TOPOLOGY} "
                  f"(data={STAND_IN}) where a row has none")
  args = ap.parse_args()
  stored = load()
  if not args.render:
    have = {(r["pair"], r["config"]): r for r in stored}
    for (pair, key), r in measured_configs(args.jsonl).items():
      old = have.get((pair, key))
      done = (old is not None and "stand_in_wire_bytes" not in old and "cycles" in old and not args.recompile
              and old.get("step_s") == r["step_s"])  # a row measured again is planned again
      if (done and (old.get("stand_in") or not args.stand_in) or args.only and args.only not in key
          or args.pair and args.pair != pair or args.config and args.config != key):
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
