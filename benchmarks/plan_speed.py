"""How long `meshdistill plan` takes, default against `--fast-compile`: benchmarks/results/plan_speed.jsonl.

Each plan runs as its own ``meshdistill plan ... --json`` process (one at a time, at the niceness given); the row
keeps its wall time, its CPU time (user + system of the process and its threads: the steadier number on a shared
machine), the load average when it ended, and the plan's figures the fast compile could move: memory per chip, the
counted FLOPs, the HBM bytes' time, the collectives on the wire and the roofline step.

  python benchmarks/plan_speed.py                 # Llama-3.1-8B -> Llama-3.2-1B on v5e:4x4, scanned (issue 37's target)
  python benchmarks/plan_speed.py --pair small    # Qwen3-1.7B -> Qwen3-0.6B on v5e:2x2, scanned
  python benchmarks/plan_speed.py --pair d512 --seq 256 --sweep '{}' '{"optimization_level": 9}'

``--sweep``: the pair's step lowered once in this process and compiled with each JSON dict of compiler options in
turn (XLA debug options, libtpu flags, ``ExecutableBuildOptions`` fields such as ``exec_time_optimization_effort``),
each line its CPU and wall seconds, memory and XLA's own FLOPs and bytes accessed (one iteration per loop).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from bench.results import append_row

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "plan_speed.jsonl")
PAIRS = {
    "8b": ["--teacher", "llama3.1-8b", "--student", "llama3.2-1b", "--topology", "v5e:4x4", "--batch", "32",
           "--seq", "2048", "--remat", "full", "--chunk-size", "1024", "--scan-layers"],
    "small": ["--teacher", "qwen3-1.7b", "--student", "qwen3-0.6b", "--topology", "v5e:2x2", "--batch", "8",
              "--seq", "2048", "--remat", "full", "--chunk-size", "1024", "--scan-layers"],
}


def run(args: list[str], nice: int) -> dict:
  """One plan in its own process: its JSON, wall and CPU seconds."""
  cmd = ["nice", "-n", str(nice), sys.executable, "-m", "meshdistill", "plan", *args, "--json"]
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  t0 = time.perf_counter()
  out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  wall = time.perf_counter() - t0
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  return {"plan": json.loads(out.stdout), "wall_s": wall, "cpu_s": cpu, "load": os.getloadavg()[0],
          "command": "meshdistill plan " + " ".join(args) + " --json"}


def row(pair: str, mode: str, r: dict) -> dict:
  p = r["plan"]
  return {"pair": pair, "mode": mode, "wall_s": round(r["wall_s"], 1), "cpu_s": round(r["cpu_s"], 1),
          "load": round(r["load"], 1), "compile_s": round(p["compile_seconds"], 1), "mesh": p["mesh"],
          "total_bytes": p["memory"]["total"], "temp_bytes": p["memory"]["temp"],
          "flops_counted": p["flops"]["counted"], "hbm_s": p["time"]["hbm_s"], "comm_s": p["time"]["comm_s"],
          "step_s": p["time"]["step_s"], "wire_bytes": sum(c["wire_bytes"] for c in p["collectives"]),
          "command": r["command"]}


def _d512():
  """A d=512 student of a d=1024 teacher (vocabulary 32,000; 4 and 3 blocks), scanned: a mid-size program."""
  import meshdistill as md  # pylint: disable=g-import-not-at-top

  t = md.ModelConfig(vocab_size=32000, d_model=1024, n_layers=4, n_heads=8, n_kv_heads=4, mlp_hidden=4096,
                     max_len=2048, tie_embeddings=False, dtype="bfloat16", scan_layers=True)
  return t, t.replace(d_model=512, n_heads=4, n_kv_heads=4, mlp_hidden=2048, n_layers=3)


def sweep(pair: str, seq: int | None, options: list[str]) -> None:
  """Compiles the pair's lowered step with each option set (see the module's docstring)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from meshdistill.planner._compile import abstract_batch  # pylint: disable=g-import-not-at-top
  from meshdistill.planner import make_planner  # pylint: disable=g-import-not-at-top
  from meshdistill.planner._entry import _default_knobs

  if pair == "d512":
    (teacher, student), topology, batch, mesh = _d512(), "v5e:2x2", 8, "2x2"
  else:
    a = dict(zip(PAIRS[pair][0:-1:2], PAIRS[pair][1::2]))
    teacher, student, topology, batch, mesh = a["--teacher"], a["--student"], a["--topology"], int(a["--batch"]), "auto"
  seq = seq or (1024 if pair == "d512" else 2048)
  pl = make_planner(teacher, student, topology=topology, seq=seq, remat="full", scan_layers=True)
  k = _default_knobs(pl, mesh, batch, 1024)
  d = pl._distiller(k)  # pylint: disable=protected-access
  state = d.init_state()
  lowered = d.compiled_step(state).lower(state, d.teacher_params, abstract_batch(d.mesh, batch, seq))
  for text in options:
    opts = json.loads(text)
    w0, c0 = time.perf_counter(), time.process_time()
    compiled = lowered.compile(compiler_options=opts or None)
    w, c = time.perf_counter() - w0, time.process_time() - c0
    m, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    print(json.dumps({"pair": pair, "seq": seq, "options": opts, "wall_s": round(w, 1), "cpu_s": round(c, 1),
                      "load": round(os.getloadavg()[0], 1), "temp_bytes": m.temp_size_in_bytes,
                      "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
                      "flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed")}), flush=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--pair", choices=sorted(PAIRS) + ["d512"], default="8b", help="d512: --sweep only")
  ap.add_argument("--seq", type=int, default=None, help="--sweep: the sequence length (default: 2048; d512: 1024)")
  ap.add_argument("--sweep", nargs="+", default=None, metavar="JSON", help="compile with each option set")
  ap.add_argument("--nice", type=int, default=10)
  ap.add_argument("--modes", default="default,fast", help="comma-separated: default, fast")
  a = ap.parse_args()
  if a.sweep:
    sweep(a.pair, a.seq, a.sweep)
    return
  for mode in a.modes.split(","):
    args = PAIRS[a.pair] + (["--fast-compile"] if mode == "fast" else [])
    r = row(a.pair, mode, run(args, a.nice))
    print(json.dumps(r), flush=True)
    append_row(OUT, r)


if __name__ == "__main__":
  main()
