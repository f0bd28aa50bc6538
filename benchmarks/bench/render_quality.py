"""The quality report (``benchmarks/results/quality.md``): the headline run, the recipes tried
(``quality_runs.jsonl``) and the spread over student seeds (``quality_seeds.jsonl``), from the rows
`benchmarks/quality.py` writes."""

from __future__ import annotations

import json
import math
import statistics

TARGET_RATIO = 0.97  # distilled / scratch validation loss
MAX_PARAM_RATIO = 0.30  # student / teacher parameters


def render_seeds(rows: list[dict]) -> str:
  """The spread over student seeds: one row per seed, then mean and sample standard deviation."""
  if not rows:
    return ""
  by_seed = {r["seed"]: r for r in rows}  # a seed run again replaces its earlier row
  rows = [by_seed[k] for k in sorted(by_seed)]
  lines = [
    f"## Spread over student seeds ({len(rows)} seed(s) finished)",
    "",
    "`python benchmarks/quality.py --seeds N`: the same recipe, teacher and data order, both students",
    "(distilled and scratch) initialised from `train.seed` = S.",
    "",
    "| train.seed | distilled loss | scratch loss | ratio | recipe | date |",
    "|---:|---:|---:|---:|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['seed']} | {r['distilled']['loss']:.4f} | {r['scratch']['loss']:.4f} | {r['loss_ratio']:.4f} | "
      f"{_recipe(r)} | {r['date']} |"
    )
  lines.append("")
  cols = {
    "distilled loss": [r["distilled"]["loss"] for r in rows],
    "scratch loss": [r["scratch"]["loss"] for r in rows],
    "distilled / scratch": [r["loss_ratio"] for r in rows],
  }
  for name, v in cols.items():
    sd = statistics.stdev(v) if len(v) > 1 else float("nan")
    lines.append(f"- {name}: mean **{statistics.mean(v):.4f}**, sd {sd:.4f} over {len(v)} seed(s)")
  worst = max(cols["distilled / scratch"])
  verdict = "met on every seed" if worst <= TARGET_RATIO else "NOT met on every seed"
  lines += [f"- worst seed's ratio {worst:.4f} (target <= {TARGET_RATIO}: {verdict})", ""]
  return "\n".join(lines) + "\n"


def history(path: str) -> list[dict]:
  """The rows of a ``.jsonl`` results file."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _recipe(r):
  s = r["settings"]
  d = s["distill"]
  tau = d["temperature"]
  tau = f"{tau['start']}->{tau['end']}" if isinstance(tau, dict) else f"{tau}"
  m = lambda c: f"d{c['d_model']}xL{c['n_layers']}"
  return (
    f"teacher {m(s['teacher'])} {s['pretrain']['steps']} steps; student {m(s['student'])} "
    f"{s['train']['steps']} steps lr {s['train']['lr']}; tau {tau}, alpha {d['alpha']}"
  )


def _timing(sec: dict) -> str:
  pre = sec.get("teacher_pretraining")
  if pre and sec["teacher"] < 0.5 * pre:
    teacher = f"teacher loaded from the cache in {sec['teacher']:.0f} s (its pretraining took {pre:.0f} s)"
  else:
    teacher = f"teacher pretraining {sec['teacher']:.0f} s"
  return (
    f"- wall time: {teacher}, distillation {sec['distill']:.0f} s, scratch student {sec['scratch']:.0f} s, "
    f"benchmark total {sec['total']:.0f} s (evaluation and compilation included)"
  )


def _main_job_sample(r) -> str:
  """Why the main job's final table shows other losses for the same recipe: it evaluates fewer batches of the split."""
  s = r["settings"]
  batch, seq = s["train"]["batch_size"], s["data"]["seq_len"]
  ours = r.get("eval_batches") or math.ceil(r["val_tokens"] / (batch * seq))  # rows written before it was stored
  main = s["train"]["eval_batches"]
  if main >= ours:
    return ""
  return (f"These are the first {ours} validation batches (`--eval-batches`); `meshdistill distill` trains the same "
          f"recipe and evaluates on the first `train.eval_batches` = {main} ({main * batch * seq:,} positions), so "
          "its final table shows other losses: another sample of the same held-out documents (its start-up line "
          "counts the whole split).")


def _row(name: str, m: dict) -> str:
  return f"| {name} | {m['params']:,} | {m['loss']:.4f} | {m['ppl']:.3f} | {m['kl']:.4f} | {m['agree']:.1%} |"


def render(r, tdir, runs) -> str:
  """The headline run ``r`` and the recipes tried (``runs``: the rows of ``quality_runs.jsonl``)."""
  ok = r["loss_ratio"] <= TARGET_RATIO and r["param_ratio"] <= MAX_PARAM_RATIO
  s = r["settings"]
  lines = [
    "# Quality benchmark: distilled student vs. the same student trained from scratch",
    "",
    (
      f"Written by `benchmarks/quality.py` on {r['date']} ({r['devices']} devices, mesh "
      f"{s['mesh']['data']}x{s['mesh']['tensor']}, {r['machine']}); config `{r['config']}`"
    )
    + (f" with `{' '.join('--set ' + o for o in r['overrides'])}`" if r["overrides"] else "")
    + ".",
    "",
    (
      f"Corpus: `{s['data']['source']}` (max_chars {s['data']['max_chars']}), tokenizer "
      f"`{s['data']['tokenizer']}`, seq_len {s['data']['seq_len']}; validation: {int(r['val_tokens']):,} tokens "
      f"(held-out documents). {_main_job_sample(r)}"
    ),
    (
      "Both students: same architecture, initialisation seed, steps, batch size, data order and learning-rate "
      "schedule; the scratch student sees only the hard labels."
    ),
    "",
    "| model | params | val loss (nats/token) | val perplexity | KL(teacher‖model) | top-1 agreement |",
    "|---|---:|---:|---:|---:|---:|",
    f"| teacher | {r['teacher']['params']:,} | {r['teacher']['loss']:.4f} | {r['teacher']['ppl']:.3f} | – | – |",
    _row("distilled student", r["distilled"]),
    _row("scratch student", r["scratch"]),
    "",
    f"- student / teacher parameters: **{r['param_ratio']:.1%}** (target <= {MAX_PARAM_RATIO:.0%})",
    f"- distilled / scratch validation loss: **{r['loss_ratio']:.4f}** (target <= {TARGET_RATIO})",
    f"- target {'met' if ok else 'NOT met'}",
    _timing(r["seconds"]),
    "",
    "Recipe: " + _recipe(r) + f"; divergence {s['distill']['divergence']}.",
    "",
  ]
  if runs:
    lines += [
      "## Recipes tried",
      "",
      "| date | recipe | teacher loss | distilled | scratch | ratio | note |",
      "|---|---|---:|---:|---:|---:|---|",
    ]
    for h in runs:
      lines.append(
        f"| {h['date']} | {_recipe(h)} | {h['teacher']['loss']:.4f} | {h['distilled']['loss']:.4f} | "
        f"{h['scratch']['loss']:.4f} | {h['loss_ratio']:.4f} | {h.get('note', '')} |"
      )
    lines.append("")
  return "\n".join(lines)
