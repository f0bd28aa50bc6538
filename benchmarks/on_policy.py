"""On-policy distillation benchmark: off-policy KD vs GKD vs SFT at equal step budgets, and sampler speed.

On the main job's teacher and student (``configs/default.yaml``: cached teacher, 2x4 mesh, 300 steps),
every run frames each training row as prompt (first ``seq_len + 1 - max_new_tokens`` tokens) +
completion, with the loss on completion tokens only, from the same initialisation and data order:

* ``off-policy KD``: the data's completions (``lambda = 0``);
* ``GKD lambda 0.5`` / ``GKD lambda 1.0``: the student samples the completions with that probability;
* ``SFT``: hard-label cross-entropy on the data's completions (no teacher term).

KD runs share the divergence (``--divergence``, default generalized JSD with beta 0.5) and the loss
temperature 1. Reported on held-out prompts (validation rows cut the same way): validation loss over
whole rows, and the teacher's per-token NLL of the student's own samples (sampled at temperature 1
with a fixed key), the number on-policy distillation is meant to lower; plus greedy completions of a
few prompts side by side. Sampler speed: greedy tokens/s of the KV-cache decoder against a decoder
that recomputes the full forward pass for every token (same model, same 2x4 mesh, both one
compiled program).

  python benchmarks/on_policy.py                 # writes benchmarks/results/on_policy.md
  python benchmarks/on_policy.py --only speed        # sampler speed only (quality numbers kept from on_policy.json)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--steps", type=int, default=None, help="train steps per run (default: train.steps)")
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--divergence", default="jsd,reverse_kl", help="comma-separated: KD runs for each")
  p.add_argument("--beta", type=float, default=0.5)
  p.add_argument("--eval-batches", type=int, default=8)
  p.add_argument("--only", choices=("quality", "speed"), default=None)
  p.add_argument("--out", default=os.path.join(HERE, "results", "on_policy.md"))
  return p.parse_args(argv)


def _full_recompute_greedy(graphdef, params, prompts_BxP, n_new):
  """Greedy decode without a cache: the full forward pass over a [B, P + N] buffer for every new token."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from meshdistill.generate import vocab_argmax

  model = nnx.merge(graphdef, params)
  B, P = prompts_BxP.shape
  buf = jnp.concatenate([prompts_BxP, jnp.zeros((B, n_new), prompts_BxP.dtype)], axis=1)

  def body(n, buf):
    logits = model(buf[:, :-1]).logits  # causal: positions after P + n - 1 do not matter; the last is never fed
    tok = vocab_argmax(jax.lax.dynamic_index_in_dim(logits, P + n - 1, axis=1, keepdims=False))
    return jax.lax.dynamic_update_slice(buf, tok[:, None].astype(buf.dtype), (0, P + n))

  return jax.lax.fori_loop(0, n_new, body, buf)[:, P:]


def speed(teacher, student, data, mesh, n_new, repeats=3):
  import jax
  import numpy as np
  from flax import nnx

  from meshdistill.generate import SamplingConfig, generate
  from meshdistill.mesh import batch_sharding

  batch = data.val_batches(max_batches=1)[0]
  P = batch["inputs"].shape[1] + 1 - n_new
  prompts = np.asarray(batch["inputs"][:, :P], np.int32)
  mask = np.ones_like(prompts, bool)
  greedy = SamplingConfig(max_new_tokens=n_new, temperature=0.0)
  rows = []
  for name, model in (("teacher", teacher), ("student", student)):
    graphdef, params = nnx.split(model)
    full = jax.jit(functools.partial(_full_recompute_greedy, graphdef, n_new=n_new))
    placed = jax.device_put(prompts, batch_sharding(mesh))
    times = {}
    for kind, run in (
        ("cached", lambda: generate((graphdef, params), prompts, mask, None, greedy, mesh=mesh).tokens_BxN),
        ("full recompute", lambda: full(params, placed)),
    ):
      out = jax.block_until_ready(run())  # compile
      best = float("inf")
      for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(run())
        best = min(best, time.perf_counter() - t0)
      times[kind] = (best, np.asarray(out))
    same = bool(np.array_equal(times["cached"][1], times["full recompute"][1]))
    n_tok = prompts.shape[0] * n_new
    rows.append({
        "model": name, "batch": prompts.shape[0], "prompt": P, "new": n_new,
        "cached_tok_s": n_tok / times["cached"][0], "full_tok_s": n_tok / times["full recompute"][0],
        "same_tokens": same,
    })
    print(f"speed {rows[-1]}", file=sys.stderr)
  return rows


def quality(cfg, teacher, data, mesh, args):
  import jax
  import numpy as np

  from meshdistill.evaluate import Evaluator
  from meshdistill.generate import SamplingConfig, generate
  from meshdistill.models import init_model
  from meshdistill.monitor import Monitor
  from meshdistill.onpolicy import OnPolicyConfig, OnPolicyDistiller
  from meshdistill.strategies import LogitKD
  from meshdistill.trainer import fit, make_optimizer

  tok = data.tokenizer
  pad = getattr(tok, "pad_id", 0) or 0
  runs = {}
  for div in args.divergence.split(","):
    kd = LogitKD(temperature=1.0, alpha=1.0, divergence=div, **({"beta": args.beta} if div == "jsd" else {}))
    for name, lmbda in (("off-policy KD", 0.0), ("GKD lambda 0.5", 0.5), ("GKD lambda 1.0", 1.0)):
      runs[f"{name}, {div}"] = (lmbda, kd)
  runs["SFT (completions)"] = (0.0, LogitKD(temperature=1.0, alpha=0.0))
  steps = args.steps or cfg.train.steps
  val = data.val_batches(max_batches=args.eval_batches)
  results, models = {}, {}
  for name, (lmbda, strategy) in runs.items():
    student = init_model(cfg.student, seed=cfg.train.seed, mesh=mesh)
    op = OnPolicyConfig(lmbda=lmbda, max_new_tokens=args.max_new_tokens, temperature=1.0, eos_id=tok.eos_id,
                        pad_id=pad)
    d = OnPolicyDistiller(student, teacher, strategy=strategy, on_policy=op, mesh=mesh, seed=cfg.train.seed,
                          optimizer=make_optimizer(cfg.train, cfg.student.n_layers))
    t0 = time.perf_counter()
    res = fit(d, data, steps=steps, monitor=Monitor(None, steps, stream=sys.stderr, name=name),
              eval_batches=args.eval_batches, log_every=cfg.train.log_every)
    seconds = time.perf_counter() - t0
    ev = Evaluator.for_trainer(d)(d.unreplicate(res.state.params)["student"], val)
    # Teacher NLL of the student's samples on held-out prompts (fixed keys: the same for every run).
    sampled = [d.sample_batch(res.state, d.as_prompt_batch(b), step=10**6 + i) for i, b in enumerate(val)]
    nll = Evaluator(d.teacher_def, mesh=mesh)(d.teacher_params, sampled)
    own = Evaluator(d.student_def, mesh=mesh)(res.state.params["student"], sampled)
    results[name] = {
        "val_loss": ev["loss"], "kl": ev["kl"], "sample_nll": nll["loss"], "student_nll": own["loss"],
        "sample_len": nll["tokens"] / sum(len(b["inputs"]) for b in sampled), "seconds": seconds, "steps": steps,
    }
    models[name] = d.student(res.state)
    print(f"quality {name}: {results[name]}", file=sys.stderr)
  # A few greedy completions of held-out prompts, side by side.
  b = val[0]
  P = b["inputs"].shape[1] + 1 - args.max_new_tokens
  prompts = np.asarray(b["inputs"][:, :P], np.int32)
  greedy = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, eos_id=tok.eos_id, pad_id=pad)
  samples = []
  for r in range(3):
    row = {"prompt": tok.decode(prompts[r][-48:])}
    for name, model in [("teacher", teacher)] + list(models.items()):
      gen = jax.device_get(generate(model, prompts, np.ones_like(prompts, bool), None, greedy, mesh=mesh))
      row[name] = tok.decode([t for t, m in zip(gen.tokens_BxN[r], gen.mask_BxN[r]) if m and t != tok.eos_id])
    samples.append(row)
  return results, samples


def render(results, samples, speed_rows, meta) -> str:
  out = ["# On-policy distillation (GKD) vs off-policy KD vs SFT", "", meta, ""]
  if results:
    out += [
        "| run | steps | val loss (whole rows) | val KL | teacher NLL of student samples | vs off-policy KD "
        "| student NLL of own samples | sample length | train s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
      base = results.get("off-policy KD, " + name.split(", ")[-1], {}).get("sample_nll")
      rel = f"{(r['sample_nll'] / base - 1) * 100:+.1f}%" if base and ", " in name else ""
      out.append(
          f"| {name} | {r['steps']} | {r['val_loss']:.4f} | {r['kl']:.4f} | {r['sample_nll']:.4f} | {rel} | "
          f"{r['student_nll']:.4f} | {r['sample_len']:.1f} | {r['seconds']:.0f} |"
      )
    out.append("")
  if samples:
    out += ["## Greedy completions of held-out prompts", ""]
    for s in samples:
      out.append(f"prompt (last 48 characters): `{json.dumps(s['prompt'])[1:-1]}`")
      out.append("")
      for k, v in s.items():
        if k != "prompt":
          out.append(f"- {k}: `{json.dumps(v)[1:-1]}`")
      out.append("")
  if speed_rows:
    out += [
        "## Sampler speed (greedy, 2x4 mesh)",
        "",
        "| model | batch | prompt | new tokens | KV cache tok/s | full recompute tok/s | speed-up | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in speed_rows:
      out.append(
          f"| {r['model']} | {r['batch']} | {r['prompt']} | {r['new']} | {r['cached_tok_s']:.0f} | "
          f"{r['full_tok_s']:.0f} | {r['cached_tok_s'] / r['full_tok_s']:.1f}x | {r['same_tokens']} |"
      )
    out.append("")
  return "\n".join(out)


def main(argv=None) -> int:
  args = _args(argv)
  from meshdistill.config import load_config

  cfg = load_config(None, [*args.overrides, "run.run_dir=runs/on_policy"])
  from meshdistill import jobs

  jobs.prepare_devices(cfg)
  import platform

  import jax

  from meshdistill.models import init_model

  mesh = jobs.build_mesh(cfg)
  data = jobs.load_data(cfg)
  teacher, tdir = jobs.obtain_teacher(cfg, data, mesh, stream=sys.stderr)
  results, samples, speed_rows = {}, [], []
  saved = os.path.splitext(args.out)[0] + ".json"  # measured quality numbers, kept for a speed-only rerun
  if args.only != "speed":
    results, samples = quality(cfg, teacher, data, mesh, args)
    with open(saved, "w", encoding="utf-8") as f:
      json.dump({"results": results, "samples": samples}, f, indent=1)
  elif os.path.isfile(saved):
    with open(saved, encoding="utf-8") as f:
      kept = json.load(f)
    results, samples = kept["results"], kept["samples"]
  if args.only != "quality":
    speed_rows = speed(teacher, init_model(cfg.student, seed=cfg.train.seed, mesh=mesh), data, mesh,
                       args.max_new_tokens)
  meta = (
      f"Main job's teacher ({tdir}) and student config; mesh {cfg.mesh.data}x{cfg.mesh.tensor} on "
      f"{jax.device_count()} {jax.default_backend()} devices ({platform.machine()}, {os.cpu_count()} CPUs); "
      f"prompts = first {cfg.data.seq_len + 1 - args.max_new_tokens} tokens of each row, completions "
      f"{args.max_new_tokens} tokens; KD divergences {args.divergence} (jsd: beta {args.beta}), alpha 1, "
      f"loss temperature 1, sampler temperature 1; {args.eval_batches} held-out batches of "
      f"{cfg.train.batch_size} rows. Command: `python benchmarks/on_policy.py {' '.join(argv or sys.argv[1:])}`"
  )
  text = render(results, samples, speed_rows, meta)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
