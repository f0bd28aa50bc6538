"""The chip calibration source's rows and report, shared by `plan_chip.py` (which compiles the rows) and
`plan_calibration.py` (whose report ends with `section`): which measured row stands for each configuration, the fit
over the stored rows (`meshdistill.planner._calibrate.calibrate_chip`), its leave-one-config-out and
leave-one-pair-out checks, the report section and the `CHIP_CALIBRATION` literal."""

from __future__ import annotations

import json
import math
import os


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
JSON = os.path.join(RESULTS, "plan_calibration_chip.json")
MEASURED = os.path.join(RESULTS, "tpu_step.jsonl")
TOPOLOGY = "v5e:2x2"  # the smallest v5e topology libtpu takes: one of its devices is compiled for
STAND_IN = 4  # the data-axis size of the stand-in over all of TOPOLOGY (a check: `stand_in_terms`)
GENERATION = "v5e"
GIB = 2**30


def config_key(setting: dict) -> str:
  """What the planner sees of a measured setting: pair-independent batch, sequence, remat, chunk, attention (the
  splash blocks and AdamW's first-moment dtype of `tpu_step.Setting` besides, and which models scan their layers)."""
  mu, scan = setting.get("mu", "float32"), setting.get("scan", "both")
  return (f"b={setting['b']},t={setting['t']},remat={setting['remat']},chunk={setting['chunk']},"
          f"attn={setting['attn']}" + ("" if mu == "float32" else f",mu={mu}")
          + ("" if scan == "both" else f",scan={scan}"))


def package_blocks(setting: dict) -> bool:
  """Whether a row was measured with the package's own splash blocks (`meshdistill.models.splash_block_sizes`)."""
  return setting.get("attn") != "splash" or setting.get("blocks") in ("default", "q512-kv1024-c512-fused")


def measured_configs(path: str = MEASURED) -> dict[tuple[str, str], dict]:
  """One measured row per (pair, `config_key`) of the successful ``meshdistill`` rows at ``path``: the newest with
  the package's splash blocks, else the newest measured with other blocks; rows of an earlier checkout (``code``)
  are left out."""
  out: dict[tuple[str, str], dict] = {}
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  for r in rows:
    if r.get("system", "meshdistill") != "meshdistill" or "step_s" not in r or "setting" not in r:
      continue
    if r["setting"].get("metrics", "full") != "full":  # the planner compiles the full step
      continue
    if r.get("code"):  # measured with an earlier checkout (a same-call before/after), not the code planned
      continue
    key = (r["pair"], config_key(r["setting"]))
    have = out.get(key)
    if have is None or package_blocks(r["setting"]) or not package_blocks(have["setting"]):
      out[key] = r
  return out


# calls that measured an earlier program than the one the planner compiles now (the ninth session's query/key kernel,
# `models/_head_prep.py`, made the Qwen3 and Gemma 3 steps 6-18% faster; Llama's 64-wide heads keep the XLA form,
# and its rows are all later): shown beside the fit, not fitted
EARLIER_CODE_TAGS = ("explore", "final", "pairs", "side-by-side", "s4-", "s5-", "s6-", "s7-", "s8-")


def earlier_code(row: dict) -> bool:
  """Whether a stored row was measured on an earlier program than the planner compiles (`EARLIER_CODE_TAGS`)."""
  return (row.get("tag") or "").startswith(EARLIER_CODE_TAGS)


def fitted(rows: list[dict]) -> list[dict]:
  """The rows the chip source is fitted on: those measured on the program the planner compiles now."""
  return [r for r in rows if not earlier_code(r)]


def row_name(row: dict) -> str:
  """A measured configuration's name in `CHIP_CALIBRATION.row_names`: its pair and its configuration."""
  return f"{row['pair']} {row['config']}"


def chip_terms(row: dict) -> tuple[float, float, float]:
  """A stored row's terms of the chip source: the compiler's estimated cycles of matmul fusions and of the rest, and
  the attention kernels' executed FLOPs at peak (`ChipCalibration`)."""
  return (row["cycles"]["matmul"], row["cycles"]["other"], row["kernel_s"])


def fit_rows(rows: list[dict]):
  """The chip calibration over ``rows`` and each row's leave-one-config-out step time (NaN with too few rows)."""
  from meshdistill.planner import _calibrate  # pylint: disable=g-import-not-at-top

  terms = [chip_terms(r) for r in rows]
  measured = [r["step_s"] for r in rows]
  cal = _calibrate.calibrate_chip(terms, measured, [row_name(r) for r in rows])
  return cal, _calibrate.chip_leave_one_out(terms, measured), terms, measured


def leave_one_pair_out(rows: list[dict], fit_on: list[dict] | None = None) -> list[float]:
  """Each row's step time predicted by the chip fit over the rows of ``fit_on`` (default ``rows``) of the OTHER
  pairs (NaN with one pair, or fewer than four other rows)."""
  from meshdistill.planner import _calibrate  # pylint: disable=g-import-not-at-top

  fit_on = rows if fit_on is None else fit_on
  fits = {}
  for pair in {r["pair"] for r in rows}:
    other = [o for o in fit_on if o["pair"] != pair]
    fits[pair] = (_calibrate.fit_chip([chip_terms(o) for o in other], [o["step_s"] for o in other])
                  if len(other) >= 4 else None)
  return [math.nan if fits[r["pair"]] is None else float(fits[r["pair"]].predict([chip_terms(r)])[0]) for r in rows]


def _pct(x: float) -> str:
  return "n/a" if x != x else f"{100 * x:+.1f}%"


def _ms(x: float) -> str:
  return "n/a" if x != x else f"{1e3 * x:.0f}"


def section(rows: list[dict]) -> str:
  """The chip section of ``plan_calibration.md``: per measured configuration, the planner's estimates (published
  source; chip source fit, leave-one-config-out and leave-one-pair-out) beside the measured step time, and planned
  against measured memory."""
  from meshdistill.planner import _calibrate  # pylint: disable=g-import-not-at-top

  if not rows:
    return "## The chip source\n\nNo measured configuration compiled yet (`python benchmarks/plan_chip.py`).\n"
  fit_set = fitted(rows)
  cal, loo_fitted, _, _ = fit_rows(fit_set)
  earlier = [r for r in rows if earlier_code(r)]
  rows = fit_set + earlier  # the fitted rows, then those measured on earlier code (predicted by the whole fit)
  terms = [chip_terms(r) for r in rows]
  measured = [r["step_s"] for r in rows]
  loo = loo_fitted + [float(x) for x in cal.predict([chip_terms(r) for r in earlier])]
  lopo = leave_one_pair_out(rows, fit_set)
  pub = _calibrate.CALIBRATION
  pairs = sorted({r["pair"] for r in fit_set})
  clock = 1.5e9
  out = ["## The chip source: steps measured on one TPU v5e chip", "",
         "`python benchmarks/plan_chip.py --stand-in`: each configuration measured by `benchmarks/tpu_step.py` on "
         "one TPU v5e chip (`tpu_step.jsonl`, the row named in the table), planned with the same models and "
         "settings. libtpu refuses a one-chip topology, so each step is compiled for one device of "
         f"{TOPOLOGY}: the one-chip program, without collectives, as `md.plan(..., devices=\"local\")` compiles it "
         f"on the chip. As a check, each is also compiled for all of {TOPOLOGY} with mesh data={STAND_IN} at "
         f"{STAND_IN}x the batch (the same rows per chip; its one gradient all-reduce is the stand-in's own): the "
         "*stand-in* columns. These rows are their own source (`train.cost.CHIP_CALIBRATION`, "
         "`plan_calibration_chip.json`), kept apart from the published pod rows above (`CALIBRATION`, "
         "`plan_calibration.json`): `md.plan(..., devices=\"local\")` on one chip of the generation the chip rows "
         "were measured on takes the chip source, every other target the published one (`_calibrate.source_for`).",
         "",
         "The chip source's model (`ChipCalibration`): step = matmul cycles x s_matmul + other cycles x s_other + "
         "kernels / f. The cycles are the TPU compiler's own `estimated_cycles` of each instruction it schedules, "
         "loops counted whole, split into matmul fusions and the rest (`train.cost.estimated_cycles`); the "
         "kernels are the splash attention kernels the compiler does not estimate, at the FLOPs they execute (every "
         "block the causal or sliding mask touches computed whole, heads narrower than 128 lanes padded: "
         "`train.cost.kernel_flops(executed=True)`) at peak. A roofline scaled by one fraction of peak and "
         "one of the HBM bandwidth (the published source's form, this source's until now) left Llama and Qwen3 "
         "steps up to 23% apart left one pair out.", "",
         f"Fitted over {cal.rows} configurations of {len(pairs)} pair{'s' * (len(pairs) > 1)} ({', '.join(pairs)}), "
         "each measured on the program the planner compiles now (rows measured on earlier code follow below the "
         "fitted ones, marked, predicted by the whole fit and not in it: "
         + (", ".join(f"{r['pair']} {r['config']} ({r['tag']})" for r in earlier) or "none") + "): "
         f"s_matmul = {cal.s_matmul * clock:.3f} and s_other = {cal.s_other * clock:.3f} cycles of the chip's "
         f"1.5 GHz per estimated cycle (the chip runs both faster than the compiler estimates, the work outside "
         f"matmuls more so), f = {cal.kernel_fraction:.3f} of peak in the attention kernels. Band (largest "
         f"leave-one-config-out error): +-{100 * cal.band:.1f}%.", "",
         "| pair | configuration | measured row (splash blocks; tag) | measured ms | roofline ms: max(compute, HBM) | "
         "published source ms (error) | compiler's estimate at 1.5 GHz: matmul + other ms | kernels at peak ms | "
         "chip source, fit ms (error) | leave one config out ms (error) | leave one pair out ms (error) | "
         "measured program GiB | planned GiB (error) | measured compiler peak GiB | planned peak GiB (error) | "
         "stand-in: roofline ms, planned GiB (error) |",
         "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  fit_ms = cal.predict(terms)
  old = pub.predict([(r["compute_s"], r["hbm_s"], r["comm_s"]) for r in rows], [GENERATION] * len(rows))
  for r, t, f, o, l, lp, m in zip(rows, terms, fit_ms, old, loo, lopo, measured):
    blocks = r["setting"].get("blocks", "default") if r["setting"]["attn"] == "splash" else "n/a"
    own = "" if r["package_blocks"] else ", not the package's"
    si = r.get("stand_in")
    stand = "not compiled" if not si else (
        f"{1e3 * max(si['compute_s'], si['hbm_s']):.0f}, {si['planned_bytes'] / GIB:.2f} "
        f"({_pct(si['planned_bytes'] / r['program_bytes'] - 1)})")
    peak, planned_peak = r.get("measured_peak_bytes"), r.get("planned_peak_bytes")
    peaks = ("n/a | n/a" if not peak or not planned_peak else
             f"{peak / GIB:.2f} | {planned_peak / GIB:.2f} ({_pct(planned_peak / peak - 1)})")
    tag = f"{r['tag']}, earlier code: not fitted" if earlier_code(r) else r["tag"]
    out.append(f"| {r['pair']} | {r['config']} | {blocks}{own}; {tag} | {1e3 * m:.0f} | "
               f"{1e3 * max(r['compute_s'], r['hbm_s']):.0f}: max({1e3 * r['compute_s']:.0f}, "
               f"{1e3 * r['hbm_s']:.0f}) | {1e3 * o:.0f} ({_pct(o / m - 1)}) | "
               f"{1e3 * t[0] / clock:.0f} + {1e3 * t[1] / clock:.0f} | {1e3 * t[2]:.0f} | "
               f"{1e3 * f:.0f} ({_pct(f / m - 1)}) | {_ms(l)} ({_pct(l / m - 1)}) | {_ms(lp)} ({_pct(lp / m - 1)}) | "
               f"{r['program_bytes'] / GIB:.2f} | {r['planned_bytes'] / GIB:.2f} "
               f"({_pct(r['planned_bytes'] / r['program_bytes'] - 1)}) | {peaks} | {stand} |")
  n = len(fit_set)
  errs = [abs(l / m - 1) for l, m in zip(loo[:n], measured[:n])]
  worst = max(range(n), key=lambda i: errs[i] if errs[i] == errs[i] else -1)
  mem = [abs(r["planned_bytes"] / r["program_bytes"] - 1) for r in fit_set]
  peak_errs = [abs(r["planned_peak_bytes"] / r["measured_peak_bytes"] - 1) for r in fit_set
               if r.get("planned_peak_bytes") and r.get("measured_peak_bytes")]
  within = sum(e <= 0.10 for e in errs)
  older = "; ".join(f"{r['pair']} {r['config']} {_pct(p / r['step_s'] - 1)}" for r, p in zip(earlier, loo[n:]))
  out += ["", f"Step time: {within} of {n} fitted configurations within 10% left out (the target); largest "
          f"{_pct(loo[worst] / measured[worst] - 1)} ({rows[worst]['pair']} {rows[worst]['config']})"
          + (f". Measured on earlier code (not fitted), against the fit: {older}: the planner plans this code's "
             "program, faster than the one they measured" if earlier else "") + ". Memory of the fitted "
          "configurations: "
          "planned per-chip bytes against the measured program's (arguments + outputs + temporaries, donated buffers "
          f"once), largest error {_pct(max(mem))}"
          + (f"; the compiler's peak of live buffers (what a fit is judged on, `MemoryReport.need_bytes`), planned "
             f"on this host against the chip's own compile, largest error {_pct(max(peak_errs))} over "
             f"{len(peak_errs)} configurations" if peak_errs else "") + "."]
  if len(pairs) < 2:
    out += ["", f"Pairs measured: {len(pairs)} ({', '.join(pairs)}): leaving one pair out needs two."]
  else:
    per_pair = []
    for pair in pairs:
      idx = [i for i, r in enumerate(fit_set) if r["pair"] == pair]
      errs_p = [lopo[i] / measured[i] - 1 for i in idx]
      span = _pct(errs_p[0]) if len(errs_p) == 1 else f"{_pct(min(errs_p))} to {_pct(max(errs_p))}"
      n_other = n - len(idx)
      per_pair.append(f"{pair} ({len(idx)} configuration{'s' * (len(idx) > 1)}) {span}, fitted on the other "
                      f"pairs' {n_other} row{'s' * (n_other > 1)}")
    known = [abs(lopo[i] / measured[i] - 1) for i in range(n) if lopo[i] == lopo[i]]
    worst_pair = max(known) if known else math.nan
    out += ["", f"Pairs measured: {len(pairs)} ({', '.join(pairs)}). Leave one pair out (the fit over the other "
            "pairs' rows predicting this pair's: how the chip source carries to shapes it was not fitted on): "
            + "; ".join(per_pair) + f". Largest error {100 * worst_pair:.1f}%: the target (within 10% on every pair) "
            + ("holds." if worst_pair <= 0.10 else "is not met.")]
  out += ["", "Compiled on a small CPU machine shared with other jobs (each row stores its load average); plan "
          "seconds per row (one chip): "
          + ", ".join(f"{r['plan_seconds']:.0f}" for r in rows) + "."]
  return "\n".join(out) + "\n"


def calibration_literal(rows: list[dict]) -> str:
  """`train.cost.CHIP_CALIBRATION`'s source for the stored rows (printed; pasted into `train/cost.py`)."""
  cal = fit_rows(fitted(rows))[0]
  names = ",\n        ".join(f'"{n}"' for n in cal.row_names)
  return (f"CHIP_CALIBRATION: ChipCalibration | None = ChipCalibration(\n    generation=\"{GENERATION}\", "
          f"s_matmul={cal.s_matmul:.6e}, s_other={cal.s_other:.6e}, kernel_fraction={cal.kernel_fraction:.6f},\n"
          f"    band={cal.band:.6f}, rows={cal.rows},\n    row_names=(\n        {names}))")


def load() -> list[dict]:
  return json.load(open(JSON, encoding="utf-8")) if os.path.exists(JSON) else []


