"""Expert parallelism compiled for a TPU slice: the collectives and per-chip memory of one MoE distillation step with
the experts split over ``tensor`` only and over an ``expert`` axis, side by side.

The pair is an MoE teacher and an MoE student (8 experts, top-2, `meshdistill.models.moe`); each layout is compiled
by the real TPU compiler for a topology of the planner (`meshdistill.planner`, libtpu: the ``tpu`` extra), nothing
runs. The collectives are labelled by mesh axis with the planner's census (`planner._compile.collectives`), so the
token exchange shows as all-to-alls over ``expert``; an all-gather of an expert weight would show with its shape.

  python benchmarks/expert_parallel.py                        # v5e:2x2: 1 x tensor 4 vs 1 x expert 2 x tensor 2
  python benchmarks/expert_parallel.py --topology v5p:2x2x1

Writes ``benchmarks/results/expert_parallel.md`` (minutes: one TPU compile per layout).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import optax  # noqa: E402

import meshdistill as md  # noqa: E402
from bench import harness  # noqa: E402
from meshdistill import planner  # noqa: E402
from meshdistill.models.moe import MoeConfig  # noqa: E402
from meshdistill.planner._compile import abstract_distiller, collectives, compile_step  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
LAYOUTS = {"tensor 4 (experts' F split)": (1, 1, 4), "expert 2 x tensor 2": (1, 2, 2)}


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--topology", default="v5e:2x2")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--out", default=str(HERE / "results" / "expert_parallel.md"))
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = _args(argv)
  moe = MoeConfig(n_experts=8, top_k=2, expert_hidden=256, aux_loss_weight=0.01)
  cfg = md.ModelConfig(vocab_size=1024, d_model=256, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=64,
                       mlp_hidden=512, max_len=args.seq, dtype="bfloat16", moe=moe)
  devices = planner.make_planner(cfg, cfg, topology=args.topology, seq=args.seq).target.devices
  # every shape an expert weight (or a shard of one) can have here; the default batch's activations ([4, 32, 256])
  # have none of them
  weights = {s for e in (8, 4) for f in (256, 128, 64) for s in ((e, 256, f), (e, f, 256))}
  rows = []
  for name, (data, expert, tensor) in LAYOUTS.items():
    mesh = md.make_mesh(data, tensor, devices=devices, axes={"expert": expert} if expert > 1 else None)
    d = abstract_distiller(cfg, cfg, md.strategies.LogitKD(), optax.adam(1e-3), mesh)
    compiled = []
    seconds, _ = harness.timed(lambda: compiled.append(compile_step(d, args.batch, args.seq)))  # noqa: B023
    c = compiled[0]
    gathered = [tuple(int(v) for v in m.group(1).split(",") if v) for m in
                re.finditer(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", c.hlo)]
    rows.append((name, dict(mesh.shape), c, collectives(c.hlo, mesh.shape), sum(s in weights for s in gathered),
                 seconds))
    print(f"{name}: compiled in {seconds:.0f} s", file=sys.stderr)
  lines = [
      "# Expert parallelism compiled for TPU", "",
      f"{datetime.date.today()}; `python benchmarks/expert_parallel.py --topology {args.topology} --batch {args.batch} "
      f"--seq {args.seq}`; MoE teacher and MoE student alike: D=256, 1 layer, 8 experts top-2, F=256, "
      "bfloat16, LogitKD, Adam; compiled by libtpu for the topology (nothing runs).", "",
      "| layout | mesh | per-chip memory (GiB) | ragged-dot in the HLO | all-gathers of an expert weight's shape | collectives "
      "(kind over axis: ops, MiB per chip) | compile s |",
      "|---|---|---|---|---|---|---|",
  ]
  for name, shape, c, census, weight_gathers, seconds in rows:
    mem = c.memory.total_bytes / 2**30 if c.memory is not None else float("nan")
    colls = "; ".join(f"{e['kind']} over {e['axis']}: {e['count']}, {e['bytes'] / 2**20:.2f}" for e in census)
    lines.append(f"| {name} | {shape} | {mem:.3f} | {'yes' if 'ragged-dot' in c.hlo else 'no'} | {weight_gathers} | {colls} | "
                 f"{seconds:.0f} |")
  lines += ["", "Reading: with the `expert` axis each chip holds 4 of the 8 experts (and half of their hidden units); "
            "the routed tokens travel by all-to-all over `expert` (3 per MoE layer forward: counts, tokens, results; "
            "2 more backward for the student), the fixed-capacity exchange of `models.moe.exchanged_experts`. The "
            "all-gathers over `expert` are activations (the MoE block's output rows and their cotangents: the rest "
            "of the step is replicated over `expert`), never an expert weight (the column above counts gathers of "
            "any shape an expert weight or its shard has)."]
  pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
