"""The rate the step's own matmul shapes reach: a roofline of the throughput models on one device.

`throughput.py` compares each step with the machine's matmul rate: the fastest of a few large float32
matmuls. The throughput models are small (student d=128), so their matmuls are not those shapes. This
benchmark asks what the step's matmuls reach by themselves, with nothing else in the program:

1. every ``dot_general`` of a compiled program is read from its StableHLO (operand shapes, contracting and
   batch dimensions; a dot in a private function counts once per call): meshdistill's one-device
   ``LogitKD`` step on the throughput models, the bare teacher forward and the bare student step of
   `throughput.py`;
2. each distinct dot is timed alone: one jitted program of ``--chain`` copies of it on different left
   operands (so XLA cannot merge them; every output is returned, so none is dropped as dead code; they are
   independent, so XLA's CPU runtime may run two side by side, as it may independent dots of a step),
   median over ``--calls`` calls, divided by ``--chain``;
3. per program: the sum over its dots of (runs x time alone) is what its matmuls cost with nothing else
   running; its FLOPs over that sum is the rate its matmul shapes reach, shown as a fraction of
   the probe rate (the matmuls of `throughput.py`'s probes, timed here the same way). The programs themselves are
   timed in the same process (median of ``--calls`` calls), for their fraction of the rate as run.

A program's time can only reach its dots' time if everything but its matmuls took no time and its dots ran as
well packed as copies of one shape do; so the dots' fraction of the probe rate is what the program can reach
on this machine at best.

Runs in a process with one CPU device (as `throughput.py`'s one-device rows). ``python
benchmarks/matmul_shapes.py [--calls 15 --chain 20]``; writes ``benchmarks/results/matmul_shapes.md``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("MESHDISTILL_THROUGHPUT_ONE_DEVICE", "1")  # read by bench.devices as it is imported
from bench import harness  # noqa: E402
from bench import systems  # noqa: E402  (after the switch above: one CPU device)
from bench.harness import median_call  # noqa: E402
from bench.matmuls import Dot, cost, dots_of, flops, time_alone  # noqa: E402

import jax  # noqa: E402
from meshdistill.strategies import LogitKD  # noqa: E402

RESULT = pathlib.Path(__file__).parent / "results" / "matmul_shapes.md"
NAMES = {systems.ONE + systems.REF: "meshdistill LogitKD step", systems.ONE + systems.BARE_T: "bare teacher forward",
         systems.ONE + systems.BARE_S: "bare student step"}


def programs(vocab: int):
  """name -> (StableHLO, a call that runs the program once and waits for it): `throughput.py`'s one-device
  LogitKD step and bare programs (`bench.systems.one_device_programs`)."""
  tcfg, scfg = systems.configs(vocab)
  x = systems.make_batches(1, vocab)[0]
  ours = systems.Ours(LogitKD(temperature=systems.TAU, alpha=systems.ALPHA), None, tcfg, scfg)
  bare = systems.Bare(None, tcfg, scfg)
  calls = {systems.ONE + systems.REF: lambda: ours.step(x), systems.ONE + systems.BARE_T: lambda: bare.teacher(x),
           systems.ONE + systems.BARE_S: lambda: bare.student(x)}
  return {NAMES[k]: (text, calls[k]) for k, text in systems.one_device_programs(ours, bare, x).items()}


def probe_list(probes: dict, alone: dict) -> str:
  return ", ".join(f"{name} {flops(d) / alone[d] / 1e9:.1f}" for name, d in probes.items())


def probe_list1(single: dict) -> str:
  return ", ".join(f"[{m}, {k}] x [{k}, {n}] {r / 1e9:.1f}" for (m, k, n), r in single.items())


def shape_name(d: Dot) -> str:
  lb = f", batch {list(d.lhs_batch)}x{list(d.rhs_batch)}" if d.lhs_batch else ""
  return f"{list(d.lhs)} x {list(d.rhs)} (contract {list(d.lhs_contract)}x{list(d.rhs_contract)}{lb})"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--vocab", type=int, default=1024)
  parser.add_argument("--calls", type=int, default=15, help="timed calls of each program (median)")
  parser.add_argument("--chain", type=int, default=20, help="copies of a dot (on different inputs) in one program")
  parser.add_argument("--out", type=pathlib.Path, default=RESULT)
  args = parser.parse_args(argv)
  if len(jax.devices()) != 1:
    raise SystemExit(f"matmul_shapes: runs on one device; this process has {len(jax.devices())} "
                     f"(unset MESHDISTILL_THROUGHPUT_ONE_DEVICE or set it to 1)")
  t0 = time.time()
  load_start = os.getloadavg()
  progs = programs(args.vocab)
  per_prog = {name: dots_of(text) for name, (text, _) in progs.items()}
  probes = {f"[{m}, {k}] x [{k}, {n}]": Dot((m, k), (k, n), (1,), (0,), (), ()) for m, k, n in systems.PROBES}
  alone: dict[Dot, float] = {}
  for d in sorted({d for c in per_prog.values() for d in c} | set(probes.values())):
    alone[d] = time_alone(d, args.calls, args.chain)
    print(f"{shape_name(d)}: {1e3 * alone[d]:.3f} ms, {flops(d) / alone[d] / 1e9:.1f} GFLOP/s", flush=True)
  run_time = {name: median_call(call, args.calls) for name, (_, call) in progs.items()}
  rate = max(flops(d) / alone[d] for d in probes.values())
  single = {}  # throughput.py's probe: one dot a call, the same operands every call
  for m, k, n in systems.PROBES:
    probe = systems.Matmul(None, m, k, n)
    single[m, k, n] = probe.flops / median_call(lambda: probe.fn(probe.a, probe.b), args.calls)
  rate1 = max(single.values())
  load_end = os.getloadavg()

  lines = [
      "# The step's own matmul shapes: what they reach alone, on one device",
      "",
      f"Produced by `python benchmarks/matmul_shapes.py --vocab {args.vocab} --calls {args.calls} --chain "
      f"{args.chain}` ({time.time() - t0:.0f} s wall; load average {load_start[0]:.1f} at the start, "
      f"{load_end[0]:.1f} at the end). {harness.machine()}; one CPU device in the process.",
      "",
      "Each distinct float32 dot of a program (from its StableHLO), timed alone: "
      f"{args.chain} copies on different inputs in one jitted program, median of {args.calls} calls, per copy. "
      f"Rates: the fastest probe timed the same way, **{rate / 1e9:.1f} GFLOP/s** (the probe matmuls of "
      f"`throughput.py`: {probe_list(probes, alone)}); and as `throughput.py` times its probes (one dot a call, "
      f"the same operands every call), **{rate1 / 1e9:.1f} GFLOP/s** ({probe_list1(single)}): the rate its "
      "70% target is measured against. See the module docstring for the method.",
      "",
      "| program | dots run | GFLOP in dots | its dots alone (ms) | the dots' rate | of the probe rate (copies / "
      "one a call) | the program as run (ms) | as run, of the probe rate (copies / one a call) | "
      "program / its dots |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name, counts in per_prog.items():
    fl, t = cost(counts, alone)
    run = run_time[name]
    lines.append(f"| {name} | {sum(counts.values())} | {fl / 1e9:.2f} | {1e3 * t:.1f} | {fl / t / 1e9:.1f} GFLOP/s | "
                 f"{100 * fl / t / rate:.0f}% / {100 * fl / t / rate1:.0f}% | {1e3 * run:.1f} | "
                 f"{100 * fl / run / rate:.0f}% / {100 * fl / run / rate1:.0f}% | {run / t:.2f}x |")
  lines += ["", "Every distinct dot (runs per program: step / bare teacher / bare student):", "",
            "| dot (lhs x rhs) | GFLOP | ms alone | GFLOP/s | of the probe rate (copies) | runs |",
            "|---|---:|---:|---:|---:|---|"]
  by_time = sorted(alone, key=lambda d: -sum(per_prog[p][d] for p in per_prog) * alone[d])
  for d in by_time:
    runs = " / ".join(str(per_prog[p][d]) for p in per_prog) if any(per_prog[p][d] for p in per_prog) else ""
    if d in probes.values():
      runs = f"{runs}, a probe" if runs else "a probe"
    lines.append(f"| {shape_name(d)} | {flops(d) / 1e9:.3f} | {1e3 * alone[d]:.3f} | {flops(d) / alone[d] / 1e9:.1f} | "
                 f"{100 * flops(d) / alone[d] / rate:.0f}% | {runs} |")
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text("\n".join(lines) + "\n")
  print("\n".join(lines[:12 + len(per_prog)]))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  sys.exit(main())
