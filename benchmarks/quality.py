"""Quality benchmark: does distillation beat training the same student from scratch?

Three models on the default corpus, all evaluated on the same validation batches:

1. the teacher (loaded from the cache, or pretrained on hard labels with ``pretrain.*``);
2. the student distilled from it (``distill.*`` recipe, ``train.*`` schedule);
3. the SAME student architecture trained from scratch on hard labels only: same
   initialisation seed, same number of steps, same data order (same data seed and batch
   size), same learning-rate schedule and optimizer.

Writes ``benchmarks/results/quality.md`` (validation loss and perplexity of each, the
student/teacher parameter ratio, the distilled/scratch loss ratio against the 0.97 target)
and appends the run to ``benchmarks/results/quality_runs.jsonl`` (every recipe run with this script);
hand-written tuning notes in ``benchmarks/results/quality_notes.md`` are appended to the report.

  python benchmarks/quality.py                              # the default config (main job's recipe)
  python benchmarks/quality.py --config configs/quality.yaml --set distill.alpha=0.8
  python benchmarks/quality.py --seeds 5                    # the spread over student seeds 1..5

With ``--seeds N`` the distilled and scratch students are trained for ``train.seed`` = 1..N (the
teacher is the same, cached after the first), each seed's row is appended to
``benchmarks/results/quality_seeds.jsonl`` as soon as it finishes, and ``quality.md`` gets the mean and
standard deviation over the seeds finished so far (``--render-only`` rewrites it from those files).

Runs on the configured mesh (2x4 simulated CPU devices by default); expect tens of minutes
on a 2-core machine.

The final numbers are over the first ``--eval-batches`` (64) validation batches; ``meshdistill distill`` ends with
the first ``train.eval_batches`` (8) of the same held-out split, so the main job's table shows other losses for the
same recipe (the report says so under its table's header).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

from bench.render_quality import history, render, render_seeds
from bench.results import append_row

HERE = os.path.dirname(os.path.abspath(__file__))


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=None, help="YAML file or packaged config name (default: the main job's)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--run-root", default="runs/quality", help="where the two student runs write their run directories")
  p.add_argument("--eval-batches", type=int, default=64, help="validation batches for the final numbers")
  p.add_argument("--out", default=os.path.join(HERE, "results", "quality.md"))
  p.add_argument("--note", default="", help="a remark stored with this run in quality_runs.jsonl")
  p.add_argument("--seeds", type=int, default=0, help="train the two students for train.seed = 1..N; report mean/sd")
  p.add_argument("--render-only", action="store_true", help="rewrite the report from quality_runs.jsonl; train nothing")
  return p.parse_args(argv)


def _fit(trainer, data, cfg, run_dir, name):
  from meshdistill.storage.checkpoint import Checkpointer
  from meshdistill.jobs import loop_kwargs
  from meshdistill.train.loop.monitor import Monitor
  from meshdistill.train.loop.trainer import fit

  monitor = Monitor(run_dir, cfg.train.steps, stream=sys.stderr, name=name)
  ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), every=cfg.checkpoint.every, keep=cfg.checkpoint.keep)
  try:
    return fit(trainer, data, kind=name, checkpointer=ckpt, monitor=monitor, **loop_kwargs(cfg.train))
  finally:
    ckpt.close()
    monitor.close()


def write_report(out: str, row: dict, tdir: str) -> str:
  """Writes ``out`` for ``row``, with the history of runs and the tuning notes next to it."""
  results = os.path.dirname(out)
  notes_path = os.path.join(results, "quality_notes.md")
  notes = ""
  if os.path.isfile(notes_path):
    with open(notes_path, encoding="utf-8") as f:
      notes = f.read()
  seeds_path = os.path.join(results, "quality_seeds.jsonl")
  seeds = render_seeds(history(seeds_path)) if os.path.isfile(seeds_path) else ""
  text = render(row, tdir, history(os.path.join(results, "quality_runs.jsonl"))) + seeds + ("\n" + notes if notes else "")
  with open(out, "w", encoding="utf-8") as f:
    f.write(text)
  return text


def main(argv=None) -> int:
  args = _args(argv)
  results = os.path.dirname(args.out)
  if args.render_only:
    rows = history(os.path.join(results, "quality_runs.jsonl"))
    write_report(args.out, rows[-1], rows[-1].get("teacher_dir", ""))
    return 0
  if args.seeds:
    seeds_path = os.path.join(results, "quality_seeds.jsonl")
    for seed in range(1, args.seeds + 1):
      row = run_once(args, [*args.overrides, f"train.seed={seed}"], os.path.join(args.run_root, f"seed{seed}"))
      row["seed"] = seed
      append_row(seeds_path, row)
      print(f"seed {seed}: distilled {row['distilled']['loss']:.4f} scratch {row['scratch']['loss']:.4f} "
            f"ratio {row['loss_ratio']:.4f}", flush=True)
      head = history(os.path.join(results, "quality_runs.jsonl"))[-1]  # the headline run stays on top
      write_report(args.out, head, head.get("teacher_dir", ""))
    return 0
  row = run_once(args, args.overrides, args.run_root)
  append_row(os.path.join(results, "quality_runs.jsonl"), row)
  write_report(args.out, row, row["teacher_dir"])
  print(render(row, row["teacher_dir"], []))
  return 0


def run_once(args, overrides: list[str], run_root: str) -> dict:
  """Trains the distilled and the scratch student once; returns the run's row."""
  from meshdistill.config import dump_config, load_config

  # The teacher's pretraining run (when no cached teacher fits) also goes under the run root.
  cfg = load_config(args.config, [*overrides, f"run.run_dir={run_root}"])
  from meshdistill import jobs

  jobs.prepare_devices(cfg)
  import jax

  from meshdistill.train.loop.evaluate import Evaluator
  from meshdistill.train.hardlabel import HardLabelTrainer
  from meshdistill.models import init_model, param_count
  from meshdistill.train.optimizers import make_optimizer

  t_start = time.perf_counter()
  os.makedirs(run_root, exist_ok=True)
  dump_config(cfg, os.path.join(run_root, "config.yaml"))
  mesh = jobs.build_mesh(cfg)
  data = jobs.load_data(cfg)
  say = jobs.stream_reporter(sys.stderr)
  t0 = time.perf_counter()
  teacher, tdir = jobs.obtain_teacher(cfg, data, mesh, stream=sys.stderr, report=say)
  teacher_seconds = time.perf_counter() - t0
  from meshdistill.teachers.checkpoint import read_teacher_meta

  teacher_pretrain_seconds = read_teacher_meta(tdir)["info"].get("seconds")

  distiller = jobs.make_distiller(cfg, teacher, mesh)
  t0 = time.perf_counter()
  distilled = _fit(distiller, data, cfg, os.path.join(run_root, "distill"), "distill")
  distill_seconds = time.perf_counter() - t0

  scratch_model = init_model(cfg.student, seed=cfg.train.seed, mesh=mesh)
  scratch = HardLabelTrainer(
    scratch_model, optimizer=make_optimizer(cfg.train, cfg.student.n_layers), mesh=mesh, backend=cfg.mesh.backend
  )
  t0 = time.perf_counter()
  baseline = _fit(scratch, data, cfg, os.path.join(run_root, "scratch"), "scratch")
  scratch_seconds = time.perf_counter() - t0

  val = data.val_batches(max_batches=args.eval_batches)
  ev_d = Evaluator.for_trainer(distiller)(distiller.unreplicate(distilled.state.params)["student"], val)
  ev_s = Evaluator(
    scratch.student_def,
    teacher_def=distiller.teacher_def,
    teacher_params=distiller.teacher_params,
    mesh=distiller.layout.eval_mesh,
  )(scratch.unreplicate(baseline.state.params)["student"], val)
  n_t, n_s = param_count(teacher), param_count(distiller.student(distilled.state))
  row = {
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "config": args.config or "default",
    "overrides": overrides,
    "note": args.note,
    "teacher": {"loss": ev_d["teacher_loss"], "ppl": ev_d["teacher_ppl"], "params": n_t},
    "distilled": {k: ev_d[k] for k in ("loss", "ppl", "kl", "agree")} | {"params": n_s},
    "scratch": {k: ev_s[k] for k in ("loss", "ppl", "kl", "agree")} | {"params": n_s},
    "loss_ratio": ev_d["loss"] / ev_s["loss"],
    "param_ratio": n_s / n_t,
    "val_tokens": ev_d["tokens"],
    "eval_batches": len(val),
    "teacher_dir": tdir,
    "seconds": {
      "teacher": teacher_seconds,
      "teacher_pretraining": teacher_pretrain_seconds,
      "distill": distill_seconds,
      "scratch": scratch_seconds,
      "total": time.perf_counter() - t_start,
    },
    "settings": {
      "teacher": cfg.to_dict()["teacher"],
      "student": cfg.to_dict()["student"],
      # null settings filled in with the strategy's defaults: the recipe the run trained with
      "distill": {**cfg.to_dict()["distill"],
                  **{k: cfg.distill.value(k) for k in ("temperature", "alpha", "divergence")}},
      "train": cfg.to_dict()["train"],
      "pretrain": cfg.to_dict()["pretrain"],
      "data": cfg.to_dict()["data"],
      "mesh": cfg.to_dict()["mesh"],
    },
    "devices": f"{jax.device_count()} x {jax.default_backend()}",
    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    "load_average": os.getloadavg()[0],
  }
  return row


if __name__ == "__main__":
  sys.exit(main())
