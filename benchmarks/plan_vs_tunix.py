"""Per-chip memory of tunix's distillation and meshdistill's at real sizes, compiled for one TPU slice on this host.

For each pair (Llama-3.1-8B -> Llama-3.2-1B, Qwen3-4B -> Qwen3-0.6B), sequence length and global batch, two systems
are compiled for the same TPU topology (default ``v5e:4x4``: 16 chips of 16 GiB) with libtpu's compiler, on abstract
arrays (nothing is allocated, no TPU is needed):

* **tunix** (`benchmarks/bench/tunix_step.py`): its teacher program (the teacher forward whose ``[B, T-1, V]`` logits it
  keeps) and its train step (its trainer's ``_train_step``: `LogitStrategy` loss, one-hot float32 labels, adamw on
  the student's ``nnx.Optimizer``), on a ``fsdp x tp`` mesh. Per chip: each program's arguments + outputs + temp
  (less aliased) and the peak of the pair: the teacher program with the student and its optimizer state resident,
  the train step with the teacher's weights resident (the logits live between them).
* **meshdistill**: ``meshdistill.plan`` (the planner compiles the one program ``meshdistill distill`` runs: teacher
  forward, chunked loss, student backward and update) for the same pair, topology, batch and sequence.

Both are held to the same limit: 90% of the chip's HBM (the planner's headroom); a compile that runs out of HBM does
not fit either. Every compiled point is appended to ``results/plan_vs_tunix.jsonl`` (a rerun skips it);
``--render`` writes ``results/plan_vs_tunix.md`` from that file alone.

  python benchmarks/plan_vs_tunix.py --search tunix qwen3 2048      # batch search for one system / pair / seq
  python benchmarks/plan_vs_tunix.py --search meshdistill qwen3 2048
  python benchmarks/plan_vs_tunix.py --render
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import subprocess
import sys
import time

import numpy as np

from bench.results import append_row, newest_rows

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
JSONL = os.path.join(RESULTS, "plan_vs_tunix.jsonl")
MD = os.path.join(RESULTS, "plan_vs_tunix.md")
GIB = 2**30
HBM = 16 * GIB  # v5e
HEADROOM = 0.9  # the planner's (and `distill`'s) limit: 90% of the chip's HBM
TOPOLOGY = "v5e:4x4"

PAIRS = {"llama": ("llama3.1-8b", "llama3.2-1b"), "qwen3": ("qwen3-4b", "qwen3-0.6b")}
SYSTEMS = ("tunix", "meshdistill")
# what each side is given (the render prints these)
TUNIX_MESH = (16, 1)  # fsdp x tp: every weight, moment and sequence split over all 16 chips
TUNIX_REMAT = "decoder"  # the student's `RematConfig.DECODER`: the leanest of tunix's remat options
# weights and moments split over `data` too, as tunix's fsdp does; the teacher stored in bfloat16, as tunix's is
MD_OVERRIDES = ("mesh.fsdp=true", "teacher.param_dtype=bfloat16")
MD_REMAT, MD_CHUNK = "full", 1024
MD_SPLASH_FROM = 8192  # from this length meshdistill is given its splash attention (tunix's Qwen3 has its own)
VERSIONED = ("jax", "jaxlib", "libtpu", "google-tunix")  # what a compiled figure depends on, kept with each point


def _key(r: dict) -> tuple:
  return (r["system"], r["pair"], r["seq"], r["batch"])


def load(superseded: list | None = None) -> dict[tuple, dict]:
  """The newest record of each (system, pair, seq, batch); older ones of the same key go to ``superseded``."""
  return newest_rows(JSONL, _key, superseded)


def compile_point(system: str, pair: str, seq: int, batch: int, topology: str = TOPOLOGY) -> dict:
  """Compiles one (system, pair, seq, batch) in this process and returns its record."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from meshdistill.planner._hardware import tpu_target  # pylint: disable=g-import-not-at-top

  teacher, student = PAIRS[pair]
  t0 = time.perf_counter()
  rec = {"system": system, "pair": pair, "teacher": teacher, "student": student, "seq": seq, "batch": batch,
         "topology": topology, "limit_bytes": int(HEADROOM * HBM)}
  if system == "tunix":
    from bench import tunix_step  # pylint: disable=g-import-not-at-top

    fsdp, tp = TUNIX_MESH
    flash = seq >= 1024  # Qwen3's splash attention (tunix's block is 1024 tokens); Llama3 has none
    p = tunix_step.TunixPair(teacher, student, tpu_target(topology).devices, fsdp=fsdp, tp=tp,
                             student_remat=TUNIX_REMAT, flash=flash)
    out = p.compile(batch, seq)
    rec.update(out, mesh={"fsdp": fsdp, "tp": tp}, remat=TUNIX_REMAT, flash=flash and pair == "qwen3")
    rec["fits"] = out["peak"] is not None and out["peak"] <= rec["limit_bytes"]
    rec["total"] = out["peak"]
  elif system == "meshdistill":
    import meshdistill as md  # pylint: disable=g-import-not-at-top

    attention = "splash" if seq >= MD_SPLASH_FROM else None
    p = md.plan(teacher, student, topology=topology, batch=batch, seq=seq, remat=MD_REMAT, chunk_size=MD_CHUNK,
                suggest=0, overrides=MD_OVERRIDES, attention=attention)
    d = p.to_dict()
    rec.update(memory=d["memory"], mesh=d["mesh"], remat=MD_REMAT, chunk_size=MD_CHUNK, overrides=list(MD_OVERRIDES),
               attention=d.get("attention"), oom=d.get("oom"), compile_seconds=d.get("compile_seconds"))
    rec["total"] = d["memory"]["total"]
    rec["fits"] = bool(d["fits"]) and rec["total"] is not None and rec["total"] <= rec["limit_bytes"]
  else:
    raise ValueError(f"system={system!r}; choose one of {SYSTEMS}")
  rec["wall_seconds"] = time.perf_counter() - t0
  rec["host"] = f"{os.cpu_count()} cores, Python {platform.python_version()}"
  rec["versions"] = {name: importlib.metadata.version(name) for name in VERSIONED}
  return rec


def _run_point(system: str, pair: str, seq: int, batch: int) -> dict | None:
  """One point in a fresh process (each 8B compile holds GBs of host memory), appended to the jsonl."""
  cmd = [sys.executable, __file__, "--one", system, pair, str(seq), str(batch)]
  print(f"compiling {system} {pair} seq {seq} batch {batch}", flush=True)
  subprocess.run(cmd, check=False)
  return load().get((system, pair, seq, batch))


def search(system: str, pair: str, seq: int, start: int, step: int, max_points: int) -> None:
  """The largest fitting batch among multiples of ``step``: doubling from ``start`` until one does not fit, then
  halving the gap; stored points are reused (a stored batch that does not fit ends the doubling), at most
  ``max_points`` new compiles."""
  done = load()
  compiled = 0

  def fits(batch: int) -> bool | None:
    nonlocal compiled
    r = done.get((system, pair, seq, batch))
    if r is None:
      if compiled >= max_points:
        return None
      compiled += 1
      r = _run_point(system, pair, seq, batch)
      if r is None:
        print(f"  {system} {pair} seq {seq} batch {batch}: no record (the compile failed)", flush=True)
        return None
      done[_key(r)] = r
    print(f"  {system} {pair} seq {seq} batch {batch}: total {_gib(r['total'])} GiB, fits {r['fits']}", flush=True)
    return r["fits"]

  stored_bad = [k[3] for k, r in done.items() if k[:3] == (system, pair, seq) and not r["fits"]]
  lo, hi, b = None, None, start
  while True:
    known = [x for x in stored_bad if x <= b and (lo is None or x > lo)]
    if known:  # a stored point already does not fit at or below the next batch: bisect below it
      hi = min(known)
      break
    f = fits(b)
    if f is None:
      return
    if f:
      lo, b = b, b * 2
    else:
      hi = b
      break
  if lo is None:
    return
  while hi - lo > step:
    mid = (lo + hi) // 2 // step * step
    f = fits(mid)
    if f is None:
      return
    lo, hi = (mid, hi) if f else (lo, mid)


def _gib(x) -> str:
  return "n/a" if x is None else f"{x / GIB:.2f}"


def _bracket(rows: dict, system: str, pair: str, seq: int) -> tuple[int | None, int | None, int | None]:
  """(largest batch compiled that fits, smallest larger batch compiled that does not, smallest batch compiled)."""
  pts = sorted((r["batch"], r["fits"]) for k, r in rows.items() if k[:3] == (system, pair, seq))
  ok = [b for b, f in pts if f]
  bad = [b for b, f in pts if not f and (not ok or b > max(ok))]
  return (max(ok) if ok else None), (min(bad) if bad else None), (pts[0][0] if pts else None)


def largest(rows: dict, system: str, pair: str, seq: int, step: int) -> str:
  """The largest batch measured to fit, with the smallest measured not to (and whether the gap is closed)."""
  best, first_bad, smallest = _bracket(rows, system, pair, seq)
  if smallest is None:
    return "not compiled"
  if best is None:
    return f"none (the smallest compiled, {smallest}, does not fit)"
  if first_bad is None:
    return f">= {best} (no larger batch compiled)"
  return f"{best}" if _exact((best, first_bad, smallest), step) else \
      f"{best} (<{first_bad}; batches between not compiled)"


def _exact(bracket: tuple, step: int) -> bool:
  """Whether a `_bracket` pins the largest batch to ``step``: one fits and the next multiple does not."""
  best, first_bad, _ = bracket
  return best is not None and first_bad is not None and first_bad - best <= step


def summary(rows: dict, step: int) -> list[str]:
  """One row per pair and T: the largest batch each side fits, and meshdistill's over tunix's where both are exact."""
  out = ["| pair | T | tunix | meshdistill | meshdistill / tunix |", "|---|---:|---:|---:|---:|"]
  for pair, (teacher, student) in PAIRS.items():
    for seq in sorted({k[2] for k in rows if k[1] == pair}):
      t, m = _bracket(rows, "tunix", pair, seq), _bracket(rows, "meshdistill", pair, seq)
      if _exact(t, step) and _exact(m, step):
        ratio = f"{m[0] / t[0]:.1f}x"
      elif t[0] is None and t[2] is not None and m[0] is not None:
        ratio = "tunix fits no batch"
      else:
        ratio = "-"
      out.append(f"| {teacher} -> {student} | {seq} | {largest(rows, 'tunix', pair, seq, step)} "
                 f"| {largest(rows, 'meshdistill', pair, seq, step)} | {ratio} |")
  return out


def linear_estimate(rows: dict, system: str, pair: str, seq: int, step: int) -> str:
  """The largest multiple of ``step`` whose memory, on the straight line through the compiled points that have a
  total (least squares in batch), stays under the limit: an estimate where the search's gap is not closed."""
  pts = sorted((r["batch"], r["total"]) for k, r in rows.items() if k[:3] == (system, pair, seq) and r["total"])
  if len(pts) < 2:
    return "n/a (fewer than two compiled points)"
  xs, ys = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
  slope, intercept = np.polyfit(xs, ys, 1)
  limit = HEADROOM * HBM
  if slope <= 0:
    return "n/a (memory does not grow with batch on the compiled points)"
  batch = int((limit - intercept) / slope) // step * step
  return f"~{batch} ({_gib(intercept)} GiB + {slope * step / GIB:.3f} GiB per {step} sequences, from batches " \
         f"{', '.join(str(int(x)) for x in xs)})"


def _tunix_cell(r: dict, prog: str) -> str:
  m = r[prog]
  return "out of HBM" if "oom" in m else _gib(m["total"])


def _why(rows: dict) -> list[str]:
  """One paragraph per pair / seq, from the largest batch both sides compiled: what tunix holds per chip that
  meshdistill does not (its numbers from the records; the one-hot labels' size from their shape)."""
  out = []
  for pair, (teacher, student) in PAIRS.items():
    for seq in sorted({k[2] for k in rows if k[1] == pair}):
      both = [b for (s, p, q, b) in rows if s == "tunix" and p == pair and q == seq
              and ("meshdistill", pair, seq, b) in rows]
      if not both:
        continue
      batch = max(both)
      t, m = rows[("tunix", pair, seq, batch)], rows[("meshdistill", pair, seq, batch)]
      per_chip = batch // t["mesh"]["fsdp"]
      b, length, vocab = t["logits_shape"]
      labels = per_chip * length * vocab * 4
      step = t["train_step"]
      text = (f"{teacher} -> {student}, T = {seq}, batch {batch} ({per_chip} sequence(s) per chip): tunix's teacher "
              f"program returns its logits [{b}, {length}, {vocab}] in {t['logits_dtype']}, "
              f"{_gib(t['resident']['teacher_logits'])} GiB per chip, which the train step then takes as an argument; "
              f"inside the train step its `labels_fn` returns one-hot float32 labels of the same shape "
              f"({_gib(labels)} GiB per chip where materialised; XLA may fuse them into the loss) and "
              f"`LogitStrategy.compute_loss` casts both logits to float32 and takes full-vocabulary softmaxes of "
              f"each")
      if "oom" in step:
        text += f"; the train step ran out of HBM ({step['oom'][:160]})"
      else:
        text += (f" (train step temp {_gib(step['temp'])} GiB, arguments {_gib(step['arguments'])} GiB, of which "
                 f"weights and moments {_gib(t['resident']['student_weights'] + t['resident']['optimizer_state'])})")
      mm = m["memory"]
      if m["total"] is None:
        text += "; meshdistill's step ran out of HBM at this batch."
      else:
        text += (f". meshdistill's one program holds no [B, T, V] array: the teacher's logits are made and consumed "
                 f"{MD_CHUNK} tokens at a time inside the loss, with the labels as int32 ids; its whole step is "
                 f"{_gib(m['total'])} GiB per chip (temp {_gib(mm['temp'])}, teacher weights "
                 f"{_gib(mm['teacher_weights'])}, student weights {_gib(mm['student_weights'])} and moments "
                 f"{_gib(mm['optimizer_state'])} in float32) against tunix's peak of {_gib(t['peak'])}.")
      out += [text, ""]
  return out or ["(no batch compiled by both sides yet)"]


def _not_monotonic(rows: dict) -> list[str]:
  """Where a larger batch compiled to a smaller total than a smaller one of the same system, pair and T."""
  out = []
  for system in SYSTEMS:
    for pair, (teacher, student) in PAIRS.items():
      for seq in sorted({k[2] for k in rows if k[1] == pair}):
        pts = sorted((k[3], r["total"]) for k, r in rows.items() if k[:3] == (system, pair, seq) and r["total"])
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
          if t1 < t0:
            out.append(f"{system} {teacher} -> {student} at T = {seq}: {_gib(t0)} GiB at batch {b0}, "
                       f"{_gib(t1)} at {b1}")
  return out


def _settings(r: dict) -> tuple:
  """What a point was compiled with, beyond its system, pair, T and batch."""
  return tuple(str(r.get(k)) for k in ("topology", "mesh", "remat", "chunk_size", "overrides", "attention", "flash"))


def _memory(r: dict):
  """Every memory figure of a point: the one program's (meshdistill) or each of tunix's two programs'."""
  return r.get("memory") if r["system"] == "meshdistill" else (r.get("teacher_program"), r.get("train_step"))


def render() -> str:
  older = []
  rows = load(older)
  lines = [
      "# tunix vs meshdistill: per-chip memory at real sizes (v5e-16, compiled on a CPU host)",
      "",
      "Made by `python benchmarks/plan_vs_tunix.py --search SYSTEM PAIR SEQ` (one compile per batch, each in its own "
      "process, appended to `plan_vs_tunix.jsonl`) and `python benchmarks/plan_vs_tunix.py --render` (this file, "
      "from the jsonl alone). Every number below is libtpu's compiler's `memory_analysis()` of a program compiled for "
      f"the TPU topology `{TOPOLOGY}` (16 v5e chips, 16 GiB HBM each) on abstract arrays: nothing ran on a TPU.",
      "",
      f"Largest global batch each fits in {HEADROOM:.0%} of a chip's HBM (multiples of 16, one sequence per chip and "
      "up; the sections below hold every compiled point; each figure is one compile, and a point compiled again gives "
      "the same bytes, the last section):",
      "",
      *summary(rows, 16),
      "",
      "## What each side compiled",
      "",
      "**tunix 0.1.7** (`benchmarks/bench/tunix_step.py`), as its trainer runs logit distillation and as its documented "
      "example (`examples/logit_distillation.ipynb`) sets it up: its own `Llama3` / `Qwen3` models (`ModelConfig."
      "llama3p1_8b()`, `llama3p2_1b()`, `qwen3_4b()`, `qwen3_0p6b()`), weights stored in bfloat16 as the example "
      "restores them, placed by the models' own sharding annotations on a `(fsdp, tp)` = "
      f"{TUNIX_MESH[0]} x {TUNIX_MESH[1]} mesh (every weight, optimizer moment and sequence split over all 16 chips: "
      "the layout of its configs that holds the least per chip; with `tp` > 1 its `shard_input` still splits the "
      "batch over `fsdp` only, so the teacher logits per chip grow), the student with `RematConfig.DECODER` (its "
      "leanest remat), Qwen3 with its splash attention (`use_flash_attention`, Llama3 has no such option) and bfloat16 "
      "compute. Two programs, each tunix's own code: (a) the teacher program, `LogitStrategy.get_teacher_outputs` "
      "(its `nnx.jit` teacher forward, `logits[:, :-1, :]`), its inputs the `gen_model_input_fn` outputs (tokens, "
      "mask, positions, a `[B, T, T]` causal mask) split over `fsdp`; (b) the train step, the trainer's own "
      "`_train_step` under `nnx.jit(..., donate_argnames=('optimizer',))` with the trainer's `nnx.Optimizer` "
      "(`optax.adamw`, moments in the weights' bfloat16), the teacher logits an argument, labels one-hot float32 "
      "`[B, T-1, V]` (its `labels_fn`). The model's activation constraints (`shard`) are applied as on a TPU host "
      "(on a CPU host tunix skips them). Pair peak = max(teacher program + student weights and moments resident, "
      "train step + teacher weights resident); the teacher logits are the teacher program's output and the train "
      "step's argument. On 16 chips tunix's smallest useful batch is 16, one sequence per chip: `shard_input` "
      "replicates a batch that `fsdp` does not divide on every chip.",
      "",
      "**meshdistill**: `meshdistill.plan(teacher, student, topology=..., batch=..., seq=..., remat='full', "
      f"chunk_size={MD_CHUNK}, overrides={list(MD_OVERRIDES)})`: the one program `meshdistill distill` runs (teacher "
      "forward under `stop_gradient`, the LogitKD loss chunked over 1024 tokens, the student's backward and AdamW "
      "update), student weights and AdamW moments float32 (mixed precision: tunix's student and moments are "
      "bfloat16, half the bytes), teacher weights bfloat16 as tunix's (`teacher.param_dtype=bfloat16`), compute "
      "bfloat16, the planner's mesh (`auto`) with weights and moments split over `data` too "
      "(`mesh.fsdp=true`, as tunix's `fsdp`), XLA attention at T < " f"{MD_SPLASH_FROM} and its splash attention "
      f"(`attention='splash'`) at T >= {MD_SPLASH_FROM}. Its total is that one program's arguments + "
      "outputs + temp - aliased. The planner gives libtpu 16 MiB fiber stacks on a CPU host (`LIBTPU_INIT_ARGS`): "
      "with its defaults libtpu 0.0.42 overflows a fiber stack and dies (SIGSEGV) compiling Qwen3-4B -> 0.6B at "
      "T = 2048, batches 192, 224 and 256.",
      "",
      f"Fits: total (tunix: the pair's peak) <= {HEADROOM:.0%} of 16 GiB = {HEADROOM * 16:.1f} GiB per chip, and the "
      "compile did not run out of HBM. GiB per chip.",
      "",
  ]
  for pair, (teacher, student) in PAIRS.items():
    for seq in sorted({k[2] for k in rows if k[1] == pair}):
      lines += [f"## {teacher} -> {student}, T = {seq}", "",
                "| global batch | tunix teacher program | tunix train step | tunix teacher logits (resident) "
                "| tunix peak | tunix fits | meshdistill (mesh) | meshdistill fits |",
                "|---:|---:|---:|---:|---:|---|---:|---|"]
      for batch in sorted({k[3] for k in rows if k[1] == pair and k[2] == seq}):
        t, m = rows.get(("tunix", pair, seq, batch)), rows.get(("meshdistill", pair, seq, batch))
        tc = ["-"] * 5 if t is None else [
            _tunix_cell(t, "teacher_program"), _tunix_cell(t, "train_step"), _gib(t["resident"]["teacher_logits"]),
            _gib(t["peak"]), "yes" if t["fits"] else "**no**"]
        if m is None:
          mc = ["-", "-"]
        else:
          mesh = "x".join(str(v) for v in m["mesh"].values())
          mc = [("out of HBM" if m["total"] is None else _gib(m["total"])) + f" ({mesh})",
                "yes" if m["fits"] else "**no**"]
        lines.append(f"| {batch} | " + " | ".join(tc + mc) + " |")
      lines += ["", f"Largest batch compiled that fits: tunix {largest(rows, 'tunix', pair, seq, 16)}; meshdistill "
                    f"{largest(rows, 'meshdistill', pair, seq, 16)}.", "",
                f"Straight-line estimate (not compiled): tunix {linear_estimate(rows, 'tunix', pair, seq, 16)}; "
                f"meshdistill {linear_estimate(rows, 'meshdistill', pair, seq, 16)}.", ""]
  lines += ["## Where the difference comes from", ""] + _why(rows) + [""]
  lines += [
      "Reading the tables: at T = 2048 and a small batch the two are close (tunix's bfloat16 student and moments and "
      "its teacher forward in a program of its own keep its fixed part small); what separates them is the growth per "
      "sequence (the straight-line slopes above), where tunix pays for `[B, T-1, V]` arrays -- the teacher logits kept "
      "between its programs (float32 for Qwen3, whose head returns float32; bfloat16 for Llama3), the float32 casts "
      "and softmaxes of both logits and the one-hot float32 labels in the train step -- and meshdistill for one "
      "chunk of them. At T = 8192 Llama3's tunix model has no splash option, so part of that pair's gap is "
      "attention (XLA's `[b, H, T, T]` scores in the student's backward) and not logits; the Qwen3 pair, splash on "
      "both sides, isolates the logits.",
      "",
      "What the per-chip figures leave out, each in tunix's favour: its trainer keeps up to "
      "`max_inflight_computations=2` steps in flight, so the next batch's teacher logits can be alive during a train "
      "step (one more logits array per chip than counted here); its `_prepare_inputs` builds the teacher's inputs "
      "before `shard_input`, so on a pod they arrive unplaced, while here they are given split over `fsdp`; its "
      "student and AdamW moments are bfloat16 (meshdistill's float32: 0.3-0.9 GiB per chip more on its side for "
      "these students). The pair's peak also assumes nothing else of the teacher program's output stays alive.",
      ""]
  dips = _not_monotonic(rows)
  if dips:
    lines += ["The compiled totals are not always monotonic in the batch (" + "; ".join(dips) + "): the compiler "
              "chooses its fusions and rematerialisation per program, so a largest batch above is one that fits with "
              "the next multiple of 16 compiled and not fitting, not a bound read off a straight line.", ""]
  same = [(r, rows[_key(r)]) for r in older if _settings(r) == _settings(rows[_key(r)])]
  other = [r for r in older if _settings(r) != _settings(rows[_key(r)])]
  if same:
    lines += ["Recompiled with the same settings (the compiler's memory analysis is deterministic for one set of "
              "versions, so each figure above is one compile and has no run-to-run spread):", ""]
    lines += [f"- {r['system']} {r['teacher']} -> {r['student']}, T = {r['seq']}, batch {r['batch']}: "
              f"{r['total']:,} B before, {n['total']:,} B again"
              + (" (every program's memory figures identical)" if _memory(r) == _memory(n) else " (**differs**)")
              for r, n in same]
    lines.append("")
  if other:
    lines += ["Points compiled earlier with other settings (replaced above by a later compile of the same system, "
              "pair, T and batch):", ""]
    lines += [f"- {r['system']} {r['teacher']} -> {r['student']}, T = {r['seq']}, batch {r['batch']}, attention "
              f"{r.get('attention') or 'auto'}: {_gib(r['total'])} GiB per chip" for r in other]
    lines.append("")
  versions = sorted({tuple(sorted(r["versions"].items())) for r in rows.values() if r.get("versions")})
  dated = sum(1 for r in rows.values() if r.get("versions"))
  if versions:
    lines.append(f"Versions recorded with {dated} of the {len(rows)} points above (earlier points carry none): "
                 + "; ".join(", ".join(f"{k} {v}" for k, v in vs) for vs in versions) + ".")
  lines.append(f"Compiled with Python {platform.python_version()} on {os.cpu_count()} CPU cores.")
  return "\n".join(lines) + "\n"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--search", nargs=3, metavar=("SYSTEM", "PAIR", "SEQ"), help=f"systems {SYSTEMS}, pairs "
                  f"{sorted(PAIRS)}")
  ap.add_argument("--start", type=int, default=16, help="first global batch of --search")
  ap.add_argument("--step", type=int, default=16, help="batch granularity of --search (the data-parallel size)")
  ap.add_argument("--max-points", type=int, default=4, help="new compiles --search may make")
  ap.add_argument("--render", action="store_true", help=f"write {os.path.relpath(MD, HERE)} from the jsonl")
  ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # SYSTEM PAIR SEQ BATCH, in this process
  args = ap.parse_args()
  os.makedirs(RESULTS, exist_ok=True)
  if args.one:
    system, pair, seq, batch = args.one
    if pair not in PAIRS:
      raise SystemExit(f"pair={pair!r}; choose one of {sorted(PAIRS)}")
    r = compile_point(system, pair, int(seq), int(batch))
    append_row(JSONL, r)
    print(f"{system} {pair} T={seq} B={batch}: {_gib(r['total'])} GiB per chip, fits={r['fits']}, "
          f"{r['wall_seconds']:.0f} s", flush=True)
    return 0
  if args.search:
    system, pair, seq = args.search
    if system not in SYSTEMS or pair not in PAIRS:
      raise SystemExit(f"--search {system} {pair}: systems {SYSTEMS}, pairs {sorted(PAIRS)}")
    search(system, pair, int(seq), args.start, args.step, args.max_points)
  if args.render or not args.search:
    text = render()
    with open(MD, "w", encoding="utf-8") as f:
      f.write(text)
    print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
