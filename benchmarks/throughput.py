"""Training throughput: meshdistill against tunix's DistillationTrainer on the same work, with a roofline.

The systems (`bench.systems`: meshdistill's step in several layouts, tunix's trainer given split and numpy
input, the bare programs, a hand-written step, matmul probes) run on the 2x4 mesh of 8 simulated CPU devices, and
the one-device rows in a child process whose JAX has one CPU device. Every position counts (mask of ones), so
tunix's loss and ours are the same ``alpha tau^2 KL + (1 - alpha) CE`` and their loss curves must agree: a check
that the work really is the same.

Timing (`bench.harness.interleave`): after warm-up steps, the steps of all systems (of each process) are
interleaved round by round, each timed to completion; then each system's own training loop over blocks of
``--loop-steps`` batches (ours: `meshdistill.train.loop.trainer.fit`, one logged step and the rest metrics-light per
block; tunix: one ``train()`` call per block; the bare programs dispatched back to back), interleaved block by
block. Medians and paired (within-round) ratios are reported against each row's analytic FLOPs and the matmul
rate measured in the same rounds; the compiled steps' ``cost_analysis()`` FLOPs and all-reduces beside them.
What the numbers mean, run by run: ``benchmarks/results/throughput_notes.md``.

Run: ``python benchmarks/throughput.py [--vocab 1024 --steps 15 --loop-rounds 6 --loop-steps 10]``; writes
``benchmarks/results/throughput.md`` (`bench.render_throughput`) and the raw times beside it (``throughput.json``).
``--render`` rewrites the ``.md`` from that ``.json`` without timing anything (after a change to the report, or
to take in new `step_profile.py` rows).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from bench import devices  # before JAX: 8 simulated CPU devices, or one in the one-device child process
from bench import harness, render_throughput
from bench.systems import (ALPHA, BARE, BARE_S, BARE_T, CE_ONLY, DP, HAND, LIGHT, ONE, OURS, PROBES, REF, ROWS, TAU,
                           TUNIX, TUNIX_DP, TUNIX_NP, TUNIX_REP, Bare, Hand, Matmul, Ours, Tunix, configs,
                           make_batches, matmul_ceilings, probe_name)

import jax  # noqa: E402
import meshdistill as md  # noqa: E402
import numpy as np  # noqa: E402
from meshdistill.strategies import HardLabelCE, LogitKD  # noqa: E402
from meshdistill.strategies import ChunkedLogitKD  # noqa: E402

RESULT = pathlib.Path(__file__).parent / "results" / "throughput.md"


def run_loops(loops: dict, vocab: int, rounds: int, k: int) -> dict[str, list[float]]:
  """Each system's own training loop over the same ``k`` batches, round after round (``rounds`` timed, after a
  warm-up block): seconds per step of each block (the block's wall time / ``k``).

  Our loops (`Ours.loop`, `meshdistill.train.loop.trainer.fit` with ``log_every=k``) are first brought to a step
  count of ``k - 1`` modulo ``k`` so that every timed block is one logged (full) step and ``k - 1``
  metrics-light ones, the steady state of a run (a fit call runs full steps until its first log)."""
  batches = make_batches(k * (rounds + 2), vocab, seed=1)
  for system in loops.values():
    if isinstance(system, Ours):
      done = int(np.asarray(jax.device_get(system.d.unreplicate(system.state).step)))
      if (k - 1 - done) % k:
        system.loop(batches[: (k - 1 - done) % k], k)
  blocks = [batches[(r + 1) * k : (r + 2) * k] for r in range(rounds + 1)]  # the first: warm-up
  fns = {name: (lambda xs, s=system: s.loop(xs, k)) for name, system in loops.items()}
  return harness.interleave(fns, blocks, warmup=1, per=k)["times"]


def run(vocab: int, steps: int, warmup: int, chunk: int, loop_rounds: int = 6, loop_steps: int = 10) -> dict:
  """Every row: first the one-device rows in a child process with one CPU device (`one_device_part`; first, before
  this process starts its JAX backend or builds tunix's trainers, whose threads could take CPU time beside it),
  then the 2x4 mesh rows here (8 simulated CPU devices); the same batches and initial weights in both."""
  one_res = one_device_part(vocab, steps, warmup, chunk, loop_rounds, loop_steps)
  mesh_res = run_part(False, vocab, steps, warmup, chunk, loop_rounds, loop_steps)
  res = {k: {**mesh_res[k], **one_res[k]}
         for k in ("times", "loop_times", "cpu", "compile_s", "stats", "matmul_flops", "ceiling")}
  losses = {**mesh_res["losses"], **one_res["losses"]}
  order = (OURS, REF, TUNIX, TUNIX_NP, TUNIX_REP, OURS + ROWS, REF + ROWS, OURS + DP, TUNIX_DP, ONE + OURS,
           ONE + REF + LIGHT, HAND, ONE + HAND)
  return {**res, "loop_steps": loop_steps, "losses": {k: losses[k] for k in order}}


def one_device_part(vocab: int, steps: int, warmup: int, chunk: int, loop_rounds: int, loop_steps: int) -> dict:
  """`run_part` of the one-device rows in a child process whose JAX has one CPU device (this process's
  device-count flag removed from its environment); its results come back as JSON."""
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "one_device.json"
    subprocess.run([sys.executable, __file__, "--one-device-part", str(out), "--vocab", str(vocab), "--steps",
                    str(steps), "--warmup", str(warmup), "--chunk", str(chunk), "--loop-rounds", str(loop_rounds),
                    "--loop-steps", str(loop_steps)], env=devices.one_device_env(), check=True)
    return json.loads(out.read_text())


def systems_of(one_device: bool, vocab: int, chunk: int) -> tuple[dict, Bare, dict, dict]:
  """(stepping systems, the bare programs, {row: a step function} of the bare programs and the probes, the
  probes) of the one-device rows or the 2x4 mesh rows (with the 8x1 data-parallel ones)."""
  mesh, pre = (None, ONE) if one_device else (md.make_mesh(data=2, tensor=4), "")
  tcfg, scfg = configs(vocab)
  chunked = lambda: ChunkedLogitKD(temperature=TAU, alpha=ALPHA, chunk_size=chunk)  # noqa: E731
  logit = lambda: LogitKD(temperature=TAU, alpha=ALPHA)  # noqa: E731
  systems = {
      pre + OURS: Ours(chunked(), mesh, tcfg, scfg),
      pre + REF: Ours(logit(), mesh, tcfg, scfg),
      # the steps the training loop runs between logging steps (same update, loss / grad_norm only)
      pre + OURS + LIGHT: Ours(chunked(), mesh, tcfg, scfg, light=True),
      pre + REF + LIGHT: Ours(logit(), mesh, tcfg, scfg, light=True),
      pre + HAND: Hand(mesh, tcfg, scfg),
  }
  if not one_device:
    dp_mesh = md.make_mesh(data=8, tensor=1)
    systems.update({
        TUNIX: Tunix(mesh, tcfg, scfg, shard=True),
        TUNIX_NP: Tunix(mesh, tcfg, scfg, shard=False),
        # the same step with a CE-only strategy: the unused teacher is dropped by the compiler, so this
        # is a bare student step in meshdistill's step structure (shard_map over `data`)
        CE_ONLY: Ours(HardLabelCE(), mesh, tcfg, scfg),
        # the student replicated and run on rows split over data x tensor (`mesh.student_split: batch`)
        OURS + ROWS: Ours(chunked(), mesh, tcfg, scfg, split="batch"),
        REF + ROWS: Ours(logit(), mesh, tcfg, scfg, split="batch"),
        OURS + ROWS + LIGHT: Ours(chunked(), mesh, tcfg, scfg, light=True, split="batch"),
        REF + ROWS + LIGHT: Ours(logit(), mesh, tcfg, scfg, light=True, split="batch"),
        TUNIX_REP: Tunix(mesh, tcfg, scfg, shard=True, replicated_student=True),
        # every system's data-parallel form: on the mesh 8x1 nothing is split over `tensor`
        OURS + DP: Ours(chunked(), dp_mesh, tcfg, scfg),
        OURS + DP + LIGHT: Ours(chunked(), dp_mesh, tcfg, scfg, light=True),
        TUNIX_DP: Tunix(dp_mesh, tcfg, scfg, shard=True),
        HAND + DP: Hand(dp_mesh, tcfg, scfg),
    })
  bare = Bare(mesh, tcfg, scfg)
  probes = {pre + probe_name(shape): Matmul(mesh, *shape) for shape in PROBES}
  parts = {pre + BARE_T: bare.teacher, pre + BARE_S: bare.student, **{k: v.step for k, v in probes.items()}}
  if not one_device:
    bare_dp = Bare(dp_mesh, tcfg, scfg)
    parts.update({BARE_T + DP: bare_dp.teacher, BARE_S + DP: bare_dp.student})
  return systems, bare, parts, probes


def run_part(one_device: bool, vocab: int, steps: int, warmup: int, chunk: int, loop_rounds: int,
             loop_steps: int) -> dict:
  """Times the mesh rows (``one_device=False``) or the one-device rows (in a process whose JAX has one device):
  steps interleaved round by round (`bench.harness.interleave`), then the training loops (`run_loops`)."""
  systems, bare, parts, probes = systems_of(one_device, vocab, chunk)
  batches = make_batches(warmup + steps, vocab)
  stats = {name: s.compiled_stats(batches[0]) for name, s in systems.items() if isinstance(s, Ours)}
  timing = harness.interleave({**{n: s.step for n, s in systems.items()}, **parts}, batches, warmup=warmup)
  ceiling = matmul_ceilings(systems[ONE + REF], bare, batches[0]) if one_device else {}
  if one_device:
    loops = {ONE + OURS: systems[ONE + OURS], ONE + REF: systems[ONE + REF], ONE + BARE: bare}
    losses = {ONE + OURS: systems[ONE + OURS].losses, ONE + REF + LIGHT: systems[ONE + REF + LIGHT].losses,
              ONE + HAND: systems[ONE + HAND].losses}
  else:
    loops = {OURS: systems[OURS], OURS + ROWS: systems[OURS + ROWS], REF + ROWS: systems[REF + ROWS],
             OURS + DP: systems[OURS + DP], TUNIX: systems[TUNIX], TUNIX_REP: systems[TUNIX_REP],
             TUNIX_DP: systems[TUNIX_DP], BARE: bare}
    losses = {OURS: systems[OURS].losses, REF: systems[REF].losses, TUNIX: systems[TUNIX].losses(),
              TUNIX_NP: systems[TUNIX_NP].losses(), TUNIX_REP: systems[TUNIX_REP].losses(),
              OURS + ROWS: systems[OURS + ROWS].losses, REF + ROWS: systems[REF + ROWS].losses,
              HAND: systems[HAND].losses, OURS + DP: systems[OURS + DP].losses, TUNIX_DP: systems[TUNIX_DP].losses()}
  loop_times = run_loops(loops, vocab, loop_rounds, loop_steps) if loop_rounds else {}
  return {**timing, "loop_times": loop_times, "stats": stats, "matmul_flops": {k: v.flops for k, v in probes.items()},
          "losses": losses, "ceiling": ceiling}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--vocab", type=int, default=1024)
  parser.add_argument("--steps", type=int, default=15, help="timed steps per system (after warm-up)")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--chunk", type=int, default=256, help="ChunkedLogitKD tokens per chunk (per device)")
  parser.add_argument("--loop-rounds", type=int, default=6,
                      help="timed rounds of the training loops side by side (0: none)")
  parser.add_argument("--loop-steps", type=int, default=10,
                      help="steps per loop block (our loop's log_every: one logged step, the rest metrics-light)")
  parser.add_argument("--out", type=pathlib.Path, default=RESULT)
  parser.add_argument("--render", action="store_true",
                      help="rewrite --out from the raw times its .json keeps (an earlier run), timing nothing")
  parser.add_argument("--one-device-part", type=pathlib.Path, default=None, metavar="JSON",
                      help=f"time only the one-device rows, in this process, and write their raw times to JSON (what "
                           f"the run does in its child process, started with {devices.ONE_DEVICE_ENV}=1: one CPU "
                           "device; without it this process simulates 8 devices and the rows run on the first)")
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error(f"--steps {args.steps}: the paired ratios' spread needs at least 2 timed steps; choose --steps >= 2")
  if args.loop_rounds == 1:
    parser.error("--loop-rounds 1: the loops' paired spread needs at least 2 rounds; choose 0 (no loops) or >= 2")
  if args.one_device_part is not None:
    part = run_part(True, args.vocab, args.steps, args.warmup, args.chunk, args.loop_rounds, args.loop_steps)
    harness.write_json(args.one_device_part, part)
    return
  raw_path = args.out.with_suffix(".json")
  if args.render:
    try:
      raw = harness.read_json(raw_path)
    except FileNotFoundError as e:
      parser.error(str(e))
    args.out.write_text(render_throughput.report(raw))
    print(f"rewrote {args.out} from {raw_path}")
    return
  t0 = time.time()
  load_start = harness.load()
  res = run(args.vocab, args.steps, args.warmup, args.chunk, args.loop_rounds, args.loop_steps)
  res["load"], res["machine"] = (load_start, harness.load()), harness.machine()
  for name, ts in res["loop_times"].items():
    print(f"loop, {name}: median {1e3 * harness.medians({name: ts})[name]:.1f} ms per step over {len(ts)} blocks",
          flush=True)
  for name, (flops, census) in res["stats"].items():
    print(f"{name}: compiled step {flops / 1e9:.2f} GFLOP (cost_analysis), all-reduces in the HLO {census}", flush=True)
  raw = render_throughput.raw_results(res, vars(args), time.time() - t0)
  print("\n".join(render_throughput.step_table(raw)))
  harness.write_json(raw_path, raw)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(render_throughput.report(raw))
  print(f"wrote {args.out} and {raw_path}")


if __name__ == "__main__":
  sys.exit(main())
