"""The distillation step measured on this machine's chip, shared by the scripts that run on one (`tpu_step.py`,
`long_context.py`): one configuration of a pair built and timed (`measure`), its model FLOPs per token and the chip's
peak (MFU), a profile of its time by role, the splash blocks a setting names, the persistent compile cache, and what
every stored row carries about where it comes from (`stamp`: date, commit, command, chip, jax and libtpu versions)."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import gc
import glob
import gzip
import json
import os
import re
import subprocess
import tempfile
import time

from bench.chip_pairs import Setting, model_configs
from bench.results import libtpu_version

# where the profile's time went: the first source-file substring of an instruction's metadata names its role
ROLES = (("/losses/", "loss"), ("_chunked.py", "loss"), ("strategies/", "loss"), ("optax/", "optimizer"),
         ("train/optimizers.py", "optimizer"))


def use_splash_blocks(spec: str):
  """A context in which the splash kernel's blocks are ``spec`` for every program traced inside it
  (`meshdistill.models.splash_blocks`): ``default`` (the package's own), or ``q<N>-kv<N>-c<N>[-fused]``: query /
  key-value / key-value compute blocks of every pass, and the fused backward kernel (dq computed in the dkv pass)."""
  import contextlib
  import math

  from meshdistill.models import splash_blocks

  if spec == "default":
    return contextlib.nullcontext()
  parts = dict((p[0] if p[0] != "k" else "kv", p.lstrip("qkvc")) for p in spec.split("-") if p != "fused")
  q, kv, c = int(parts["q"]), int(parts["kv"]), int(parts.get("c", parts["kv"]))
  fused = spec.endswith("fused")

  def sizes(T, **_):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    bq, bkv, bc = math.gcd(T, q), math.gcd(T, kv), math.gcd(T, c)
    return splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bc, block_q_dkv=bq, block_kv_dkv=bkv,
                             block_kv_dkv_compute=bc, block_q_dq=None if fused else bq,
                             block_kv_dq=None if fused else bkv, use_fused_bwd_kernel=fused)

  return splash_blocks(sizes)


def peak_flops(device_kind: str) -> float | None:
  """The chip's peak bf16 FLOP/s, MFU's denominator: the planner's chip table (`meshdistill.planner.TPU_CHIPS`), the
  one copy of these numbers; None on a device it does not list."""
  from meshdistill.planner import chip_of_kind

  chip = chip_of_kind(device_kind)
  return None if chip is None else chip.peak_bf16_flops


def model_flops_per_token(cfg, seq: int, passes: int) -> float:
  """``passes`` x (2 N + causal attention) per token: the forward's model FLOPs once (teacher) or three times
  (student: forward, backward)."""
  import math

  import jax

  from meshdistill.models import abstract_params
  from meshdistill.planner._plan import _matmul_params

  _, target, _ = abstract_params(cfg.replace(scan_layers=False))
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(target))
  n = _matmul_params(cfg, total)
  attn = 0.0
  for layer in range(cfg.n_layers):
    window = cfg.layer_attention(layer)[0]
    keys = seq / 2 if window is None else min(window, seq / 2)
    attn += 4.0 * keys * cfg.n_heads * cfg.hd
  return passes * (2.0 * n + attn), n


def random_batch(rng, b: int, t: int, vocab: int) -> dict:
  import numpy as np

  x = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
  return {"inputs": x[:, :-1], "targets": x[:, 1:], "mask": np.ones((b, t), np.float32)}


def trace_roles(d, state, batch, steps: int, out_dir: str | None) -> dict:
  """Milliseconds per step by role (`ROLES`, the attention kernel, then op kinds) from a profiler trace of
  ``steps`` steps, and the 25 slowest instructions; ``state`` is consumed."""
  import jax

  from bench.op_kinds import describe, hlo_roles

  hlo = d.lower(state, batch).compile().as_text()
  roles = hlo_roles(hlo, ROLES)
  if out_dir:  # the profiled program's text: the trace's instruction names are this program's
    os.makedirs(out_dir, exist_ok=True)
    with gzip.open(os.path.join(out_dir, "step.hlo.txt.gz"), "wt") as f:
      f.write(hlo)

  def run():
    nonlocal state
    for _ in range(steps):
      state, metrics = d.step(state, batch)
    jax.block_until_ready(metrics)

  try:
    ops, processes = device_ops(run, out_dir)
  except FileNotFoundError as e:
    return {"error": str(e)}
  per_role = collections.Counter()
  per_op = collections.Counter()
  unknown = collections.Counter()
  for name, dur_ms in ops:
    ms = dur_ms / steps
    if name in roles:
      per_role[roles[name]] += ms
      per_op[name] += ms
    else:
      unknown[name] += ms
  top = per_op.most_common(25)
  what = describe(hlo, [name for name, _ in top])
  return {"ms": dict(per_role), "top": top, "top_roles": {n: roles[n] for n, _ in top},
          "top_hlo": {n: what.get(n, "") for n, _ in top}, "unmatched": unknown.most_common(10),
          "device_processes": processes[:10]}


def device_ops(run, out_dir: str | None = None) -> tuple[list[tuple[str, float]], list[str]]:
  """``(name, milliseconds)`` of every device op ``run()`` makes under `jax.profiler.trace` (the TPU's process: its
  pid's name names the TPU; events named after HLO instructions; every process where none is a TPU's), and the
  trace's process names. ``out_dir``: the trace is copied there as ``trace.json.gz``."""
  import jax

  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      run()
    paths = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
    if not paths:
      raise FileNotFoundError(f"no trace.json.gz under the profile directory ({os.listdir(tmp)})")
    trace = json.load(gzip.open(paths[0]))
    if out_dir:
      import shutil
      shutil.copy(paths[0], os.path.join(out_dir, "trace.json.gz"))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  pids = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M"
          and e.get("name") == "process_name"}
  tpu = {p for p, n in pids.items() if "TPU" in n or "/device:" in n}
  ops = [(e.get("name", ""), e.get("dur", 0.0) / 1e3) for e in events
         if e.get("ph") == "X" and (not tpu or e.get("pid") in tpu)]
  return ops, sorted(set(pids.values()))


def measure(pair: str, s: Setting, steps: int, profile: bool, out_dir: str | None, warmup: int = 2) -> dict:
  """One configuration of a pair on this machine's first device: models built with random weights, the step compiled
  (its memory analysis: ``program_bytes``, ``temp_bytes``, ``compiler_peak_bytes``), ``warmup`` steps (the first
  loads the program just compiled), then ``steps`` timed; ``step_s`` is their median. An exception (out of HBM at
  compile or run time) is the row's ``error``, not raised. ``profile``: a trace of 3 more steps by role."""
  import jax
  import numpy as np

  import meshdistill as md
  from meshdistill.train.memory import MemoryReport

  dev = jax.devices()[0]
  row = {"pair": pair, "setting": dataclasses.asdict(s), "label": s.label(), "device": dev.device_kind,
         "jax": jax.__version__, "steps": steps, "warmup": warmup}
  row["libtpu"] = libtpu_version()
  tcfg, scfg = model_configs(pair, s)
  mesh = md.make_mesh(data=1, tensor=1)
  t0 = time.perf_counter()
  teacher = md.init_model(tcfg, seed=0, mesh=mesh)
  student = md.init_model(scfg, seed=1, mesh=mesh)
  strategy = md.ChunkedLogitKD(temperature=2.0, alpha=0.5, chunk_size=s.chunk_size, loss_kernel=s.loss)
  d = md.Distiller(student, teacher, mesh=mesh, strategy=strategy, optimizer=s.optimizer(), micro_batch=s.micro_batch,
                   chunk_size="auto" if s.chunk == "auto" else None)
  if s.metrics == "light":  # the step the training loop runs on every step it does not log: the same update
    d = d.metrics_light()
  del teacher, student
  state = d.init_state()
  jax.block_until_ready(state)
  row["build_s"] = time.perf_counter() - t0
  gc.collect()
  # what the chip holds before the step's program is loaded (the state and the teacher's weights, nothing else)
  row["resident_bytes"] = (dev.memory_stats() or {}).get("bytes_in_use")
  rng = np.random.default_rng(0)
  batch = random_batch(rng, s.b, s.t, min(tcfg.vocab_size, scfg.vocab_size))
  # progress on stdout: a run stopped by a time limit shows how far it got
  say = lambda what: print(f"{pair} {s.label()}: {what}", flush=True)  # noqa: E731
  say(f"models and state built in {row['build_s']:.0f} s; compiling the step")
  try:
    if "auto" in (scfg.remat, s.chunk, s.mb):  # the Distiller decides on its first step; here before the measured
      t0 = time.perf_counter()                  # compile (`train.tuning`)
      tuned = d.decide_auto(state, batch)
      row["decide_s"] = time.perf_counter() - t0
      row["remat_chosen"] = d.student_cfg.remat
      row["auto"] = {"remat": tuned.chosen.remat, "micro_batch": tuned.chosen.micro_batch, "chunk": tuned.chosen.chunk,
                     "line": tuned.line(), "compiled": len(tuned.measured), "cached": tuned.cached}
      say(f"{tuned.line()} in {row['decide_s']:.0f} s")
    t0 = time.perf_counter()
    compiled = d.lower(state, batch).compile()
    row["compile_s"] = time.perf_counter() - t0
    say(f"compiled in {row['compile_s']:.0f} s; {warmup} warm-up step(s)")
    m = MemoryReport.of(compiled)
    row["program_bytes"], row["temp_bytes"], row["compiler_peak_bytes"] = m.total_bytes, m.temp_bytes, m.peak_bytes
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    row["xla_flops"] = float(cost.get("flops", -1)) if cost else None
    del compiled
    t0 = time.perf_counter()
    for _ in range(warmup):  # the jitted step compiles here (the persistent cache holds the program above)
      state, metrics = d.step(state, batch)
    jax.block_until_ready(metrics)
    row["warmup_s"] = time.perf_counter() - t0
    say(f"warm-up steps in {row['warmup_s']:.0f} s; timing {steps} steps")
    times = []
    for _ in range(steps):
      t0 = time.perf_counter()
      state, metrics = d.step(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t0)
    row["step_times"] = times
    row["loss"] = float(metrics["loss"])
  except Exception as e:  # noqa: BLE001 -- out of memory and other compile failures are results too
    row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    del state, d
    gc.collect()
    return row
  step_s = float(np.median(times))
  tokens = s.b * s.t
  ft, nt = model_flops_per_token(tcfg, s.t, 1)
  fs, ns = model_flops_per_token(scfg, s.t, 3)
  peak = peak_flops(dev.device_kind)
  row.update(step_s=step_s, tokens_per_s=tokens / step_s, n_teacher=nt, n_student=ns,
             model_flops_per_token=ft + fs, mfu=None if peak is None else (ft + fs) * tokens / step_s / peak)
  stats = dev.memory_stats() or {}
  row["peak_bytes"] = stats.get("peak_bytes_in_use")
  row["bytes_limit"] = stats.get("bytes_limit")
  if profile:
    try:
      row["profile"] = trace_roles(d, state, batch, 3, out_dir)
    except Exception as e:  # noqa: BLE001
      row["profile"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
  del state, d
  gc.collect()
  return row


def checkout_commit() -> str | None:
  """This checkout's HEAD commit (None where the folder is no git checkout or git is missing)."""
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                         capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def commit_or_exit(parser, given: str | None) -> str:
  """The commit of the code measured: ``given`` (``--commit``) or this checkout's HEAD; ``parser.error`` (exit 2,
  nothing measured) where there is neither or it is not 7 to 40 hex digits."""
  commit = given or checkout_commit()
  if not commit or not re.fullmatch(r"[0-9a-f]{7,40}", commit):
    parser.error(f"--commit {commit!r}: every row names the commit of the code it measured (7 to 40 hex digits); "
                 "this is no git checkout, so give --commit SHA")
  return commit


def use_compile_cache() -> None:
  """JAX's persistent compilation cache in ``MESHDISTILL_BENCH_CACHE`` (default under the temp folder), every
  program kept: `measure` compiles a step once for its memory analysis, then its first step loads that program."""
  import jax

  cache = os.environ.get("MESHDISTILL_BENCH_CACHE", os.path.join(tempfile.gettempdir(), "meshdistill-jax-cache"))
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def stamp(row: dict, commit: str, command: str) -> dict:
  """``row`` with where it comes from: today's date (UTC), the commit measured (7 digits), the command, and the chip,
  jax and libtpu versions where the row does not name them already."""
  import jax

  row.update(date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(), commit=commit[:7], command=command)
  if "device" not in row:  # asked only where missing: a row of the command line's runs names it (`bench.cli_run`)
    row["device"] = jax.devices()[0].device_kind
  row.setdefault("jax", jax.__version__)
  row.setdefault("libtpu", libtpu_version())
  return row
