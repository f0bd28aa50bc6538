"""Compress, then distil: a student pruned from the teacher vs a layer subset vs random init, and
quantization-aware distillation vs post-training quantization.

The main job's data, teacher (cached or pretrained by the main job's settings) and distillation recipe; the
scale is set by ``--steps`` / ``--eval-every`` and ``--set`` (the defaults below are smaller than the main job's
300 steps and run on one device: ``mesh.backend=single``). Arms, each for every seed in ``--seeds`` (the seed is
``train.seed`` and ``data.seed``: the data order and a fresh student's initialisation; the teacher is the main
job's for every seed, ``pretrain.teacher``), equal steps and tokens:

  (a) pruned   -- ``meshdistill prune --embed E --mlp F`` (width pruning, Minitron) to about the size of (b),
                  then distilled (``student.init.pruned``);
  (b) subset   -- ``student.init: {from_teacher: true, layers: LAYERS}``, distilled;
  (c) random   -- (a)'s shape initialised from ``train.seed``, distilled;
  (d) pruned, fine-tuned -- (a)'s start trained on the hard labels only (``distill.alpha=0``);
  (q) QAD      -- (a)'s start distilled through int4 fake quantization (``student.quantize_aware``);
  (r) QAD after full precision -- (a)'s run for its first ``--qad-from`` steps (stopped there), then the SAME
                  run continued through int4 fake quantization to ``--steps``: the optimizer state, learning-rate
                  schedule and data position carry on, so every token is (a)'s (the library refuses a changed
                  ``student.quantize_aware`` on resume; this script rewrites the run's config.yaml between the phases);
  PTQ          -- (a)'s distilled student quantized after training by the same int4 rule (no training).

  python benchmarks/compress.py                            # seeds 0,1,2; 150 steps; curves every 10 steps
  python benchmarks/compress.py --render                   # rewrite the report from compress.json
  python benchmarks/compress.py --arms pruned,qad_after    # rerun some arms; the others are kept from compress.json

Writes ``benchmarks/results/compress.json`` (every curve and final number), ``compress.md`` and
``compress.png`` (validation loss curves, mean over seeds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time

from bench import harness

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ARMS = ("pruned", "subset", "random", "pruned_finetuned", "qad", "qad_after")
LABELS = {"pruned": "(a) pruned, distilled", "subset": "(b) layer subset, distilled",
          "random": "(c) random init, distilled", "pruned_finetuned": "(d) pruned, fine-tuned (no teacher)",
          "qad": "(q) pruned, distilled quantization-aware (int4)",
          "qad_after": "(r) (a), then quantization-aware (int4) from the middle"}


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=None, help="YAML file or packaged config name (default: the main job's)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--eval-every", type=int, default=10)
  p.add_argument("--embed", type=int, default=112, help="(a): embedding channels kept")
  p.add_argument("--mlp", type=int, default=240, help="(a): MLP units kept per block")
  p.add_argument("--layers", default="0,3", help="(b): teacher blocks copied")
  p.add_argument("--weights", default="int4", help="QAD / PTQ weight type")
  p.add_argument("--group-size", type=int, default=0, help="QAD / PTQ input features per scale (0: one scale per "
                 "output channel)")
  p.add_argument("--batches", type=int, default=8, help="calibration batches for the importance scores")
  p.add_argument("--qad-from", type=int, default=None, help="(r): full-precision steps before the quantization-aware "
                 "phase (default: half of --steps)")
  p.add_argument("--arms", default=",".join(ARMS), help="arms to run; the others' runs are kept from --out's .json "
                 "(which must hold them)")
  p.add_argument("--run-root", default="runs/compress")
  p.add_argument("--render", action="store_true", help="rewrite compress.md / .png from compress.json")
  p.add_argument("--out", default=os.path.join(RESULTS, "compress"))
  return p.parse_args(argv)


def _val_curve(run_dir: str) -> dict[int, float]:
  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows if r.get("split") == "val"}


def _overrides(args, seed: int) -> list[str]:
  return ["mesh.backend=single", "mesh.data=1", "mesh.tensor=1", f"train.steps={args.steps}",
          f"train.eval_every={args.eval_every}", f"train.seed={seed}", f"data.seed={seed}", *args.overrides]


def run(args) -> dict:
  from meshdistill.config import load_config

  seeds = [int(s) for s in args.seeds.split(",")]
  arms = [a for a in args.arms.split(",") if a]
  if set(arms) - set(ARMS):
    raise SystemExit(f"--arms: unknown {sorted(set(arms) - set(ARMS))}; choose from {list(ARMS)}")
  kept = {}
  if set(arms) != set(ARMS):
    with open(args.out + ".json", encoding="utf-8") as f:
      kept = json.load(f)
  qad_from = args.qad_from if args.qad_from is not None else args.steps // 2
  root = os.path.abspath(args.run_root)
  pruned_dir = os.path.join(root, "pruned")
  base = load_config(args.config, _overrides(args, seeds[0]) + [f"run.run_dir={root}/prune"])
  from meshdistill import jobs

  jobs.prepare_devices(base)
  import jax
  from flax import nnx

  from meshdistill.models.compress import QuantizeAware, dequantized
  from meshdistill.train.loop.evaluate import Evaluator

  t0 = time.perf_counter()
  data = jobs.load_data(base)  # the main job's teacher (pretrained now if not cached), then the same one for every seed
  jobs.obtain_teacher(base, data, None, stream=sys.stderr)
  teacher_path = jobs.teacher_dir(base, data.tokenizer)
  args.overrides = [*args.overrides, f"pretrain.teacher={teacher_path}"]
  base = load_config(args.config, _overrides(args, seeds[0]) + [f"run.run_dir={root}/prune"])
  report = jobs.prune(base, pruned_dir, jobs.PruneTargets(embed=args.embed, mlp=args.mlp), batches=args.batches,
                      overwrite=True, stream=sys.stderr)
  prune_s = time.perf_counter() - t0
  shape = report["student"]
  group = args.group_size or None
  qa = QuantizeAware(weights=args.weights, group_size=group)
  layers = "[" + args.layers + "]"
  head_dim = base.teacher.d_model // base.teacher.n_heads if base.teacher.head_dim is None else base.teacher.head_dim
  arm_sets = {
      "pruned": [f"student.init={{pruned: {pruned_dir}}}"],
      "subset": [f"student.init={{from_teacher: true, layers: {layers}}}"],
      "random": [f"student={json.dumps({**base.to_dict()['teacher'], 'd_model': shape['d_model'], 'mlp_hidden': shape['mlp_hidden'], 'n_heads': shape['n_heads'], 'n_kv_heads': shape['n_kv_heads'], 'head_dim': head_dim})}"],
      "pruned_finetuned": [f"student.init={{pruned: {pruned_dir}}}", "distill.alpha=0.0"],
      "qad": [f"student.init={{pruned: {pruned_dir}}}",
              f"student.quantize_aware={{weights: {args.weights}, group_size: {'null' if group is None else group}}}"],
  }
  arm_sets["qad_after"] = arm_sets["qad"] + [f"checkpoint.every={qad_from}"]  # a checkpoint where phase 1 stops
  out = {"seeds": seeds, "prune": report, "prune_seconds": prune_s, "runs": {}, "ptq": {}, "float_eval": {},
         "qad_from": qad_from, "rerun": arms}
  for seed in seeds:
    for arm in ARMS:
      if arm not in arms:
        out["runs"][f"{arm}-s{seed}"] = kept["runs"][f"{arm}-s{seed}"]
        continue
      run_dir = os.path.join(root, f"{arm}-s{seed}")
      shutil.rmtree(run_dir, ignore_errors=True)  # every arm starts from step 0
      cfg = load_config(args.config, _overrides(args, seed) + arm_sets[arm] + [f"run.run_dir={run_dir}"])
      t = time.perf_counter()
      if arm == "qad_after":  # (a)'s run to qad_from, then the same run continued quantization-aware
        first = load_config(args.config, _overrides(args, seed) + arm_sets["pruned"]
                            + [f"checkpoint.every={qad_from}", f"run.run_dir={run_dir}"])
        jobs.distill(first, stream=sys.stderr, stop_after=qad_from)
        from meshdistill.storage.checkpoint import Checkpointer

        ckpt = Checkpointer(first.checkpoint_dir, every=0, read_only=True)
        saved = ckpt.all_steps()
        ckpt.close()
        if qad_from not in saved:  # else the second phase would start again from step 0
          raise SystemExit(f"(r): no checkpoint at step {qad_from} in {first.checkpoint_dir} (steps {saved})")
        from meshdistill.config import dump_config

        dump_config(cfg, os.path.join(run_dir, "config.yaml"))  # the run now trains through fake quantization
      summary = jobs.distill(cfg, stream=sys.stderr)
      out["runs"][f"{arm}-s{seed}"] = {"curve": _val_curve(run_dir), "loss": summary["student"]["loss"],
                                       "agree": summary["student"]["agree"], "params": summary["student"]["params"],
                                       "teacher_loss": summary["teacher"]["loss"], "seconds": time.perf_counter() - t}
    if "pruned" not in arms:  # (a) kept: so are its PTQ and float evaluations
      for name in ("float_eval", "ptq"):
        out[name][f"s{seed}"] = kept[name][f"s{seed}"]
      continue
    # PTQ: the distilled (a) student quantized after training, and the same float student, on one evaluator
    cfg = load_config(args.config, _overrides(args, seed) + arm_sets["pruned"] + [f"run.run_dir={root}/pruned-s{seed}"])
    data = jobs.load_data(cfg)
    val = data.val_batches(max_batches=cfg.train.eval_batches)
    teacher, _ = jobs.obtain_teacher(cfg, data, None, stream=sys.stderr)
    t_def, t_params = nnx.split(teacher)
    student = jobs.load_run(cfg.run.run_dir).student
    for name, model in (("float_eval", student), ("ptq", dequantized(student, qa))):
      graphdef, params = nnx.split(model)
      m = Evaluator(graphdef, teacher_def=t_def, teacher_params=t_params)(params, val)
      out[name][f"s{seed}"] = {"loss": m["loss"], "agree": m["agree"]}
  out["meta"] = {"written": datetime.datetime.now().isoformat(timespec="seconds"), "devices": jax.device_count(),
                 "backend": jax.default_backend(), "machine": harness.machine(), "cpus": os.cpu_count(),
                 "steps": args.steps, "eval_every": args.eval_every, "batch_size": base.train.batch_size,
                 "seq_len": base.data.seq_len, "lr": base.train.lr, "temperature": base.distill.value("temperature"),
                 "alpha": base.distill.value("alpha"), "layers": args.layers, "quantize": qa.describe(),
                 "kept_from": kept.get("meta", {}).get("written"),
                 "argv": [a for a in sys.argv[1:] if not a.startswith("pretrain.teacher=")],
                 "total_seconds": time.perf_counter() - t0}
  return out


def _ms(values) -> str:
  values = list(values)
  sd = statistics.stdev(values) if len(values) > 1 else 0.0
  return f"{statistics.mean(values):.4f} ± {sd:.4f}"


def render(out: dict, path: str) -> str:
  seeds, runs, meta = out["seeds"], out["runs"], out["meta"]
  arms = [a for a in ARMS if all(f"{a}-s{s}" in runs for s in seeds)]  # a report of an older version lacks (r)
  curve = {arm: {} for arm in arms}
  for arm in arms:
    for s in seeds:
      for step, loss in runs[f"{arm}-s{s}"]["curve"].items():
        curve[arm].setdefault(int(step), []).append(loss)
  steps = sorted(set.intersection(*(set(c) for c in curve.values())))
  mean = {arm: {st: statistics.mean(curve[arm][st]) for st in steps} for arm in arms}
  last = steps[-1]
  target = mean["random"][last]
  reach = next((st for st in steps if mean["pruned"][st] <= target), None)
  p = out["prune"]
  lines = [
      "# Compress, then distil: pruned vs layer-subset vs random students; QAD vs PTQ",
      "",
      f"Written by `benchmarks/compress.py` on {meta['written']} ({meta['devices']} x {meta['backend']} device, "
      f"{meta['machine']}" + ("" if "CPU cores" in meta["machine"] else f", {meta['cpus']} CPUs") + "), arguments `{' '.join(meta['argv']) or '(defaults)'}`. The main job's "
      f"data (byte-level, Python standard library source), teacher and recipe (lr {meta['lr']}, tau "
      f"{meta['temperature']}, alpha {meta['alpha']}, batch {meta['batch_size']} x {meta['seq_len']} tokens) at a "
      f"smaller scale than the main job: {meta['steps']} steps instead of 300, one device (`mesh.backend=single`). "
      f"Every arm: the same steps, tokens and data order per seed; seeds {seeds} (`train.seed` = `data.seed`; one "
      "teacher, the main job's, for every seed). "
      "Validation loss is the student's cross-entropy (nats/token) on the main job's validation batches, mean ± "
      "standard deviation over the seeds.",
      "",
      f"Teacher: {p['teacher']['params']:,} params (d_model {p['teacher']['d_model']}, {p['teacher']['n_layers']} "
      f"blocks, mlp {p['teacher']['mlp_hidden']}), validation loss {runs[f'pruned-s{seeds[0]}']['teacher_loss']:.4f}. "
      f"(a) `meshdistill prune --embed {p['student']['d_model']} --mlp {p['student']['mlp_hidden']} --batches "
      f"{p['calibration']['sequences'] // max(1, meta['batch_size'])}` ({p['calibration']['tokens']:,} calibration "
      f"tokens, {out['prune_seconds']:.0f} s): {p['student']['params']:,} params "
      f"({100 * p['fraction_kept']:.1f}%). (b) teacher blocks [{meta['layers']}]: "
      f"{runs[f'subset-s{seeds[0]}']['params']:,} params. (c) (a)'s shape, random init.",
      "",
      "## Validation loss by step",
      "",
      "| step | " + " | ".join(LABELS[a] for a in arms) + " |",
      "|---:|" + "---:|" * len(arms),
  ]
  for st in steps:
    lines.append(f"| {st} | " + " | ".join(_ms(curve[a][st]) for a in arms) + " |")
  final = {a: [runs[f"{a}-s{s}"]["loss"] for s in seeds] for a in arms}
  agree = {a: [runs[f"{a}-s{s}"]["agree"] for s in seeds] for a in arms}
  lines += ["", "| arm | params | final validation loss | top-1 agreement with the teacher | seconds / run |",
            "|---|---:|---:|---:|---:|"]
  for a in arms:
    secs = statistics.mean(runs[f"{a}-s{s}"]["seconds"] for s in seeds)
    lines.append(f"| {LABELS[a]} | {runs[f'{a}-s{seeds[0]}']['params']:,} | {_ms(final[a])} | {_ms(agree[a])} | "
                 f"{secs:.0f} |")
  a_vs_b = [mean["pruned"][st] - mean["subset"][st] for st in steps]
  lines += [
      "",
      "## Aims",
      "",
      f"- (a) reaches (c)'s final validation loss ({target:.4f} at step {last}) "
      + (f"at step {reach} ({reach / last:.2f} of the steps; aim: at most 0.25): "
         f"**{'holds' if reach / last <= 0.25 else 'does not hold'}**." if reach is not None else
         "at no evaluated step: **does not hold**."),
      f"- (a) vs (b) at equal steps (mean loss difference, negative = (a) lower): "
      + ", ".join(f"step {st}: {d:+.4f}" for st, d in zip(steps, a_vs_b))
      + f"; **{'holds' if all(d < 0 for d in a_vs_b) else 'does not hold at every step'}**.",
  ]
  fl = {k: [out["float_eval"][f"s{s}"][k] for s in seeds] for k in ("loss", "agree")}
  pt = {k: [out["ptq"][f"s{s}"][k] for s in seeds] for k in ("loss", "agree")}
  quantized = [("qad", "(q) distilled quantization-aware (QAD)")]
  if "qad_after" in arms:
    quantized.append(("qad_after", f"(r) (a) for {out.get('qad_from')} steps, then QAD to step {meta['steps']}"))
  lines += ["", f"## Quantization-aware distillation ({meta['quantize']})", "",
            "| student | validation loss | top-1 agreement with the teacher |", "|---|---:|---:|",
            f"| (a) distilled, full precision | {_ms(fl['loss'])} | {_ms(fl['agree'])} |",
            f"| (a) distilled, then quantized (PTQ) | {_ms(pt['loss'])} | {_ms(pt['agree'])} |"]
  lines += [f"| {label} | {_ms(final[a])} | {_ms(agree[a])} |" for a, label in quantized]
  lines += ["", "Gap closed: (PTQ - arm) / (PTQ - full precision), per seed and of the means (aim: at least 50%).", ""]
  for a, label in quantized:
    q = {"loss": final[a], "agree": agree[a]}
    for k, sign in (("loss", 1), ("agree", -1)):
      gap = statistics.mean(pt[k]) - statistics.mean(fl[k])
      closed = (statistics.mean(pt[k]) - statistics.mean(q[k])) / gap if gap * sign > 0 else float("nan")
      per_seed = [(p_ - q_) / (p_ - f_) if (p_ - f_) * sign > 0 else float("nan")
                  for p_, q_, f_ in zip(pt[k], q[k], fl[k])]
      lines.append(f"- {label.split(' ')[0]} {k}: PTQ gap to full precision {gap:+.4f}; closed "
                   f"{100 * closed:.0f}% (per seed: {', '.join(f'{100 * c:.0f}%' for c in per_seed)}): "
                   f"**{'holds' if closed >= 0.5 else 'does not hold'}**.")
  if out.get("rerun") and set(out["rerun"]) != set(ARMS):
    lines += ["", f"Arms run for this report: {', '.join(out['rerun'])}; the others' runs are those of the report "
              f"written {meta.get('kept_from')} (same arguments, seeds and teacher)."]
  lines += ["", f"Total wall time {meta['total_seconds']:.0f} s (compilation included). Curves: `compress.png`.", "",
            "Reproduce: `python benchmarks/compress.py " + " ".join(meta["argv"]) + "`"]
  _plot(mean, steps, path + ".png", arms)
  text = "\n".join(lines) + "\n"
  with open(path + ".md", "w", encoding="utf-8") as f:
    f.write(text)
  return text


def _plot(mean: dict, steps: list[int], path: str, arms) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(7, 4.2))
  for arm in arms:
    ax.plot(steps, [mean[arm][s] for s in steps], marker="o", label=LABELS[arm])
  ax.set_xlabel("step")
  ax.set_ylabel("validation loss (nats/token), mean over seeds")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  args = _args(argv)
  if args.render:
    with open(args.out + ".json", encoding="utf-8") as f:
      out = json.load(f)
  else:
    out = run(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)
  print(render(out, args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
