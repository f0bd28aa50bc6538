"""Long sequences on one chip: the longest row the headline pair trains at batch 1, planned and measured.

The pair is `tpu_step.py`'s ``qwen3``: Qwen3-1.7B (bfloat16 weights) distilled into a 14-layer Qwen3-0.6B-shaped
student (float32 weights, AdamW), both computing in bfloat16 with scanned layers and splash attention,
``ChunkedLogitKD`` (forward KL at temperature 2, alpha 0.5), batch 1. A configuration is a sequence length, the
student's remat policy, the loss chunk and the splash kernel's blocks (`bench.chip_pairs.Setting`; `BLOCKS`: the
package's, whose fused backward keeps a dq partial per key block, memory that grows as T^2, and its forward blocks
with a dq pass of its own); a sequence past Qwen3's ``max_len`` (40,960) raises that bound
(`bench.chip_pairs.model_configs`). Configurations form ladders, one per (blocks, remat, chunk), short to long.

Planned (default; a CPU host with libtpu, no chip): each configuration compiled for one v5e chip (one device of
``v5e:2x2``, `bench.chip_pairs.pair_planner`: the program ``md.plan(..., devices="local")`` compiles on the chip, its
calibrated time from the chip source), one at a time. A plan *fits* where the compiler's peak is at most
``safeguards.remat.headroom`` (0.9) x the chip's 16 GiB, the rule ``distill``'s automatic remat uses; the compiler
itself refuses a program over 15.75 GiB (out of HBM). A ladder is planned up to its first configuration the compiler
refuses: between the two limits a configuration does not fit the plan's rule and may still run.
Configurations already stored are not planned again (``--replan``: they are). Each plan row keeps its compile's wall
and CPU seconds.

Measured (``--measure``, on the chip): from the stored plans of ``--seqs`` / ``--remats`` / ``--chunks`` /
``--blocks``, each ladder's longest configuration that fits (``--every-fit``: every one), the longer ones the compiler
made (over the headroom) and the first it refused (the limit, seen from both sides), in one process, shortest
sequence first; a ladder stops at its first configuration that fails on the chip (out of HBM is a row with its error,
not a crash). Each row: the step's median of 3 after one warm-up step (the first loads the program just compiled:
`bench.chip_step.measure`), tokens/s, MFU, the compiler's peak (what a fit is judged on) and the process's peak HBM
(`peak_bytes_in_use`, which keeps the largest configuration run so far: shortest first, it is the current one's while
a ladder climbs). ``--config`` names the configurations instead (``t=32768,remat=full,chunk=1024``; batch 1 and
splash unless given); ``--budget S`` starts none after S seconds.

  python benchmarks/long_context.py                          # plan (minutes of CPU per configuration)
  python benchmarks/long_context.py --measure --commit SHA   # on the chip; rows appended to --out
  python benchmarks/long_context.py --render                 # long_context.md: planned and measured side by side

Rows are appended to ``--out`` (default ``benchmarks/results/long_context.jsonl``), each with its date, the commit of
the code (``--commit``, default this checkout's HEAD; refused without either), the command, and the chip (or the
topology compiled for), jax and libtpu versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import shlex
import sys
import time

from bench.chip_pairs import PAIRS, Setting, pair_planner
from bench.results import append_row, libtpu_version, write_keeping_notes

RESULTS = pathlib.Path(__file__).parent / "results"
JSONL = RESULTS / "long_context.jsonl"
PAIR = "qwen3"  # `--pair`: another of `bench.chip_pairs.PAIRS` (``tiny``: a smoke test on any machine)
TOPOLOGY = "v5e:2x2"  # planned as one chip of its family (v5e:1x1: `bench.chip_pairs.pair_planner`'s one_chip)
SEQS = (8192, 16384, 32768, 65536, 131072)
REMATS = ("dots_no_batch", "full")  # the least remat that fitted 2048-token rows, and the least memory
CHUNKS = (1024,)
# the splash kernel's blocks (`chip_step.use_splash_blocks`): the package's (its fused backward accumulates dq in the
# dk/dv pass, one [T, head_dim] partial per 1024-token key block of every head, summed after: memory that grows as
# T^2), and its forward blocks with the backward in two passes, dq in one of its own (512-token query and 1024-token
# key blocks; memory linear in T)
BLOCKS = ("default", "q512-kv1024-c512")
BLOCK_NAMES = {"default": "fused backward (the package's)", "q512-kv1024-c512": "separate dq pass"}
STEPS, WARMUP = 3, 1  # timed steps after the warm-up step that loads the compiled program
GIB = 2**30


def ladder_key(s: dict) -> tuple[str, str, int]:
  """The ladder a setting belongs to: its splash blocks, remat policy and loss chunk."""
  return s.get("blocks", "default"), s["remat"], s["chunk"]


def config_key(s: dict) -> tuple[str, str, int, int]:
  return (*ladder_key(s), s["t"])


def ladder_order(key: tuple) -> tuple:
  blocks, remat, chunk, *t = key
  return (BLOCKS.index(blocks) if blocks in BLOCKS else 99, REMATS.index(remat) if remat in REMATS else 99, chunk, *t)


def setting_of(t: int, remat: str, chunk: int, blocks: str = "default") -> Setting:
  return Setting(b=1, t=t, remat=remat, chunk=chunk, attn="splash", blocks=blocks)


def load(path: str) -> list[dict]:
  if not os.path.isfile(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def newest(rows: list[dict], kind: str, pair: str = PAIR) -> dict[tuple, dict]:
  """The newest row of each configuration of ``pair`` and ``kind`` (``plan`` or ``measured``), in file order."""
  return {config_key(r["setting"]): r for r in rows if r.get("kind") == kind and r.get("pair") == pair}


def plan_row(s: Setting, pair: str = PAIR) -> dict:
  """``s`` planned for one v5e chip: fits, memory, roofline and calibrated step, tokens/s, compile seconds."""
  from meshdistill.planner import Knobs

  from bench.chip_step import use_splash_blocks

  row = {"kind": "plan", "pair": pair, "setting": dataclasses.asdict(s), "label": s.label(),
         "device": "TPU v5 lite (compiled for v5e:1x1 on a CPU host)"}
  cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
  try:
    pl = pair_planner(pair, s, TOPOLOGY, one_chip=True)
    with use_splash_blocks(s.blocks):  # the step is traced with the setting's blocks
      p = pl.plan(Knobs(1, 1, s.remat, s.chunk_size, s.b))
  except Exception as e:  # noqa: BLE001 -- a configuration the planner refuses is a result too
    row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    return row
  cpu1 = resource.getrusage(resource.RUSAGE_SELF)
  mem, cal = p.memory, p.time.get("calibrated") or {}
  row.update(fits=p.fits, need_bytes=mem.get("need"), compiler_peak_bytes=mem.get("compiler_peak"),
             total_bytes=mem.get("total"), temp_bytes=mem.get("temp"), budget_bytes=p.budget_bytes,
             headroom=p.headroom, roofline_s=p.time.get("step_s"), calibrated_s=cal.get("step_s"),
             calibrated_low_s=cal.get("low_s"), calibrated_high_s=cal.get("high_s"), source=cal.get("source"),
             tokens_per_s=s.b * s.t / cal["step_s"] if cal.get("step_s") else None, mfu=cal.get("mfu"),
             compile_seconds=p.compile_seconds, plan_seconds=time.perf_counter() - t0,
             cpu_seconds=(cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
             load_average=os.getloadavg()[0], notes=[n for n in p.notes if "stopped" in n])
  return row


def compiled(row: dict) -> bool:
  """Whether the TPU compiler made the row's program (it may still be over the headroom the plan's fit allows)."""
  return "error" not in row and row.get("compiler_peak_bytes") is not None


def plan_ladders(seqs, remats, chunks, blocks, stored: dict[tuple, dict], replan: bool, keep,
                 pair: str = PAIR) -> None:
  """Plans each ladder from its shortest sequence, stopping after its first configuration the TPU compiler refuses
  (out of HBM: no longer sequence can fit; a stored row counts as planned unless ``replan``); ``keep`` stores each
  new row."""
  for block in blocks:
    for remat in remats:
      for chunk in chunks:
        for t in sorted(seqs):
          row = None if replan else stored.get((block, remat, chunk, t))
          if row is None:
            print(f"planning t={t}, remat={remat}, chunk={chunk}, blocks={block}", flush=True)
            row = keep(plan_row(setting_of(t, remat, chunk, block), pair))
          if not compiled(row):
            break


def chip_list(plans: dict[tuple, dict], seqs=None, remats=None, chunks=None, blocks=None,
              every_fit: bool = False) -> list[Setting]:
  """The configurations to measure from the stored plans (only those of ``seqs``, ``remats``, ``chunks``, ``blocks``
  where given): in each ladder its longest that fits (``every_fit``: every one that fits; the ladder's shortest where
  none does), every longer one the compiler made (over the plan's headroom, which the chip may still run) and the
  first it refused: each limit seen from both sides. Shortest sequence first across ladders."""
  out = []
  ladders: dict[tuple, list[dict]] = {}
  for r in plans.values():
    s = r["setting"]
    if (seqs is None or s["t"] in seqs) and (remats is None or s["remat"] in remats) and (
        chunks is None or s["chunk"] in chunks) and (blocks is None or s.get("blocks", "default") in blocks):
      ladders.setdefault(ladder_key(s), []).append(r)
  for rows in ladders.values():
    rows = sorted(rows, key=lambda r: r["setting"]["t"])
    fitting = [i for i, r in enumerate(rows) if r.get("fits") is True]
    start = 0 if every_fit or not fitting else fitting[-1]
    for r in rows[start:]:
      out.append(setting_of(r["setting"]["t"], r["setting"]["remat"], r["setting"]["chunk"],
                            r["setting"].get("blocks", "default")))
      if not compiled(r):
        break
  return sorted(out, key=lambda s: (s.t, *ladder_order(ladder_key(vars(s)))))


def measure_all(settings: list[Setting], keep, budget_s: float | None, pair: str = PAIR) -> None:
  """Measures ``settings`` in order in this process; a ladder stops at its first failure (its row keeps the error),
  and no configuration starts after ``budget_s`` seconds (said on stdout; it has no row)."""
  from bench.chip_step import measure, use_splash_blocks

  failed: set[tuple] = set()
  t0 = time.perf_counter()
  for i, s in enumerate(settings):
    where = f"[{i + 1}/{len(settings)}, {time.perf_counter() - t0:.0f} s]"
    if ladder_key(vars(s)) in failed:
      print(f"{where} {s.label()}: skipped, its ladder failed at a shorter sequence", flush=True)
      continue
    if budget_s is not None and time.perf_counter() - t0 > budget_s:
      print(f"{where} {s.label()}: not started, past the --budget of {budget_s:.0f} s", flush=True)
      continue
    print(f"{where} {s.label()}: starting", flush=True)
    with use_splash_blocks(s.blocks):  # every program of this setting is traced with its blocks
      row = keep({"kind": "measured", **measure(pair, s, STEPS, False, None, warmup=WARMUP)})
    if "error" in row:
      failed.add(ladder_key(vars(s)))


def summary(r: dict) -> str:
  s = r["setting"]
  head = f"{r['kind']} t={s['t']}, remat={s['remat']}, chunk={s['chunk']}, blocks={s.get('blocks', 'default')}:"
  if "error" in r:
    return f"{head} {r['error'][:300]}"
  if r["kind"] == "plan":
    peak = r["compiler_peak_bytes"] or r["need_bytes"] or 0
    step = f"{r['calibrated_s'] * 1e3:.0f} ms calibrated, {r['tokens_per_s']:,.0f} tokens/s" if r["calibrated_s"] \
        else "no step time"
    return (f"{head} fits={r['fits']}, compiler peak {peak / GIB:.2f} GiB, {step}; compiled in "
            f"{r['compile_seconds']:.0f} s ({r['cpu_seconds']:.0f} CPU s)")
  peaks = [(r.get(k) or 0) / GIB for k in ("compiler_peak_bytes", "peak_bytes")]
  return (f"{head} {r['step_s'] * 1e3:.0f} ms, {r['tokens_per_s']:,.0f} tokens/s, MFU {100 * (r['mfu'] or 0):.1f}%, "
          f"compiler peak {peaks[0]:.2f} GiB, chip peak {peaks[1]:.2f} GiB")


# ------------------------------------------------------------------------------------------------ the report
def _gib(x) -> str:
  return "" if not x else f"{x / GIB:.2f}"


def _blocks(spec: str) -> str:
  return f"{BLOCK_NAMES[spec]} (`{spec}`)" if spec in BLOCK_NAMES else f"`{spec}`"


def _result(r: dict | None) -> str:
  if r is None:
    return "not run"
  if "error" in r:
    return "out of HBM" if "RESOURCE_EXHAUSTED" in r["error"] else " ".join(r["error"][:80].replace("|", "/").split())
  return "ran"


def _planned_peak(r: dict | None) -> str:
  """The plan's compiler peak in GiB; where the compiler ran out of HBM, the arguments and the temporaries it named."""
  if r is None or "error" in r:
    return ""
  if r.get("compiler_peak_bytes") is None:
    return f"{_gib(r.get('need_bytes'))} (arguments + temporaries)" if r.get("need_bytes") else ""
  return _gib(r["compiler_peak_bytes"])


def _planned(r: dict | None) -> str:
  if r is None:
    return "not planned"
  if "error" in r:
    return _result(r)
  if r.get("compiler_peak_bytes") is None:
    return "out of HBM (compile)"
  return "fits" if r["fits"] else f"over {r['headroom'] * r['budget_bytes'] / GIB:.1f} GiB"


def longest(rows: dict[tuple, dict], ok) -> dict[tuple, int]:
  """The longest sequence of each ladder whose row satisfies ``ok``, with every shorter one of the ladder also ``ok``
  (a ladder's limit)."""
  out: dict[tuple, int] = {}
  by_ladder: dict[tuple, list[dict]] = {}
  for r in rows.values():
    by_ladder.setdefault(ladder_key(r["setting"]), []).append(r)
  for key, rs in by_ladder.items():
    for r in sorted(rs, key=lambda r: r["setting"]["t"]):
      if not ok(r):
        break
      out[key] = r["setting"]["t"]
  return out


def render(jsonl: str = str(JSONL), md_path: str = str(RESULTS / "long_context.md")) -> str:
  """``long_context.md`` from the stored rows: each ladder's longest sequence planned and measured, then each
  configuration's newest plan beside its newest measurement, then where the rows come from. Notes written below the
  marker are kept."""
  rows = load(jsonl)
  plans, measured = newest(rows, "plan"), newest(rows, "measured")
  fit = longest(plans, lambda r: r.get("fits") is True)
  ran = longest(measured, lambda r: "step_s" in r)
  out = ["# Long sequences on one TPU v5e chip", "",
         "Generated by `python benchmarks/long_context.py --render` from `long_context.jsonl` (the script's docstring "
         "says how each row is made). Qwen3-1.7B (bfloat16 weights) -> 14-layer Qwen3-0.6B-shaped student (float32, "
         "AdamW), batch 1, splash attention, scanned layers, `ChunkedLogitKD` (T 2, alpha 0.5). *Planned*: compiled "
         "for one v5e chip on a CPU host (one device of v5e:2x2); it fits where the compiler's peak is at most "
         "`safeguards.remat.headroom` (0.9) x the chip's 16 GiB = 14.4 GiB (the rule `distill`'s automatic remat "
         "uses; the compiler itself stops at 15.75 GiB, *out of HBM (compile)*); ms from the chip calibration "
         "source, tokens/s = seq / ms. *Measured*: on one v5e chip, median of 3 steps after one warm-up step; "
         "compiler peak = the chip's own compile, chip peak = the process's `peak_bytes_in_use` (it keeps the "
         "largest configuration run before: the rows ran shortest first). MFU counts causal attention's FLOPs "
         "(`tpu_step.py`'s docstring).", "",
         "## The longest sequence at batch 1", "",
         "| splash backward (blocks) | student remat | loss chunk | planned (fits) | measured (ran) |",
         "|---|---|---:|---:|---:|"]
  for key in sorted(set(fit) | set(ran) | {ladder_key(r["setting"]) for r in plans.values()}, key=ladder_order):
    def cell(longest_of: dict, rows: dict) -> str:
      tried = [r["setting"]["t"] for r in rows.values() if ladder_key(r["setting"]) == key]
      if not tried:
        return "not measured" if rows is measured else "not planned"
      return f"{longest_of[key]:,}" if key in longest_of else f"none of {min(tried):,} and up"

    fit_cell, meas = cell(fit, plans), cell(ran, measured)
    out.append(f"| {_blocks(key[0])} | `{key[1]}` | {key[2]} | {fit_cell} | {meas} |")
  out += ["", "## Each configuration, planned and measured", "",
          "| splash backward (blocks) | student remat | loss chunk | seq | planned | planned compiler peak GiB | "
          "planned ms (calibrated) | planned tokens/s | measured | ms / step | tokens/s | MFU | measured compiler "
          "peak GiB | chip peak GiB | plan commit | chip commit |",
          "|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
  for key in sorted(set(plans) | set(measured), key=ladder_order):
    p, m = plans.get(key), measured.get(key)
    blocks, remat, chunk, t = key
    planned_ms = planned_tps = ""
    if p is not None and p.get("calibrated_s"):
      planned_ms = f"{p['calibrated_s'] * 1e3:,.0f}"
      planned_tps = f"{p['tokens_per_s']:,.0f}"
    ms = tps = mfu = ""
    if m is not None and "step_s" in m:
      ms, tps, mfu = f"{m['step_s'] * 1e3:,.0f}", f"{m['tokens_per_s']:,.0f}", f"{100 * (m.get('mfu') or 0):.1f}%"
    out.append(f"| {_blocks(blocks)} | `{remat}` | {chunk} | {t:,} | {_planned(p)} | {_planned_peak(p)} | "
               f"{planned_ms} | {planned_tps} | {_result(m)} | {ms} | {tps} | {mfu} | "
               f"{_gib(m and m.get('compiler_peak_bytes'))} | {_gib(m and m.get('peak_bytes'))} | "
               f"{(p or {}).get('commit', '')} | {(m or {}).get('commit', '')} |")
  out += ["", "## Where the rows come from", "", "| rows | date | commit | chip | jax | libtpu | command |",
          "|---|---|---|---|---|---|---|"]
  seen = {}
  for r in [*plans.values(), *measured.values()]:
    k = (r["kind"], r.get("date"), r.get("commit"), r.get("device"), r.get("jax"), r.get("libtpu"), r.get("command"))
    seen[k] = seen.get(k, 0) + 1
  for (kind, *cells), n in seen.items():
    cells[-1] = f"`{cells[-1]}`".replace("|", "\\|") if cells[-1] else ""
    out.append(f"| {n} {kind} | " + " | ".join(str(c or "") for c in cells) + " |")
  text = "\n".join(out) + "\n"
  write_keeping_notes(md_path, text)
  return text


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--measure", action="store_true", help="measure on this machine's chip (else: plan)")
  parser.add_argument("--pair", choices=sorted(PAIRS), default=PAIR, help="the pair (tiny: a smoke test)")
  parser.add_argument("--render", action="store_true", help="only rewrite long_context.md from the stored rows")
  parser.add_argument("--seqs", default=",".join(map(str, SEQS)), help="sequence lengths (multiples of 128)")
  parser.add_argument("--remats", default=",".join(REMATS), help="the student's remat policies")
  parser.add_argument("--chunks", default=",".join(map(str, CHUNKS)), help="loss chunk sizes")
  parser.add_argument("--blocks", default=",".join(BLOCKS),
                      help="the splash kernel's blocks (tpu_step.py's form: default, q512-kv1024-c512[-fused])")
  parser.add_argument("--replan", action="store_true", help="plan configurations already stored again")
  parser.add_argument("--config", action="append", default=[],
                      help="--measure: this configuration instead of the plans' list (repeatable), e.g. "
                           "t=32768,remat=full,chunk=1024")
  parser.add_argument("--every-fit", action="store_true",
                      help="--measure: every configuration that fits, not only each ladder's longest")
  parser.add_argument("--budget", type=float, default=None,
                      help="--measure: start no configuration after this many seconds")
  parser.add_argument("--jsonl", default=str(JSONL), help="the stored rows (plans read from here)")
  parser.add_argument("--out", default=None, help="where new rows are appended (default: --jsonl)")
  parser.add_argument("--commit", default=None, help="the commit of the code (default: this checkout's HEAD)")
  args = parser.parse_args(argv)
  if args.render:
    print(render(args.jsonl))
    return 0
  from bench.chip_step import commit_or_exit, stamp

  commit = commit_or_exit(parser, args.commit)
  command = " ".join(["python3 benchmarks/long_context.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
  out = args.out or args.jsonl
  seqs = [int(x) for x in args.seqs.split(",")]
  stored = load(args.jsonl)

  def keep(row: dict) -> dict:
    stamp(row, commit, command)
    print(summary(row), flush=True)
    append_row(out, row)
    return row

  if not args.measure:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPU is compiled for, not used
    t0 = time.perf_counter()
    plan_ladders(seqs, args.remats.split(","), [int(x) for x in args.chunks.split(",")], args.blocks.split(","),
                 newest(stored, "plan", args.pair), args.replan, keep, args.pair)
    print(f"planning took {time.perf_counter() - t0:.0f} s", flush=True)
    return 0
  import jax

  from bench.chip_step import use_compile_cache

  use_compile_cache()
  print(f"devices: {jax.devices()}, jax {jax.__version__}, libtpu {libtpu_version()}", flush=True)
  if args.config:
    settings = [Setting.parse("b=1,attn=splash," + text) for text in args.config]
  else:
    settings = chip_list(newest(stored, "plan", args.pair), set(seqs), set(args.remats.split(",")),
                         {int(x) for x in args.chunks.split(",")}, set(args.blocks.split(",")), args.every_fit)
    if not settings:
      parser.error(f"no stored plans in {args.jsonl} to measure; plan first (without --measure) or name --config")
  print("measuring, in order: " + "; ".join(f"t={s.t} {s.remat} chunk {s.chunk} blocks {s.blocks}" for s in settings),
        flush=True)
  measure_all(settings, keep, args.budget, args.pair)
  return 0


if __name__ == "__main__":
  sys.exit(main())
