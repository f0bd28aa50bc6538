"""Plans of real teacher -> student pairs on TPU slices, compiled on this machine: benchmarks/results/plan.md.

Each row compiles the distillation step (``meshdistill.plan``) for one pair on one topology at
``--batch`` x ``--seq`` tokens per step (default 32 x 2048 = 65,536), mesh ``auto``, student remat
``full`` and the chunked loss (``--chunk-size``), and records per-chip memory, the fit against HBM,
compiled and analytic FLOPs, the roofline step time / MFU and the compile time on this machine.

Rows run one at a time, each in its own process, and are appended to ``results/plan.jsonl``; a
rerun skips rows already measured (``--rows`` picks some by index, ``--report`` only rewrites the
Markdown). Needs libtpu: ``pip install -e '.[tpu]'``. ``--add FILE`` appends the JSON of a ``meshdistill plan
--json`` run (and its suggestions) as extra rows named ``ROW`` / ``ROW suggestion``.

  python benchmarks/plan.py --rows 0          # Llama-3.1-8B -> Llama-3.2-1B on v5e:4x4
  python benchmarks/plan.py --report          # write results/plan.md from the rows measured
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from bench.results import append_row, newest_rows, pending_rows
from meshdistill.planner._calibrate import CALIBRATION  # numpy / scipy only: the fit of plan_calibration.md

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
JSONL = os.path.join(RESULTS, "plan.jsonl")

PAIRS = [
    ("llama3.1-8b", "llama3.2-1b"),
    ("qwen3-8b", "qwen3-1.7b"),
    ("llama3.1-70b", "llama3.1-8b"),
    ("qwen3-4b", "qwen3-0.6b"),
    ("gemma-3-12b", "gemma-3-1b"),
    ("mistral-7b-v0.3", "mistral-7b-v0.3[0,10,21,31]"),
    ("qwen3-30b-a3b", "qwen3-1.7b"),
    ("qwen3-235b-a22b", "qwen3-8b"),
]
# (topology name, what Google Cloud calls the slice)
TOPOLOGIES = [("v5e:4x4", "v5e-16"), ("v5e:8x8", "v5e-64"), ("v5p:2x4x4", "v5p-64 (32 chips)")]
ROWS = [(t, s, topo, label) for t, s in PAIRS for topo, label in TOPOLOGIES]


def run_row(i: int, batch: int, seq: int, chunk: int, scan_layers: bool = False, overrides=()) -> dict:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import meshdistill as md  # pylint: disable=g-import-not-at-top

  teacher, student, topo, label = ROWS[i]
  t0 = time.perf_counter()
  p = md.plan(teacher, _model(student, scan_layers), topology=topo, batch=batch, seq=seq, remat="full",
              chunk_size=chunk, suggest=0, scan_layers=scan_layers or None, overrides=tuple(overrides))
  out = p.to_dict()
  out.update(row=i, slice=label, wall_seconds=time.perf_counter() - t0, host=f"{os.cpu_count()} cores",
             scan_layers=scan_layers, overrides=list(overrides))
  return out


def _model(spec: str, scan_layers: bool = False):
  """A preset name, or ``PRESET[i,j,...]``: that preset's blocks i, j, ... (a layer-subset student, as
  ``student.init.layers`` makes; e.g. a 1.1B student of Mistral-7B's blocks 0, 10, 21 and 31)."""
  if not spec.endswith("]"):
    return spec
  from meshdistill.planner import resolve_model  # pylint: disable=g-import-not-at-top

  name, layers = spec[:-1].split("[")
  cfg = resolve_model(name, who="student")[0].with_layers([int(x) for x in layers.split(",")])
  return cfg.replace(scan_layers=True) if scan_layers else cfg


def _gib(x):
  return "n/a" if x is None else f"{x / 2**30:.2f}"


def _fits(r) -> str:
  if r["fits"]:
    return "yes"
  if r["over_bytes"] is not None:
    return f"**no**: {_gib(r['over_bytes'])} GiB over the 90% limit"
  return "**no**: the compiler ran out of HBM"



# the rows asked for by the model-family and mixture-of-experts work: (row, command that produced it)
FAMILY_ROWS = [(12, "python benchmarks/plan.py --rows 12 --scan-layers"),
               (14, "python benchmarks/plan.py --rows 14 --scan-layers"),
               (15, "python benchmarks/plan.py --rows 15 --scan-layers"),
               (17, "python benchmarks/plan.py --rows 17 --scan-layers"),
               (19, "python benchmarks/plan.py --rows 19 --scan-layers"),
               (20, "python benchmarks/plan.py --rows 20 --scan-layers"),
               ("qwen3-235b-a22b, mesh.fsdp=true", "meshdistill plan --teacher qwen3-235b-a22b --student qwen3-8b "
                "--topology v5p:2x4x4 --batch 32 --seq 2048 --remat full --chunk-size 1024 --scan-layers --set "
                "mesh.fsdp=true --max-compiles 0 --json > p.json; python benchmarks/plan.py --add p.json "
                "'qwen3-235b-a22b, mesh.fsdp=true'"),
               ("gemma-3-12b, teacher.param_dtype=bfloat16", "meshdistill plan --teacher gemma-3-12b --student "
                "gemma-3-1b --topology v5e:4x4 --batch 32 --seq 2048 --remat full --chunk-size 1024 --scan-layers "
                "--set teacher.param_dtype=bfloat16 --max-compiles 0 --json > p.json; python benchmarks/plan.py --add "
                "p.json 'gemma-3-12b, teacher.param_dtype=bfloat16'")]


# what the Gemma 3 rows are (their numbers: the rows above), and what was not compiled
GEMMA3_NOTE = ("Gemma 3 (gemma-3-12b -> gemma-3-1b) is scanned in groups: its five local (sliding-window 1024 / 512, "
               "RoPE base 10k) and one global layer (RoPE base 1M) repeat, so `scan_layers` runs one loop body of 6 "
               "blocks, 8 times for the 12B teacher's 48 layers and 4 times for the 1B student's 26, whose last 2 "
               "layers run after the loop (`ModelConfig.scan_period`, `docs/models.md`): the compiled step holds 6 "
               "teacher and 8 student blocks instead of 48 + 26. Its loops as the planner counted them (v5e-16): the "
               "teacher's 8 trips of 11.9 TFLOP per chip, the student's 4 forward and 4 backward trips, the loss's 32 "
               "chunks. On v5e-16 mesh `auto` is 2x8, where the teacher's float32 weights take 5.48 GiB per chip (its "
               "262k x 3840 embedding split 8 ways) and the step's temporaries 8.37 GiB: 1.00 GiB over the 90% limit; "
               "with the teacher stored in bfloat16 (`--set teacher.param_dtype=bfloat16`, the row above) its weights "
               "take 2.74 GiB and the temporaries 6.97 (no float32 -> bfloat16 copy of the stacked weights), and the "
               "pair fits v5e-16 with 11.26 GiB per chip at the same 31% MFU. On v5p-64 mesh `auto` is 16x2 and the pair fits with 41.31 GiB "
               "per chip of 95.00 (teacher 21.92, temporaries 13.72). Compile times on the shared 2-core machine, "
               "under a load average of 6-18 from other jobs: 1678 s (v5e-16), 839 s (v5p-64), 447 s (v5e-16, bfloat16 "
               "teacher).")


def _colls(r) -> str:
  top = sorted(r.get("collectives") or [], key=lambda c: -c["wire_bytes"])[:3]
  return "; ".join(f"{c['count']} {c['kind']} over {c['axis']} ({c['wire_bytes'] / 1e9:.2f} GB on the wire)"
                   for c in top) or "none"


def _family_rows(rows: dict) -> list[str]:
  """Gemma 3, Mistral and Qwen3-MoE plans: fits / GiB per chip / MFU / collectives per chip and step, with the
  command of each (rows not compiled are said so, with why)."""
  out = ["Gemma 3, Mistral and Qwen3 mixture-of-experts pairs (scanned blocks, so that each compiles in minutes; "
         "32 x 2048 tokens per step, student remat `full`, loss chunked over 1024 tokens, mesh `auto`):", ""]
  for key, cmd in FAMILY_ROWS:
    r = rows.get(key)
    name = f"{ROWS[key][0]} -> {ROWS[key][1]} on {ROWS[key][3]}" if isinstance(key, int) else key
    if r is None:
      out.append(f"- {name}: not compiled yet (`{cmd}`; each took 10-17 minutes on the shared machine)")
      continue
    if isinstance(key, str):
      name = f"{r['teacher']} -> {r['student']} on {r['target']} ({r['devices']} chips), {key.split(', ', 1)[1]}"
    tm = r["time"]
    mfu = "n/a" if tm.get("mfu") is None else f"{100 * tm['mfu']:.0f}%"
    cal = None if CALIBRATION is None or tm.get("step_s") is None else CALIBRATION.of(tm, r["target"].split(":")[0])
    cal_mfu = "" if cal is None else f" (calibrated {100 * cal['mfu']:.0f}%)"
    out.append(f"- {name}: fits: {_fits(r)}, {_gib(r['memory']['total'])} GiB per chip of "
               f"{_gib(r['budget_bytes'])}, mesh {r['mesh']['data']}x{r['mesh']['tensor']}, estimated MFU {mfu}"
               f"{cal_mfu}; collectives per chip and step: {_colls(r)}. `{cmd}`")
  out += ["", GEMMA3_NOTE + " The "
          "MoE plans split each expert's hidden units over `tensor`, as a dense MLP's (the planner's meshes have `data` "
          "and `tensor` only), so their collectives are listed over those axes; a plan with experts over an `expert` "
          "axis needs the planner's N-axis meshes. Qwen3-30B-A3B -> Qwen3-1.7B on v5e-64: mesh `auto` (the least "
          "`tensor` whose weights and moments take at most half the limit) is 2x32, where the step's activations "
          "leave it 2.88 GiB over the limit and 32-way all-reduces of every block's activations dominate the step "
          "(its 6% MFU: 3 B active parameters of teacher compute against 88 GB per chip on the wire); "
          "`--set mesh.fsdp=true` over a wider `data` axis is the layout to try next (not compiled in the time "
          "available). Qwen3-235B-A22B -> Qwen3-8B: the smallest v5p slice found to fit is v5p-64 (32 chips, the row "
          "above); on v5p-32 (the same command with `--topology v5p:2x2x4`, 16 chips, without `--max-compiles 0` "
          "taking effect: 5 compiles, 11.1 min) mesh `auto` picks 1x16, where the teacher's float32 weights alone "
          "take 56.29 GiB per chip and the compiler runs out of HBM at batch 32 x 2048 (102.58 GiB of temporaries "
          "against 95.74) and at batches 16, 8, 4 and 2; a 16-chip plan with the teacher stored in bfloat16 "
          "(`--set teacher.param_dtype=bfloat16`) and `data` over all 16 chips was not compiled.", ""]
  return out

PLACEMENT_K = 32  # top-k a cache / remote teacher keeps per token in plan.md's placement section


def report() -> str:
  rows = newest_rows(JSONL)
  lines = [
      "# Plans of real pairs on TPU slices (compiled on a CPU machine)",
      "",
      "`python benchmarks/plan.py`: `meshdistill.plan` compiles the distillation step `distill` runs (LogitKD "
      "loss chunked over 1024 tokens, student remat `full`, AdamW, parameters and optimizer state float32, "
      "compute bfloat16) with libtpu's compiler for each topology, every array abstract. Memory is per chip "
      "(XLA's memory analysis), the budget is 90% of the chip's HBM (the headroom `distill` uses); step time "
      "is the roofline estimate max(compute, HBM) + collectives, MFU from the analytic 2*N_t + 6*N_s FLOPs "
      "per token. Compile time is on this shared 2-core machine, under load from other jobs.",
      "",
      "| teacher -> student | slice | mesh d x t | remat, loss | attention | tokens/step | teacher GiB "
      "| student GiB | opt GiB | temp GiB | total GiB / HBM | fits | TFLOP/chip compiled (analytic) | roofline step s "
      "| MFU | calibrated step s (band) | calibrated MFU | compile s |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  missing = []
  labels = dict(TOPOLOGIES)
  extra = [(k, r) for k, r in rows.items() if not isinstance(k, int)]
  for i, (t, s, topo, label) in [*enumerate(ROWS), *((k, (r["teacher"], r["student"], r["target"],
                                                         labels.get(r["target"], r["target"]) + f" ({k})"))
                                                     for k, r in extra)]:
    r = rows.get(i)
    if r is None:
      missing.append(f"{t} -> {s} on {label} (`{topo}`)")
      continue
    m, f, tm = r["memory"], r["flops"], r["time"]
    fits = _fits(r)
    flops = "n/a" if f["compiled"] is None else f"{f['compiled'] / 1e12:.1f}"
    if f.get("counted") not in (None, f["compiled"]):  # loops (scanned blocks, chunked loss) counted whole
      flops = f"{f['counted'] / 1e12:.1f} (program's own count {f['compiled'] / 1e12:.1f})"
    if f.get("kernels") and f["compiled"] is not None:  # attention inside Pallas kernels, counted analytically
      flops += f" + {f['kernels'] / 1e12:.1f} in kernels"
    step = "n/a" if tm["step_s"] is None else f"{tm['step_s']:.2f}"
    mfu = "n/a" if tm["mfu"] is None else f"{100 * tm['mfu']:.0f}%"
    cal = (None if CALIBRATION is None or r.get("budget_bytes") is None
           else CALIBRATION.of(tm, r["target"].split(":")[0]))
    cal_step = "n/a" if cal is None else f"{cal['step_s']:.2f}" + (
        "" if cal["band"] is None else f" ({cal['low_s']:.2f}-{cal['high_s']:.2f})")
    cal_mfu = "n/a" if cal is None else f"{100 * cal['mfu']:.0f}%"
    if cal is not None and cal.get("extrapolated"):  # collectives a larger share than on any published run
      cal_step += f" (collectives {100 * cal['comm_share']:.0f}%: extrapolated)"
    loss = "full logits" if r.get("chunk_size") is None else f"chunk {r['chunk_size']}"
    if r.get("scan_layers"):
      loss += ", scan_layers"
    if r.get("overrides"):
      label += ", " + ", ".join(r["overrides"])
    lines.append(
        f"| {t} -> {s} | {label} | {r['mesh']['data']}x{r['mesh']['tensor']} | {r.get('remat')}, "
        f"{loss} | {r.get('attention', 'auto')} | {r['batch'] * r['seq']:,} "
        f"| {_gib(m['teacher_weights'])} | {_gib(m['student_weights'])} | {_gib(m['optimizer_state'])} "
        f"| {_gib(m['temp'])} | {_gib(m['total'])} / {_gib(r['budget_bytes'])} | {fits} "
        f"| {flops} ({f['analytic'] / 1e12:.1f}) | {step} | {mfu} | {cal_step} | {cal_mfu} "
        f"| {r['compile_seconds']:.0f} |"
    )
  lines.append("")
  if missing:
    lines.append("Not run (each 8B-class compile takes minutes and a 70B one far longer on the 2 shared cores of "
                 "the machine these were measured on; run them with `python benchmarks/plan.py`):")
    lines += [f"- {x}" for x in missing]
    lines.append("")
  lines.append("Where the memory goes: in the rows without `mesh.fsdp` the teacher's weights are replicated over "
               "`data` and split only over `tensor`, and so are the student's parameters and float32 AdamW moments "
               "(together 5.5-6.2 GiB of the 8B-class rows). Without it the 70B teacher alone holds 21.1 GiB of weights "
               "per chip at mesh 1x16 on v5e-16 (its 8 key/value heads replicated over 16 `tensor` devices), over "
               "the chip's 16 GiB, and on v5e-64 the widest split (1x64, 9.0 GiB of teacher) leaves the step's "
               "activations 15.7 GiB over the limit. With `mesh.fsdp=true` (`--set mesh.fsdp=true`) every "
               "weight and moment is split over `data` too and gathered per block: Llama-3.1-70B -> Llama-3.1-8B "
               "then fits a v5e-64 at mesh 8x8 (teacher 4.11 GiB per chip, 9.89 GiB in all), and Llama-3.1-8B -> "
               "Llama-3.2-1B at T=8192 (8 x 8192 tokens) goes from 0.15 GiB over the limit on v5e-16 to 11.82 GiB "
               "at mesh 8x2. At the same tokens per step, T=8192 raises compiled FLOPs from 96.5 to 123.6 TFLOP per "
               "chip (attention, which the analytic count leaves out) and temp from 5.80 to 9.08 GiB with "
               "`attention: auto` (XLA's attention).")
  lines.append("")
  lines.append("Attention at T=8192 (the rows named `attention explicit` / `attention splash`, planned with "
               "`--attention`): with explicit scores (`[B, H, T, T]` float32 scores and probabilities, what "
               "attention-map capture needs) the step needs 16.25 GiB of temporaries at mesh 2x8, where the TPU "
               "compiler runs out of HBM (21.72 GiB per chip, 7.32 GiB over the limit), and 11.67 GiB with "
               "`mesh.fsdp` at 8x2 (14.41 GiB in all, 0.01 GiB over); XLA's attention (`auto`) needs 9.08 GiB "
               "(0.15 GiB over at 2x8, 11.82 GiB in all at 8x2 with fsdp). The Pallas splash kernel, run per "
               "device on its query heads in a `shard_map` over `tensor` and compiled to the Mosaic kernel for "
               "the TPU, needs 3.88 GiB at 2x8, so the row without fsdp now fits (9.35 GiB per chip, 5.05 GiB "
               "to spare), and 3.73 GiB at 8x2 with fsdp (6.46 GiB in all). Estimated MFU at 2x8 / 8x2: explicit "
               "n/a (no program) / 17%, XLA 21% / 30%, splash 62% / 75%. XLA's cost analysis does not see inside "
               "the kernel: its causal attention matmuls are added analytically (17.6 TFLOP per chip, `+ ... in "
               "kernels`; the compiled count around them is 87.5-88.4 TFLOP, against 123.6-124.5 with XLA's "
               "attention, which also computes the masked half) and only its inputs and outputs count as HBM "
               "traffic, so the splash MFUs are an upper estimate. Compile times on this machine: explicit 21 s "
               "(stopped out of memory) and 143 s, splash 48 s and 110 s.")
  lines.append("")
  lines.append("The student over the batch (the two Qwen3-1.7B -> Qwen3-0.6B rows, `meshdistill plan --teacher "
               "qwen3-1.7b --student qwen3-0.6b --topology v5p:2x2x2 --mesh 2x4 --batch 16 --seq 1024 "
               "--no-scan-layers --remat full`, the second with `--set mesh.student_split=batch`): the student and its "
               "AdamW moments whole on every chip (2.22 + 4.44 GiB against 0.56 + 1.11 split over `tensor`), its "
               "activations on a quarter of the rows (temp 4.80 against 11.61 GiB): 13.07 GiB in all against 14.88. "
               "Collectives per step (the plans' JSON): split over `tensor`, 144 all-reduces over `tensor` (6.44 GB "
               "on the wire per device) and 7 over `data`; over the batch, 57 over `tensor` (the teacher's, 2.87 GB), "
               "one all-to-all of the teacher's logits to the student's rows (0.93 GB) and the student's gradients "
               "in 17 all-reduces over all 8 chips (4.17 GB). Roofline step 0.10 s against 0.09 s. Before the "
               "teacher's inputs and outputs were pinned whole over rows, the compiler gathered the whole teacher "
               "every step in this layout (198 all-gathers over `tensor`, 2.58 GB on the wire; "
               "`throughput_notes.md`).")
  lines.append("")
  lines += _family_rows(rows)
  lines.append("Scanned blocks (the row `--scan-layers`: `meshdistill plan --teacher llama3.1-8b --student "
               "llama3.2-1b --topology v5e:4x4 --batch 32 --seq 2048 --remat full --chunk-size 1024 --scan-layers "
               "--json`): the scanned program's memory (13.81 GiB per chip against 11.27 unrolled: the stacked "
               "blocks' loop carries) and its FLOPs, bytes and collectives counted whole from the ONE compiled "
               "program: each loop body (the teacher's 32 blocks, the student's 16 forward and 16 backward, the "
               "chunked loss's 32 chunks of 1024 tokens per chip) cost-analysed on its own by XLA and multiplied by "
               "its trip count (`planner._loops`, 7.0 s). 107.0 TFLOP per chip: the teacher's blocks 61.8, the "
               "student's 34.4, the rest 10.8, against 4.4 in the program's own analysis (one iteration per loop) "
               "and 96.5 in the unrolled row, whose count still sees one chunk of the loss (the 10.5 TFLOP between "
               "them are the other 31 chunks' logits matmuls, forward and backward). Planning time: 517 s wall, 134 "
               "CPU s (498.8 s of it the TPU compile, at a load average of 12-13 on the 2 cores), against 917 s wall "
               "and 340 CPU s when the loops were counted from three more compiles unrolled at 1 and 2 blocks; still "
               "above the 120 s aimed at: the 134 CPU s are almost all the one TPU compile of the step, which no way "
               "of counting removes. Re-measured (`benchmarks/results/plan_speed.md`): 94.6 s wall, 89.5 CPU s on a "
               "quiet machine (load 3), 137.3 s at load 5.5, so the 517 s were other jobs on the two cores; 78% of "
               "the CPU is libtpu's code generation; `--fast-compile` takes 31 CPU s (31.6 s wall) but plans another "
               "program (memory 11.96 GiB against 13.81).")
  lines.append("")
  fitted = ("n/a: `planner._calibrate.CALIBRATION` holds no fit yet (too few published rows compiled; "
            "`plan_calibration.md`)" if CALIBRATION is None else
            ", ".join(f"a[{g}] = {a:.3f} (band +-{100 * CALIBRATION.band[g]:.0f}%)" for g, a in CALIBRATION.a.items())
            + f", k = {CALIBRATION.k:.3f} from {CALIBRATION.rows} rows")
  lines.append("Calibrated columns: the roofline's terms of each row (stored in `plan.jsonl`, not recompiled) "
               "through the model fitted on MaxText's published pod measurements, max(compute / a[generation], HBM, "
               "collectives) + k x collectives, with its generation's band (the largest leave-one-out error of that fit; "
               f"{fitted}); "
               "where collectives are a larger share of the roofline step than on any published run "
               f"({'n/a' if CALIBRATION is None else f'{100 * CALIBRATION.comm_share:.0f}%'}) the calibrated "
               "column names their share and says *extrapolated*: how far they hide behind compute there is beyond "
               "what the fit saw, and the estimate can be shorter than the roofline, which counts them on top. "
               "`plan_calibration.md` has the rows, the fit and its errors. The rows compiled before the planner "
               "counted loops whole (every row whose TFLOP column shows no `program's own count`) see one chunk of "
               "the chunked loss's token loop (XLA counts a loop body once), so their logits matmuls are undercounted "
               "in both estimates (about 10 TFLOP per chip of 8B -> 1B on v5e-16: 96.5 against 107.0 counted whole); "
               "a re-run of those rows (`python benchmarks/plan.py --rows ...`) counts them.")
  from bench import placement  # pylint: disable=g-import-not-at-top

  lines += ["", f"## Where the teacher should live (`--placement {PLACEMENT_K}`)", "",
            f"`python benchmarks/plan.py --report` (also `python benchmarks/plan_placement.py --k {PLACEMENT_K}`): "
            + placement.INTRO.format(k=PLACEMENT_K), ""]
  lines += placement.sections(rows, PLACEMENT_K, level="###")
  lines.append(f"Measured with Python {platform.python_version()} on {os.cpu_count()} CPU cores.")
  return "\n".join(lines) + "\n"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", default=None, help="comma-separated row indices (default: every row not yet measured)")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--chunk-size", type=int, default=1024)
  ap.add_argument("--scan-layers", action="store_true", help="both models' blocks scanned (`scan_layers`)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, e.g. "
                  "mesh.fsdp=true (repeatable)")
  ap.add_argument("--report", action="store_true", help="only write results/plan.md")
  ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a row, in this process
  ap.add_argument("--add", nargs=2, metavar=("FILE", "ROW"), default=None, help="add a `plan --json` output")
  args = ap.parse_args()
  os.makedirs(RESULTS, exist_ok=True)
  if args.add:
    with open(args.add[0], encoding="utf-8") as f:
      p = json.load(f)
    for name, r in [(args.add[1], p)] + [(f"{args.add[1]} suggestion", x) for x in p.get("suggestions", [])]:
      append_row(JSONL, {**r, "row": name, "suggestions": []})
    args.report = True
  if args.one is not None:
    r = run_row(args.one, args.batch, args.seq, args.chunk_size, args.scan_layers, args.set)
    append_row(JSONL, r)
    print(f"row {args.one}: {r['teacher']} -> {r['student']} on {r['target']}: {_gib(r['memory']['total'])} GiB "
          f"per chip, fits={r['fits']}, compile {r['compile_seconds']:.0f} s", flush=True)
    return 0
  if not args.report:
    for i in pending_rows(JSONL, args.rows, len(ROWS)):
      cmd = [sys.executable, __file__, "--one", str(i), "--batch", str(args.batch), "--seq", str(args.seq),
             "--chunk-size", str(args.chunk_size)] + (["--scan-layers"] if args.scan_layers else []) \
          + [x for kv in args.set for x in ("--set", kv)]
      print(f"row {i}: {ROWS[i]}", flush=True)
      subprocess.run(cmd, check=False)
  md = report()
  with open(os.path.join(RESULTS, "plan.md"), "w", encoding="utf-8") as f:
    f.write(md)
  print(md)
  return 0


if __name__ == "__main__":
  sys.exit(main())
