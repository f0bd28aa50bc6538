"""The planner's roofline against published MaxText pod measurements, and the calibrated model fitted on them.

For each `meshdistill.planner._published.PUBLISHED` row: the plain training step (teacher-less `Distiller`,
`NextTokenCE`, AdamW, bfloat16 compute, the Pallas splash attention as MaxText's ``attention: flash``) compiled with
libtpu for the row's slice at its sequence and global batch, weights and moments split over ``data`` (``mesh.fsdp``)
and over ``tensor`` where the recipe sets MaxText's tensor parallelism. Its FLOPs, bytes and collectives come from
the step compiled once with scanned blocks, each loop of the program counted whole (body x trip count,
`meshdistill.planner._cost`). Then the roofline terms, the fit over every row (a fraction of peak per TPU generation,
one collective cost: `meshdistill.planner._calibrate`), each row left out, each generation left out.

  python benchmarks/plan_calibration.py --small --rows 8,9   # compile rows (minutes each), fit, write the report
  python benchmarks/plan_calibration.py --render             # refit and rewrite the report from the stored .json

Writes benchmarks/results/plan_calibration.json (the rows' terms) and plan_calibration.md, and prints the
`CALIBRATION` literal of the fit (`planner/_calibrate.py` holds it; tests/test_plan_cost.py refits it from the json).
The report ends with the chip source's section (`bench.chip_calibration.section`, from plan_calibration_chip.json:
steps measured on one TPU v5e chip, fitted apart from these rows; `plan_chip.py` compiles them) and prints its
`CHIP_CALIBRATION` literal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
JSON = os.path.join(HERE, "results", "plan_calibration.json")
MD = os.path.join(HERE, "results", "plan_calibration.md")
# MaxText's remat policies as ours, by how much each recomputes: "full" recomputes the block, as ours; "minimal"
# (checkpoint_dots_with_no_batch_dims) keeps the weight projections' outputs, our "dots_no_batch". The Trillium
# recipes' "custom" (decoder input and q/k/v/out projections offloaded to host, the rest recomputed: the MLP, the
# attention context) and "qkv_proj_offloaded" (only q/k/v offloaded, all else recomputed:
# src/MaxText/layers/decoders.py) do about 7.6-7.8 N matmul FLOPs per token for 6 N of model FLOPs: as our "full"
# (8 N), not "dots" (6 N), which besides keeps those outputs in HBM (Mistral 7B at 6 x 8192 tokens: 149 GiB of a v6e
# chip's 31). "save_dot_except_mlpwi" recomputes only the MLP's input projections (about 7 N): compiled as "dots".
REMAT = {"full": "full", "minimal": "dots_no_batch", "custom": "full", "qkv_proj_offloaded": "full"}
REMAT_OTHER = "dots"


# the slices compiled for when --small: 16 chips, the same batch per chip
SMALL = {"v6e": "v6e:4x4", "v5p": "v5p:2x2x4", "v5e": "v5e:4x4"}
# rows whose weights and moments do not fit 16 chips of their generation: the smallest slice they fit, with --small
SMALL_ROW = {10: "v5p:2x4x4"}
# v6e rows that do not fit a v6e chip's 31.25 GiB as we compile them (MaxText offloads activations to host; the Llama
# 3.1 rows' float32 logits over 128,256 words alone take 12.6-21 GiB per chip; Mistral 7B at 6 x 8192 tokens asked
# 36.1 GiB with remat "full", Llama 2 70B at 3 x 4096 91.6 GiB): their counts are compiled for v5p chips (95 GiB; as
# many as the row's, or 32 for the 70B models, whose weights and moments need them) and timed at v6e's rates
PROXY = {0: "v5p:2x2x4", 1: "v5p:2x4x4", 2: "v5p:2x4x4", 11: "v5p:2x2x2", 12: "v5p:2x2x4", 13: "v5p:2x2x2"}

# rows whose program at the published batch does not fit their chips as we compile it (the v5p rows at MaxText's
# "minimal" remat asked 193-221 GiB of HLO temporaries of 95.7 per chip; the v5e 128B row, 16 rows per data shard,
# 53.3 GiB of 15.75; Llama 2 70B at 3 x 4096 tokens per chip, remat "full", 91.6 GiB of a v6e chip's 31.25): compiled
# at two smaller batches, ``rows`` and 2 x ``rows`` per data shard, and
# every count (FLOPs, HBM bytes, collective bytes) extended linearly to the published batch (each is affine in the
# batch: the per-token work, plus the weights' and the optimizer's once per step)
EXTRAPOLATED = {1: 1, 2: 1, 7: 1, 8: 4, 9: 1, 10: 1}


def remat_of(maxtext: str) -> str:
  """Our remat policy for MaxText's ``remat_policy`` ``maxtext`` (`REMAT`, else `REMAT_OTHER`)."""
  return REMAT.get(maxtext.split(" ")[0], REMAT_OTHER)


def model_of(pub):
  """The `ModelConfig` of a published row: `_published.MODELS`' config.json, else a planner preset."""
  from meshdistill.models import config_from_hf  # pylint: disable=g-import-not-at-top
  from meshdistill.planner import _presets, _published  # pylint: disable=g-import-not-at-top

  if pub.model in _published.MODELS:
    return config_from_hf(_published.MODELS[pub.model], where=f"{pub.model} config.json")
  model, _ = _presets.resolve_model(pub.model, who="student")
  return model


def row_terms(i: int, small: bool = False, fast: bool = False) -> dict:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from meshdistill.config import load_config
  from meshdistill.jobs import strategy_and_optimizer
  from meshdistill.parallel.mesh import make_mesh
  from meshdistill.core.chips import TPU_CHIPS
  from meshdistill.planner import _compile, _cost, _hardware, _published
  from meshdistill.train.hardlabel import NextTokenCE

  pub = _published.PUBLISHED[i]
  remat = remat_of(pub.remat)
  model = model_of(pub).replace(dtype="bfloat16", attention="splash", remat=remat)
  model = model.replace(max_len=max(model.max_len, pub.seq))
  small = small and pub.chips > 16  # a slice of 16 chips or fewer is compiled as published
  topology = PROXY.get(i) or ((SMALL_ROW.get(i) or SMALL[pub.generation]) if small else pub.topology)
  target = _hardware.tpu_target(topology)
  chip = TPU_CHIPS[pub.generation]  # the row's chip: its rates time the counts
  n = len(target.devices)
  batch = pub.batch // pub.chips * n  # the published batch per chip
  mesh = make_mesh(data=n // pub.tensor, tensor=pub.tensor, devices=target.devices)
  _, optimizer = strategy_and_optimizer(load_config(None, ()), model.n_layers)  # the default AdamW

  t0 = time.perf_counter()
  d = _compile.abstract_distiller(None, model.replace(scan_layers=True), NextTokenCE(), optimizer, mesh, fsdp=True,
                                  compiler_options=_compile.FAST_COMPILE if fast else None)

  def counts_at(b: int) -> tuple[float, float, list[dict]]:
    compiled = _compile.compile_step(d, b, pub.seq)
    if compiled.flops is None:
      raise ValueError(f"row {i} ({pub.name}) did not fit {topology} at batch {b}: {compiled.oom}")
    c = _cost.loop_counts(compiled, (n // pub.tensor, pub.tensor), (0, model.n_layers))  # scanned blocks whole
    return c.flops, c.bytes_accessed, c.collectives

  shard_rows = EXTRAPOLATED.get(i)
  if shard_rows is None:
    flops, bytes_accessed, collectives = counts_at(batch)
    wire = sum(c["wire_bytes"] for c in collectives)
    compiled_batches = [batch]
  else:  # two smaller batches, every count extended linearly to the published one
    b1, b2 = shard_rows * (n // pub.tensor), 2 * shard_rows * (n // pub.tensor)
    (f1, y1, c1), (f2, y2, collectives) = counts_at(b1), counts_at(b2)
    line = lambda q1, q2: q1 + (q2 - q1) * (batch - b1) / (b2 - b1)  # noqa: E731
    flops, bytes_accessed = line(f1, f2), line(y1, y2)
    wire = line(sum(c["wire_bytes"] for c in c1), sum(c["wire_bytes"] for c in collectives))
    compiled_batches = [b1, b2]
  seconds = time.perf_counter() - t0
  tokens = batch * pub.seq
  kernels = 2.0 * pub.seq * model.n_heads * model.hd * model.n_layers * (3 + (remat != "none")) * tokens / n
  n_params = model.n_layers * (model.d_model * model.hd * (2 * model.n_heads + 2 * model.n_kv_heads)
                               + 3 * model.d_model * model.mlp_hidden) + model.vocab_size * model.d_model
  compute = (flops + kernels) / chip.peak_bf16_flops
  hbm = bytes_accessed / chip.hbm_bandwidth
  comm = wire / chip.ici_bandwidth
  return {"row": i, "name": pub.name, "topology": pub.topology, "compiled_for": topology, "chips": n,
          "mesh": [n // pub.tensor, pub.tensor], "seq": pub.seq, "batch": batch, "remat": remat,
          "compiled_batches": compiled_batches,
          "flops_per_chip": flops, "kernel_flops_per_chip": kernels, "bytes_per_chip": bytes_accessed,
          "wire_bytes_per_chip": wire, "collectives": collectives, "matmul_params": n_params,
          "compute_s": compute, "hbm_s": hbm, "comm_s": comm, "roofline_s": max(compute, hbm) + comm,
          "compile_s": seconds, "fast_compile": fast, "load_average": os.getloadavg()[0]}


def row_name(pub) -> str:
  """A published row's name in `CALIBRATION.row_names`: the model and its slice."""
  return f"{pub.name} on {pub.topology}"


def fit_rows(rows: list[dict]):
  """The calibration over the stored ``rows`` and each row's leave-one-out and leave-generation-out step time."""
  from meshdistill.planner import _calibrate, _published  # pylint: disable=g-import-not-at-top

  pubs = [_published.PUBLISHED[r["row"]] for r in rows]
  terms = [(r["compute_s"], r["hbm_s"], r["comm_s"]) for r in rows]
  measured = [p.step_seconds for p in pubs]
  gens = [p.generation for p in pubs]
  if not rows:
    return None, [], [], terms, measured, gens
  cal = dataclasses.replace(_calibrate.calibrate(terms, measured, gens), row_names=tuple(row_name(p) for p in pubs))
  loo = _calibrate.leave_one_out(terms, measured, gens) if len(rows) >= 2 else [float("nan")] * len(rows)
  lgo = _calibrate.leave_generation_out(terms, measured, gens)
  return cal, loo, lgo, terms, measured, gens


def _pct(x: float) -> str:
  return "n/a" if x != x else f"{100 * x:+.1f}%"  # NaN: not computable


def render(rows: list[dict], command: str) -> str:
  from meshdistill.planner import _published  # pylint: disable=g-import-not-at-top

  pub_of = lambda r: _published.PUBLISHED[r["row"]]  # noqa: E731
  cal, loo, lgo, terms, measured, gens = fit_rows(rows)
  by_row = {r["row"]: (r, j) for j, r in enumerate(rows)}
  fitted = cal.predict(terms, gens) if cal else []
  out = ["# The planner's step time against published measurements", "",
         "`" + command + "`: each row is a published MaxText plain-pretraining measurement (the page and the "
         "configuration, commit pinned, in the last column) and the planner's plan of the same step: the "
         "teacher-less `Distiller` with `NextTokenCE`, AdamW, bfloat16 compute, splash attention, weights and "
         "moments split over the `data` axis (`mesh.fsdp`) and, where MaxText's recipe sets "
         "`ici_tensor_parallelism`, the same tensor split (mesh data x tensor), compiled with libtpu's compiler on "
         "this CPU host with its loops counted whole (`planner._cost`). Remat, by what each recomputes: MaxText's "
         "`full` as ours, `minimal` as `dots_no_batch`, the Trillium recipes' `custom` and `qkv_proj_offloaded` "
         "(projections offloaded to host, the MLP recomputed) as `full`, `save_dot_except_mlpwi` as `dots` (`REMAT` "
         "in the script). Planned on: the published slice, or with "
         "`--small` a smaller slice of the generation at the published batch per chip (FLOPs and bytes per chip "
         "the same; the FSDP collectives per chip within (n-1)/n of the published slice's); rows that do not fit a "
         "v6e chip as compiled here are compiled for v5p chips (as many, or 32 for the 70B rows) and timed at v6e's "
         "rates (`PROXY`); rows that do not fit at the published batch are compiled at two smaller batches and every "
         "count extended linearly to it (`EXTRAPOLATED`, said in the row).", "",
         "Roofline: the compiled step's max(compute at peak, HBM) + collectives at full ICI bandwidth, an upper "
         "bound on speed. Calibrated: max(compute / a[generation], HBM, collectives) + k x collectives, a fraction of peak per "
         "TPU generation and one k, fitted by least squares on log step time (scipy `least_squares`; "
         "`planner._calibrate`). *Fit*: every row in the fit. *Leave-one-out* (LOO): each row predicted by the fit "
         "over the others (a row alone in its generation then gets the pooled fraction, one `a` over the other "
         "rows). *Leave-generation-out* (LGO): each row predicted from the other generations' rows only (the pooled "
         "fraction): what a plan on a generation without published rows can expect. Tokens/s per chip throughout; "
         "errors are of tokens/s against the published figure.", "",
         "| # | model | slice | seq | global batch | remat (MaxText) | published tokens/s/chip | published MFU | "
         "planned on | roofline | calibrated, fit | calibrated, LOO | LOO error | LGO | LGO error | compile s | "
         "source |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for i, p in enumerate(_published.PUBLISHED):
    tp = "" if p.tensor == 1 else f", tensor {p.tensor}"
    head = (f"| {i} | {p.name} | {p.topology} ({p.chips} chips{tp}) | {p.seq} | {p.batch} | {p.remat} | "
            f"{p.tokens_per_chip:,.0f} | {100 * p.mfu:.1f}% | ")
    if i not in by_row:
      out.append(head + "not compiled (see below) | n/a | n/a | n/a | n/a | n/a | n/a | n/a | " + p.source + " |")
      continue
    r, j = by_row[i]
    per_chip = lambda s, r=r: r["batch"] * r["seq"] / (s * r["chips"])  # noqa: E731
    err = lambda s: per_chip(s) / p.tokens_per_chip - 1  # noqa: E731
    num = lambda s: "n/a" if s != s else f"{per_chip(s):,.0f}"  # noqa: E731
    fast = ", --fast-compile" if r.get("fast_compile") else ""
    if r["compiled_for"].split(":")[0] != p.generation:
      fast += f", timed at {p.generation} rates (`PROXY`)"
    if len(r.get("compiled_batches", [])) == 2:
      fast += ", counts compiled at batch {} and {}, extended linearly (`EXTRAPOLATED`)".format(*r["compiled_batches"])
    mesh = r.get("mesh", [r["chips"], 1])
    out.append(head + f"{r['compiled_for']} ({r['chips']} chips, mesh {mesh[0]}x{mesh[1]}, batch {r['batch']}, "
               f"remat {r.get('remat', remat_of(p.remat))}{fast}) | {per_chip(r['roofline_s']):,.0f} | "
               f"{num(fitted[j]) if cal else 'n/a'} | {num(loo[j])} | {_pct(err(loo[j]))} | {num(lgo[j])} | "
               f"{_pct(err(lgo[j]))} | {r['compile_s']:.0f} | {p.source} |")
  out.append("")
  if cal is None:
    out.append("Fit: not made: no row compiled. `planner._calibrate.CALIBRATION` stays None; plans print the "
               "roofline only.")
    return "\n".join(out) + "\n"
  count = {g: gens.count(g) for g in cal.a}
  held = "" if len(rows) > len(cal.a) else f" (held at {cal.k:g}: no generation has two rows, so k cannot be fitted)"
  out.append("Fitted parameters (over " + f"{cal.rows} rows): " + "; ".join(
      f"a[{g}] = {a:.3f} ({count[g]} row{'s' * (count[g] > 1)})" for g, a in cal.a.items())
      + f"; pooled a = {cal.a_pooled:.3f} (a generation without rows); k = {cal.k:.3f}{held} (collective seconds per "
      "second of ideal ring traffic not hidden behind compute).")
  out.append("")
  out.append("Error bands on step time (the planner prints them beside the estimate): " + "; ".join(
      f"{g}: +-{100 * b:.1f}%" + (" (its only row, predicted with the pooled a)" if count[g] == 1 else "")
      for g, b in cal.band.items()) + f"; a generation without rows (largest leave-generation-out error): "
      f"+-{100 * cal.band_unseen:.1f}%.")
  errs = [(j, abs(m / l - 1)) for j, (l, m) in enumerate(zip(loo, measured))]  # of tokens/s, as the table's
  miss = [(j, e) for j, e in errs if e > 0.15]
  worst = max(e for _, e in errs)
  verdict = (f"Against the 15% aim: {len(errs) - len(miss)} of {len(errs)} rows' leave-one-out estimates of tokens/s "
             f"per chip are within 15% of the published figure (largest error {100 * worst:.1f}%; the bands above "
             "are of step time, the planner's estimate: a tokens/s error e is a step-time error 1/(1+e) - 1).")
  if miss:
    verdict += " Missing it: " + "; ".join(
        f"row {rows[j]['row']} ({pub_of(rows[j]).name} on {pub_of(rows[j]).topology}, {100 * e:.1f}%"
        + (", alone in its generation: predicted with the pooled a" if count[gens[j]] == 1 else "") + ")"
        for j, e in miss) + "."
  out.append(verdict)
  lgo_errs = [abs(m / l - 1) for l, m in zip(lgo, measured) if l == l]
  if lgo_errs:
    out += ["", f"Leave-generation-out: {sum(e <= 0.15 for e in lgo_errs)} of {len(lgo_errs)} rows within 15%, "
            f"largest error {100 * max(lgo_errs):.1f}%: the fraction of peak does not carry from one TPU generation "
            "to another, so a plan on a generation without published rows (e.g. tpu7x) gets the pooled a and this "
            "wide band."]
  out += ["", "The remat mapping matters at this band: row 2 as stored before with `dots` (nothing recomputed; compute "
          "5.81 s, roofline 6.78 s per step, `git show 894b35b:benchmarks/results/plan_calibration.json`) reaches 50% "
          "of the published speed at the roofline, as compiled now with `full` (MaxText's `qkv_proj_offloaded` "
          "recomputes the MLP and the output projection) 60%, beside the other v6e rows' 53-61%."]
  old = [r["row"] for r in rows if "mesh" not in r]
  if old:
    out += ["", f"Row(s) {', '.join(map(str, old))}: stored from the earlier counting of this script (commit 8e98687: "
            "the step compiled unrolled at 1 and 2 blocks, extended linearly to the depth; the same count as the "
            "scanned one on the pair of tests/test_plan_cost.py), not in the commands above: the scanned compile of "
            "row 3 at its published batch (4 rows per chip, remat `dots`) asks 284.35 GiB of HLO temporaries of "
            "95.74 on 16 v5p chips, about 71 GiB per row, so `EXTRAPOLATED` has no two batches that fit."]
  out += ["", "Roofline over published step time per row (how close each measured run came to the roofline): "
          + "; ".join(f"{r['row']} ({pub_of(r).name}, {r['topology']}): {100 * r['roofline_s'] / m:.0f}%"
                      for r, m in zip(rows, measured)) + "."]
  missing = [i for i in range(len(_published.PUBLISHED)) if i not in by_row]
  if missing:
    v5e = [str(i) for i in missing if _published.PUBLISHED[i].generation == "v5e"]
    other = [str(i) for i in missing if _published.PUBLISHED[i].generation != "v5e"]
    cmds = ([f"`python benchmarks/plan_calibration.py --small --rows {','.join(other)}`"] if other else []) + (
        [f"`python benchmarks/plan_calibration.py --rows {','.join(v5e)}`"] if v5e else [])
    why = {1: "row 1 (Llama 3.1 70B at 5 x 8192 tokens per chip) did not fit 16 v5p chips (its v6e proxy, `PROXY`) "
              "even at 2 rows per data shard: 100.35 GiB of HLO temporaries of 95.74; a 32-chip proxy with "
              "`EXTRAPOLATED` at 1 row per shard is the next thing to try"}
    out += ["", "Not compiled: " + "; ".join(why.get(i, f"row {i}, for lack of time") for i in missing)
            + f" ({' and '.join(cmds)})."]
  if any(r.get("fast_compile") for r in rows):
    out += ["", "Rows marked `--fast-compile` were compiled with XLA's least execution-time effort "
            "(`planner._compile.FAST_COMPILE`): FLOPs and collectives within 0.5% of the default compile's "
            "(`benchmarks/results/plan_speed.md`), HBM bytes another program's."]
  out += ["", "Roofline terms per compiled row (seconds per step): " + "; ".join(
      f"{r['row']}: compute {r['compute_s']:.2f} (splash attention "
      f"{r['kernel_flops_per_chip'] / (r['flops_per_chip'] + r['kernel_flops_per_chip']) * 100:.0f}% of it), HBM "
      f"{r['hbm_s']:.2f}, collectives {r['comm_s']:.2f}, published step {m:.2f}" for r, m in zip(rows, measured))
      + "."]
  loads = [r["load_average"] for r in rows if r.get("load_average") is not None]
  load = "" if not loads else f" (1-minute load average {min(loads):.1f}-{max(loads):.1f} at the end of each compile)"
  out += ["", f"Compiled with Python {platform.python_version()} on {os.cpu_count()} CPU cores shared with other "
          f"jobs{load}; compile s is the wall time of each row's compile and loop count on that machine."]
  return "\n".join(out) + "\n"


def calibration_literal(rows: list[dict]) -> str:
  """`planner._calibrate.CALIBRATION`'s source for the stored rows (printed; pasted into `train/cost.py`)."""
  cal = fit_rows(rows)[0]
  if cal is None:
    return "CALIBRATION: Calibration | None = None"
  a = ", ".join(f'"{g}": {v:.6f}' for g, v in cal.a.items())
  band = ", ".join(f'"{g}": {v:.6f}' for g, v in cal.band.items())
  names = ",\n        ".join(f'"{n}"' for n in cal.row_names)
  return (f"CALIBRATION: Calibration | None = Calibration(\n    a={{{a}}}, a_pooled={cal.a_pooled:.6f}, "
          f"k={cal.k:.6f},\n    band={{{band}}}, band_unseen={cal.band_unseen:.6f}, rows={cal.rows},\n"
          f"    comm_share={cal.comm_share:.6f}, source=\"published\",\n    row_names=(\n        {names}))")


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--render", action="store_true", help="refit and rewrite the report from the stored .json")
  ap.add_argument("--rows", default=None, help="comma-separated row numbers to compile (default: all)")
  ap.add_argument("--fast-compile", action="store_true", help="compile with XLA's least execution-time effort "
                  "(planner._compile.FAST_COMPILE): FLOPs and collectives as the default compile's, about 3x faster")
  ap.add_argument("--small", action="store_true", help="compile each row for a 16-chip slice of its generation at "
                  "the published batch per chip (the 256 / 512-chip compiles take too long on a small machine)")
  args = ap.parse_args()
  from bench import chip_calibration  # pylint: disable=g-import-not-at-top
  from meshdistill.planner import _published  # pylint: disable=g-import-not-at-top

  stored = json.load(open(JSON)) if os.path.exists(JSON) else []
  if not args.render:
    wanted = range(len(_published.PUBLISHED)) if args.rows is None else [int(x) for x in args.rows.split(",")]
    for i in wanted:
      try:
        r = row_terms(i, args.small, args.fast_compile)
      except ValueError as e:  # e.g. the program out of HBM: no counts for this row
        print(f"row {i}: {e}", flush=True)
        continue
      print(json.dumps({k: v for k, v in r.items() if k != "collectives"}), flush=True)
      stored = [s for s in stored if s["row"] != i] + [r]
      stored.sort(key=lambda s: s["row"])
      with open(JSON, "w") as f:
        json.dump(stored, f, indent=1)
  with open(MD, "w") as f:
    def rows_of(fast: bool, small: bool) -> list[str]:
      return [str(r["row"]) for r in stored if bool(r.get("fast_compile")) == fast and "mesh" in r
              and (r["compiled_for"] != r["topology"]) == small]

    commands = []
    for fast in (False, True):
      for small in (True, False):
        rows = rows_of(fast, small)
        if rows:
          flags = (" --small" if small else "") + (" --fast-compile" if fast else "")
          commands.append(f"python benchmarks/plan_calibration.py{flags} --rows " + ",".join(rows))
    command = "`; `".join(commands) or "python benchmarks/plan_calibration.py"
    f.write(render(stored, command) + "\n" + chip_calibration.section(chip_calibration.load()))
  print(open(MD).read())
  print(calibration_literal(stored))
  print(chip_calibration.calibration_literal(chip_calibration.load()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
