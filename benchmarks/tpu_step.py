"""The distillation step on a real TPU chip: tokens/s, step time, MFU, HBM, and a profile of where the time goes.

Each pair is built as a user of the Python API would build it: preset shapes with random weights
(`meshdistill.planner.resolve_model`), ``md.init_model`` on a 1x1 mesh, the teacher's weights stored in bfloat16,
the student's in float32 (AdamW, ``md.default_optimizer``), both computing in bfloat16 with scanned layers (the
setting's ``scan``: ``both``; ``teacher`` or ``student``: that model's only; ``none``: every layer unrolled), and
``md.Distiller`` with ``ChunkedLogitKD`` (forward KL at temperature 2, alpha 0.5). The batch is random tokens.

Model FLOPs (the MFU numerator) per token: ``2 N_teacher + 6 N_student`` (N: the parameters that take part in a
token's matmuls, the LM head included, the input embedding lookup not: `meshdistill.planner._plan._matmul_params`)
plus causal attention, ``2 T H K`` per layer forward (``q.k`` and ``p.v`` over ``T / 2`` keys on average; a sliding
layer over ``min(window, T / 2)``), once for the teacher and three times for the student. Rematerialised work is
not counted (it is not model FLOPs). Peak: 197 TFLOP/s bf16 per v5e chip.

Memory: ``peak`` is the process's ``peak_bytes_in_use`` on the chip after the configuration ran (a process
measures its configurations in order, so a later, smaller one shows the earlier peak; each row also carries
``program``, the compiled step's own arguments + outputs + temporaries, its donated buffers counted once, and
``resident_bytes``, what the chip holds before that program loads: the train state and the teacher's weights, which
the program's arguments should account for in full).

Run on a TPU machine (docs/tpu.md says how to install there)::

    python benchmarks/tpu_step.py --pair qwen3 --config b=8,remat=full,chunk=1024,attn=splash --profile
    python benchmarks/tpu_step.py --pair qwen3 --config b=8,remat=full --config b=16,remat=dots_no_batch ...
    python benchmarks/tpu_step.py --pair qwen3 --systems generate,tunix-generate --gen-batches 1,8,64
    python benchmarks/tpu_step.py --render     # benchmarks/results/tpu_step.md from the stored rows

Sampling (``--systems generate,generate-unrolled,tunix-generate``): meshdistill's cached sampler (the student built
with scanned layers as it trains, or ``generate-unrolled``: built unrolled; both decode the layers unrolled, one KV
cache each) and tunix's ``Sampler``
(`bench.tunix_generate`) with the pair's student shape, float32 weights computing in bfloat16, temperature 1; each
batch's first call compiles (``first_call_s``), its tokens/s is ``batch * new`` over the median of `GEN_CALLS`
calls after it. Variants of meshdistill's decoding, each measured in turn in the same process (rows say which):
``--gen-loops 4,8`` the number of decoding loops (`meshdistill.models.generate.DECODE_STAGES` and
`CACHE_BOUND_STAGES`, both replaced for the measurement, and `MIN_STAGE_TOKENS` lowered to one token),
``--gen-programs default,selective`` the compilation (`generate.decoding_program`'s choice by default;
``selective``: the cache-bound program, `generate.SELECTIVE_MSA`, at every batch, ``default``: at none; a TPU's),
``--gen-kernels xla,1,2`` the decoding attention (``xla``: no decoding kernel; a number: the kernel's MiB of keys and
values a grid step, `meshdistill.models._decode_attention.STEP_BYTES`).

Rows are appended to ``--out`` (default ``benchmarks/results/tpu_step.jsonl``), each with its date, the commit of the
code measured (``--commit``, default this checkout's HEAD: a run without either is refused before anything is
measured), its command, and the chip, jax and libtpu versions; ``--render`` prints them beside every row of
``tpu_step.md`` and moves a configuration's older rows to its appendix.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import pathlib
import shlex
import sys
import tempfile
import time
from typing import Iterator

from bench.chip_pairs import PAIRS, TINY, Setting, model_configs, plan_overrides  # noqa: F401 -- the pairs
from bench.chip_step import (ROLES, checkout_commit, commit_or_exit, measure, model_flops_per_token,  # noqa: F401
                             peak_flops, random_batch, stamp, use_compile_cache, use_splash_blocks)
from bench.cli_run import CLI_SYSTEMS, measure_cli

RESULTS = pathlib.Path(__file__).parent / "results"
JSONL = RESULTS / "tpu_step.jsonl"

# the step a row measured (`Setting.metrics`): `Distiller.step`, or the one the training loop runs between logged steps
STEP_KIND = {"full": "full metrics", "light": "metrics-light"}


def measure_plain(pair: str, s: Setting, steps: int) -> dict:
  """The hand-written step (`bench.plain_step`) on the same models and batch: step time and peak."""
  import jax
  import numpy as np

  import meshdistill as md
  from bench.plain_step import make_plain_step

  tcfg, scfg = model_configs(pair, s)
  row = {"pair": pair, "system": "plain", "setting": dataclasses.asdict(s), "label": s.label(), "steps": steps}
  teacher, student = md.init_model(tcfg, seed=0), md.init_model(scfg, seed=1)
  step, params, opt_state, t_params = make_plain_step(teacher, student, s.optimizer(), temperature=2.0,
                                                      alpha=0.5, chunk=s.chunk_size)
  del teacher, student
  batch = {k: jax.numpy.asarray(v) for k, v in random_batch(np.random.default_rng(0), s.b, s.t,
                                                             min(tcfg.vocab_size, scfg.vocab_size)).items()}
  try:
    times = []
    for i in range(steps + 2):
      t0 = time.perf_counter()
      params, opt_state, loss = step(params, opt_state, t_params, batch)
      jax.block_until_ready(loss)
      if i >= 2:
        times.append(time.perf_counter() - t0)
    row.update(step_s=float(np.median(times)), step_times=times, loss=float(loss),
               tokens_per_s=s.b * s.t / float(np.median(times)))
  except Exception as e:  # noqa: BLE001
    row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
  row["peak_bytes"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  del params, opt_state, t_params
  gc.collect()
  return row


def measure_tunix(pair: str, settings: list[Setting], steps: int) -> Iterator[dict]:
  """tunix's DistillationTrainer (its two programs) on the pair's tunix models, bfloat16 weights, splash attention
  where tunix offers it (Qwen3). Settings that differ only in batch share one build of the models (minutes on the
  chip's host); each batch gets its own trainer. Yields each row as it is measured."""
  from bench import tunix_step

  names = {"qwen3": ("qwen3-1.7b", "qwen3-0.6b"), "llama": ("llama3.2-1b", "llama3.2-1b")}
  if pair not in names:
    for s in settings:
      yield {"pair": pair, "system": "tunix", "label": s.label(), "error": f"no tunix model pair for {pair!r}"}
    return
  tunix_step.MODELS.setdefault("qwen3-1.7b", ("qwen3", "qwen3_1p7b"))
  layers = PAIRS[pair][2]
  groups: dict[Setting, list[Setting]] = {}
  for s in settings:
    groups.setdefault(dataclasses.replace(s, b=0), []).append(s)
  for group in groups.values():
    s0 = group[0]
    outs = tunix_step.run_steps(*names[pair], tuple(s.b for s in group), s0.t, steps, student_layers=layers,
                                student_remat="decoder", flash=s0.attn == "splash")
    for s, out in zip(group, outs):
      yield {"pair": pair, "system": "tunix", "setting": dataclasses.asdict(s), "label": s.label(), "steps": steps,
             **out, **({"tokens_per_s": s.b * s.t / out["step_s"]} if "step_s" in out else {})}


GEN_CALLS = 3  # timed calls of each sampler per batch, after the first (compiling) call; the row keeps the median


def _gen_row(pair: str, system: str, b: int, prompt: int, new: int) -> dict:
  return {"pair": pair, "system": system, "batch": b, "prompt": prompt, "new": new}


@contextlib.contextmanager
def decoding_variant(loops: int | None = None, program: str = "auto", kernel: str = "auto"):
  """`meshdistill.models.generate` decoding in ``loops`` loops (as many as there are new tokens at most; None: its
  `DECODE_STAGES`, or `CACHE_BOUND_STAGES` in the cache-bound program, of `MIN_STAGE_TOKENS` tokens or more each)
  with ``program``'s compilation (``auto``: `decoding_program`'s choice; ``selective``: the cache-bound program,
  `SELECTIVE_MSA`, at every batch; ``default``: at none) and ``kernel``'s attention (``auto``: the package's;
  ``xla``: no decoding kernel, `_decode_attention.usable` false; a number: the kernel reading that many MiB of keys
  and values a grid step, its `STEP_BYTES`), the modules as they were afterwards. The compiled programs are dropped
  on the way in and out: a program traced under one variant is never run under another."""
  from meshdistill.models import _decode_attention
  from meshdistill.models import generate as gen

  if program not in GEN_PROGRAMS:
    raise ValueError(f"decoding program {program!r}: choose from {', '.join(GEN_PROGRAMS)}")
  if loops is not None and (isinstance(loops, bool) or not isinstance(loops, int) or loops < 1):
    raise ValueError(f"decoding loops {loops!r}: a positive integer (e.g. 4)")
  step_mib = kernel_mib(kernel)
  saved = gen.DECODE_STAGES, gen.CACHE_BOUND_STAGES, gen.MIN_STAGE_TOKENS, gen.cache_bound
  saved_kernel = _decode_attention.usable, _decode_attention.STEP_BYTES
  drop = lambda: [f.clear_cache() for f in (gen._generate_jit, gen._generate_jit_cache_bound)]  # noqa: E731
  drop()
  try:
    if loops is not None:
      gen.DECODE_STAGES = gen.CACHE_BOUND_STAGES = loops
      gen.MIN_STAGE_TOKENS = 1  # the loops asked for, however few tokens each decodes
    if program != "auto":
      gen.cache_bound = lambda *a, **k: program == "selective"
    if kernel == "xla":
      _decode_attention.usable = lambda *a, **k: False
    elif step_mib is not None:
      _decode_attention.STEP_BYTES = int(step_mib * 2**20)
    yield
  finally:
    gen.DECODE_STAGES, gen.CACHE_BOUND_STAGES, gen.MIN_STAGE_TOKENS, gen.cache_bound = saved
    _decode_attention.usable, _decode_attention.STEP_BYTES = saved_kernel
    drop()


def kernel_mib(kernel: str) -> float | None:
  """The MiB a grid step of the decoding kernel reads in `decoding_variant`'s ``kernel`` (None for ``auto`` and
  ``xla``); a ValueError naming what would do for anything else."""
  if kernel in ("auto", "xla"):
    return None
  try:
    mib = float(kernel)
  except (TypeError, ValueError):
    mib = 0.0
  if not 0 < mib <= 8:
    raise ValueError(f"decoding kernel {kernel!r}: auto, xla (no kernel) or the MiB of keys and values a grid step "
                     "reads, in (0, 8] (e.g. 2)")
  return mib


def measure_generation(pair: str, batches: tuple[int, ...], prompt: int, new: int,
                       system: str = "generate", loops: int | None = None, program: str = "auto",
                       kernel: str = "auto") -> list[dict]:
  """Cached sampling (`meshdistill.models.generate`, the on-policy path's sampler) with the pair's student as it
  trains (float32 weights, bfloat16 compute, temperature 1, no filters): tokens/s per batch size beside the
  HBM-bandwidth limit (weights and the KV cache read once per decoded token). ``first_call_s``: the first call
  (compiles); ``seconds``: the median of `GEN_CALLS` calls after it. ``system``: ``generate`` (the student's layers
  scanned, as `tpu_step` trains it) or ``generate-unrolled`` (``scan_layers=False``); both decode the layers unrolled
  with one KV cache per layer (`meshdistill.models._scan.layer_blocks`). ``loops`` / ``program`` / ``kernel``: a
  variant of the decoding (`decoding_variant`), stored in each row where named."""
  import jax
  import numpy as np

  import meshdistill as md
  from meshdistill.models.generate import SamplingConfig, generate

  dev = jax.devices()[0]
  if program == "selective" and dev.platform != "tpu":
    raise ValueError(f"decoding program 'selective' compiles with a libtpu option: a TPU's, not {dev.platform}'s")
  bandwidth = {"TPU v5 lite": 819e9}.get(dev.device_kind)
  # attention `auto`, the model's default: decoding through `models._decode_attention` on a TPU
  _, scfg = model_configs(pair, Setting(attn="auto", remat="none", scan=GEN_LAYERS[system]))
  scfg = scfg.replace(max_len=prompt + new)
  model = md.init_model(scfg, seed=1)
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx_state(model)))
  rows = []
  with decoding_variant(loops, program, kernel):  # the variant named, if any
    for b in batches:
      cfg = SamplingConfig(max_new_tokens=new, temperature=1.0)
      rng = np.random.default_rng(b)
      prompts = rng.integers(0, scfg.vocab_size, (b, prompt)).astype(np.int32)
      mask = np.ones((b, prompt), bool)
      row = _gen_row(pair, system, b, prompt, new)
      if loops is not None:
        row["loops"] = loops
      if program != "auto":
        row["program"] = program
      if kernel != "auto":
        row["kernel"] = kernel
      try:
        t0 = time.perf_counter()
        jax.block_until_ready(generate(model, prompts, mask, jax.random.key(0), cfg))
        first = time.perf_counter() - t0
        times = []
        for call in range(GEN_CALLS):
          t0 = time.perf_counter()
          jax.block_until_ready(generate(model, prompts, mask, jax.random.key(call + 1), cfg))
          times.append(time.perf_counter() - t0)
        seconds = float(np.median(times))
        kv_per_token = 2 * scfg.n_layers * scfg.n_kv_heads * scfg.hd * 2  # k and v, bfloat16, per cached position
        mean_len = prompt + new / 2
        bytes_per_step = weights + b * kv_per_token * mean_len
        limit = None if bandwidth is None else b * bandwidth / bytes_per_step
        row.update(seconds=seconds, times=times, first_call_s=first, tokens_per_s=b * new / seconds,
                   bandwidth_limit_tokens_per_s=limit, weight_bytes=weights, device=dev.device_kind,
                   dtype="bfloat16", param_dtype="float32")
      except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      rows.append(row)
  return rows


def measure_tunix_generation(pair: str, batches: tuple[int, ...], prompt: int, new: int) -> list[dict]:
  """tunix's sampler (`bench.tunix_generate`) on tunix's Qwen3 at the shape of the pair's student, with the dtype
  policy, sampling, lengths and timing of `measure_generation`; a batch tunix cannot run is a row with its error."""
  import jax

  from bench import tunix_generate

  _, scfg = model_configs(pair, Setting(attn="xla", remat="none"))
  rows = tunix_generate.sample_rows(scfg, batches, prompt, new, calls=GEN_CALLS)
  device = jax.devices()[0].device_kind
  return [{**_gen_row(pair, "tunix-generate", r["batch"], prompt, new), "device": device, **r} for r in rows]


def nnx_state(model):
  from flax import nnx

  return nnx.state(model)


def measure_plan(pair: str, s: Setting) -> dict:
  """``md.plan`` for this machine's chips (``devices="local"``) at the setting: estimated step and memory."""
  import meshdistill as md

  tcfg, scfg = model_configs(pair, s)
  t0 = time.perf_counter()
  try:
    p = md.plan(tcfg, scfg, devices="local", mesh=(1, 1), batch=s.b, seq=s.t, chunk_size=s.chunk_size, remat=s.remat,
                suggest=0, overrides=plan_overrides(s))
    d = p.to_dict() if hasattr(p, "to_dict") else {}
  except Exception as e:  # noqa: BLE001
    return {"pair": pair, "system": "plan", "label": s.label(), "error": f"{type(e).__name__}: {str(e)[:600]}"}
  return {"pair": pair, "system": "plan", "label": s.label(), "setting": dataclasses.asdict(s),
          "plan": d, "text": str(p)[:4000], "plan_seconds": time.perf_counter() - t0}


def summary(row: dict) -> str:
  if "error" in row:
    what = row.get("label") or (f"batch {row['batch']}" if "batch" in row else "")
    return f"{row['pair']} {row.get('system', 'meshdistill')} {what}: {row['error'][:300]}"
  if row.get("system") in ("plain", "tunix"):
    return (f"{row['pair']} {row['system']} {row['label']}: {row['step_s'] * 1e3:.0f} ms/step, "
            f"{row['tokens_per_s']:.0f} tok/s, peak {(row.get('peak_bytes') or 0) / 2**30:.2f} GiB")
  if row.get("system") in GEN_SYSTEMS:
    return (f"{row['pair']} {sampler_label(row)} batch {row['batch']} ({row['prompt']} + {row['new']} tokens): "
            f"{row['tokens_per_s']:.0f} tok/s, first call {row['first_call_s']:.1f} s (bandwidth limit "
            f"{generation_limit(row):.0f} tok/s at 819 GB/s)")
  if row.get("system") in ("cli", "cli-scan"):
    return (f"{row['pair']} {row['system']} {row['label']}: {row['tokens_per_s']:.0f} tok/s, "
            f"{row['command_s']:.0f} s in all; "
            f"{' | '.join(row.get('log_tail', []))[:1500]}")
  if row.get("system") == "plan":
    return f"{row['pair']} plan {row['label']}: {row['text'][:1500]}"
  gib = 2**30
  return (f"{row['pair']} {row['label']}: {row['step_s'] * 1e3:.0f} ms/step, {row['tokens_per_s']:.0f} tok/s, "
          f"MFU {100 * (row['mfu'] or 0):.1f}%, program {row['program_bytes'] / gib:.2f} GiB, peak "
          f"{(row['peak_bytes'] or 0) / gib:.2f} GiB, compile {row['compile_s']:.0f} s")


GIB = 2**30

# the columns every table row ends with: where it comes from (the script stores them in each row it appends)
PROVENANCE = ("date", "commit", "chip", "jax", "libtpu", "command")


def provenance(r: dict) -> str:
  """The cells of `PROVENANCE` for row ``r`` (empty where the row lacks a field, which the results test refuses)."""
  command = r.get("command") or ""
  cells = (r.get("date"), r.get("commit") or r.get("code"), r.get("device"), r.get("jax"), r.get("libtpu"),
           f"`{command}`".replace("|", "\\|") if command else "")
  return " | ".join(str(c or "") for c in cells) + " |"


def _head(*columns: str, right: int = 0) -> list[str]:
  """A table's header and separator: ``columns`` (the last ``right`` of them right-aligned), then `PROVENANCE`."""
  aligns = ["---"] * (len(columns) - right) + ["---:"] * right + ["---"] * len(PROVENANCE)
  return ["| " + " | ".join((*columns, *PROVENANCE)) + " |", "|" + "|".join(aligns) + "|"]


def config_key(r: dict) -> tuple:
  """What a row measured, without its splash blocks: a later row of the same key supersedes it (blocks tried at one
  configuration are variants of it, superseded together)."""
  s = dict(r.get("setting") or {})
  s.pop("blocks", None)
  s.pop("only", None)  # which systems measured a setting is not what they measured
  defaults = {"mu": "float32", "metrics": "full", "scan": "both", "dtypes": "bf16"}
  return (r["pair"], r.get("system", "meshdistill"), r.get("batch"), r.get("prompt"), r.get("new"),
          tuple(sorted({**defaults, **s}.items())))


def current_and_superseded(rows: list[dict]) -> tuple[list[dict], list[dict]]:
  """``rows`` (in file order) split into the current ones and the superseded: a configuration's current rows are
  those its newest command measured (its newest row and the variants of other splash blocks that command measured
  beside it); every older row of it is superseded (a retry of the same setting too), and so is every row of an
  earlier checkout kept for a before/after (``code``)."""
  newest = {}
  for r in rows:
    if not r.get("code"):
      newest[config_key(r)] = r
  current, superseded = [], []
  for r in rows:
    last = newest.get(config_key(r))
    same = last is not None and not r.get("code") and (r is last or (
        r.get("label") != last.get("label") and all(r.get(k) == last.get(k) for k in ("commit", "command", "tag"))))
    (current if same else superseded).append(r)
  return current, superseded


def _order(r: dict) -> tuple:
  s = r.get("setting") or {}
  return (list(PAIRS).index(r["pair"]) if r["pair"] in PAIRS else 99, s.get("b", r.get("batch", 0)), s.get("t", 0),
          s.get("scan", "both"), s.get("remat", ""), str(s.get("chunk", 0)).zfill(5), s.get("mu", ""),
          s.get("metrics", ""),
          s.get("attn", ""), s.get("blocks", ""), r.get("date", ""))


def _why(error: str) -> str:
  return "out of HBM" if "RESOURCE_EXHAUSTED" in error else " ".join(error[:60].replace("|", "/").split())


def steps_table(steps: list[dict], key=_order) -> list[str]:
  """One row per step measured (or refused), in ``key``'s order."""
  out = _head("pair", "batch x seq", "student remat", "loss chunk", "attention (splash blocks)", "AdamW first moment",
              "scanned layers", "step", "ms / step", "tokens/s", "MFU", "program GiB", "result")
  # right-aligned: the numbers (the loss chunk and the four measured columns)
  out[1] = "|---|---|---|---:|---|---|---|---|---:|---:|---:|---:|---|" + "---|" * len(PROVENANCE)
  for r in sorted(steps, key=key):
    s = r["setting"]
    attn = s["attn"] + (f" ({s.get('blocks')})" if s["attn"] == "splash" else "")
    if s.get("dtypes") == "auto":  # the models' defaults: dtype and param_dtype auto too
      attn += ", dtypes auto"
    if s.get("loss", "xla") != "xla":  # the chunked loss's values and gradient in the one-read kernel
      attn += f", loss kernel {s['loss']}"
    remat = s['remat'] + (f" -> {r['remat_chosen']}" if r.get('remat_chosen') else '')  # auto: what it chose
    chunk = s['chunk'] if s['chunk'] != "auto" else f"auto -> {(r.get('auto') or {}).get('chunk', '?')}"
    rows = f"{s['b']} x {s['t']}"
    if s.get("mb", "whole") != "whole":  # micro-batches (gradient accumulation): rows per forward and backward
      rows += f" ({s['mb']}" + (f" -> {r['auto']['micro_batch']}" if s["mb"] == "auto" and r.get("auto") else "") + \
          " rows a pass)"
    head = (f"| {r['pair']} | {rows} | {remat} | {chunk} | {attn} | {s.get('mu', 'float32')} | "
            f"{s.get('scan', 'both')} | {STEP_KIND[s.get('metrics', 'full')]}")
    if "error" in r:
      prog = f"{r['program_bytes'] / GIB:.2f}" if r.get("program_bytes") else ""
      out.append(f"{head} | | | | {prog} | {_why(r['error'])} | {provenance(r)}")
      continue
    out.append(f"{head} | {r['step_s'] * 1e3:.0f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
               f"{r['program_bytes'] / GIB:.2f} | ran | {provenance(r)}")
  return out


def pairs_table(steps: list[dict]) -> list[str]:
  """Each pair's fastest current configuration (tokens/s) and what the pair is."""
  best = {}
  for r in steps:
    if "step_s" in r and (r["pair"] not in best or r["tokens_per_s"] > best[r["pair"]]["tokens_per_s"]):
      best[r["pair"]] = r
  out = _head("pair", "teacher -> student", "matmul parameters (teacher, student)", "fastest configuration",
              "ms / step", "tokens/s", "MFU", right=3)
  for pair, r in sorted(best.items(), key=lambda kv: _order(kv[1])):
    teacher, student, layers = PAIRS[pair]
    s = r["setting"]
    what = (f"{s['b']} x {s['t']}, remat {s['remat']}, chunk {s['chunk']}, AdamW first moment {s.get('mu', 'float32')}"
            f", layers scanned: {s.get('scan', 'both')}")
    params = ("n/a" if r.get("n_teacher") is None else
              f"{r['n_teacher'] / 1e9:.2f} B, {r['n_student'] / 1e9:.3f} B")
    out.append(f"| {pair} | {teacher} -> {layers}-layer {student} | {params} | {what} | {r['step_s'] * 1e3:.0f} | "
               f"{r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {provenance(r)}")
  return out


def profile_table(rows: list[dict], key=_order) -> list[str]:
  out = _head("pair", "setting", *PROFILE_ROLES, right=len(PROFILE_ROLES))
  for r in sorted(rows, key=key):
    ms = r["profile"]["ms"]
    total = sum(ms.values())
    cells = " | ".join(f"{ms.get(k, 0):.0f} ({100 * ms.get(k, 0) / total:.0f}%)" for k in PROFILE_ROLES)
    out.append(f"| {r['pair']} | {r['label']} | {cells} | {provenance(r)}")
  return out


def plan_table(plans: list[dict], steps: list[dict]) -> list[str]:
  """Each plan on the chip beside the step measured at its setting (``steps`` in file order: the newest row of the
  plan's commit and setting, else of its setting on any commit; the package's splash blocks where the plan's were not
  measured)."""
  out = _head("pair", "setting", "measured ms", "roofline ms", "calibrated ms (band; source)", "measured / calibrated",
              "measured program GiB", "planned GiB", "measured compiler peak GiB", "planned compiler peak GiB",
              right=8)
  for r in plans:
    t, mem = r["plan"]["time"], r["plan"]["memory"]
    cal = t.get("calibrated") or {}
    label = r["label"].rsplit(",blocks=", 1)[0]
    meas = [m for m in steps if m.get("label", "").rsplit(",blocks=", 1)[0] == label and "step_s" in m
            and m["pair"] == r["pair"]]
    if not meas:
      continue
    exact = [x for x in meas if x.get("label") == r["label"]]
    m = ([x for x in exact if x.get("commit") == r.get("commit")] or exact or meas)[-1]
    peak, planned_peak = m.get("compiler_peak_bytes"), mem.get("compiler_peak")
    peaks = " | ".join("n/a" if not x else f"{x / GIB:.2f}" for x in (peak, planned_peak))
    out.append(f"| {r['pair']} | {r['label']} | {m['step_s'] * 1e3:.0f} | "
               f"{t['step_s'] * 1e3:.0f} | {cal.get('step_s', 0) * 1e3:.0f} ({cal.get('low_s', 0) * 1e3:.0f}-"
               f"{cal.get('high_s', 0) * 1e3:.0f}; {cal.get('source', 'n/a')}) | {m['step_s'] / cal['step_s']:.2f} | "
               f"{m['program_bytes'] / GIB:.2f} | {mem['total'] / GIB:.2f} | {peaks} | {provenance(r)}")
  return out


def render(jsonl: str = str(JSONL), md_path: str = str(RESULTS / "tpu_step.md")) -> str:
  """``tpu_step.md``'s tables from the stored rows: one table per question (steps, pairs, side by side, profiles,
  sampling, the planner), each row ending with its date, commit, chip, jax, libtpu and command; a configuration's
  older rows (`current_and_superseded`) in an appendix by date. The notes written below the tables' marker are
  kept."""
  from bench.results import write_keeping_notes

  rows = []
  if os.path.isfile(jsonl):
    with open(jsonl, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
  current, superseded = current_and_superseded(rows)

  def kind(rs, *systems):
    return [r for r in rs if r.get("system", "meshdistill") in systems]

  def traced(r):
    return isinstance(r.get("profile"), dict) and "ms" in r["profile"]

  steps = kind(current, "meshdistill")
  out = ["# The distillation step on a TPU v5e chip", "",
         "Measured by `benchmarks/tpu_step.py` on one TPU chip; the rows are in `tpu_step.jsonl`, the tables are "
         "`python benchmarks/tpu_step.py --render`. Every row ends with the date it was measured, the commit of the "
         "code it ran, the chip, the jax and libtpu versions and the command (run from the checkout's root on the "
         "chip; `$OLD`: a checkout of the row's commit, `$OUT`: a folder for traces). Each table holds the newest "
         "measurement of each configuration; older ones are in the appendix, by date. Model FLOPs and the memory "
         "columns are defined in the script's docstring (MFU against 197 TFLOP/s bf16); the notes below the tables "
         "say what the rows show.", "",
         "## Steps: time, throughput and memory of each configuration", ""]
  out += steps_table(steps)
  out += ["", "## Pairs: each pair's fastest configuration", ""]
  out += pairs_table(steps)
  out += cli_section(kind(current, "cli", "cli-scan"), steps)
  out += side_by_side_section(kind(rows, "meshdistill", "plain", "tunix"), peers=kind(current, "plain", "tunix"))
  # a configuration's newest trace stays while later rows of it went untraced
  profiled, old_profiles = current_and_superseded([r for r in kind(rows, "meshdistill") if traced(r)])
  if profiled:
    out += ["", "## Profiles: device time per step by role (ms, from a `jax.profiler` trace)", ""]
    out += profile_table(profiled)
  out += generation_section(kind(current, *GEN_SYSTEMS))
  plans = [r for r in kind(current, "plan") if "plan" in r]
  if plans:
    out += ["", "## The planner on the chip (`md.plan(..., devices=\"local\")`, run there)", "",
            "Each plan compiled the step on the chip itself; its calibrated figure is the chip source of the row's "
            "commit (`plan_calibration.md` holds the current source against every measured configuration). "
            "Measured: the newest row of the same setting in the steps table.", ""]
    out += plan_table(plans, kind(rows, "meshdistill"))
  if superseded or old_profiles:
    out += ["", "## Appendix: superseded rows, by date", "",
            "Rows a newer measurement of the same configuration replaced, and rows of a checkout without a change, "
            "measured beside the change for a before / after (their commit is that checkout).", ""]
    old = sorted(superseded, key=lambda r: r.get("date", ""))  # stable: the file's order within a day
    old_steps = kind(old, "meshdistill")
    if old_steps:
      out += ["### Steps", ""] + steps_table(old_steps, key=lambda r: r.get("date", ""))
    out += side_by_side_section(kind(rows, "meshdistill", "plain", "tunix"), superseded=True,
                                peers=kind(old, "plain", "tunix"))
    if old_profiles:
      out += ["", "### Profiles", ""] + profile_table(old_profiles, key=lambda r: r.get("date", ""))
    out += generation_section(kind(old, *GEN_SYSTEMS), heading="### Sampling")
    old_plans = [r for r in kind(old, "plan") if "plan" in r]
    if old_plans:
      out += ["", "### The planner on the chip", ""] + plan_table(old_plans, kind(rows, "meshdistill"))
  text = "\n".join(out) + "\n"
  write_keeping_notes(md_path, text)
  return text


def cli_section(cli: list[dict], steps: list[dict]) -> list[str]:
  """The command line's rows (`bench.cli_run`) beside the fastest `Distiller` row of their pair (tokens/s)."""
  if not cli:
    return []
  out = ["", "## Through the command line: `meshdistill distill` with shapes, batch and sequence only", "",
         "The teacher a Hugging Face directory (the pair's teacher with random weights, bfloat16), the student given "
         "by its shape keys, the setting's batch and sequence, everything else at the config's defaults "
         "(`bench/cli_run.py` writes the config); tokens/s: the training loop's own, the median of its logged "
         "windows after the two that compile. *fastest step row*: the steps table's fastest row of the pair.", ""]
  out += _head("pair", "batch x seq", "named besides shapes", "tokens/s", "fastest step row (tokens/s)",
               "of the fastest", "command s", "result")
  for r in sorted(cli, key=lambda r: (r["pair"], r["label"], r["system"])):
    best = max((x["tokens_per_s"] for x in steps if x["pair"] == r["pair"] and x.get("tokens_per_s")), default=None)
    named = "scan_layers" if r["system"] == "cli-scan" else "nothing"
    shape = f"{r['setting']['b']} x {r['setting']['t']}"
    if "error" in r:
      out.append(f"| {r['pair']} | {shape} | {named} | | | | | {_why(r['error'])} | {provenance(r)}")
      continue
    share = f"{100 * r['tokens_per_s'] / best:.1f}%" if best else ""
    fastest = f"{best:,.0f}" if best else ""
    out.append(f"| {r['pair']} | {shape} | {named} | {r['tokens_per_s']:,.0f} | {fastest} | {share} | "
               f"{r['command_s']:.0f} | ran | {provenance(r)}")
  return out


# what each system of the side by side ran (its configuration; tunix's is its logit-distillation example's)
SIDE_CONFIG = {
    "meshdistill": "`Distiller` + `ChunkedLogitKD` (T 2, alpha 0.5), scanned layers, the row's remat and chunk, "
                   "splash attention, bf16 teacher, f32 student, AdamW",
    "plain": "`bench/plain_step.py`: the same decoders, KL and AdamW in one `jax.jit`, the loss in a checkpointed "
             "scan over 1024-token chunks",
    "tunix": "tunix 0.1.7 `DistillationTrainer` + `LogitStrategy` (T 2, alpha 0.5), `tunix.models.qwen3` with "
             "splash attention, bf16 weights, optax AdamW, student remat `decoder` (its example's configuration)",
}


def _spread(r: dict) -> str:
  """(slowest - fastest) / fastest of a row's timed steps, or why there is none."""
  t = r.get("step_times")
  return f"{100 * (max(t) / min(t) - 1):.2f}%" if t else "not recorded"


def _side_setting(r: dict) -> str:
  """A side-by-side row's configuration in a few words: remat, loss chunk, micro-batch, attention, and what ``auto``
  chose where the row records it (tunix: its own configuration, `SIDE_CONFIG`)."""
  s, auto = r["setting"], r.get("auto") or {}
  if r.get("system") == "tunix":
    return "its example's: student remat decoder, splash attention"
  remat = s["remat"] + (f" -> {r['remat_chosen']}" if r.get("remat_chosen") else "")
  chunk = str(s["chunk"]) + (f" -> {auto['chunk']}" if s["chunk"] == "auto" and "chunk" in auto else "")
  words = [f"remat {remat}", f"chunk {chunk}"]
  if s.get("mb", "whole") != "whole":
    words.append(f"micro-batch {s['mb']}" + (f" -> {auto['micro_batch']}" if "micro_batch" in auto else ""))
  words.append(f"attention {s['attn']}" + (", dtypes auto" if s.get("dtypes") == "auto" else ""))
  if s.get("loss", "xla") != "xla":
    words.append(f"loss kernel {s['loss']}")
  return ", ".join(words)


def side_by_side_section(rows: list[dict], superseded: bool = False, peers: list[dict] | None = None) -> list[str]:
  """The peers' table: each command that measured the plain step or tunix (``peers``, default: those in ``rows``),
  with every meshdistill row of that command (from ``rows``: the systems ran one after another in one process) and
  the spread of each row's timed steps. Each row's ratio is its tokens/s over the best meshdistill row of its command
  (best against best; another command's meshdistill row is never the reference). ``superseded``: the appendix's form
  (a sub-heading, no configurations)."""
  peers = [r for r in rows if r.get("system") in ("plain", "tunix")] if peers is None else peers
  if not peers:
    return []
  run = lambda r: tuple(r.get(k) for k in ("tag", "command", "commit"))  # noqa: E731
  groups: dict[tuple, list[dict]] = {}
  for p in peers:
    groups.setdefault(run(p), []).append(p)
  for key, group in groups.items():
    group[:0] = [r for r in rows if r.get("system", "meshdistill") == "meshdistill" and run(r) == key]
  if superseded:
    out = ["", "### Side by side", ""]
  else:
    out = ["", "## Side by side: meshdistill, the plain `jax.jit` step and tunix in one process", "",
           "Configurations: " + "; ".join(f"**{k}**: {v}" for k, v in SIDE_CONFIG.items()) + ". The systems of one "
           "command ran one after another in one process on the chip; each row's ratio is to the fastest meshdistill "
           "row of that command.", ""]
  out += _head("pair", "system", "batch x seq", "setting", "ms / step", "tokens/s", "spread of the timed steps",
               "tokens/s / meshdistill's best", "result")
  out[-1] = "|---|---|---|---|---:|---:|---:|---:|---|" + "---|" * len(PROVENANCE)
  order = lambda r: (list(SIDE_CONFIG).index(r.get("system", "meshdistill")), r["setting"]["b"])  # noqa: E731
  for group in sorted(groups.values(), key=lambda g: (g[-1].get("date", ""), g[-1]["setting"]["b"])):
    ours = [r for r in group if r.get("system", "meshdistill") == "meshdistill" and "step_s" in r]
    ref = max(ours, key=lambda r: r["tokens_per_s"]) if ours else None
    for r in sorted(group, key=order):
      s, system = r["setting"], r.get("system", "meshdistill")
      head = f"| {r['pair']} | {system} | {s['b']} x {s['t']} | {_side_setting(r)} |"
      if "error" in r or "step_s" not in r:
        out.append(f"{head} | | | | {_why(r.get('error', 'no time'))} | {provenance(r)}")
        continue
      ratio = "" if ref is None else f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x"
      out.append(f"{head} {r['step_s'] * 1e3:.0f} | {r['tokens_per_s']:,.0f} | {_spread(r)} | {ratio} | ran | "
                 f"{provenance(r)}")
  return out


# system -> the sampler's name in the table
GEN_SYSTEMS = {"generate": "meshdistill", "generate-unrolled": "meshdistill, layers unrolled",
               "tunix-generate": "tunix"}
GEN_LAYERS = {"generate": "both", "generate-unrolled": "none"}  # meshdistill's samplers: `Setting.scan` of the student
GEN_PROGRAMS = ("auto", "selective", "default")  # `decoding_variant`'s compilations


def sampler_label(r: dict) -> str:
  """The sampler's name in the table: the system's, with the decoding variant its row names (`decoding_variant`)."""
  label = GEN_SYSTEMS[r["system"]]
  if r.get("loops") is not None:
    label += f", {r['loops']} decoding loop{'s' if r['loops'] != 1 else ''}"
  if r.get("program", "auto") != "auto":  # `decoding_variant`'s: the cache-bound program (selective memory-space
    # assignment, up to CACHE_BOUND_STAGES loops) or the default one, whatever the batch
    label += f", the {'cache-bound' if r['program'] == 'selective' else 'default'} program at every batch"
  if r.get("kernel", "auto") != "auto":  # `decoding_variant`'s attention
    label += (", decoding attention in XLA" if r["kernel"] == "xla"
              else f", decoding kernel reading {r['kernel']} MiB a step")
  return label


def _did_not_run(error: str) -> str:
  why = "out of HBM" if "RESOURCE_EXHAUSTED" in error else error[:120]
  return "did not run: " + " ".join(why.replace("|", "/").split())


def generation_section(gen: list[dict], heading: str | None = None) -> list[str]:
  """The cached-sampling table: one row per sampler, batch and lengths, tokens/s beside `generation_limit`, its first
  run's seconds (``first_call_s``) and its result. ``heading``: the appendix's sub-heading instead of the section's."""
  if not gen:
    return []

  def order(r):
    return (r.get("prompt", 0), r.get("new", 0), r["batch"], list(GEN_SYSTEMS).index(r["system"]), sampler_label(r),
            r.get("date", ""))

  if heading:
    out = ["", heading, ""]
  else:
    out = ["", "## Sampling: meshdistill's cached sampler (the on-policy path's) and tunix's", "",
           "Both on the same student shape with random weights stored in float32, computing in bfloat16 (bfloat16 KV "
           "cache), temperature 1 over the whole vocabulary; tokens/s = batch x new tokens / the median of the timed "
           "runs after the first; *first run*: the first run's seconds (it compiles). meshdistill: the student at its "
           "default attention, `auto` (from 70e3685 a decoded token's cache write and attention are one Pallas kernel "
           "per layer on a TPU, `models._decode_attention`). tunix: `tunix.generate.sampler.Sampler` on tunix's Qwen3 "
           "(`benchmarks/bench/tunix_generate.py` says what each sampler does per run).", ""]
  out += _head("pair", "sampler", "batch", "prompt + new tokens", "tokens/s", "HBM-bandwidth limit (tokens/s)",
               "share of the limit", "first run (s)", "result")
  out[-1] = "|---|---|---:|---|---:|---:|---:|---:|---|" + "---|" * len(PROVENANCE)
  for r in sorted(gen, key=(lambda r: r.get("date", "")) if heading else order):  # the appendix: by date
    lengths = f"{r.get('prompt', '?')} + {r.get('new', '?')}"
    head = f"| {r['pair']} | {sampler_label(r)} | {r['batch']} | {lengths} |"
    if "error" in r:
      out.append(f"{head} | | | | {_did_not_run(r['error'])} | {provenance(r)}")
      continue
    limit = generation_limit(r)
    first = f"{r['first_call_s']:.1f}" if r.get("first_call_s") is not None else ""
    out.append(f"{head} {r['tokens_per_s']:,.0f} | {limit:,.0f} | {100 * r['tokens_per_s'] / limit:.0f}% | {first} "
               f"| ran | {provenance(r)}")
  return out


PROFILE_ROLES = ("matmul", "attention kernel", "loss", "optimizer", "copy/transpose", "elementwise", "reduction")


def generation_limit(r: dict) -> float:
  """Tokens/s if every decoded token read the student's weights once in bfloat16 (the compute dtype: the cast of
  the float32 weights does not depend on the token, and batch 1 runs faster than a float32 read would allow) and
  each row's KV cache at its mean length, at 819 GB/s."""
  weights = r["weight_bytes"] / 2
  tcfg, scfg = model_configs(r["pair"], Setting(attn="xla", remat="none"))
  kv = 2 * scfg.n_layers * scfg.n_kv_heads * scfg.hd * 2 * (r["prompt"] + r["new"] / 2)
  return r["batch"] * 819e9 / (weights + r["batch"] * kv)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pair", choices=sorted(PAIRS), default="qwen3")
  parser.add_argument("--config", action="append", default=[],
                      help="b=8,t=2048,remat=full,chunk=1024,attn=splash (repeatable; defaults for missing keys; "
                           "only=tunix+plain: measured by those systems only)")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--profile", action="store_true", help="trace 3 more steps and split their time by role")
  parser.add_argument("--trace-dir", default=None, help="copy the trace of the last profiled config here")
  parser.add_argument("--out", default=str(JSONL))
  parser.add_argument("--tag", default="", help="a label stored with every row (e.g. the run's purpose)")
  parser.add_argument("--systems", default="meshdistill",
                      help="comma-separated: meshdistill, plain (the hand-written step), tunix, plan (md.plan for this "
                           "machine's chips), generate (cached sampling with the student), tunix-generate (tunix's "
                           "sampler on tunix's Qwen3 at the student's shape), cli (`meshdistill distill` with the "
                           "teacher a Hugging Face directory and the student's shape, batch and sequence only: "
                           "`bench.cli_run`), cli-scan (the same with scan_layers named)")
  parser.add_argument("--cli-steps", type=int, default=40, help="steps of each `meshdistill distill` run (cli)")
  parser.add_argument("--cli-timeout", type=float, default=300, help="seconds one cli run may take")
  parser.add_argument("--cli-dir", default=os.path.join(tempfile.gettempdir(), "meshdistill-cli"),
                      help="where the cli systems write the teacher's directory, configs and runs")
  parser.add_argument("--gen-batches", default="1,8,64", help="batch sizes of the generate systems")
  parser.add_argument("--gen-lengths", default="128,256", metavar="PROMPT,NEW",
                      help="prompt tokens and new tokens per row of the generate systems")
  parser.add_argument("--gen-loops", default=None, metavar="N,N",
                      help="meshdistill's decoding in each of these numbers of loops, in turn (default: the package's)")
  parser.add_argument("--gen-programs", default="auto", metavar="P,P",
                      help="meshdistill's decoding compiled each of these ways, in turn: auto (the package's choice), "
                           "selective (the cache-bound program, libtpu's selective memory-space assignment, at every "
                           "batch), default (at none)")
  parser.add_argument("--gen-kernels", default="auto", metavar="K,K",
                      help="meshdistill's decoding attention each of these ways, in turn: auto (the package's), xla "
                           "(no decoding kernel), or the MiB of keys and values a grid step of the kernel reads "
                           "(e.g. 2)")
  parser.add_argument("--commit", default=None,
                      help="the commit of the code measured, stored with every row (default: this checkout's HEAD; "
                           "name it where the checkout has no .git, or where PYTHONPATH runs another checkout)")
  parser.add_argument("--render", action="store_true", help="only rewrite tpu_step.md from the stored rows")
  args = parser.parse_args(argv)
  if args.render:
    print(render(args.out))
    return 0
  commit = commit_or_exit(parser, args.commit)
  command = " ".join(["python3 benchmarks/tpu_step.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
  systems = args.systems.split(",")
  unknown = sorted(set(systems) - {"meshdistill", "plain", "tunix", "plan", *CLI_SYSTEMS, *GEN_SYSTEMS})
  if unknown:
    parser.error(f"--systems: unknown {', '.join(unknown)}; choose from meshdistill, plain, tunix, plan, cli, "
                 f"cli-scan, {', '.join(GEN_SYSTEMS)}")
  if set(systems) & set(CLI_SYSTEMS) and set(systems) - set(CLI_SYSTEMS):
    # the command line runs in a process of its own, which needs the chip that this process would hold
    parser.error(f"--systems {args.systems}: run cli / cli-scan in a command of their own (each `meshdistill distill` "
                 "is a process that needs the chip, which this process holds once it has measured anything else)")
  from bench.results import append_row

  if not set(systems) <= set(CLI_SYSTEMS):  # this process takes the chip
    import jax

    use_compile_cache()
    print(f"devices: {jax.devices()}", flush=True)
  batches = tuple(int(b) for b in args.gen_batches.split(","))
  try:
    loops_list = [None] if args.gen_loops is None else [int(n) for n in args.gen_loops.split(",")]
  except ValueError:
    parser.error(f"--gen-loops {args.gen_loops!r}: give numbers of decoding loops, e.g. 4,8")
  programs = args.gen_programs.split(",")
  if any(n is not None and n < 1 for n in loops_list) or set(programs) - set(GEN_PROGRAMS):
    parser.error(f"--gen-loops {args.gen_loops} / --gen-programs {args.gen_programs}: loops are positive integers "
                 f"(e.g. 4,8), programs among {', '.join(GEN_PROGRAMS)}")
  kernels = args.gen_kernels.split(",")
  try:
    [kernel_mib(k) for k in kernels]
  except ValueError as e:
    parser.error(f"--gen-kernels {args.gen_kernels}: {e}")
  try:
    prompt, new = (int(x) for x in args.gen_lengths.split(","))
  except ValueError:
    parser.error(f"--gen-lengths {args.gen_lengths!r}: give PROMPT,NEW token counts, e.g. 128,256")

  def keep(row):
    row["tag"] = args.tag
    row.setdefault("system", "meshdistill")
    stamp(row, commit, command)  # where the row comes from: what tpu_step.md prints beside every row
    print(summary(row), flush=True)
    if "profile" in row:
      print(json.dumps(row["profile"])[:2000], flush=True)
    append_row(args.out, row)

  for text in args.config or [""]:
    setting = Setting.parse(text)
    with use_splash_blocks(setting.blocks):  # every program of this setting is traced with its blocks
      for system in (x for x in systems if setting.measured_by(x)):
        if system == "meshdistill":
          keep(measure(args.pair, setting, args.steps, args.profile, args.trace_dir))
        elif system == "plain":
          keep(measure_plain(args.pair, setting, args.steps))
        elif system == "plan":
          keep(measure_plan(args.pair, setting))
        elif system in ("cli", "cli-scan"):
          keep(measure_cli(args.pair, setting, args.cli_steps, args.cli_dir, scan=system == "cli-scan",
                           timeout_s=args.cli_timeout))
  if "tunix" in systems:  # after the others: one build of tunix's models serves every batch
    settings = [s for s in map(Setting.parse, args.config or [""]) if s.measured_by("tunix")]
    for row in measure_tunix(args.pair, settings, args.steps):
      keep(row)
  for system in (s for s in GEN_LAYERS if s in systems):
    for loops in loops_list:
      for program in programs:
        for kernel in kernels:
          for row in measure_generation(args.pair, batches, prompt, new, system, loops, program, kernel):
            keep(row)
  if "tunix-generate" in systems:
    for row in measure_tunix_generation(args.pair, batches, prompt, new):
      keep(row)
  return 0


if __name__ == "__main__":
  sys.exit(main())
