"""On-policy distillation benchmark: off-policy KD vs GKD vs SFT at equal step budgets, and sampler speed.

On the main job's teacher and student (``configs/default.yaml``: cached teacher, 2x4 mesh, 300 steps),
every run frames each training row as prompt (first ``seq_len + 1 - max_new_tokens`` tokens) +
completion, with the loss on completion tokens only, from the same initialisation and data order:

* ``off-policy KD``: the data's completions (``lambda = 0``);
* ``GKD lambda 0.5`` / ``GKD lambda 1.0``: the student samples the completions with that probability;
* ``SFT``: hard-label cross-entropy on the data's completions (no teacher term).

With ``--warm-start N`` every arm starts from one checkpoint: N steps of the main job's off-policy KD
(whole rows, the first N batches); each arm then trains the remaining ``train.steps - N`` steps on
the next batches (the optimizer state and the learning-rate schedule carry on). ``--seeds`` repeats
everything per ``train.seed``. KD runs share the divergence (``--divergence``) and the loss
temperature 1. Reported on held-out prompts (the first validation batches, cut the same way):
validation loss over whole rows; the teacher's per-token NLL of the student's own samples (sampled
at ``--temperature`` with fixed keys), the number on-policy distillation is meant to lower; the
student's NLL of the same samples, and their difference (an estimate of the reverse KL on the
student's own text); the sampled and greedy completions of a few prompts side by side. Sampler
speed: greedy tokens/s of the KV-cache decoder against a decoder that recomputes the full forward
pass for every token (same model, same 2x4 mesh, both one compiled program), and of tunix's
``Sampler`` on a tunix Llama3 of the teacher's shapes.

  python benchmarks/on_policy.py --warm-start 150 --seeds 1,2,3   # writes benchmarks/results/on_policy.md
  python benchmarks/on_policy.py --warm-start 150 --only speed    # sampler speed only (quality numbers kept
                                                                  # from on_policy.json)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

from bench.harness import best_call

HERE = os.path.dirname(os.path.abspath(__file__))


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--warm-start", type=int, default=0,
                 help="steps of the main job's off-policy KD shared by every arm; the arms train the rest of train.steps")
  p.add_argument("--seeds", default=None, help="comma-separated train.seed values (default: train.seed)")
  p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (training and evaluation)")
  p.add_argument("--samples", type=int, default=3, help="held-out prompts shown with greedy completions")
  p.add_argument("--no-sft", action="store_true", help="leave out the SFT run")
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

  from meshdistill.models.generate import vocab_argmax

  model = nnx.merge(graphdef, params)
  B, P = prompts_BxP.shape
  buf = jnp.concatenate([prompts_BxP, jnp.zeros((B, n_new), prompts_BxP.dtype)], axis=1)

  def body(n, buf):
    logits = model(buf[:, :-1]).logits  # causal: positions after P + n - 1 do not matter; the last is never fed
    tok = vocab_argmax(jax.lax.dynamic_index_in_dim(logits, P + n - 1, axis=1, keepdims=False))
    return jax.lax.dynamic_update_slice(buf, tok[:, None].astype(buf.dtype), (0, P + n))

  return jax.lax.fori_loop(0, n_new, body, buf)[:, P:]


class _IdTokenizer:
  """tunix's tokenizer interface over prompts written as space-separated token ids (no BOS added)."""

  def encode(self, text, **_):
    return [int(x) for x in text.split()]

  def decode(self, ids, **_):
    return " ".join(map(str, ids))

  def bos_id(self):
    return None

  def eos_id(self):
    return -1  # never sampled: every row decodes all its tokens, as in the other rows of the table

  def pad_id(self):
    return 0


def tunix_speed(cfg, mesh, prompts_BxP, n_new, repeats):
  """Greedy tokens/s of tunix's `Sampler` on a tunix Llama3 of ``cfg``'s shapes (random weights), on ``mesh``."""
  import jax
  from flax import nnx
  from tunix.generate import sampler as tunix_sampler
  from tunix.models.llama3 import model as llama

  from meshdistill.parallel.mesh import TENSOR, param_shardings

  # meshdistill's split: heads / MLP units / vocabulary over `tensor`; KV heads replicated (as the built-in
  # decoder does when n_kv_heads < tensor).
  kv = (None, TENSOR, None) if cfg.n_kv_heads % mesh.shape[TENSOR] == 0 else (None, None, None)
  shd = llama.ShardingConfig(
      emb_vd=(TENSOR, None), emb_dv=(None, TENSOR), q_weight_dnh=(None, TENSOR, None), kv_weight_dnh=kv,
      o_weight_nhd=(TENSOR, None, None), ffw_weight_df=(None, TENSOR), ffw_weight_fd=(TENSOR, None),
      rms_norm_weight=(None,), act_btd=(None, None, None), act_btf=(None, None, None),
      act_btnh=(None, None, None, None))
  hd = cfg.head_dim or cfg.d_model // cfg.n_heads
  tcfg = llama.ModelConfig(num_layers=cfg.n_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.d_model,
                           hidden_dim=cfg.mlp_hidden, num_heads=cfg.n_heads, head_dim=hd, num_kv_heads=cfg.n_kv_heads,
                           rope_theta=int(cfg.rope_theta), norm_eps=cfg.norm_eps, weight_tying=cfg.tie_embeddings,
                           shd_config=shd)
  with nnx.use_eager_sharding(False):
    model = llama.Llama3(tcfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, jax.device_put(state, param_shardings(nnx.get_partition_spec(state), mesh)))
  B, P = prompts_BxP.shape
  sampler = tunix_sampler.Sampler(model, _IdTokenizer(), tunix_sampler.CacheConfig(
      cache_size=P + n_new, num_layers=cfg.n_layers, num_kv_heads=cfg.n_kv_heads, head_dim=hd))
  texts = [" ".join(map(str, row)) for row in prompts_BxP]
  with jax.set_mesh(mesh):
    run = lambda: sampler(texts, max_generation_steps=n_new, max_prompt_length=P, temperature=0.0)
    out = run()  # compile
    assert all(len(t) == n_new for t in out.tokens), [len(t) for t in out.tokens]
    best, _ = best_call(lambda: run().tokens, repeats)
  return B * n_new / best


def speed(teacher, student, data, mesh, n_new, repeats=5):
  import jax
  import numpy as np
  from flax import nnx

  from meshdistill.models.generate import SamplingConfig, generate
  from meshdistill.parallel.mesh import batch_sharding

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
      best, out = best_call(run, repeats)  # one call to compile, then the fastest of ``repeats``
      times[kind] = (best, np.asarray(out))
    same = bool(np.array_equal(times["cached"][1], times["full recompute"][1]))
    n_tok = prompts.shape[0] * n_new
    rows.append({
        "model": name, "batch": prompts.shape[0], "prompt": P, "new": n_new,
        "cached_tok_s": n_tok / times["cached"][0], "full_tok_s": n_tok / times["full recompute"][0],
        "same_tokens": same,
    })
    print(f"speed {rows[-1]}", file=sys.stderr)
  try:
    tunix_tok_s = tunix_speed(teacher.cfg, mesh, prompts, n_new, repeats)
  except Exception as e:  # pylint: disable=broad-except
    tunix_tok_s = f"failed: {type(e).__name__}: {e}"[:300]
  rows[0]["tunix_tok_s"] = tunix_tok_s  # like for like: the teacher's shapes
  print(f"speed tunix: {tunix_tok_s}", file=sys.stderr)
  return rows


class _After:
  """``data`` whose training batches start after the first ``skip`` (the warm-start phase's)."""

  def __init__(self, data, skip: int):
    self.data, self.skip = data, skip
    self.tokenizer = data.tokenizer

  def train_iterator(self, state=None, **kwargs):
    it = self.data.train_iterator(state, **kwargs)
    if state is None:
      for _ in range(self.skip):
        next(it)
    return it

  def val_batches(self, max_batches=None):
    return self.data.val_batches(max_batches=max_batches)


def _completion_text(tok, batch, r):
  """The completion of row ``r`` of a sampled batch (its target tokens under the loss mask, EOS dropped)."""
  ids = [int(t) for t, m in zip(batch["targets"][r], batch["mask"][r]) if m and t != tok.eos_id]
  return tok.decode(ids)


def _arms(args):
  from meshdistill.strategies import LogitKD

  runs = {}
  for div in args.divergence.split(","):
    kd = LogitKD(temperature=1.0, alpha=1.0, divergence=div, **({"beta": args.beta} if div == "jsd" else {}))
    for name, lmbda in (("off-policy KD", 0.0), ("GKD lambda 0.5", 0.5), ("GKD lambda 1.0", 1.0)):
      runs[f"{name}, {div}"] = (lmbda, kd)
  if not args.no_sft:
    runs["SFT (completions)"] = (0.0, LogitKD(temperature=1.0, alpha=0.0))
  return runs


def quality(cfg, teacher, data, mesh, args, keep_models=False):
  """One seed (``cfg.train.seed``): the optional shared warm start, then every arm; returns (results, models)."""
  from meshdistill.train.distiller import Distiller
  from meshdistill.train.loop.evaluate import Evaluator
  from meshdistill.train.loop.guard import copy_state
  from meshdistill.models import init_model
  from meshdistill.train.loop.monitor import Monitor
  from meshdistill.train.onpolicy import OnPolicyConfig, OnPolicyDistiller
  from meshdistill.strategies import LogitKD
  from meshdistill.train.loop.trainer import fit, make_optimizer

  tok = data.tokenizer
  pad = getattr(tok, "pad_id", 0) or 0
  seed, steps, warm = cfg.train.seed, cfg.train.steps, args.warm_start
  if not 0 <= warm < steps:
    raise SystemExit(f"--warm-start {warm} must be in [0, train.steps={steps})")
  val = data.val_batches(max_batches=args.eval_batches)
  op0 = OnPolicyConfig(lmbda=0.0, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       eos_id=tok.eos_id, pad_id=pad)

  def evaluate(d, state, name, seconds):
    ev = Evaluator.for_trainer(d)(d.unreplicate(state.params)["student"], val)
    # Teacher NLL of the student's samples on held-out prompts (fixed keys: the same for every run of a seed).
    sampled = [d.sample_batch(state, d.as_prompt_batch(b), step=10**6 + i) for i, b in enumerate(val)]
    nll = Evaluator(d.teacher_def, mesh=mesh)(d.teacher_params, sampled)
    own = Evaluator(d.student_def, mesh=mesh)(state.params["student"], sampled)
    r = {"val_loss": ev["loss"], "kl": ev["kl"], "sample_nll": nll["loss"], "student_nll": own["loss"],
         "sample_len": nll["tokens"] / sum(len(b["inputs"]) for b in sampled), "seconds": seconds,
         "steps": steps - warm if name != "warm start" else warm,
         "sampled_texts": [_completion_text(tok, sampled[0], r) for r in range(args.samples)]}
    print(f"quality seed {seed} {name}: {r}", file=sys.stderr)
    return r

  results, models, warm_state = {}, {}, None
  optimizer = make_optimizer(cfg.train, cfg.student.n_layers)  # one schedule over all train.steps
  if warm:  # the main job's off-policy KD on whole rows, shared by every arm
    student = init_model(cfg.student, seed=seed, mesh=mesh)
    kd = LogitKD(**{k: cfg.distill.value(k) for k in ("temperature", "alpha", "divergence")})
    d = Distiller(student, teacher, strategy=kd, mesh=mesh, seed=seed, optimizer=optimizer)
    t0 = time.perf_counter()
    res = fit(d, data, steps=warm, monitor=Monitor(None, warm, stream=sys.stderr, name="warm start"),
              eval_batches=args.eval_batches, log_every=cfg.train.log_every)
    warm_state = res.state
    op = OnPolicyDistiller(student, teacher, strategy=kd, on_policy=op0, mesh=mesh, seed=seed, optimizer=optimizer)
    results["warm start"] = evaluate(op, warm_state, "warm start", time.perf_counter() - t0)
  for name, (lmbda, strategy) in _arms(args).items():
    student = init_model(cfg.student, seed=seed, mesh=mesh)
    op = dataclasses.replace(op0, lmbda=lmbda)
    d = OnPolicyDistiller(student, teacher, strategy=strategy, on_policy=op, mesh=mesh, seed=seed, optimizer=optimizer)
    t0 = time.perf_counter()
    res = fit(d, _After(data, warm) if warm else data, steps=steps,
              monitor=Monitor(None, steps, stream=sys.stderr, name=name), eval_batches=args.eval_batches,
              log_every=cfg.train.log_every, state=copy_state(warm_state) if warm else None)
    results[name] = evaluate(d, res.state, name, time.perf_counter() - t0)
    if keep_models:
      models[name] = d.student(res.state)
  return results, models


def samples_of(teacher, models, data, mesh, args):
  """Greedy completions of the first held-out prompts, side by side."""
  import jax
  import numpy as np

  from meshdistill.models.generate import SamplingConfig, generate

  tok = data.tokenizer
  pad = getattr(tok, "pad_id", 0) or 0
  b = data.val_batches(max_batches=1)[0]
  P = b["inputs"].shape[1] + 1 - args.max_new_tokens
  prompts = np.asarray(b["inputs"][:, :P], np.int32)
  greedy = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, eos_id=tok.eos_id, pad_id=pad)
  gens = {name: jax.device_get(generate(m, prompts, np.ones_like(prompts, bool), None, greedy, mesh=mesh))
          for name, m in [("teacher", teacher)] + list(models.items())}
  samples = []
  for r in range(args.samples):
    row = {"prompt": tok.decode(prompts[r][-48:])}
    for name, gen in gens.items():
      row[name] = tok.decode([t for t, m in zip(gen.tokens_BxN[r], gen.mask_BxN[r]) if m and t != tok.eos_id])
    samples.append(row)
  return samples


def _rel(per_seed, name, key="sample_nll"):
  """Per seed: ``key`` of run ``name`` relative to off-policy KD of the same divergence (None for other runs)."""
  if ", " not in name:
    return None
  base = "off-policy KD, " + name.split(", ")[-1]
  return [r[name][key] / r[base][key] - 1 for r in per_seed.values() if name in r and base in r]


def render(per_seed, samples, speed_rows, meta, meta_temperature=1.0) -> str:
  import numpy as np

  out = ["# On-policy distillation (GKD) vs off-policy KD vs SFT", "", meta, ""]
  for r in per_seed.values():  # per token on the student's samples: teacher NLL = student NLL + reverse KL
    for v in r.values():
      v["sample_rkl"] = v["sample_nll"] - v["student_nll"]
  if per_seed:
    seeds = list(per_seed)
    names = list(dict.fromkeys(n for r in per_seed.values() for n in r))
    mean = lambda name, key: float(np.mean([r[name][key] for r in per_seed.values() if name in r]))
    out += [
        f"Means over seeds {', '.join(map(str, seeds))} (train.seed sets the initialisation, the sampling keys and "
        "the GKD coin flips; the data order is the same for every seed):", "",
        "| run | steps | val loss (whole rows) | val KL | teacher NLL of student samples | vs off-policy KD "
        "(per seed) | student NLL of own samples | reverse KL on own samples (difference) | vs off-policy KD "
        "| sample length | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pct = lambda rel: "" if rel is None else f"{np.mean(rel) * 100:+.1f}% ({', '.join(f'{x * 100:+.1f}' for x in rel)})"
    for name in names:
      steps = next(r[name]["steps"] for r in per_seed.values() if name in r)
      out.append(
          f"| {name} | {steps} | {mean(name, 'val_loss'):.4f} | {mean(name, 'kl'):.4f} | "
          f"{mean(name, 'sample_nll'):.4f} | {pct(_rel(per_seed, name))} | {mean(name, 'student_nll'):.4f} | "
          f"{mean(name, 'sample_rkl'):.4f} | {pct(_rel(per_seed, name, 'sample_rkl'))} | "
          f"{mean(name, 'sample_len'):.1f} | {mean(name, 'seconds'):.0f} |"
      )
    out.append("")
    if len(seeds) > 1:
      out += ["Teacher NLL of student samples, per seed:", "",
              "| run | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
      for name in names:
        cells = [f"{per_seed[s][name]['sample_nll']:.4f}" if name in per_seed[s] else "" for s in seeds]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
      out.append("")
  shown = [seed for seed, r in per_seed.items() if all("sampled_texts" in v for v in r.values())][:1]
  first = per_seed[shown[0]] if shown else {}
  if samples and shown:
    out += [f"## Samples at temperature {meta_temperature} (the ones graded above), seed {shown[0]}", ""]
    for r, s in enumerate(samples):
      out.append(f"prompt (last 48 characters): `{json.dumps(s['prompt'])[1:-1]}`")
      out.append("")
      for name, v in first.items():
        if r < len(v["sampled_texts"]):
          out.append(f"- {name}: `{json.dumps(v['sampled_texts'][r])[1:-1]}`")
      out.append("")
  if samples:
    out += ["## Greedy completions of held-out prompts" + (f", seed {shown[0]}" if shown else ""), ""]
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
        "| model | batch | prompt | new tokens | KV cache tok/s | full recompute tok/s | speed-up | same tokens "
        "| tunix `Sampler` tok/s (Llama3 of the same shapes) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in speed_rows:
      tx = r.get("tunix_tok_s", "")
      tx = f"{tx:.0f} (KV cache: {r['cached_tok_s'] / tx:.2f}x)" if isinstance(tx, float) else tx
      out.append(
          f"| {r['model']} | {r['batch']} | {r['prompt']} | {r['new']} | {r['cached_tok_s']:.0f} | "
          f"{r['full_tok_s']:.0f} | {r['cached_tok_s'] / r['full_tok_s']:.1f}x | {r['same_tokens']} | {tx} |"
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
  per_seed, samples, speed_rows, quality_cmd = {}, [], [], None
  saved = os.path.splitext(args.out)[0] + ".json"  # measured quality numbers, kept for a speed-only rerun
  seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [cfg.train.seed]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  if args.only != "speed":
    for i, seed in enumerate(seeds):
      scfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed))
      per_seed[seed], models = quality(scfg, teacher, data, mesh, args, keep_models=i == 0)
      if i == 0:
        samples = samples_of(teacher, models, data, mesh, args)
      with open(saved, "w", encoding="utf-8") as f:  # after every seed: a partial run keeps what it measured
        json.dump({"per_seed": per_seed, "samples": samples, "argv": argv or sys.argv[1:]}, f, indent=1)
  elif os.path.isfile(saved):
    with open(saved, encoding="utf-8") as f:
      kept = json.load(f)
    per_seed, samples = kept["per_seed"], kept["samples"]
    quality_cmd = kept.get("argv")
  if args.only != "quality":
    speed_rows = speed(teacher, init_model(cfg.student, seed=cfg.train.seed, mesh=mesh), data, mesh,
                       args.max_new_tokens)
  warm = (f"every arm starts from the same checkpoint: {args.warm_start} steps of the main job's off-policy KD "
          f"(divergence {cfg.distill.value('divergence')}, whole rows, the first {args.warm_start} batches), "
          f"then trains "
          f"{cfg.train.steps - args.warm_start} steps on the next batches (one learning-rate schedule over "
          f"{cfg.train.steps} steps, optimizer state carried over)" if args.warm_start else
          f"every arm starts from random weights and trains {cfg.train.steps} steps")
  meta = (
      f"Main job's teacher ({tdir}) and student config; mesh {cfg.mesh.data}x{cfg.mesh.tensor} on "
      f"{jax.device_count()} {jax.default_backend()} devices ({platform.machine()}, {os.cpu_count()} CPUs); "
      f"{warm}; prompts = first {cfg.data.seq_len + 1 - args.max_new_tokens} tokens of each row, completions "
      f"{args.max_new_tokens} tokens; KD divergences {args.divergence} (jsd: beta {args.beta}), alpha 1, "
      f"loss temperature 1, sampler temperature {args.temperature} (training and evaluation); "
      f"{args.eval_batches} held-out batches of {cfg.train.batch_size} rows. "
      f"Command: `python benchmarks/on_policy.py {' '.join(argv or sys.argv[1:])}`"
      + (f"; quality numbers from `{quality_cmd}`" if quality_cmd and per_seed else "")
  )
  text = render(per_seed, samples, speed_rows, meta, args.temperature)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
