"""The chip calibration source's rows and report, shared by `plan_chip.py` (which compiles the rows) and
`plan_calibration.py` (whose report ends with `section`): which measured row stands for each configuration, the fit
over the stored rows (`meshdistill.planner._calibrate.calibrate_chip`), its leave-one-config-out check, the report
section and the `CHIP_CALIBRATION` literal."""

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
  """Whether a row was measured with the package's own splash blocks (`_attention._splash_block_sizes`)."""
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


def row_name(row: dict) -> str:
  """A measured configuration's name in `CHIP_CALIBRATION.row_names`: its pair and its configuration."""
  return f"{row['pair']} {row['config']}"


def fit_rows(rows: list[dict]):
  """The chip calibration over ``rows`` and each row's leave-one-config-out step time (NaN with one row)."""
  from meshdistill.planner import _calibrate  # pylint: disable=g-import-not-at-top

  terms = [(r["compute_s"], r["hbm_s"], r["comm_s"]) for r in rows]
  measured = [r["step_s"] for r in rows]
  gens = [GENERATION] * len(rows)
  cal = _calibrate.calibrate_chip(terms, measured, [row_name(r) for r in rows])
  loo = (_calibrate.leave_one_out(terms, measured, gens, k=cal.k, fit_h=True) if len(rows) >= 2
         else [math.nan] * len(rows))
  return cal, loo, terms, measured


def leave_one_pair_out(rows: list[dict]) -> list[float]:
  """Each row's step time predicted by the chip fit over the rows of the OTHER pairs (`lopo_fit`; NaN with one
  pair)."""
  if len({r["pair"] for r in rows}) < 2:
    return [math.nan] * len(rows)
  fits = {pair: lopo_fit(rows, pair) for pair in {r["pair"] for r in rows}}
  return [float(fits[r["pair"]].predict([(r["compute_s"], r["hbm_s"], r["comm_s"])], [GENERATION])[0]) for r in rows]


def lopo_fit(rows: list[dict], pair: str):
  """The chip fit (``a`` and ``h``) over the rows of every pair but ``pair``."""
  from meshdistill.planner import _calibrate  # pylint: disable=g-import-not-at-top

  other = [r for r in rows if r["pair"] != pair]
  return _calibrate.fit([(r["compute_s"], r["hbm_s"], r["comm_s"]) for r in other], [r["step_s"] for r in other],
                        [GENERATION] * len(other), _calibrate.HELD_K, fit_h=len(other) >= 2)


def lopo_a(rows: list[dict], pair: str) -> float:
  """``a`` of the chip fit over the rows of every pair but ``pair``."""
  return float(lopo_fit(rows, pair).a[GENERATION])


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
         f"a[{GENERATION}] = {cal.a[GENERATION]:.3f} of the peak matmul rate (published source: "
         f"{pub.a[GENERATION]:.3f}) and h = {cal.h:.3f} of the HBM bandwidth (the published source holds it at 1): "
         "step = max(compute / a, HBM / h). One chip has no collectives, so `k` (held at "
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
  hbm_bound = [r["hbm_s"] / cal.h > r["compute_s"] / cal.a[GENERATION] for r in rows]
  bound = [f"{r['pair']} {r['config']}" for r, b in zip(rows, hbm_bound) if b]
  a_only = _calibrate.fit(terms, measured, [GENERATION] * len(rows), _calibrate.HELD_K)  # h held at 1
  plain = a_only.predict(terms, [GENERATION] * len(rows))
  errs_a = [p / m - 1 for p, m, b in zip(plain, measured, hbm_bound) if b]
  out += ["", "HBM-bound under the fit (HBM / h above compute / a): " + (", ".join(bound) or "none") + ". These rows "
          "tell `h`, the others `a`. Fitted with `h` held at 1 (the roofline's full bandwidth, as the published "
          f"source has it), a = {a_only.a[GENERATION]:.3f} and these rows' errors are "
          + (", ".join(_pct(e) for e in errs_a) or "none") + ". HBM time at full bandwidth over the measured "
          "step, per configuration: " + "; ".join(
              f"{r['pair']} {r['config']}: {100 * r['hbm_s'] / r['step_s']:.0f}%" for r in rows) + "."]
  if len(pairs) < 2:
    out += ["", f"Pairs measured: {len(pairs)} ({', '.join(pairs)}). The target is every pair; with one pair, "
            "\"every pair\" cannot be checked yet, and the leave-one-config-out errors above are within one pair: "
            "they do not show how the chip source carries to another pair's shapes."]
  else:
    lopo = leave_one_pair_out(rows)
    per_pair = []
    for pair in pairs:
      idx = [i for i, r in enumerate(rows) if r["pair"] == pair]
      errs_p = [lopo[i] / measured[i] - 1 for i in idx]
      other = lopo_fit(rows, pair)
      span = _pct(errs_p[0]) if len(errs_p) == 1 else f"{_pct(min(errs_p))} to {_pct(max(errs_p))}"
      others, n_other = ("other pairs'" if len(pairs) > 2 else "other pair's"), len(rows) - len(idx)
      per_pair.append(f"{pair} ({len(idx)} configuration{'s' * (len(idx) > 1)}) {span}, from a = "
                      f"{other.a[GENERATION]:.3f}, h = {other.h:.3f} fitted on the {others} {n_other} "
                      f"row{'s' * (n_other > 1)}")
    worst_pair = max(abs(lopo[i] / measured[i] - 1) for i in range(len(rows)))
    out += ["", f"Pairs measured: {len(pairs)} ({', '.join(pairs)}). Leave one pair out (the fit over the other "
            "pairs' rows predicting this pair's: how the chip source carries to shapes it was not fitted on): "
            + "; ".join(per_pair) + f". Largest error {100 * worst_pair:.1f}%: the target (within 10% on every pair) "
            + ("holds." if worst_pair <= 0.10 else "is not met.")]
  out += ["", "Compiled on a small CPU machine shared with other jobs (each row stores its load average); plan "
          "seconds per row (one chip): "
          + ", ".join(f"{r['plan_seconds']:.0f}" for r in rows) + "."]
  return "\n".join(out) + "\n"


def calibration_literal(rows: list[dict]) -> str:
  """`planner._calibrate.CHIP_CALIBRATION`'s source for the stored rows (printed; pasted into `_calibrate.py`)."""
  cal = fit_rows(rows)[0]
  names = ",\n        ".join(f'"{n}"' for n in cal.row_names)
  return (f"CHIP_CALIBRATION = Calibration(\n    a={{\"{GENERATION}\": {cal.a[GENERATION]:.6f}}}, "
          f"a_pooled={cal.a_pooled:.6f}, k={cal.k:.6f}, h={cal.h:.6f},\n"
          f"    band={{\"{GENERATION}\": {cal.band[GENERATION]:.6f}}}, "
          f"rows={cal.rows}, comm_share=0.0, source=\"chip\",\n    row_names=(\n        {names}))")


def load() -> list[dict]:
  return json.load(open(JSON, encoding="utf-8")) if os.path.exists(JSON) else []


