"""Several teachers routed by domain: each model teacher run on its own rows alone vs on the whole batch.

Under ``teachers.combine: route`` a row is distilled from one teacher only. `meshdistill.teachers.multi` runs each
model teacher (`Live`) on its own rows, gathered into a block of a power-of-two size (`Live.on_rows`); the simple
form runs every teacher on every row and keeps each row's teacher (one forward pass per teacher per batch whatever
its share). Both give the same target; this script times one batch's teacher work both ways (two teachers of one
shape on one CPU device), for a few shares of the rows, and reports the compile seconds of each (the own-rows form
compiles one program per block size it meets).

Timing: `bench.harness.interleave` (each round times both forms on the same batch, after a first call of each, which
compiles what it meets for the first time); the ratio of medians and the paired per-round ratio.

  python benchmarks/multi_teacher_rows.py                 # d_model 256, 4 layers, batch 32 x 128 tokens
  python benchmarks/multi_teacher_rows.py --rounds 9

Writes ``benchmarks/results/multi_teacher_rows.md``.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
import meshdistill as md
from meshdistill.teachers.cache import TeacherTopK
from meshdistill.teachers.multi import Live, MultiTeacherData, combine

HERE = pathlib.Path(__file__).resolve().parent


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--vocab", type=int, default=1024)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--k", type=int, default=16)
  p.add_argument("--shares", default="16,8,4", help="comma-separated rows of the first teacher's domain per batch")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--out", default=str(HERE / "results" / "multi_teacher_rows.md"))
  return p.parse_args(argv)


def _batches(n, batch, seq, vocab, first_rows, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    domain = np.ones(batch, np.int32)
    domain[rng.permutation(batch)[:first_rows]] = 0
    out.append({"inputs": rng.integers(0, vocab, (batch, seq)).astype(np.int32), "domain": domain})
  return out


def main(argv=None) -> int:
  args = _args(argv)
  cfg = md.ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                       mlp_hidden=4 * args.d_model, max_len=args.seq)
  teachers = [md.init_model(cfg, seed=s) for s in (0, 1)]
  lives = [Live(TeacherTopK(t, k=args.k, temperature=1.0)) for t in teachers]
  data = MultiTeacherData(None, lives, k=args.k, route=[0, 1], weights=[1.0, 1.0])

  def own(batch):
    jax.block_until_ready(data.with_teachers({**batch, "topk": []}))

  def whole(batch):
    topks = [p(batch) for p in lives]
    jax.block_until_ready(combine(topks, jnp.asarray(batch["domain"]), k=args.k, weights=None))

  rows, raw = [], {}
  for first in (int(v) for v in args.shares.split(",")):
    batches = _batches(args.rounds + 1, args.batch, args.seq, args.vocab, first)
    compile_s = {"own rows": harness.timed(lambda: own(batches[0]))[0],  # a new block size compiles here
                 "whole batch": harness.timed(lambda: whole(batches[0]))[0]}  # noqa: B023
    got = data.with_teachers({**batches[0], "topk": []})
    want = combine([p(batches[0]) for p in lives], jnp.asarray(batches[0]["domain"]), k=args.k, weights=None)
    err = float(jnp.max(jnp.abs(got["teacher_logprobs"] - want["teacher_logprobs"])))
    same_ids = bool(jnp.all(got["teacher_ids"] == want["teacher_ids"]))
    res = harness.interleave({"own rows": own, "whole batch": whole}, batches[1:])
    res["compile_s"] = compile_s
    med = harness.medians(res["times"])
    raw[str(first)] = res
    ratio, pair, spread = harness.ratio_of(res["times"], med, "whole batch", ("own rows",))
    blocks = [lives[0].block_rows(first, args.batch), lives[1].block_rows(args.batch - first, args.batch)]
    rows.append(f"| {first} / {args.batch - first} | {blocks[0]} + {blocks[1]} | {med['own rows'] * 1e3:.0f} | "
                f"{med['whole batch'] * 1e3:.0f} | {ratio:.2f}x (paired {pair:.2f}x, {spread}) | "
                f"{res['compile_s']['own rows']:.1f} / {res['compile_s']['whole batch']:.1f} | "
                f"{'same' if same_ids else 'DIFFER'}, {err:.1e} |")
    print(rows[-1], flush=True)
  load = harness.load()
  text = "\n".join([
      "# Several teachers routed by domain: each on its own rows vs on the whole batch",
      "",
      f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {harness.machine()}; load "
      f"average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end (a shared machine: the paired ratio, "
      "taken within each round, is the number to read).",
      "",
      "Command: `" + " ".join(["PYTHONPATH=src:benchmarks python benchmarks/multi_teacher_rows.py",
                               *(argv if argv is not None else sys.argv[1:])]) + "`",
      "",
      f"Two teachers of d_model={args.d_model}, {args.layers} layers, vocabulary {args.vocab}, float32, one CPU "
      f"device; batches of {args.batch} rows x {args.seq} tokens, top-{args.k}; rows: how many rows go to each "
      "teacher (random rows each batch); blocks: the rows each teacher's program runs on in the own-rows form "
      "(`Live.block_rows`). One batch's teacher work (both teachers' top-k and the routed target), median of "
      f"{args.rounds} interleaved rounds after a first call of each; compile: seconds of that first call (a block size "
      "met before is compiled already). target: the "
      "routed target's ids in the two forms, and the largest difference of its log-probabilities.",
      "",
      "| rows | blocks | own rows ms | whole batch ms | own-rows speed-up | compile s (own / whole) | target |",
      "|---|---|---|---|---|---|---|",
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
