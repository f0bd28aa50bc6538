"""Several teachers: two teachers trained here on two domains, a student distilled from both (routed by domain, and
mixed) against students distilled from each alone and one trained from scratch; validation loss on each domain.

Domains (`meshdistill.data.DataConfig.corpora`): ``python``, the standard library's source without its docstrings
and comments (``--with-docstrings``: as written, so both domains hold the docstrings); ``prose``, the English
docstrings of the same library (both written to temporary directories in documents of ~2,000 characters). Each
teacher is trained on its own domain's rows only; every student sees the same batches of the union, in the same
order, from the same initialisation (per seed), with the same optimizer and steps. The teachers' top-k of every
training batch is computed once and given to every distilled arm (the route / mix targets from
`meshdistill.teachers.multi.combine`, as a ``teachers:`` run builds them).

  python benchmarks/multi_teacher.py --seeds 0,1,2          # writes benchmarks/results/multi_teacher.md (+ .json)
  python benchmarks/multi_teacher.py --seeds 0,1,2 --with-docstrings --out benchmarks/results/multi_teacher_shared.md
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from bench.harness import load, machine

import meshdistill as md
from meshdistill.data import DataConfig, build_data
from meshdistill.data._corpus import stdlib_root
from meshdistill.train.loop.evaluate import Evaluator
from meshdistill.strategies import LogitKD
from meshdistill.teachers.cache import TeacherTopK, TopKTeacher
from meshdistill.teachers.multi import combine
from meshdistill.train.hardlabel import HardLabelTrainer
from meshdistill.train.optimizers import default_optimizer
from meshdistill.train.step import TOPK_KEYS

HERE = os.path.dirname(os.path.abspath(__file__))
DOMAINS = ("python", "prose")


def _chunks(out: str, name: str, pieces, size: int = 2000) -> int:
  """``pieces`` (texts) joined into files ``<name>.<i>.txt`` of about ``size`` characters in ``out``: documents of
  similar size, so the split by document name gives each domain about ``val_fraction`` of its text."""
  chunk, part, total = [], 0, 0
  for piece in [*pieces, None]:
    if piece is not None:
      chunk.append(piece)
    if chunk and (piece is None or sum(map(len, chunk)) >= size):
      text = "".join(chunk)
      with open(os.path.join(out, f"{name}.{part}.txt"), "w", encoding="utf-8") as g:
        g.write(text)
      total, part, chunk = total + len(text), part + 1, []
  return total


def _without_docstrings(tree: ast.Module) -> str:
  """The module's code with its docstrings (and comments) left out (`ast.unparse`)."""
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
      node.body = node.body[1:] or [ast.Pass()]
  return ast.unparse(tree)


def write_domains(python_dir: str, prose_dir: str, max_chars: int, code_only: bool) -> tuple[int, int]:
  """The stdlib's source (by lines; ``code_only``: without its docstrings and comments) and its module, class and
  function docstrings (by docstring) into documents of ~2,000 characters, at most ``max_chars`` of each; characters
  written."""
  root, code, prose = stdlib_root(), 0, 0
  for dirpath, dirnames, files in sorted(os.walk(root)):
    dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib", "__pycache__"))
    for f in sorted(files):
      if not f.endswith(".py") or (code >= max_chars and prose >= max_chars):
        continue
      try:
        source = open(os.path.join(dirpath, f), encoding="utf-8").read()
        tree = ast.parse(source)
      except (SyntaxError, UnicodeDecodeError, ValueError):
        continue
      name = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "_")
      docs = [ast.get_docstring(n) for n in ast.walk(tree)
              if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
      if code < max_chars:
        text = _without_docstrings(tree) + "\n" if code_only else source
        code += _chunks(python_dir, name, text.splitlines(keepends=True))
      if prose < max_chars:
        prose += _chunks(prose_dir, name, [d + "\n\n" for d in docs if d and len(d) > 40])
  return code, prose


class Rows:
  """Training batches of the rows of some domains of packed corpora (a teacher's own data), shuffled by ``seed``."""

  def __init__(self, packed, domains, batch: int, seed: int):
    self.packed, self.batch = packed, batch
    self.ids = np.flatnonzero(np.isin(packed.domain_rows(), domains))
    self.rng = np.random.default_rng(seed)

  def train_iterator(self):
    while True:
      for start in range(0, len(self.ids) - self.batch + 1, self.batch):
        yield self.packed.rows(self.rng.permutation(self.ids)[start:start + self.batch])


def train(trainer, batches, steps: int):
  state = trainer.init_state()
  for _, b in zip(range(steps), batches):
    state, _ = trainer.step(state, b)
  return state


def val_by_domain(bundle, batch: int, max_batches: int) -> dict[str, list[dict]]:
  """At most ``max_batches`` validation batches of each domain (whole batches of its rows)."""
  rows = bundle.val.arrays()
  out = {}
  for d, name in enumerate(DOMAINS):
    idx = np.flatnonzero(rows["domain"] == d)[:max_batches * batch]
    out[name] = [{k: v[idx[i:i + batch]] for k, v in rows.items()} for i in range(0, len(idx) - batch + 1, batch)]
  return out


def scores(model_def, params, val) -> dict[str, float]:
  """Validation loss per domain and over both (``all``: the token mean over the two domains' batches)."""
  ev = Evaluator(model_def)
  got = {name: ev(params, batches) for name, batches in val.items()}
  out = {name: float(g["loss"]) for name, g in got.items()}
  out["all"] = sum(float(g["loss"]) * g["tokens"] for g in got.values()) / sum(g["tokens"] for g in got.values())
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--max-chars", type=int, default=300_000, help="characters of each domain")
  p.add_argument("--teacher-steps", type=int, default=600)
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--top-k", type=int, default=16)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--alpha", type=float, default=0.5)
  p.add_argument("--val-batches", type=int, default=8, help="validation batches per domain")
  p.add_argument("--with-docstrings", action="store_true",
                 help="keep the docstrings in the python domain (the domains then share that text)")
  p.add_argument("--out", default=os.path.join(HERE, "results", "multi_teacher.md"))
  a = p.parse_args(argv)
  seeds = [int(s) for s in a.seeds.split(",")]
  t0, load_start = time.perf_counter(), load()
  python_dir, prose_dir = tempfile.mkdtemp(prefix="python-"), tempfile.mkdtemp(prefix="prose-")
  chars = write_domains(python_dir, prose_dir, a.max_chars, not a.with_docstrings)
  data = build_data(DataConfig(corpora={"python": python_dir, "prose": prose_dir}, max_chars=a.max_chars,
                               seq_len=a.seq, val_fraction=0.1), a.batch, process_index=0, process_count=1)
  vocab = data.tokenizer.vocab_size
  val = val_by_domain(data, a.batch, a.val_batches)
  teacher_cfg = md.ModelConfig(vocab_size=vocab, d_model=96, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden=384,
                               max_len=a.seq)
  student_cfg = md.ModelConfig(vocab_size=vocab, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=192,
                               max_len=a.seq)
  opt = lambda: default_optimizer(a.lr)  # noqa: E731

  teachers, programs, teacher_scores = {}, [], {}
  for d, name in enumerate(DOMAINS):  # each teacher on its own domain's rows only
    trainer = HardLabelTrainer(md.init_model(teacher_cfg, seed=100 + d), optimizer=opt())
    state = train(trainer, Rows(data.train, [d], a.batch, seed=d).train_iterator(), a.teacher_steps)
    teachers[name] = (trainer.student_def, state.params["student"])
    programs.append(TeacherTopK(trainer.student(state), k=a.top_k, temperature=1.0))
    teacher_scores[f"teacher {name}"] = scores(*teachers[name], val)
    print(f"teacher {name}: {teacher_scores[f'teacher {name}']} ({time.perf_counter() - t0:.0f} s)", flush=True)

  it = data.train_iterator()
  batches = [next(it) for _ in range(a.steps)]
  it.close()
  topks = [[p(b["inputs"]) for p in programs] for b in batches]  # once, for every arm
  route_of = np.arange(len(DOMAINS), dtype=np.int32)  # domain d -> teacher d

  def with_target(how):
    out = []
    for b, tk in zip(batches, topks):
      plain = {k: b[k] for k in ("inputs", "targets", "mask")}
      if how in DOMAINS:
        plain.update(dict(zip(TOPK_KEYS, map(np.asarray, tk[DOMAINS.index(how)]))))
      else:
        route = route_of[b["domain"]] if how == "route" else None
        plain.update({k: np.asarray(v) for k, v in combine(tk, route, k=a.top_k, weights=(1.0, 1.0)).items()})
      out.append(plain)
    return out

  def distiller(seed, names=()):
    spec = TopKTeacher(cfg=teacher_cfg, k=a.top_k, temperature=1.0, vocab=vocab, names=names)
    return md.Distiller(md.init_model(student_cfg, seed=seed), spec, optimizer=opt(),
                        strategy=LogitKD(temperature=1.0, alpha=a.alpha, top_k=a.top_k))

  arms = {
      "scratch": (lambda s: HardLabelTrainer(md.init_model(student_cfg, seed=s), optimizer=opt()), batches),
      "python teacher alone": (lambda s: distiller(s), with_target("python")),
      "prose teacher alone": (lambda s: distiller(s), with_target("prose")),
      "both, routed by domain": (lambda s: distiller(s, DOMAINS), with_target("route")),
      "both, mixed 1:1": (lambda s: distiller(s, DOMAINS), with_target("mix")),
  }
  results = {name: [] for name in arms}
  for seed in seeds:
    for name, (make, arm_batches) in arms.items():
      trainer = make(seed)
      state = train(trainer, iter(arm_batches), a.steps)
      results[name].append(scores(trainer.student_def, state.params["student"], val))
      print(f"seed {seed} {name}: {results[name][-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
  write(a, results, teacher_scores, time.perf_counter() - t0, data, chars, argv, load_start)
  for folder in (python_dir, prose_dir):
    shutil.rmtree(folder, ignore_errors=True)
  return 0


def write(a, results, teacher_scores, seconds, data, chars, argv, load_start) -> None:
  cols = ("python", "prose", "all")
  mean = {k: {c: statistics.mean(r[c] for r in v) for c in cols} for k, v in results.items()}
  sd = {k: {c: statistics.stdev([r[c] for r in v]) if len(v) > 1 else 0.0 for c in cols} for k, v in results.items()}
  val_rows = data.val.domain_rows()
  lines = [
      "# Several teachers: validation loss per domain",
      "",
      f"Command: `python benchmarks/multi_teacher.py {' '.join(argv or sys.argv[1:])}` ({seconds:.0f} s; "
      f"{machine()}; load average {load_start[0]:.1f} at the start, {load()[0]:.1f} at the end: a shared machine).",
      "",
      f"Data: `data.corpora` python (the stdlib's source, "
      f"{'with' if a.with_docstrings else 'without'} its docstrings and comments, {chars[0]:,} characters) and prose "
      "(the stdlib's "
      f"docstrings, {chars[1]:,} characters), both cut into documents of ~2,000 characters (so the split by document "
      f"holds out ~10% of each), byte tokens, rows of {a.seq}; training rows per domain "
      f"{data.stats['domains']}, validation rows python {int(np.sum(val_rows == 0))}, prose "
      f"{int(np.sum(val_rows == 1))} (scored: the first {a.val_batches} batches of {a.batch} rows of each; union: "
      f"the token mean over both). Teachers: d=96, 3 layers, {a.teacher_steps} steps of hard labels on "
      f"their own domain only. Students: d=48, 2 layers, {a.steps} steps of {a.batch} rows of the union (the same "
      f"batches for every arm), AdamW lr {a.lr}; distilled arms `logit_kd` top-{a.top_k}, temperature 1, alpha "
      f"{a.alpha}. Loss: cross-entropy in nats per token (lower is better); seeds {a.seeds}.",
      "",
      "| model | python | prose | union |",
      "|---|---|---|---|",
  ]
  for k, v in teacher_scores.items():
    lines.append(f"| {k} | {v['python']:.4f} | {v['prose']:.4f} | {v['all']:.4f} |")
  for k in results:
    cells = " | ".join(f"{mean[k][c]:.4f} ± {sd[k][c]:.4f}" for c in cols)
    lines.append(f"| student: {k} | {cells} |")
  lines += ["", "Per seed (python / prose / union):", ""]
  for k, v in results.items():
    lines.append(f"- {k}: " + "; ".join(f"{r['python']:.4f} / {r['prose']:.4f} / {r['all']:.4f}" for r in v))
  route = mean["both, routed by domain"]
  py, pr = mean["python teacher alone"], mean["prose teacher alone"]
  within = lambda a_, b_: "yes" if a_ <= 1.02 * b_ else "no"  # noqa: E731
  lines += [
      "",
      "The aim, checked on the means:",
      "",
      f"- routed student on python vs the python-teacher student: {route['python']:.4f} vs {py['python']:.4f} "
      f"({route['python'] / py['python'] - 1:+.2%}; within 2%: {within(route['python'], py['python'])})",
      f"- routed student on prose vs the prose-teacher student: {route['prose']:.4f} vs {pr['prose']:.4f} "
      f"({route['prose'] / pr['prose'] - 1:+.2%}; within 2%: {within(route['prose'], pr['prose'])})",
      f"- routed student on the union vs both single-teacher students: {route['all']:.4f} vs {py['all']:.4f} / "
      f"{pr['all']:.4f} (better than both: {'yes' if route['all'] < min(py['all'], pr['all']) else 'no'})",
  ]
  notes = os.path.join(os.path.dirname(a.out), "multi_teacher_notes.md")
  if os.path.isfile(notes):
    lines += ["", open(notes, encoding="utf-8").read().rstrip()]
  with open(a.out, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  with open(a.out.replace(".md", ".json"), "w", encoding="utf-8") as f:
    json.dump({"results": results, "teachers": teacher_scores, "seconds": seconds, "args": vars(a)}, f, indent=1)
  print("\n".join(lines))


if __name__ == "__main__":
  sys.exit(main())
