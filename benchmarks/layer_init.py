"""Layer-subset initialisation: a student started from the teacher's blocks vs the same student started fresh.

The main job (byte tokenizer, built-in models, cached or pretrained teacher, 2x4 mesh), with the
student's shape derived from the teacher (``student.init: {from_teacher: true, layers: LAYERS}``:
the teacher's d_model, heads and MLP width, ``len(LAYERS)`` blocks). Both runs distil with the same
recipe, data order, steps and learning-rate schedule; the fresh student is the same architecture
initialised from ``train.seed``. The validation loss of both (same validation batches) is recorded
at step 0 and every ``train.eval_every`` steps.

  python benchmarks/layer_init.py                                 # layers [0, 3] of the 4-block teacher
  python benchmarks/layer_init.py --layers 0,2 --set train.steps=200

Prints a Markdown table and writes it to ``benchmarks/results/layer_init.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from bench import harness

HERE = os.path.dirname(os.path.abspath(__file__))


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=None, help="YAML file or packaged config name (default: the main job's)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--layers", default="0,3", help="teacher blocks copied into the student (comma-separated)")
  p.add_argument("--run-root", default="runs/layer_init", help="where the two runs write their run directories")
  p.add_argument("--out", default=os.path.join(HERE, "results", "layer_init.md"))
  return p.parse_args(argv)


def _val_curve(run_dir: str) -> dict[int, float]:
  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows if r.get("split") == "val"}


def main(argv=None) -> int:
  args = _args(argv)
  layers = [int(x) for x in args.layers.split(",")]
  from meshdistill.config import load_config
  from meshdistill.teachers.sources import ModelSources

  init = "{from_teacher: true, layers: [" + ", ".join(map(str, layers)) + "]}"
  base = [*args.overrides, f"student.init={init}"]
  cfg_init = load_config(args.config, [*base, f"run.run_dir={args.run_root}/from_teacher"])
  # The fresh student: the same derived shape, initialised from train.seed.
  cfg_fresh = load_config(args.config, [*args.overrides, f"run.run_dir={args.run_root}/fresh"])
  cfg_fresh = cfg_fresh.replace(student=cfg_init.student, models=ModelSources())

  from meshdistill import jobs

  jobs.prepare_devices(cfg_init)
  import jax

  from meshdistill.train.loop.evaluate import Evaluator
  from meshdistill.models import param_count

  results = {}
  t0 = time.perf_counter()
  mesh = jobs.build_mesh(cfg_init)
  data = jobs.load_data(cfg_init)
  val = data.val_batches(max_batches=cfg_init.train.eval_batches)
  for name, cfg in (("from teacher", cfg_init), ("fresh", cfg_fresh)):
    teacher, _ = jobs.obtain_teacher(cfg, data, mesh, stream=sys.stderr)
    distiller = jobs.make_distiller(cfg, teacher, mesh)
    state0 = distiller.init_state()
    step0 = Evaluator.for_trainer(distiller)(distiller.unreplicate(state0.params)["student"], val)["loss"]
    n_params = param_count(distiller.student(state0))
    del distiller, state0
    t = time.perf_counter()
    summary = jobs.distill(cfg, stream=sys.stderr)
    curve = {0: step0, **_val_curve(cfg.run.run_dir)}
    results[name] = {"curve": curve, "final": summary["student"]["loss"], "params": n_params,
                     "teacher": summary["teacher"]["loss"], "seconds": time.perf_counter() - t}
  steps = sorted(set(results["from teacher"]["curve"]) & set(results["fresh"]["curve"]))
  c = cfg_init
  lines = [
      "# Layer-subset initialisation: student from the teacher's blocks vs fresh",
      "",
      f"Written by `benchmarks/layer_init.py` on {datetime.datetime.now().isoformat(timespec='seconds')} "
      f"({jax.device_count()} x {jax.default_backend()} devices, mesh {c.mesh.data}x{c.mesh.tensor}, "
      f"{harness.machine()}); the main job's data, teacher and recipe.",
      "",
      f"Teacher d{c.teacher.d_model}xL{c.teacher.n_layers} (validation loss {results['fresh']['teacher']:.4f}). "
      f"Student: the teacher's shape with {len(layers)} blocks ({results['fresh']['params']:,} params); "
      f"`student.init: {init}` copies the teacher's embeddings, LM head, final norm and blocks {layers}; "
      f"the fresh student is initialised from train.seed={c.train.seed}. Both: {c.train.steps} steps, lr {c.train.lr}, "
      f"tau {c.distill.value('temperature')}, alpha {c.distill.value('alpha')}, same data order; validation loss "
      f"(nats/token) on the same {c.train.eval_batches} validation batches.",
      "",
      "| step | from teacher | fresh | difference |",
      "|---:|---:|---:|---:|",
  ]
  for s in steps:
    a, b = results["from teacher"]["curve"][s], results["fresh"]["curve"][s]
    lines.append(f"| {s} | {a:.4f} | {b:.4f} | {a - b:+.4f} |")
  lines += ["", f"Wall time: from teacher {results['from teacher']['seconds']:.0f} s, fresh "
            f"{results['fresh']['seconds']:.0f} s, total {time.perf_counter() - t0:.0f} s (compilation included)."]
  text = "\n".join(lines) + "\n"
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
