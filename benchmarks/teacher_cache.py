"""The offline top-k teacher cache: bytes per token, write speed, the loss error of float16, step times.

Three measurements, one run:

* size: a decoder with a 128k vocabulary (V = 128,000; random weights, d_model 32) writes a k=32 cache
  of 16 rows x 64 tokens in both precisions; bytes per token are the shard files' sizes (headers
  included) over the cached tokens.
* the main job's tiny config (``configs/tiny.yaml``: byte vocabulary, 2x4 mesh of simulated CPU devices),
  its teacher pretrained for ``--pretrain-steps`` steps: cache write speed (teacher forward + top-k +
  encoding + files, tokens per second, after a warm-up call), then the same student trained ``--steps``
  steps three ways from the same batches: live teacher with ``LogitKD(top_k=k)``, from the float32 cache,
  from the float16 cache. Reported: the largest relative loss difference to the live run, and the median
  step time of each (each step waited for; reading the batch and its cached top-k included; the three
  runs step in turn, so machine load falls on all of them alike).

Run: ``python benchmarks/teacher_cache.py [--steps 30 --k 32]``; writes ``benchmarks/results/teacher_cache.md``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import tempfile
import time

from bench import harness

import meshdistill as md

md.simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshdistill import jobs  # noqa: E402
from meshdistill.teachers import cache as tc  # noqa: E402
from meshdistill.config import load_config  # noqa: E402
from meshdistill.strategies import LogitKD  # noqa: E402

RESULT = pathlib.Path(__file__).parent / "results" / "teacher_cache.md"


def size_at_128k(root: str, k: int) -> dict:
  """Bytes per token of a k-token cache of a V=128,000 teacher, per precision."""
  cfg = md.ModelConfig(vocab_size=128_000, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, mlp_hidden=64,
                       max_len=64)
  teacher = md.init_model(cfg, seed=0)
  rng = np.random.default_rng(0)
  stream = md.data.TokenStream(rng.integers(0, 128_000, 16 * 64 + 1).astype(np.int32), np.array([16 * 64 + 1]))
  packed = md.data.pack(stream, 64, 0)
  program = tc.TeacherTopK(teacher, k=k, temperature=1.0)
  identity = {"teacher": tc.teacher_identity(teacher), "data": {"rows": len(packed)}}
  out = {}
  for precision in ("float16", "float32"):
    path = os.path.join(root, f"v128k-{precision}")
    tc.write_cache(program, packed, path, identity=identity, precision=precision, rows_per_shard=len(packed),
                   batch_size=4)
    cache = tc.TeacherCache(path, verify=True)
    out[precision] = cache.bytes_per_token()
    if precision == "float16":  # the float16 error on these (real, if untrained) log-probabilities
      ref = program(packed.rows(np.arange(4))["inputs"])
      got = cache.rows(np.arange(4))
      out["f16_max_abs_logprob_err"] = float(np.max(np.abs(got["teacher_logprobs"] - np.asarray(ref.logprobs))))
      out["ids_exact"] = bool(np.array_equal(got["teacher_ids"], np.asarray(ref.indices)))
  out["bits"] = tc.id_bits(128_000)
  return out


def interleaved_steps(runs: dict, student, steps: int) -> dict:
  """Trains one student per entry of ``runs = {name: (distiller, data)}`` from the same batches, one step of
  each in turn (`bench.harness.interleave`: a loaded machine slows all alike); returns ``{name: (losses, median
  step seconds)}``. Reading the batch (and its cached top-k) counts in a step's time."""
  live = {}
  for name, (distiller, data) in runs.items():
    it = data.train_iterator()
    state, metrics = distiller.step(distiller.init_state(student), next(it))  # compile
    live[name] = {"distiller": distiller, "it": it, "state": state, "metrics": [metrics]}

  def stepper(entry: dict):
    def step(_):
      entry["state"], metrics = entry["distiller"].step(entry["state"], next(entry["it"]))
      jax.block_until_ready(metrics)
      entry["metrics"].append(metrics)  # read on the host after the timing

    return step

  timing = harness.interleave({name: stepper(e) for name, e in live.items()}, range(steps - 1))
  for entry in live.values():
    entry["it"].close()
  return {name: (np.array([float(m["loss"]) for m in e["metrics"]]), statistics.median(timing["times"][name]))
          for name, e in live.items()}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--k", type=int, default=32)
  p.add_argument("--pretrain-steps", type=int, default=100)
  args = p.parse_args()
  root = tempfile.mkdtemp(prefix="teacher-cache-bench-")
  os.environ.setdefault("MESHDISTILL_CACHE", os.path.join(root, "teachers"))
  size = size_at_128k(root, args.k)

  cfg = load_config("tiny", [f"run.run_dir={root}/run", f"pretrain.steps={args.pretrain_steps}",
                             "data.max_chars=100000", "data.seq_len=64", "train.batch_size=16",
                             "teacher.max_len=64", "student.max_len=64"])
  mesh = jobs.build_mesh(cfg)
  data = jobs.load_data(cfg)
  teacher, _ = jobs.obtain_teacher(cfg, data, mesh)
  tau = float(cfg.distill.value("temperature"))
  program = tc.TeacherTopK(teacher, k=args.k, temperature=tau, mesh=mesh)
  jax.block_until_ready(program(data.train.rows(np.arange(16))["inputs"]))  # compile
  identity = {"teacher": tc.teacher_identity(teacher), "data": tc.data_identity(data.train, data.tokenizer)}
  caches, write = {}, {}
  for precision in ("float32", "float16"):
    path = os.path.join(root, precision)
    t0 = time.perf_counter()
    tc.write_cache(program, data.train, path, identity=identity, precision=precision, rows_per_shard=256,
                   batch_size=16)
    seconds = time.perf_counter() - t0
    caches[precision] = tc.TeacherCache(path)
    write[precision] = (len(data.train) * data.train.seq_len / seconds, seconds, caches[precision].bytes_per_token())

  strategy = LogitKD(top_k=args.k, temperature=tau, alpha=float(cfg.distill.value("alpha")))
  student = md.init_model(cfg.student, seed=1, mesh=mesh)
  plan = {"live teacher (top-k in the step)": (md.Distiller(student, teacher, mesh=mesh, strategy=strategy), data)}
  for precision, cache in caches.items():
    plan[f"cache, {precision}"] = (md.Distiller(student, cache.spec(), mesh=mesh, strategy=strategy),
                                   tc.CachedTeacherData(data, cache))
  runs = interleaved_steps(plan, student, args.steps)
  want = runs["live teacher (top-k in the step)"][0]

  lines = [
      "# Offline top-k teacher cache",
      "",
      f"`python benchmarks/teacher_cache.py --steps {args.steps} --k {args.k} --pretrain-steps {args.pretrain_steps}` "
      f"on {platform.machine()} ({os.cpu_count()} CPU cores, 8 simulated devices, load average "
      f"{os.getloadavg()[0]:.1f} at the end: a shared machine), jax {jax.__version__}.",
      "",
      f"## Size at V = 128,000, k = {args.k}",
      "",
      f"ids packed to {size['bits']} bits; log-probabilities and the tail log-mass in the cache's precision. "
      "Bytes per token are shard file sizes (headers included) over cached tokens (16 rows x 64).",
      "",
      "| precision | bytes / token |",
      "|---|---|",
      f"| float16 (compact) | {size['float16']:.1f} |",
      f"| float32 (exact) | {size['float32']:.1f} |",
      "",
      f"float16 costs at most {size['f16_max_abs_logprob_err']:.2e} absolute error per log-probability here; "
      f"ids are exact ({size['ids_exact']}).",
      "",
      f"## Tiny config (byte vocabulary 264, 2x4 mesh, T=64, B=16), teacher pretrained {args.pretrain_steps} steps",
      "",
      "| cache | write tokens/s | write seconds | bytes / token |",
      "|---|---|---|---|",
  ]
  for precision, (tps, seconds, bpt) in write.items():
    lines.append(f"| {precision} | {tps:,.0f} | {seconds:.2f} | {bpt:.1f} |")
  lines += ["", f"Student trained {args.steps} steps from the same batches (LogitKD top_k={args.k}, tau={tau}):", "",
            "| teacher | median step ms | max rel loss diff vs live |", "|---|---|---|"]
  for name, (losses, step_s) in runs.items():
    diff = float(np.max(np.abs(losses - want) / np.abs(want)))
    lines.append(f"| {name} | {step_s * 1e3:.1f} | {diff:.2e} |")
  lines += ["", "As several processes (one cache writer each): `benchmarks/teacher_cache_processes.py`, results in "
            "`teacher_cache_processes.md`."]
  RESULT.parent.mkdir(parents=True, exist_ok=True)
  RESULT.write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
