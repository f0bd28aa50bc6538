"""Cross-tokenizer distillation: a BPE teacher distilled into a byte-level student, against the same student from
scratch and distilled from a byte-level teacher of the same size (same data, steps and batch rows).

Every model is scored on the same validation bytes: bits per byte over the counted spans of the two-tokenization
validation rows (`meshdistill.train.loop.evaluate`), so the BPE teacher and the byte models compare.

  python benchmarks/cross_tokenizer.py --seeds 0,1,2        # writes benchmarks/results/cross_tokenizer.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import meshdistill as md
from bench import harness
from meshdistill.data import DataConfig, build_data
from meshdistill.data.alignment import byte_tables_of, matched_vocabulary
from meshdistill.train.loop.evaluate import Evaluator
from meshdistill.strategies import ByteKL, LogitKD, SpanKL, ULD
from meshdistill.train.hardlabel import HardLabelTrainer
from meshdistill.train.optimizers import default_optimizer

HERE = os.path.dirname(os.path.abspath(__file__))


def train(trainer, data, steps: int):
  """``steps`` steps of ``trainer`` on ``data``'s training rows; the final state."""
  state = trainer.init_state()
  it = data.train_iterator()
  for _ in range(steps):
    state, _ = trainer.step(state, next(it))
  it.close()
  return state


def bpb(model_def, params, val, teacher=None) -> dict:
  """Bits per byte of a model (and of ``teacher = (def, params)`` on its own tokens) on the cross validation rows."""
  ev = Evaluator(model_def, teacher_def=None if teacher is None else teacher[0],
                 teacher_params=None if teacher is None else teacher[1])
  return ev(params, val)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--max-chars", type=int, default=400_000)
  p.add_argument("--teacher-steps", type=int, default=400)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--bpe", type=int, default=512)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--kinds", default="span_kl,uld,byte_kl",
                 help="cross-tokenizer strategies to run (span_kl, uld, byte_kl)")
  p.add_argument("--max-depth", type=int, default=16, help="byte_kl: deepest byte inside a teacher token compared")
  p.add_argument("--keep", action="store_true",
                 help="keep the rows of cross-tokenizer arms not run now from the results file's .json (its scratch "
                      "and same-tokenizer rows must equal this run's: same seeds and data)")
  p.add_argument("--out", default=os.path.join(HERE, "results", "cross_tokenizer.md"))
  a = p.parse_args(argv)
  seeds = [int(s) for s in a.seeds.split(",")]
  t0 = time.perf_counter()
  base = DataConfig(source="stdlib", max_chars=a.max_chars, seq_len=a.seq, val_fraction=0.05)
  cross = build_data(base.replace(teacher_tokenizer="bpe", bpe_vocab_size=a.bpe, teacher_seq_len=a.seq), a.batch,
                     process_index=0, process_count=1)
  bpe_tok, byte_tok = cross.teacher_tokenizer, cross.tokenizer
  bpe_rows = build_data(base.replace(tokenizer="bpe", bpe_vocab_size=a.bpe), a.batch, tokenizer=bpe_tok,
                        process_index=0, process_count=1)
  byte_rows = build_data(base, a.batch, process_index=0, process_count=1)
  val = cross.val_batches(max_batches=8)
  teacher_shape = dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=512, max_len=a.seq)
  student_cfg = md.ModelConfig(vocab_size=byte_tok.vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               mlp_hidden=256, max_len=a.seq)
  opt = lambda: default_optimizer(a.lr)  # noqa: E731

  teachers = {}
  for name, vocab, rows in (("bpe", bpe_tok.vocab_size, bpe_rows), ("byte", byte_tok.vocab_size, byte_rows)):
    model = md.init_model(md.ModelConfig(vocab_size=vocab, **teacher_shape), seed=100)
    trainer = HardLabelTrainer(model, optimizer=opt())
    state = train(trainer, rows, a.teacher_steps)
    teachers[name] = (trainer.student_def, state.params["student"])
    print(f"teacher {name}: trained {a.teacher_steps} steps ({time.perf_counter() - t0:.0f} s)", flush=True)
  matched = matched_vocabulary(bpe_tok, byte_tok)
  tables = byte_tables_of(bpe_tok, byte_tok, max_depth=a.max_depth)
  arms = {
      "scratch": lambda s: (HardLabelTrainer(md.init_model(student_cfg, seed=s), optimizer=opt()), byte_rows),
      "same-tokenizer KD (byte teacher, logit_kd)": lambda s: (md.Distiller(
          md.init_model(student_cfg, seed=s), _teacher(teachers["byte"]),
          strategy=LogitKD(temperature=1.0, alpha=0.5), optimizer=opt()), byte_rows),
      "cross-tokenizer span_kl (BPE teacher)": lambda s: (md.Distiller(
          md.init_model(student_cfg, seed=s), _teacher(teachers["bpe"]),
          strategy=SpanKL(alpha=0.5, top_k=64).with_matched(*matched), optimizer=opt()), cross),
      "cross-tokenizer uld (BPE teacher)": lambda s: (md.Distiller(
          md.init_model(student_cfg, seed=s), _teacher(teachers["bpe"]),
          strategy=ULD(alpha=0.5, top_k=64), optimizer=opt()), cross),
      "cross-tokenizer byte_kl (BPE teacher)": lambda s: (md.Distiller(
          md.init_model(student_cfg, seed=s), _teacher(teachers["bpe"]),
          strategy=ByteKL(alpha=0.5, max_depth=a.max_depth).with_tables(tables), optimizer=opt()), cross),
  }
  kinds = a.kinds.split(",")
  arms = {k: v for k, v in arms.items() if not k.startswith("cross") or k.split()[1] in kinds}
  results = {name: [] for name in arms}
  teacher_scores = {}
  for seed in seeds:
    for name, make in arms.items():
      trainer, rows = make(seed)
      state = train(trainer, rows, a.steps)
      teacher = teachers["bpe"] if name.startswith("cross") else None
      got = bpb(trainer.student_def, state.params["student"], val, teacher)
      results[name].append(got["bpb"])
      if "teacher_bpb" in got:
        teacher_scores["bpe teacher"] = got["teacher_bpb"]
      print(f"seed {seed} {name}: {got['bpb']:.4f} bits/byte ({time.perf_counter() - t0:.0f} s)", flush=True)
  teacher_scores["byte teacher"] = bpb(teachers["byte"][0], teachers["byte"][1], val)["bpb"]
  if a.keep:
    results = _kept(a.out.replace(".md", ".json"), results)
  write(a, results, teacher_scores, time.perf_counter() - t0, cross, argv)
  return 0


def _kept(path: str, results: dict) -> dict:
  """``results`` with the arms of an earlier run (``path``) that this run did not repeat, after checking that the
  arms both ran agree (the same seeds and data give the same numbers)."""
  with open(path, encoding="utf-8") as f:
    old = json.load(f)["results"]
  for name in set(old) & set(results):
    if [round(x, 4) for x in old[name]] != [round(x, 4) for x in results[name]]:
      raise SystemExit(f"--keep: {name} gave {results[name]} now but {old[name]} in {path}; rerun every arm")
  return {**results, **{k: v for k, v in old.items() if k not in results}}


def _teacher(pair):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return nnx.merge(*pair)


def write(a, results, teacher_scores, seconds, cross, argv) -> None:
  mean = {k: statistics.mean(v) for k, v in results.items()}
  sd = {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in results.items()}
  scratch, same = mean["scratch"], mean["same-tokenizer KD (byte teacher, logit_kd)"]
  lines = [
      "# Cross-tokenizer distillation: validation bits per byte",
      "",
      f"Command: `python benchmarks/cross_tokenizer.py {' '.join(argv or sys.argv[1:])}` ({seconds:.0f} s on "
      f"{harness.machine()}, shared).",
      "",
      f"Data: the stdlib corpus, {a.max_chars:,} characters ({cross.stats['train_docs']} train documents); teacher "
      f"BPE of {cross.teacher_tokenizer.base_vocab_size} tokens trained here on the training split, student bytes. "
      f"Students: d=64, 2 layers; teachers: d=128, 4 layers, {a.teacher_steps} steps of hard labels each. Every "
      f"student: {a.steps} steps of {a.batch} rows of at most {a.seq} byte tokens, AdamW lr {a.lr}, alpha 0.5; "
      "scored on the same validation bytes (the counted spans of the two-tokenization validation rows, 8 batches).",
      "",
      "| model | bits/byte (mean ± sd over seeds) | per seed |",
      "|---|---|---|",
  ]
  for k, v in teacher_scores.items():
    lines.append(f"| {k} | {v:.4f} | |")
  for k in results:
    lines.append(f"| student: {k} | {mean[k]:.4f} ± {sd[k]:.4f} | {', '.join(f'{x:.4f}' for x in results[k])} |")
  lines.append("")
  gain = scratch - same
  for k in results:
    if k.startswith("cross"):
      share = (scratch - mean[k]) / gain if gain > 0 else float("nan")
      lines.append(f"- {k}: recovers {share:.0%} of the same-tokenizer gain over scratch "
                   f"({scratch - mean[k]:+.4f} vs {gain:+.4f} bits/byte).")
  with open(a.out, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  with open(a.out.replace(".md", ".json"), "w", encoding="utf-8") as f:
    json.dump({"results": results, "teachers": teacher_scores, "seconds": seconds}, f, indent=1)
  print("\n".join(lines))


if __name__ == "__main__":
  sys.exit(main())
