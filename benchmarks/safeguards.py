"""What the training loop's safeguards cost: the divergence guard's step time and memory, remat's trade.

The main job's models, batch and 2x4 mesh (`meshdistill.config.Config` defaults) go through
`meshdistill.train.loop.trainer.fit`:

* guard: the same `Distiller` trains ``--steps`` steps without the guard and with it, the default
  (lagged check, ``keep_every=10``: step ``s``'s loss is read after step ``s + 1`` is dispatched,
  so the device queue never drains), the check read at once (``guard_lag=0``: one device sync per
  step) and a state copy before every step (``keep_every=1``). Rounds are interleaved (off, on,
  ...; the order rotates each round), side by side on the same compiled step; reported are the
  median step time of each variant and the median over rounds of its ratio to the no-guard run of
  the same round.
  The step is compiled before timing (a warm-up fit), so only the loop is timed. The memory the
  guard holds is one train state per device (two while a fresh copy waits for the next step's loss).
* remat: per-device memory of the compiled step (XLA's memory analysis, CPU memory-aware
  scheduler, as the trainer measures on CPU with a budget) and the step time of each policy:
  what `safeguards.remat.auto` trades for memory.

Run: ``python benchmarks/safeguards.py [--steps 20 --rounds 12]``; writes
``benchmarks/results/safeguards.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import statistics

from bench import harness

import meshdistill as md

md.simulate_cpu_devices(8)

import jax  # noqa: E402

from meshdistill.config import Config  # noqa: E402
from meshdistill.data import build_data  # noqa: E402
from meshdistill.train.memory import CPU_MEMORY_SCHEDULER, REMAT_ORDER, step_memory  # noqa: E402
from meshdistill.train.loop.guard import DivergenceGuard  # noqa: E402
from meshdistill.train.optimizers import make_optimizer  # noqa: E402
from meshdistill.train.loop.trainer import fit  # noqa: E402

RESULT = pathlib.Path(__file__).parent / "results" / "safeguards.md"


def state_bytes_per_device(state) -> int:
  """Bytes of ``state`` held by the first device (its shards of every leaf)."""
  device = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == device)


def timed_fit(distiller, data, steps: int, guard: dict | None) -> float:
  """Seconds per step of ``steps`` steps of `fit` (the step is already compiled); ``guard``: None (off) or
  the guard's ``keep_every`` and ``guard_lag``."""
  kw = {} if guard is None else {"guard": DivergenceGuard(), **guard}
  result = fit(distiller, data, steps=steps, log_every=steps, **kw)
  jax.block_until_ready(result.state)
  return result.train_seconds / steps


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=20, help="timed steps per variant in each round")
  p.add_argument("--rounds", type=int, default=12, help="rounds; each runs every variant once, in rotated order")
  p.add_argument("--remat-steps", type=int, default=10, help="timed steps per remat policy")
  args = p.parse_args()

  cfg = Config()
  cfg = cfg.replace(data=dataclasses.replace(cfg.data, max_chars=600_000))  # enough batches, quick to load
  mesh = md.make_mesh(cfg.mesh.data, cfg.mesh.tensor)
  data = build_data(cfg.data, cfg.train.batch_size)
  teacher = md.init_model(cfg.teacher, seed=0, mesh=mesh)
  student = md.init_model(cfg.student, seed=1, mesh=mesh)
  d = md.Distiller(student, teacher, strategy=cfg.distill.strategy(), mesh=mesh, seed=1,
                   optimizer=make_optimizer(cfg.train, cfg.student.n_layers))
  tokens = cfg.train.batch_size * cfg.data.seq_len

  # ---------------------------------------------------------------- guard
  variants = {
    "no guard": None,
    "guard (default: lagged check, keep_every=10)": {"keep_every": 10, "guard_lag": 1},
    "guard, check read at once (guard_lag=0), keep_every=10": {"keep_every": 10, "guard_lag": 0},
    "guard, lagged check, keep_every=1": {"keep_every": 1, "guard_lag": 1},
  }
  fit(d, data, steps=3, log_every=3)  # compile
  load_before = os.getloadavg()[0]
  times: dict[str, list[float]] = {k: [] for k in variants}
  names = list(variants)
  for r in range(args.rounds):
    # Variants run back to back and the order rotates from round to round, so a slow spell of a
    # shared machine hits each variant alike; each is compared with the no-guard run of its round.
    for name in names[r % len(names):] + names[:r % len(names)]:
      times[name].append(timed_fit(d, data, args.steps, variants[name]))
      print(f"round {r + 1}: {name}: {times[name][-1] * 1e3:.1f} ms/step", flush=True)
  med = harness.medians(times)
  ratio = {k: harness.paired(times, k, ("no guard",)) for k in times}  # against the no-guard run of each round
  best = {k: min(v) for k, v in times.items()}  # the round least disturbed by other work on the machine
  state_mib = state_bytes_per_device(d.init_state()) / 2**20

  # ---------------------------------------------------------------- remat
  it = data.train_iterator()
  batch = next(it)
  it.close()
  state = d.init_state()
  remat_rows = []
  for policy in REMAT_ORDER:
    dr = d.with_remat(policy).with_compiler_options(CPU_MEMORY_SCHEDULER)
    report = step_memory(dr, state, batch)
    fit(dr, data, steps=2, log_every=2)  # compile
    per_step = statistics.median(timed_fit(dr, data, args.remat_steps, None) for _ in range(2))
    remat_rows.append((policy, report, per_step))
    print(f"remat={policy}: {report}; {per_step * 1e3:.1f} ms/step", flush=True)

  lines = [
    "# Safeguards: cost of the divergence guard and of remat",
    "",
    f"`python benchmarks/safeguards.py --steps {args.steps} --rounds {args.rounds} --remat-steps {args.remat_steps}`"
    f" on {platform.machine()} with {os.cpu_count()} CPU cores, jax {jax.__version__}, 8 simulated CPU devices "
    f"(2x4 mesh); the main job's models (teacher {cfg.teacher.d_model}x{cfg.teacher.n_layers}, student "
    f"{cfg.student.d_model}x{cfg.student.n_layers}, V={cfg.student.vocab_size}), batch {cfg.train.batch_size} x "
    f"{cfg.data.seq_len}. Timed: `trainer.fit`'s loop (data, step, guard), compiled beforehand.",
    "",
    "## Divergence guard",
    "",
    "| variant | best ms/step | best vs no guard | median ms/step | median of per-round ratios to no guard | "
    "tokens/s (median) | rounds (ms/step) |",
    "|---|---|---|---|---|---|---|",
  ]
  for name in variants:
    rounds = ", ".join(f"{t * 1e3:.1f}" for t in times[name])
    lines.append(f"| {name} | {best[name] * 1e3:.1f} | {best[name] / best['no guard']:.3f}x | {med[name] * 1e3:.1f} | "
                 f"{ratio[name]:.3f}x | {tokens / med[name]:,.0f} | {rounds} |")
  default = "guard (default: lagged check, keep_every=10)"
  lines += [
    "",
    f"Guard on (default) vs off: **{best[default] / best['no guard']:.3f}x** on the best round of each (the "
    f"intrinsic cost; target <= 1.01x), {ratio[default]:.3f}x as the median of per-round ratios. Load average of "
    f"the machine during the run (other work shares its cores): {load_before:.1f} at the start, "
    f"{os.getloadavg()[0]:.1f} at the end; the spread of the rounds column is that load, not the guard.",
  ]
  lines += [
    "",
    f"Memory held by the guard: one copy of the train state, {state_mib:.3f} MiB per device here (params + "
    "AdamW moments of the student; the teacher is not copied), two for one step while a new copy awaits the "
    "next loss.",
    "",
    "## Remat policies (memory-aware CPU scheduler)",
    "",
    "| remat | step memory per device (MiB) | temp (MiB) | median ms/step | vs none |",
    "|---|---|---|---|---|",
  ]
  t_none = remat_rows[0][2]
  for policy, report, per_step in remat_rows:
    lines.append(f"| {policy} | {report.total_bytes / 2**20:.2f} | {report.temp_bytes / 2**20:.2f} | "
                 f"{per_step * 1e3:.1f} | {per_step / t_none:.3f}x |")
  lines.append("")
  RESULT.write_text("\n".join(lines))
  print("\n".join(lines))
  print(f"wrote {RESULT}")


if __name__ == "__main__":
  main()
