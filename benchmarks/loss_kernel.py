"""The chunked loss's per-chunk work on one device, side by side: XLA's two passes against the Pallas loss kernel.

For one chunk of ``C`` tokens at a model's vocabulary, both models' float32 logits are given and each variant forms
the default recipe's per-token values (their token sums) and the gradient of the loss sum with respect to the student
logits in bfloat16 (what the head matmuls read on a TPU), as the chunk loop of `meshdistill.losses.chunked_token_sums`
calls it:

- ``xla``: `jax.value_and_grad` of `forward_kl_terms`'s sums (the loop's default: one pass for the sums, one for
  the gradient); ``xla, loss only``: the same with the metrics' sums unused (what a metrics-light step keeps);
- ``pallas``: `kl_value_and_grad` (one read of both chunks); ``pallas, loss only``: its ``metrics=False`` form.

Each is timed as the median of ``--repeats`` calls after a compile (`bench.harness.median_call`); the HBM floor is the bytes one
read of both chunks and one write of the gradient take at ``--hbm-gbs`` (a v5e: 819 GB/s). Prints a Markdown table
(ms a chunk, ms for ``--runs`` chunks: the chunks of a step, and each variant's time over XLA's), with the date,
commit, device, jax and libtpu versions and the command; ``--out`` also appends its rows as JSON lines.

  python benchmarks/loss_kernel.py --vocab 151936,262144 --chunk 1024 --runs 8,4
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys

import jax
import jax.numpy as jnp

from bench.chip_step import commit_or_exit
from bench.harness import median_call
from bench.results import append_row, libtpu_version
from meshdistill.losses import forward_kl_terms, kl_value_and_grad

TAU, ALPHA = 2.0, 0.5


def _xla(loss_only: bool):
  def sums(s, t, y, keep):
    out = forward_kl_terms(s, t, y, keep, TAU, ALPHA)
    kept = {"loss": out["loss"]} if loss_only else out
    total = {k: jnp.sum(v) for k, v in kept.items()}
    return total["loss"], total

  def run(s, t, y, keep):
    (_, total), d = jax.value_and_grad(sums, has_aux=True)(s, t, y, keep)
    return total, d.astype(jnp.bfloat16)

  return run


def _pallas(loss_only: bool, unroll: int):
  def run(s, t, y, keep):
    out, d = kl_value_and_grad(s, t, y, keep, TAU, ALPHA, metrics=not loss_only, unroll=unroll)
    return {k: jnp.sum(v) for k, v in out.items()}, d

  return run


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--vocab", default="151936,262144", help="vocabularies (comma-separated)")
  ap.add_argument("--chunk", type=int, default=1024, help="tokens a chunk")
  ap.add_argument("--runs", default="8,4", help="chunks a step for each vocabulary (the headline pairs' 4 x 2048 "
                  "and 2 x 2048 steps at chunk 1024)")
  ap.add_argument("--unroll", default="4", help="the kernel's column loop unroll factors to time (comma-separated)")
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--hbm-gbs", type=float, default=819.0, help="the chip's HBM bandwidth, GB/s (v5e: 819)")
  ap.add_argument("--commit", default=None, help="the commit measured (default: this checkout's HEAD)")
  ap.add_argument("--out", default=None, help="also append the rows to this JSON-lines file")
  args = ap.parse_args(argv)

  vocabs = [int(v) for v in args.vocab.split(",")]
  runs = [int(r) for r in args.runs.split(",")]
  if len(runs) != len(vocabs):
    raise SystemExit(f"--runs={args.runs!r} needs one count per vocabulary of --vocab={args.vocab!r}")
  commit, jax_version, libtpu = commit_or_exit(ap, args.commit)[:7], jax.__version__, libtpu_version() or "-"
  device = jax.devices()[0].device_kind
  date = datetime.date.today().isoformat()
  command = "python3 benchmarks/loss_kernel.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
  rows = []
  for vocab, n in zip(vocabs, runs):
    k = jax.random.split(jax.random.key(0), 4)
    s = 3.0 * jax.random.normal(k[0], (args.chunk, vocab), jnp.float32)
    t = s + 2.0 * jax.random.normal(k[1], (args.chunk, vocab), jnp.float32)
    y = jax.random.randint(k[2], (args.chunk,), 0, vocab)
    keep = jax.random.bernoulli(k[3], 0.9, (args.chunk,))
    inputs = (s, t, y, keep)
    variants = {"xla": _xla(False), "xla, loss only": _xla(True)}
    for u in (int(x) for x in args.unroll.split(",")):
      variants[f"pallas (unroll {u})"] = _pallas(False, u)
      variants[f"pallas, loss only (unroll {u})"] = _pallas(True, u)
    floor = (2 * 4 + 2) * args.chunk * vocab / (args.hbm_gbs * 1e9)
    base = None
    for name, fn in variants.items():
      call = jax.jit(fn)
      seconds = median_call(lambda: call(*inputs), args.repeats)  # noqa: B023
      base = base or seconds
      rows.append({"vocab": vocab, "chunk": args.chunk, "variant": name, "ms": seconds * 1e3, "runs": n,
                   "step_ms": n * seconds * 1e3, "vs_xla": seconds / base, "floor_ms": floor * 1e3, "date": date,
                   "commit": commit, "device": device, "jax": jax_version, "libtpu": libtpu, "command": command})
      print(f"{vocab} {name}: {seconds * 1e3:.3f} ms", file=sys.stderr, flush=True)
  print("| vocabulary | chunk | variant | ms a chunk | ms a step (chunks) | vs xla | HBM floor ms | date | commit | "
        "device | jax | libtpu | command |")
  print("|---:|---:|---|---:|---:|---:|---:|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['vocab']:,} | {r['chunk']} | {r['variant']} | {r['ms']:.2f} | {r['step_ms']:.1f} ({r['runs']}) | "
          f"{r['vs_xla']:.2f} | {r['floor_ms']:.2f} | {r['date']} | {r['commit']} | {r['device']} | {r['jax']} | "
          f"{r['libtpu']} | `{r['command']}` |")
  for r in rows if args.out else ():
    append_row(args.out, r)


if __name__ == "__main__":
  main()
