"""The experts of a mixture-of-experts block: one grouped matmul (`jax.lax.ragged_dot`) vs a loop over experts.

Both compute the same thing at the same routing (`meshdistill.models.moe`): ``grouped_experts`` sorts the
``tokens * top_k`` assignments by expert and runs each projection as one `jax.lax.ragged_dot`;
``dense_experts`` runs every expert on every token in a Python loop and keeps each token's routed outputs (the
plain way to write it without dynamic shapes: ``n_experts / top_k`` times the useful FLOPs). The routing is computed
once from fixed router logits and is an input of both, so only the expert computation is timed: the forward pass,
and the forward and backward pass (gradients of the input and of the three stacked expert weights).

Timing: `bench.harness.interleave` (each round times every system once on the same inputs, one call to compile
first); tokens/s from the median call, and the ratio of medians with the paired per-round ratio.

  python benchmarks/moe_block.py                     # 2048 tokens, D=256, F=512; 8 experts top-2 and 32 top-4
  python benchmarks/moe_block.py --tokens 4096 --rounds 7

Writes ``benchmarks/results/moe_block.md``.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

import jax
import jax.numpy as jnp

from bench import harness
from meshdistill.models.moe import MoeConfig, dense_experts, grouped_experts, route

HERE = pathlib.Path(__file__).resolve().parent
NOTE = (
    "Reading: on CPU jax 0.10.2 lowers `jax.lax.ragged_dot` by masking (`_ragged_dot_general_impl`: every group's "
    "rows expanded to a dense `[E, M, K]` operand, then one batched dot), so it does E times the useful FLOPs and "
    "allocates E copies of the sorted activations: slower than the loop, which does E/k times; the gap grows with "
    "E. On TPU and GPU it lowers to the platform's grouped matmul (`chlo.ragged_dot`; compiled for v5e:2x2 the "
    "step holds `ragged-dot` ops, see tests/test_moe.py), which is what the block is written for; this CPU table "
    "measures the fallback, not that kernel."
)


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tokens", type=int, default=2048)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--hidden", type=int, default=512, help="each expert's hidden units (F)")
  p.add_argument("--experts", default="8:2,32:4", help="comma-separated n_experts:top_k cases")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--out", default=str(HERE / "results" / "moe_block.md"))
  return p.parse_args(argv)


def _inputs(n, d, f, e, k, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (n, d), jnp.float32)
  weights, experts = route(jax.random.normal(keys[1], (n, e)), MoeConfig(n_experts=e, top_k=k))
  w = [jax.random.normal(kk, s) / s[1] ** 0.5 for kk, s in zip(keys[2:], [(e, d, f), (e, d, f), (e, f, d)])]
  return x, experts, weights, w


def _systems(x, experts, weights, w):
  """The four timed calls; the routing is an argument (not a constant of the program), so the grouped path's sort by
  expert runs in the timed call, as it does in the block."""
  def loss(fn):
    return lambda x, e, g, w: jnp.sum(fn(x, e, g, *w) ** 2)

  fns = {}
  for name, fn in (("ragged_dot", grouped_experts), ("dense loop", dense_experts)):
    fwd = jax.jit(lambda x, e, g, w, fn=fn: fn(x, e, g, *w))
    bwd = jax.jit(jax.grad(loss(fn), argnums=(0, 3)))
    fns[f"{name} fwd"] = lambda _, f=fwd: jax.block_until_ready(f(x, experts, weights, w))
    fns[f"{name} fwd+bwd"] = lambda _, f=bwd: jax.block_until_ready(f(x, experts, weights, w))
  return fns


def main(argv=None) -> int:
  args = _args(argv)
  n, d, f = args.tokens, args.d_model, args.hidden
  cases = [tuple(int(v) for v in c.split(":")) for c in args.experts.split(",")]
  rows, raw = [], {}
  for e, k in cases:
    x, experts, weights, w = _inputs(n, d, f, e, k)
    ref = grouped_experts(x, experts, weights, *w)
    err = float(jnp.max(jnp.abs(dense_experts(x, experts, weights, *w) - ref)) / jnp.max(jnp.abs(ref)))
    res = harness.interleave(_systems(x, experts, weights, w), range(args.rounds + 1), warmup=1)
    med = harness.medians(res["times"])
    raw[f"{e}:{k}"] = res
    for kind in ("fwd", "fwd+bwd"):
      g, dl = f"ragged_dot {kind}", f"dense loop {kind}"
      ratio, pair, spread = harness.ratio_of(res["times"], med, dl, (g,))
      rows.append(f"| {e} / top-{k} | {kind} | {n / med[g]:,.0f} | {n / med[dl]:,.0f} | {ratio:.2f}x "
                  f"(paired {pair:.2f}x, {spread}) | {err:.1e} |")
      print(rows[-1], flush=True)
  load = harness.load()
  text = "\n".join([
      "# MoE block: grouped matmul (ragged_dot) vs a loop over experts",
      "",
      f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {harness.machine()}; load "
      f"average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end (a shared machine: the paired ratio, "
      "taken within each round, is the number to read).",
      "",
      "Command: `" + " ".join(["PYTHONPATH=src:benchmarks python benchmarks/moe_block.py",
                               *(argv if argv is not None else sys.argv[1:])]) + "`",
      "",
      f"{n} tokens, d_model={d}, each expert's hidden F={f}, float32, one CPU device; the same routing (fixed router "
      "logits, softmax, top-k renormalised) is an input of both. ragged_dot: `models.moe.grouped_experts`, the "
      "block's own path; dense loop: `models.moe.dense_experts`, every expert on every token (E/k times the useful "
      f"FLOPs). Median of {args.rounds} interleaved rounds after one call to compile. fwd+bwd: the gradients of the "
      "input and of the stacked expert weights. max rel. diff: the largest difference of the two outputs over the "
      "largest output.",
      "",
      NOTE,
      "",
      "| experts | pass | ragged_dot tokens/s | dense loop tokens/s | ragged_dot speed-up | max rel. diff |",
      "|---|---|---|---|---|---|",
      *rows,
      "",
  ])
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(text)
  harness.write_json(out.with_suffix(".json"), raw)
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
