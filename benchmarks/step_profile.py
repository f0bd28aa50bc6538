"""Where a step's time goes: a profiler trace of the compiled step, its ops grouped by kind.

The throughput benchmark's models (`benchmarks/bench/systems.py`) run a few steps under
`jax.profiler.trace`; every op the XLA CPU runtime executes is one trace event named after its
HLO instruction. Each instruction of the compiled step's HLO is put in one kind, by what it (or
the fused computation it calls) holds, first match wins:

* **matmul** -- a ``dot`` / ``convolution`` (with whatever elementwise work is fused into it);
* **collective** -- all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute;
* **reduction** -- a ``reduce`` (softmax sums and maxima, norms, metric sums);
* **copy/transpose** -- a ``copy`` or ``transpose`` (layout changes; elementwise work fused into
  them is counted here too);
* **elementwise** -- everything else (exp, log, selects, the optimizer update, ...).

Each op is counted at its fastest of the traced steps (on a shared machine a run of an op that other
jobs slowed is not the op's cost), times its runs per step; summed over the runtime's threads (ops run
concurrently) and shown as shares.

The one-device rows are traced in a process whose JAX has one CPU device, as `throughput.py` times
them (a program on one of 8 simulated devices runs slower than in a process with one device); with
``--mesh`` they come from a child process of that kind and the 2x4 rows from this one.

Run: ``python benchmarks/step_profile.py [--steps 4] [--mesh] [--label after]``; prints a markdown
table and replaces the rows of ``--label`` in ``benchmarks/results/step_profile.jsonl``, which
`benchmarks/throughput.py` renders into ``benchmarks/results/throughput.md`` (before / after).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ONE_DEVICE_ENV = "MESHDISTILL_THROUGHPUT_ONE_DEVICE"  # read by bench.devices as it is imported
if __name__ == "__main__" and "--mesh" not in sys.argv[1:]:
  os.environ.setdefault(ONE_DEVICE_ENV, "1")
from bench import devices  # noqa: E402  (8 simulated CPU devices, unless the one-device switch is on)
from bench import systems  # noqa: E402
from bench.op_kinds import KINDS, hlo_kinds  # noqa: E402

import jax  # noqa: E402
import meshdistill as md  # noqa: E402
from meshdistill.strategies import LogitKD  # noqa: E402
from meshdistill.strategies import ChunkedLogitKD  # noqa: E402

RESULT = pathlib.Path(__file__).parent / "results" / "step_profile.jsonl"


def profile(distiller, batches, steps: int) -> dict[str, float]:
  """Milliseconds per step of each kind (summed over threads), from a trace of ``steps`` steps."""
  state = distiller.init_state()
  batch = systems.ours_batch(batches[0])
  hlo = distiller.lower(state, batch).compile().as_text()
  kinds = hlo_kinds(hlo)
  for x in batches[:2]:  # compile and warm up
    state, metrics = distiller.step(state, systems.ours_batch(x))
  jax.block_until_ready(metrics)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for x in batches[2:2 + steps]:
        state, metrics = distiller.step(state, systems.ours_batch(x))
        jax.block_until_ready(metrics)
    path = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]
    trace = json.load(gzip.open(path))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  durations = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and e.get("name") in kinds:
      durations[e["name"]].append(e.get("dur", 0.0) / 1e3)  # us -> ms
  # Each op at its fastest run (a run slowed by other jobs on the shared cores counts as that fastest one),
  # times how often it ran per step (ops inside a loop run once per iteration).
  total = collections.Counter()
  for name, ds in durations.items():
    total[kinds[name]] += min(ds) * len(ds) / steps
  return {k: total[k] for k in KINDS}


def table_row(step: str, ms: dict[str, float]) -> str:
  total = sum(ms.values())
  shares = " | ".join(f"{100 * ms[k] / total:.0f}% ({ms[k]:.0f})" for k in KINDS)
  return f"| {step} | {total:.0f} | {shares} |"


def one_device_rows(args) -> list[dict]:
  """The one-device rows, traced by this script in a child process whose JAX has one CPU device."""
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "one_device.jsonl"
    subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--vocab", str(args.vocab), "--label",
                    args.label, "--out", str(out)], env=devices.one_device_env(), check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in out.read_text().splitlines()]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--vocab", type=int, default=1024)
  parser.add_argument("--mesh", action="store_true", help="also profile the 2x4 mesh (8 simulated devices)")
  parser.add_argument("--label", default="after", help="what this run measures (e.g. before / after a change)")
  parser.add_argument("--out", type=pathlib.Path, default=RESULT)
  args = parser.parse_args(argv)
  one_device = os.environ.get(ONE_DEVICE_ENV) == "1"
  if one_device and args.mesh:
    parser.error(f"--mesh needs the 8 simulated devices: unset {ONE_DEVICE_ENV} (the one-device rows run in a "
                 "child process of their own)")
  print("| step | op time / step (ms, summed over threads) | " + " | ".join(KINDS) + " |")
  print("|---|---:|" + "---:|" * len(KINDS))
  rows = [] if one_device else one_device_rows(args)
  for row in rows:
    print(table_row(row["step"], row["ms"]), flush=True)
  tcfg, scfg = systems.configs(args.vocab)
  batches = systems.make_batches(args.steps + 2, args.vocab)
  meshes = {"1 device": None} if one_device else {"2x4": md.make_mesh(data=2, tensor=4)}
  strategies = {
      "ChunkedLogitKD": ChunkedLogitKD(temperature=systems.TAU, alpha=systems.ALPHA, chunk_size=256),
      "LogitKD": LogitKD(temperature=systems.TAU, alpha=systems.ALPHA),
  }
  for where, mesh in meshes.items():
    for name, strategy in strategies.items():
      teacher, student = md.init_model(tcfg, seed=0, mesh=mesh), md.init_model(scfg, seed=1, mesh=mesh)
      d = md.Distiller(student, teacher, strategy=strategy, optimizer=md.default_optimizer(systems.LR), mesh=mesh)
      variants = {"": d}
      if hasattr(d, "metrics_light"):
        variants[", metrics-light"] = d.metrics_light()
      for suffix, dv in variants.items():
        ms = profile(dv, batches, args.steps)
        print(table_row(f"{where}: {name}{suffix}", ms), flush=True)
        rows.append({"label": args.label, "step": f"{where}: {name}{suffix}", "steps": args.steps,
                     "load": os.getloadavg()[0], "ms": ms})
  kept = []
  if args.out.exists():
    kept = [r for r in map(json.loads, args.out.read_text().splitlines()) if r["label"] != args.label]
  args.out.write_text("".join(json.dumps(r) + "\n" for r in kept + rows))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  sys.exit(main())
