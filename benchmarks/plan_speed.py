"""How long `meshdistill plan` takes, default against `--fast-compile`: benchmarks/results/plan_speed.jsonl.

Each plan runs as its own ``meshdistill plan ... --json`` process (one at a time, at the niceness given); the row
keeps its wall time, its CPU time (user + system of the process and its threads: the steadier number on a shared
machine), the load average when it ended, and the plan's figures the fast compile could move: memory per chip, the
counted FLOPs, the HBM bytes' time, the collectives on the wire and the roofline step.

  python benchmarks/plan_speed.py                 # Llama-3.1-8B -> Llama-3.2-1B on v5e:4x4, scanned (issue 37's target)
  python benchmarks/plan_speed.py --pair small    # Qwen3-1.7B -> Qwen3-0.6B on v5e:2x2, scanned
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

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


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--pair", choices=sorted(PAIRS), default="8b")
  ap.add_argument("--nice", type=int, default=10)
  ap.add_argument("--modes", default="default,fast", help="comma-separated: default, fast")
  a = ap.parse_args()
  for mode in a.modes.split(","):
    args = PAIRS[a.pair] + (["--fast-compile"] if mode == "fast" else [])
    r = row(a.pair, mode, run(args, a.nice))
    print(json.dumps(r), flush=True)
    with open(OUT, "a", encoding="utf-8") as f:
      f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
