"""The headline pair through the command line, as a user of `meshdistill distill` runs it: the teacher a Hugging Face
directory (the pair's teacher preset with random weights, written by `md.export_hf` in bfloat16 with the Qwen3 test
fixture's tokenizer), the student given by its shape keys only, the batch and sequence of the setting, everything
else at the config's defaults (mesh, dtypes, attention, remat, loss: ``auto``). Tokens/s is the training loop's own
``tokens_per_s`` (`meshdistill.train.loop.monitor`): the median of the logged windows after the first two (which
hold the compiles of the full step and of the metrics-light step).

Used by ``benchmarks/tpu_step.py --systems cli``."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import yaml

from bench.chip_pairs import Setting, model_configs

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "tests" / "fixtures" / "hf_qwen3"  # 128 tokens: every id fits the presets' vocabularies
CLI_SYSTEMS = ("cli", "cli-scan")  # `tpu_step.py --systems`: the run's defaults; with scan_layers named
# what a user leaves to the defaults: how the model computes, not what it is
NOT_SHAPE = ("dtype", "param_dtype", "remat", "attention", "scan_layers")


def _die_with_parent() -> None:
  """In a child before it runs: the kernel kills it when this process ends (Linux), so a measuring process stopped
  by a time limit leaves no run behind holding the chip for the next command."""
  try:
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
  """`subprocess.run` of a child that ends with this process (`_die_with_parent`)."""
  return subprocess.run(args, preexec_fn=_die_with_parent, **kwargs)  # noqa: PLW1509 (no threads started here)


def device_info() -> dict:
  """The chip, jax and libtpu of the runs, asked of a process of its own: the measuring process never takes the chip,
  which each `meshdistill distill` process needs."""
  probe = ("import json, jax; from bench.results import libtpu_version; "
           "print(json.dumps({'device': jax.devices()[0].device_kind, 'jax': jax.__version__, "
           "'libtpu': libtpu_version()}))")
  out = _run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
             cwd=pathlib.Path(__file__).resolve().parents[1])
  return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else {}


def teacher_directory(pair: str, out: pathlib.Path, max_len: int) -> pathlib.Path:
  """The pair's teacher with random weights as a Hugging Face directory of positions up to ``max_len`` (made once per
  folder)."""
  if (out / "config.json").exists():
    return out
  code = (f"import pathlib; from bench.cli_run import write_teacher; "
          f"write_teacher({pair!r}, pathlib.Path({str(out)!r}), {max_len})")
  # in a process of its own: this one never takes the chip (see `device_info`)
  _run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).resolve().parents[1])
  return out


def write_teacher(pair: str, out: pathlib.Path, max_len: int) -> None:
  """`teacher_directory`'s work: the random teacher written by `md.export_hf`."""
  import meshdistill as md

  tcfg, _ = model_configs(pair, Setting(attn="xla", remat="none", dtypes="auto"))
  # initialised scanned: one compiled block instead of 28 (on a CPU 1.9 s against 16.9); `export_hf` writes the
  # checkpoint's per-layer tensors either way
  tcfg = tcfg.replace(param_dtype="bfloat16", dtype="bfloat16", scan_layers=True, max_len=max(tcfg.max_len, max_len))
  model = md.init_model(tcfg, seed=0)
  md.export_hf(model, out, tokenizer=str(TOKENIZER), dtype="bfloat16")


def config(pair: str, s: Setting, teacher_dir: pathlib.Path, run_dir: pathlib.Path, steps: int,
           scan: bool = False) -> dict:
  """The run's config: the teacher's directory, the student's shape, batch and sequence; ``scan``: both models'
  ``scan_layers`` named true (the one setting besides shapes that the hand-tuned rows name)."""
  _, scfg = model_configs(pair, Setting(attn="xla", remat="none", dtypes="auto"))
  student = {k: v for k, v in dataclasses.asdict(scfg).items() if k not in NOT_SHAPE}
  student["max_len"] = max(student["max_len"], s.t)
  cfg = {
      "teacher": {"hf": str(teacher_dir), "max_len": s.t},  # the sequence bound (config.json's is not read)
      "student": student,
      "data": {"source": "stdlib", "seq_len": s.t, "val_fraction": 0.01},
      "distill": {"temperature": 2.0, "alpha": 0.5},
      "train": {"steps": steps, "warmup": max(1, steps // 10), "batch_size": s.b, "eval_every": 10 * steps,
                "eval_batches": 1, "log_every": 5},
      "checkpoint": {"every": 10 * steps},
      "run": {"run_dir": str(run_dir)},
  }
  if scan:
    cfg["teacher"]["scan_layers"] = cfg["student"]["scan_layers"] = True
  return cfg


def measure_cli(pair: str, s: Setting, steps: int, workdir: str, scan: bool = False, timeout_s: float = 300) -> dict:
  """One `meshdistill distill` run of the setting's batch and sequence in a subprocess: its tokens/s (median of the
  logged windows after the first two), the seconds of the whole command, and the tail of its output on failure."""
  work = pathlib.Path(workdir)
  work.mkdir(parents=True, exist_ok=True)
  row = {"pair": pair, "system": "cli-scan" if scan else "cli", "label": f"b={s.b},t={s.t}",
         "setting": dataclasses.asdict(s), "steps": steps, **device_info()}
  t0 = time.perf_counter()
  teacher = teacher_directory(pair, work / f"{pair}-teacher-hf-{s.t}", s.t)
  row["teacher_dir_s"] = time.perf_counter() - t0
  run_dir = work / f"run-{row['system']}-{row['label'].replace(',', '-').replace('=', '')}"
  path = work / f"{run_dir.name}.yaml"
  path.write_text(yaml.safe_dump(config(pair, s, teacher, run_dir, steps, scan)), encoding="utf-8")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
  t0 = time.perf_counter()
  try:
    out = _run([sys.executable, "-m", "meshdistill", "distill", "--config", str(path)], env=env,
               capture_output=True, text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired as e:
    row["error"] = f"TimeoutExpired: the run took over {timeout_s:.0f} s; {str(e.stderr or '')[-1200:]}"
    return row
  row["command_s"] = time.perf_counter() - t0
  row["cli_command"] = f"meshdistill distill --config {path.name}"
  row["config"] = json.loads(json.dumps(config(pair, s, pathlib.Path("TEACHER_DIR"), pathlib.Path("RUN_DIR"), steps,
                                                scan)))
  if out.returncode != 0:
    row["error"] = f"exit {out.returncode}: {(out.stderr or out.stdout)[-1500:]}"
    return row
  windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
  rates = [w["tokens_per_s"] for w in windows if "tokens_per_s" in w]
  if len(rates) < 3:
    row["error"] = f"{len(rates)} logged windows with tokens_per_s in {run_dir / 'metrics.jsonl'}; need 3 or more"
    return row
  steady = rates[2:]  # the first two windows hold the compiles of the full and of the metrics-light step
  row.update(tokens_per_s=statistics.median(steady), windows=rates, step_s=s.b * s.t / statistics.median(steady),
             log_tail=[line for line in out.stderr.splitlines() if "auto" in line or "mesh" in line][-12:])
  return row
