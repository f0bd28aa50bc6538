"""Full fine-tuning vs LoRA vs QLoRA of an 8B student on a TPU slice, planned: benchmarks/results/peft.md.

Each row compiles the distillation step (``meshdistill.plan``, libtpu's compiler on this CPU machine,
nothing allocated) for Llama-3.1-8B -> Llama-3.1-8B on ``v5e:4x4`` (16 chips of 16 GiB) at one mesh
(``--mesh``, default 2x8), ``--batch`` x ``--seq`` tokens, student remat ``full`` and the chunked loss,
with the LoRA / quantization settings given as the same ``--set`` overrides ``meshdistill distill``
takes (``student.lora.*``, ``teacher.quantize``). It records per-chip memory (XLA's memory analysis;
the step's inputs by kind) and the fit against HBM.

Rows run one at a time, each in its own process, appended to ``results/peft_plan.jsonl``; a rerun skips
rows already measured. The section ``## 8B student on a TPU slice`` of ``results/peft.md`` is rewritten
from them (the rest of the file is kept). Needs libtpu: ``pip install -e '.[tpu]'``.

  python benchmarks/peft_plan.py              # every row not yet measured, then the report
  python benchmarks/peft_plan.py --static     # weights + optimizer state per chip of every row, no compile
  python benchmarks/peft_plan.py --report     # only rewrite the section of results/peft.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.results import append_row, newest_rows, pending_rows, replace_section

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
JSONL = os.path.join(RESULTS, "peft_plan.jsonl")
STATIC_JSONL = os.path.join(RESULTS, "peft_plan_static.jsonl")
PEFT_MD = os.path.join(RESULTS, "peft.md")
SECTION = "\n## 8B student on a TPU slice"

TEACHER, STUDENT, TOPOLOGY, SLICE = "llama3.1-8b", "llama3.1-8b", "v5e:4x4", "v5e-16"
RANK = 16
LORA = [f"student.lora.rank={RANK}"]
ROWS = [
    ("full fine-tuning", []),
    (f"LoRA r={RANK}", LORA),
    (f"QLoRA r={RANK}, int4 base", LORA + ["student.lora.quantize=int4"]),
    (f"QLoRA r={RANK}, int4 base, int8 teacher", LORA + ["student.lora.quantize=int4", "teacher.quantize=int8"]),
]


def run_row(i: int, mesh: str, batch: int, seq: int, chunk: int) -> dict:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import meshdistill as md  # pylint: disable=g-import-not-at-top

  name, overrides = ROWS[i]
  t0 = time.perf_counter()
  p = md.plan(TEACHER, STUDENT, topology=TOPOLOGY, mesh=mesh, batch=batch, seq=seq, remat="full", chunk_size=chunk,
              overrides=overrides, suggest=0)
  out = p.to_dict()
  out.update(row=i, name=name, overrides=overrides, wall_seconds=time.perf_counter() - t0,
             host=f"{os.cpu_count()} cores")
  return out


def static_row(i: int, mesh: str, batch: int, seq: int, chunk: int) -> dict:
  """Per-chip bytes of the step's inputs of row ``i`` (weights, optimizer state, batch) from the planner's
  abstract train state, without compiling (seconds instead of minutes)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from meshdistill.planner import Knobs, make_planner  # pylint: disable=g-import-not-at-top
  from meshdistill.planner._compile import abstract_batch, leaf_count, shard_bytes  # pylint: disable=g-import-not-at-top

  name, overrides = ROWS[i]
  pl = make_planner(TEACHER, STUDENT, topology=TOPOLOGY, seq=seq, overrides=overrides, remat="full")
  data, tensor = (int(x) for x in mesh.split("x"))
  pl.check_mesh(data, tensor, batch)
  d = pl._distiller(Knobs(data, tensor, "full", chunk, batch))  # pylint: disable=protected-access
  state = d.init_state()
  student = state.params["student"]
  trained = student if d.trainable is None else __import__("flax").nnx.filter_state(student, d.trainable)
  parts = {"teacher_weights": shard_bytes(d.teacher_params, True), "student_weights": shard_bytes(student, True),
           "optimizer_state": shard_bytes(state.opt_state, True),
           "batch": shard_bytes(abstract_batch(d.mesh, batch, seq), True)}
  return {"row": i, "name": name, "overrides": overrides, "mesh": {"data": data, "tensor": tensor}, "batch": batch,
          "seq": seq, "parts": parts, "static_total": sum(parts.values()), "trained_params": leaf_count(trained),
          "budget_bytes": pl.target.budget_bytes, "headroom": pl.headroom}


def _gib(x) -> str:
  return "n/a" if x is None else f"{x / 2**30:.2f}"


def report() -> str:
  rows, static = newest_rows(JSONL), newest_rows(STATIC_JSONL)
  lines = [
      SECTION.strip(),
      "",
      f"`python benchmarks/peft_plan.py`: `meshdistill.plan` compiles the step `distill` runs for {TEACHER} -> "
      f"{STUDENT} on `{TOPOLOGY}` ({SLICE}, 16 GiB HBM per chip) with libtpu's compiler on this CPU machine "
      "(nothing allocated), LoRA and quantization passed as the `--set` overrides `distill` takes. LogitKD "
      "chunked over 1024 tokens, student remat `full`, AdamW; parameters and optimizer state float32, compute "
      "bfloat16; adapters on q, k, v, o, gate, up, down. Memory is per chip (XLA's memory analysis of the "
      "compiled step); the limit is 90% of HBM.",
      "",
      "Columns up to *weights + optimizer* come from the planner's abstract train state with its shardings "
      "(`benchmarks/peft_plan.py --static`: exact, no compile); *temp* and *total* from compiling the step "
      "(minutes per row; a row whose compile did not finish on the shared machine says so).",
      "",
      "| student | overrides | mesh d x t | tokens/step | trained params | teacher GiB | student GiB | optimizer GiB "
      "| weights + optimizer GiB | temp GiB | total GiB / HBM | fits | compile s |",
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
  ]
  for i, (name, overrides) in enumerate(ROWS):
    r, st = rows.get(i), static.get(i)
    if r is None and st is None:
      lines.append(f"| {name} | `{' '.join(overrides) or '-'}` | not run | | | | | | | | | | |")
      continue
    src = st or r
    parts = st["parts"] if st else r["memory"]
    trained = st["trained_params"] if st else r["params"].get("student_trained", r["params"]["student"])
    static_total = sum(parts[k] for k in ("teacher_weights", "student_weights", "optimizer_state"))
    cells = [name, f"`{' '.join(overrides) or '-'}`", f"{src['mesh']['data']}x{src['mesh']['tensor']}",
             f"{src['batch'] * src['seq']:,}", f"{trained:,}", _gib(parts["teacher_weights"]),
             _gib(parts["student_weights"]), _gib(parts["optimizer_state"]), _gib(static_total)]
    if r is None:
      limit = st["headroom"] * st["budget_bytes"]
      fits = "**no**" if static_total > limit else "not compiled"
      cells += ["not compiled", "not compiled", fits, "-"]
    else:
      m = r["memory"]
      fits = "yes" if r["fits"] else ("**no**" + ("" if r.get("over_bytes") is None
                                                  else f": {_gib(r['over_bytes'])} GiB over"))
      cells += [_gib(m["temp"]), f"{_gib(m['total'])} / {_gib(r['budget_bytes'])}", fits,
                f"{r['compile_seconds']:.0f}"]
    lines.append("| " + " | ".join(cells) + " |")
  lines.append("")
  return "\n".join(lines) + "\n"


def write_report() -> str:
  section = report()
  replace_section(PEFT_MD, SECTION, section)
  return section


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", default=None, help="comma-separated row indices (default: every row not yet measured)")
  ap.add_argument("--mesh", default="2x8")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--chunk-size", type=int, default=1024)
  ap.add_argument("--report", action="store_true", help="only rewrite the section of results/peft.md")
  ap.add_argument("--static", action="store_true", help="only the per-chip bytes of weights and optimizer state of "
                  "every row (no compile; seconds), then the report")
  ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a row, in this process
  args = ap.parse_args()
  os.makedirs(RESULTS, exist_ok=True)
  if args.one is not None:
    r = run_row(args.one, args.mesh, args.batch, args.seq, args.chunk_size)
    append_row(JSONL, r)
    print(f"row {args.one}: {r['name']}: {_gib(r['memory']['total'])} GiB per chip, fits={r['fits']}, "
          f"compile {r['compile_seconds']:.0f} s", flush=True)
    return 0
  if args.static:
    with open(STATIC_JSONL, "w", encoding="utf-8") as f:
      for i in range(len(ROWS)):
        f.write(json.dumps(static_row(i, args.mesh, args.batch, args.seq, args.chunk_size)) + "\n")
    args.report = True
  if not args.report:
    for i in pending_rows(JSONL, args.rows, len(ROWS)):
      cmd = [sys.executable, __file__, "--one", str(i), "--mesh", args.mesh, "--batch", str(args.batch), "--seq",
             str(args.seq), "--chunk-size", str(args.chunk_size)]
      print(f"row {i}: {ROWS[i][0]}", flush=True)
      subprocess.run(cmd, check=False)
  print(write_report())
  return 0


if __name__ == "__main__":
  sys.exit(main())
