"""The throughput report (``benchmarks/results/throughput.md``) from the raw results of a run (its ``.json``)."""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import types

from bench.harness import machine, medians, paired, ratio_of, verdict
from bench.systems import (B, BARE, BARE_S, BARE_T, CE_ONLY, DP, HAND, LIGHT, ONE, OURS, PROBES, REF, ROWS,
                           SOURCES, T, TUNIX, TUNIX_DP, TUNIX_NP, TUNIX_REP, configs, step_flops)

# `all_reduce_census` of the same 2x4 steps at commit 6dda497 (before the bundled sums, the one-pass gradient norm
# and the metrics-light step): total (over `data` / over `tensor` / over part of `tensor`)
BEFORE_ALL_REDUCES = "37 (2 / 28 / 7) ChunkedLogitKD, 36 (2 / 27 / 7) LogitKD"
PROFILE = pathlib.Path(__file__).parents[1] / "results" / "step_profile.jsonl"


def ceiling_sentence(ceiling: dict, rate: float) -> str:
  """The targets' line on the matmul shapes' own ceiling (`matmul_ceilings`), if the run measured it."""
  if not ceiling:
    return ""
  frac = {k: fl / s / rate for k, (fl, s) in ceiling.items()}
  return (f" The models' own matmul shapes, every dot of a program timed alone in the same process "
          f"(`benchmarks/_matmuls.py`; `benchmarks/matmul_shapes.py` lists them): the LogitKD step's dots reach "
          f"{100 * frac[ONE + REF]:.0f}% of the rate with nothing else to run, the bare teacher forward's "
          f"{100 * frac[ONE + BARE_T]:.0f}%, the bare student step's {100 * frac[ONE + BARE_S]:.0f}%: the most a "
          "step of these models reaches on this machine.")



def profile_section() -> list[str]:
  """The op-kind breakdown of `benchmarks/step_profile.py` runs (``results/step_profile.jsonl``), if any."""
  if not PROFILE.exists():
    return []
  rows = [json.loads(line) for line in PROFILE.read_text().splitlines()]
  kinds = list(rows[0]["ms"])
  out = [
      "## Profile: where the step's time goes, before / after",
      "",
      "`python benchmarks/step_profile.py --label <label>`: a `jax.profiler` trace of the one-device step on these",
      "models; every op the XLA CPU runtime ran, grouped by what its HLO holds (matmul: a dot, with whatever is fused",
      "into it; reduction; copy/transpose: a layout change, with fused elementwise work; elementwise: the rest).",
      "Each op at its fastest of the traced steps (other jobs on the shared cores slow single runs) times its runs",
      "per step, summed over the runtime's threads (ops run concurrently, so the sum is not the step's wall time).",
      "*before*: the code before this round's changes (commit 6dda497); *after: ...*: with the changes named, in",
      "order (collectives and metrics-light step; then the decoder's token-flat matmuls; then the one-pass loss and",
      "metrics of `forward_kl_terms`). The load column matters: rows traced while the machine was loaded (1-minute",
      "load ~20 on 2 cores) show about twice the op time of rows traced on a quiet machine (~2), so compare shares",
      "across such rows, milliseconds only between rows of similar load. The last two runs (*same machine, before*:",
      "stacked reductions on one device too; *after: + separate reductions where V is whole*) were traced minutes",
      "apart on another machine than the rows above, whose op times sum about twice as high at the same load and the",
      "same step time: compare those two runs with each other, and with earlier rows by shares only.",
      "",
      "| run | step | load (1 min) | op ms / step | " + " | ".join(kinds) + " |",
      "|---|---|---:|---:|" + "---:|" * len(kinds),
  ]
  for r in rows:
    total = sum(r["ms"].values())
    shares = " | ".join(f"{100 * r['ms'][k] / total:.0f}% ({r['ms'][k]:.0f})" for k in kinds)
    out.append(f"| {r['label']} | {r['step']} | {r['load']:.1f} | {total:.0f} | {shares} |")
  return out + [""]



LOOP_OURS = (OURS, OURS + ROWS, REF + ROWS)


def loop_section(res, fl, rate, med) -> dict[str, list[str]]:
  """The training loops side by side (`run_loops`): the section's lines and the targets' lines ({} of each
  without loop times, e.g. a file rendered from a run before them)."""
  t = res.get("loop_times") or {}
  if not t:
    return {"lines": [], "targets": []}
  k, tokens = res["loop_steps"], B * T
  lmed = {name: statistics.median(v) for name, v in t.items()}

  def ratio(num: str, den: tuple[str, ...]) -> tuple[float, float, str]:
    return ratio_of(t, lmed, num, den)

  peers = [p for p in (TUNIX, TUNIX_REP, TUNIX_DP) if p in t]
  peer = min(peers, key=lmed.get)
  vs = {(o, p): ratio(p, (o,)) for o in (*LOOP_OURS, OURS + DP) if o in t for p in peers}
  bare = {o: ratio(o, (BARE,)) for o in LOOP_OURS} | {ONE + o: ratio(ONE + o, (ONE + BARE,)) for o in (OURS, REF)}
  slow = {"ours": lmed[OURS + ROWS] / med[OURS + ROWS + LIGHT], "tunix": lmed[TUNIX] / med[TUNIX],
          "rep": lmed[TUNIX_REP] / med[TUNIX_REP], "bare": lmed[BARE] / (med[BARE_T] + med[BARE_S]),
          "bare1": lmed[ONE + BARE] / (med[ONE + BARE_T] + med[ONE + BARE_S])}
  def where(o: str) -> str:
    return o.replace(ONE, "one device, ").replace("meshdistill ", "") if o.startswith(ONE) else (
        o.removeprefix("meshdistill ") + ", 2x4 mesh")

  lines = [
      "",
      "## Training loops side by side",
      "",
      f"Each system's own training loop over the same {k} batches per block, {len(t[TUNIX])} timed blocks interleaved",
      "round by round after a warm-up block; time per step = the block's wall time / "
      f"{k}. Ours: `meshdistill.loop.trainer.fit` (default options, `log_every={k}`, no checkpoints or evaluation), whose",
      f"steady state is one logged step with every metric and {k - 1} metrics-light steps per block, dispatched",
      "ahead (it reads losses only to log them); the blocks are aligned to that, and a block ends when the state",
      "after its last step is computed. tunix: one `train()` call over the",
      "block's batches (its usage, `train(train_ds)`; split input as in its rows above), so its per-call set-up is",
      "paid once per block; the step rows above call `train()` once per batch. Bare: the teacher forward and the",
      "student step dispatched back to back for every batch, waited on once per block (no distillation loss).",
      "These are what a run costs per step; the step rows above time one step at a time.",
      "",
      "| loop | median ms / step | tokens/s | GFLOP/s | of matmul rate | every block (ms / step) |",
      "|---|---:|---:|---:|---:|---|",
  ]
  for name, ts in t.items():
    r = rate[ONE if name.startswith(ONE) else ""]
    every = ", ".join(f"{1e3 * v:.0f}" for v in ts)
    rate_s = fl["step"] / lmed[name]
    lines.append(f"| {name} | {1e3 * lmed[name]:.1f} | {tokens / lmed[name]:.0f} | {rate_s / 1e9:.1f} | "
                 f"{100 * rate_s / r:.0f}% | {every} |")
  lines += [
      "",
      "| comparison (loops) | ratio of medians | paired | paired, middle half of the rounds |",
      "|---|---:|---:|---:|",
      *[f"| {'**' if p == peer else ''}tokens/s, {o.removeprefix('meshdistill ')} / {p}{'**' if p == peer else ''} | "
        f"{a:.2f}x | {b:.2f}x | {c} |" for (o, p), (a, b, c) in vs.items()],
      *[f"| our loop / the bare loop, {where(o)} | {a:.2f}x | {b:.2f}x | {c} |" for o, (a, b, c) in bare.items()],
      f"| tunix: step rows (one `train()` call per batch) / its loop (not paired: other rounds) | "
      f"{med[TUNIX] / lmed[TUNIX]:.2f}x | | |",
      "",
      "Per step, each loop against the same system timed one step at a time in the rounds above (loop / step-row "
      f"medians, not paired: ours, ChunkedLogitKD over the batch, against its metrics-light step {slow['ours']:.2f}x; "
      f"tunix {slow['tunix']:.2f}x, student replicated {slow['rep']:.2f}x; the bare programs {slow['bare']:.2f}x, one "
      f"device {slow['bare1']:.2f}x). A loop dispatches ahead: its host work and its next program (for tunix and the",
      "bare loop, the next teacher forward, which does not wait for the student step) run while the last program",
      "computes; on these 2 shared cores that competes with the compute's own threads rather than hiding behind",
      "them (on an accelerator the host work runs on cores of its own), so a loop need not be the faster form here.",
      "",
  ]
  best = max((o for o in (*LOOP_OURS, OURS + DP) if o in t), key=lambda o: min(vs[(o, peer)][:2]))
  roof = {o: fl["step"] / lmed[ONE + o] / rate[ONE] for o in (OURS, REF)}
  targets = [
      f"* In the training loops (above; each system's own loop, tunix's per-call set-up paid once per block): ours "
      f"/ tunix's faster loop (*{peer}*) >= 1.25x: best {best.removeprefix('meshdistill ')} "
      f"{vs[(best, peer)][0]:.2f}x by medians, {vs[(best, peer)][1]:.2f}x paired ({vs[(best, peer)][2]}): "
      f"**{verdict(min(vs[(best, peer)][:2]) >= 1.25)}**; ours / bare <= 1.05x on one device: ChunkedLogitKD "
      f"{bare[ONE + OURS][0]:.2f}x / {bare[ONE + OURS][1]:.2f}x, LogitKD {bare[ONE + REF][0]:.2f}x / "
      f"{bare[ONE + REF][1]:.2f}x: **{verdict(max(bare[ONE + OURS][0], bare[ONE + REF][0]) <= 1.05)}**; one device of "
      "the "
      f"matmul rate: {100 * roof[OURS]:.0f}% / {100 * roof[REF]:.0f}%: **{verdict(max(roof.values()) >= 0.7)}**.",
  ]
  return {"lines": lines, "targets": targets}


def fastest_layouts(t, med, ratio) -> str:
  """The first target's closing sentence: each system at its fastest layout of those in the run (ChunkedLogitKD),
  the full step and the metrics-light one, against tunix's fastest ("" for a run without the 8x1 rows)."""
  if TUNIX_DP not in t:
    return ""
  peer = min((TUNIX, TUNIX_REP, TUNIX_DP), key=med.get)
  out = (" Each system at its fastest layout of those run here (2x4 as above, or data parallel on 8x1; "
         f"tunix: *{peer}*):")
  for kind, names in (("full step", (OURS, OURS + ROWS, OURS + DP)),
                      ("metrics-light", (OURS + LIGHT, OURS + ROWS + LIGHT, OURS + DP + LIGHT))):
    ours = min(names, key=med.get)
    a, b, c = ratio(peer, (ours,))
    out += (f" ChunkedLogitKD {kind} (*{ours.removeprefix('meshdistill ')}*) {a:.2f}x by medians, {b:.2f}x paired "
            f"({c}): **{verdict(min(a, b) >= 1.25)}**;")
  return out[:-1] + "."


def dp_reading(t, med, ratio) -> list[str]:
  """The reading of the data-parallel (8x1) rows ([] for a run without them)."""
  if TUNIX_DP not in t:
    return []
  tun, hand = ratio(TUNIX_DP, (OURS + DP,)), ratio(HAND + DP, (OURS + DP,))
  tun_hand, layout = ratio(TUNIX_DP, (HAND + DP,)), ratio(TUNIX_DP, (TUNIX,))
  bare = ratio(OURS + DP, (BARE_T + DP, BARE_S + DP))
  return [
      f"Data parallel on 8x1 (no `tensor` split, no collective but the gradient sums): tunix / ours ChunkedLogitKD "
      f"{tun[0]:.2f}x by medians ({tun[1]:.2f}x paired), the hand-written step / ours {hand[0]:.2f}x ({hand[1]:.2f}x), "
      f"tunix / the hand-written step {tun_hand[0]:.2f}x ({tun_hand[1]:.2f}x); ours / the bare programs {bare[0]:.2f}x "
      f"({bare[1]:.2f}x). tunix on 8x1 / tunix on 2x4: {layout[0]:.2f}x ({layout[1]:.2f}x). Each device holds "
      "the whole vocabulary here, so the hand-written step forms its full `[B, T, V]` logits and their softmaxes per "
      "device, where the chunked loss forms them a chunk at a time from the final hidden states.",
  ]


RAW_KEYS = ("times", "loop_times", "loop_steps", "cpu", "compile_s", "stats", "matmul_flops", "losses", "load",
            "machine", "ceiling")
ARGS = ("vocab", "steps", "warmup", "chunk", "loop_rounds", "loop_steps")


def raw_results(res: dict, args: dict, seconds: float) -> dict:
  """What a run keeps in its ``.json`` (what `report` reads): ``res`` of the run, the settings in ``args``
  (`ARGS`), its wall seconds."""
  return {**{k: res[k] for k in RAW_KEYS if k in res}, "args": {k: args[k] for k in ARGS}, "seconds": seconds}


def report(raw: dict) -> str:
  """The Markdown report of a run from its raw results (`raw_results`, as its ``.json`` holds them)."""
  args = types.SimpleNamespace(**raw["args"])
  res = {**raw, "stats": {k: tuple(v) for k, v in raw["stats"].items()}}
  res["tcfg"], res["scfg"] = configs(args.vocab)
  med = medians(res["times"])
  seconds = raw["seconds"]
  tokens = B * T
  t, cpu = res["times"], res["cpu"]
  cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
  fl = step_flops(res["tcfg"], res["scfg"])
  probe_rate = {k: f / med[k] for k, f in res["matmul_flops"].items()}
  # The roofline of each device set is the fastest probe on that device set (one device: no mesh; mesh: the
  # 8 simulated devices), measured in the same rounds.
  rate = {pre: max(r for k, r in probe_rate.items() if k.startswith(ONE) == (pre == ONE)) for pre in ("", ONE)}
  row_flops = {OURS: fl["step"], REF: fl["step"], OURS + LIGHT: fl["step"], REF + LIGHT: fl["step"],
               TUNIX: fl["step"], TUNIX_NP: fl["step"], TUNIX_REP: fl["step"], CE_ONLY: fl["student"],
               OURS + ROWS: fl["step"], REF + ROWS: fl["step"], OURS + ROWS + LIGHT: fl["step"],
               REF + ROWS + LIGHT: fl["step"],
               BARE_T: fl["teacher"], BARE_S: fl["student"], HAND: fl["step"],
               OURS + DP: fl["step"], OURS + DP + LIGHT: fl["step"], TUNIX_DP: fl["step"], HAND + DP: fl["step"],
               BARE_T + DP: fl["teacher"], BARE_S + DP: fl["student"]}
  tc, sc = res["tcfg"], res["scfg"]
  (l1, l5, l15), (e1, e5, e15) = res["load"]
  lines = [
      "# Throughput: meshdistill vs tunix on the same work, with a roofline",
      "",
      f"Produced by `python benchmarks/throughput.py --vocab {args.vocab} --steps {args.steps} --warmup {args.warmup} "
      f"--chunk {args.chunk} --loop-rounds {args.loop_rounds} --loop-steps {args.loop_steps}` "
      f"({seconds:.0f} s wall).",
      "",
      "## Set-up",
      "",
      f"* Machine: {os.cpu_count()} CPU cores, possibly shared with other jobs: load average (1/5/15 min)",
      f"  {l1:.1f}/{l5:.1f}/{l15:.1f} at the start, {e1:.1f}/{e5:.1f}/{e15:.1f} at the end (`os.getloadavg()`, as `uptime`",
      "  prints; it counts this benchmark's own threads too). Absolute times are slow and noisy; the ratios compare systems timed in the",
      "  same interleaved rounds (medians of per-round ratios: *paired*), which is what this measures.",
      "* Mesh 2x4 (`data`=2, `tensor`=4) of 8 simulated CPU devices sharing those cores. The `1 device:` rows run",
      "  first, in a child process whose JAX has one CPU device (no mesh; XLA's CPU client uses the cores for",
      "  intra-op threads), interleaved among themselves: a program placed on one of 8 simulated devices runs slower",
      "  than the same program in a process with one device (see throughput_notes.md), which is not what one device",
      "  means.",
      f"* Teacher: {tc.n_layers} layers, d={tc.d_model}, MLP {tc.mlp_hidden}; student: {sc.n_layers} layers, "
      f"d={sc.d_model}, MLP {sc.mlp_hidden}; V={sc.vocab_size}; B={B}, T={T} ({tokens} tokens per step), float32.",
      "* Same initial weights, optimizer (clip 1.0 + AdamW lr 1e-3) and batches (random tokens, no",
      "  padding) for every system; tau=2, alpha=0.5, forward KL + CE. Every system gets host numpy",
      "  batches and does its own transfer inside the timed step.",
      "* **tunix** (the headline peer row): each batch put on the mesh split over `data` before `train()`",
      "  (what tunix's `shard_input` does and its examples feed), so its jitted teacher forward (the",
      "  strategy `nnx.jit`s it) runs on the split batch. **tunix, host numpy input**: the same trainer",
      "  given numpy batches: tunix runs the teacher in `_prepare_inputs` before `shard_input`, so the",
      "  teacher forward sees the whole batch and is computed on every `data` replica. **tunix, student",
      "  replicated**: split input as in the headline row, the student's weights replicated instead of split over",
      "  `tensor` (the layout of our *student over the batch* rows; tunix still splits the batch over `data` only).",
      "  The targets compare against the faster of the two split-input tunix rows in the run.",
      "* **..., data parallel (8x1)**: the same systems on the mesh `data`=8, `tensor`=1 of the same 8 devices: both",
      "  models replicated, the batch split over all 8, no collective but the gradient sums (for models this small",
      "  the layout a user would pick; tunix given split input as in its headline row). The targets also compare",
      "  each system at its fastest layout of those run.",
      f"* {args.warmup} warm-up steps (compilation) per system, then {args.steps} timed steps each, interleaved;",
      "  each step timed to completion.",
      f"* ChunkedLogitKD with chunk_size={args.chunk} tokens per device.",
      "",
      "## Results",
      "",
      f"Roofline: analytic FLOPs per step: teacher forward {fl['teacher'] / 1e9:.2f} GFLOP (N_teacher = "
      f"{fl['n_t']:,} matmul weights), student forward + backward {fl['student'] / 1e9:.2f} GFLOP (N_student = "
      f"{fl['n_s']:,}), distillation step {fl['step'] / 1e9:.2f} GFLOP (KL / softmax elementwise work not counted).",
      f"Matmul rate measured in these rounds, on each device set: **one device {rate[ONE] / 1e9:.1f} GFLOP/s, "
      f"2x4 mesh {rate[''] / 1e9:.1f} GFLOP/s**: the fastest of {len(PROBES)} float32 matmul shapes timed on that "
      "device set (on the mesh, rows split over the 8 devices, the rate of the 2x4 and the 8x1 rows alike; median "
      "time of each, table below). Both device sets "
      "run on the same 2 cores. *of matmul rate* = (FLOPs / median step time) / the rate of the row's device set.",
      "",
      "| system | median step (ms) | tokens/s | median CPU s / step | GFLOP / step | GFLOP/s | of matmul rate "
      "| all timed steps (ms) |",
      "|---|---:|---:|---:|---:|---:|---:|---|",
  ]
  order = [OURS, REF, OURS + LIGHT, REF + LIGHT, OURS + ROWS, REF + ROWS, OURS + ROWS + LIGHT, REF + ROWS + LIGHT,
           OURS + DP, OURS + DP + LIGHT, TUNIX, TUNIX_REP, TUNIX_DP, TUNIX_NP, HAND, HAND + DP, CE_ONLY, BARE_T, BARE_S,
           BARE_T + DP, BARE_S + DP, ONE + OURS, ONE + REF, ONE + OURS + LIGHT, ONE + REF + LIGHT, ONE + HAND,
           ONE + BARE_T, ONE + BARE_S]
  for name in (n for n in order if n in t):  # a file rendered from an earlier run may lack some rows
    base = name.removeprefix(ONE)
    r = rate[ONE if name.startswith(ONE) else ""]
    f = row_flops[base]
    ts = ", ".join(f"{1e3 * v:.0f}" for v in t[name])
    lines.append(
        f"| {name} | {1e3 * med[name]:.1f} | {tokens / med[name]:.0f} | {cpu_med[name]:.3f} | {f / 1e9:.2f} | "
        f"{f / med[name] / 1e9:.1f} | {100 * f / med[name] / r:.0f}% | {ts} |"
    )
  for name, f in res["matmul_flops"].items():
    r = rate[ONE if name.startswith(ONE) else ""]
    ts = ", ".join(f"{1e3 * v:.0f}" for v in t[name])
    lines.append(f"| {name} | {1e3 * med[name]:.1f} | | {cpu_med[name]:.3f} | {f / 1e9:.2f} | "
                 f"{probe_rate[name] / 1e9:.1f} | {100 * probe_rate[name] / r:.0f}% | {ts} |")
  ours = (OURS, REF, OURS + LIGHT, REF + LIGHT)
  rows = (OURS + ROWS, REF + ROWS, OURS + ROWS + LIGHT, REF + ROWS + LIGHT)  # mesh only

  def ratio(num: str, den: tuple[str, ...]) -> tuple[float, float, str]:
    return ratio_of(t, med, num, den)

  sp = {k: ratio(TUNIX, (k,)) for k in (*ours, *rows)}
  sp_rep = {k: ratio(TUNIX_REP, (k,)) for k in (*ours, *rows)}
  sp_np = {k: ratio(TUNIX_NP, (k,)) for k in (OURS, REF)}
  ov = {**{pre + k: ratio(pre + k, (pre + BARE_T, pre + BARE_S)) for pre in (ONE, "") for k in ours},
        **{k: ratio(k, (BARE_T, BARE_S)) for k in rows}}
  tunix_split = ratio(TUNIX_NP, (TUNIX,))
  tunix_rep = ratio(TUNIX_REP, (TUNIX,))
  hand_tunix = ratio(TUNIX, (HAND,))
  hand = {**{pre + k: ratio(pre + k, (pre + HAND,)) for pre in (ONE, "") for k in ours},
          **{k: ratio(k, (HAND,)) for k in rows}}
  rows_vs_tensor = {r: ratio(k, (r,)) for k, r in zip(ours, rows)}
  loop = loop_section(res, fl, rate, med)
  lines += loop["lines"]
  lines += [
      "",
      "## Ratios (medians of step times / medians of per-round ratios, and their spread)",
      "",
      "| comparison | ratio of medians | paired | paired, middle half of the rounds |",
      "|---|---:|---:|---:|",
      *[f"| **tokens/s, {k.removeprefix('meshdistill ')} / tunix (input split over `data`)** | **{a:.2f}x** | {b:.2f}x | {c} |"
        for k, (a, b, c) in sp.items()],
      *[f"| tokens/s, {k.removeprefix('meshdistill ')} / tunix, student replicated (input split over `data`) | {a:.2f}x | "
        f"{b:.2f}x | {c} |" for k, (a, b, c) in sp_rep.items()],
      *[f"| tokens/s, {k.removeprefix('meshdistill ')} / tunix, host numpy input | {a:.2f}x | {b:.2f}x | {c} |"
        for k, (a, b, c) in sp_np.items()],
      f"| tunix: numpy input step / split input step | {tunix_split[0]:.2f}x | {tunix_split[1]:.2f}x | {tunix_split[2]} |",
      f"| tunix: student replicated step / student split over `tensor` step | {tunix_rep[0]:.2f}x | {tunix_rep[1]:.2f}x "
      f"| {tunix_rep[2]} |",
      *[f"| tokens/s, {k.removeprefix('meshdistill ')} / the same with the student split over `tensor` | {a:.2f}x | "
        f"{b:.2f}x | {c} |" for k, (a, b, c) in rows_vs_tensor.items()],
      *[f"| {'**' if k.startswith(ONE) else ''}our step / (bare teacher forward + bare student step), "
        f"{k.replace(ONE, 'one device, ').replace('meshdistill ', '') if k.startswith(ONE) else k.removeprefix('meshdistill ') + ', 2x4 mesh'}"
        f"{'**' if k.startswith(ONE) else ''} | {a:.2f}x | {b:.2f}x | {c} |" for k, (a, b, c) in ov.items()],
      *[f"| our step / the hand-written step, {k.replace(ONE, 'one device, ').replace('meshdistill ', '') if k.startswith(ONE) else k.removeprefix('meshdistill ') + ', 2x4 mesh'}"
        f" | {a:.2f}x | {b:.2f}x | {c} |" for k, (a, b, c) in hand.items()],
      "",
  ]
  roof = {k: fl["step"] / med[ONE + k] / rate[ONE] for k in ours}
  # tunix's faster layout of the two it was given (student split over `tensor`, or replicated), by medians
  peer = TUNIX if med[TUNIX] <= med[TUNIX_REP] else TUNIX_REP
  best = {k: ratio(peer, (k,)) for k in (OURS, OURS + ROWS, REF, REF + ROWS, OURS + ROWS + LIGHT, REF + ROWS + LIGHT)}
  light = (OURS + ROWS + LIGHT, REF + ROWS + LIGHT)
  targets = [
      f"* ours / tunix >= 1.25x with tunix given split input (ChunkedLogitKD, the full step, against tunix's faster "
      f"layout here: *{peer}*): student split over `tensor` **{verdict(min(best[OURS][:2]) >= 1.25)}** "
      f"({best[OURS][0]:.2f}x by medians, {best[OURS][1]:.2f}x paired, middle half of the rounds {best[OURS][2]}); "
      f"student over the batch (`mesh.student_split: batch`) **{verdict(min(best[OURS + ROWS][:2]) >= 1.25)}** "
      f"({best[OURS + ROWS][0]:.2f}x / {best[OURS + ROWS][1]:.2f}x, {best[OURS + ROWS][2]}). LogitKD: "
      f"{best[REF][0]:.2f}x / {best[REF][1]:.2f}x, over the batch {best[REF + ROWS][0]:.2f}x / "
      f"{best[REF + ROWS][1]:.2f}x. (Met: both the ratio of medians and the paired ratio at least 1.25.) "
      "The metrics-light step, which the training loop runs on every step it does not log (tunix computes its loss "
      "and none of these metrics), student over the batch: ChunkedLogitKD "
      f"{best[light[0]][0]:.2f}x / {best[light[0]][1]:.2f}x ({best[light[0]][2]}), LogitKD {best[light[1]][0]:.2f}x / "
      f"{best[light[1]][1]:.2f}x: **{verdict(min(best[k][i] for k in light for i in (0, 1)) >= 1.25)}**."
      + fastest_layouts(t, med, ratio),
      f"* ours / bare <= 1.05x on one device: ChunkedLogitKD {ov[ONE + OURS][0]:.2f}x, LogitKD {ov[ONE + REF][0]:.2f}x: "
      f"**{verdict(max(ov[ONE + OURS][0], ov[ONE + REF][0]) <= 1.05)}**; metrics-light steps (the loop's steps between "
      f"logs): {ov[ONE + OURS + LIGHT][0]:.2f}x, {ov[ONE + REF + LIGHT][0]:.2f}x: "
      f"**{verdict(max(ov[ONE + OURS + LIGHT][0], ov[ONE + REF + LIGHT][0]) <= 1.05)}** (the mesh ratios beside it "
      "come from 8 simulated devices time-sharing 2 cores).",
      f"* one-device step at >= 70% of the measured matmul rate: ChunkedLogitKD {100 * roof[OURS]:.0f}% "
      f"(metrics-light {100 * roof[OURS + LIGHT]:.0f}%), LogitKD {100 * roof[REF]:.0f}% (metrics-light "
      f"{100 * roof[REF + LIGHT]:.0f}%): **{verdict(min(roof.values()) >= 0.7)}** for all four"
      f"{'' if min(roof.values()) >= 0.7 else ', ' + verdict(max(roof.values()) >= 0.7) + ' for the best'}. "
      "What the models themselves allow, on one device in the same rounds: the hand-written one-program step "
      f"{100 * fl['step'] / med[ONE + HAND] / rate[ONE]:.0f}%; the bare teacher forward "
      f"{100 * fl['teacher'] / med[ONE + BARE_T] / rate[ONE]:.0f}% and the bare student step "
      f"{100 * fl['student'] / med[ONE + BARE_S] / rate[ONE]:.0f}% (its matmuls are [{B * T}, {res['scfg'].d_model}]-thin), "
      f"{100 * fl['step'] / (med[ONE + BARE_T] + med[ONE + BARE_S]) / rate[ONE]:.0f}% back to back."
      + ceiling_sentence(res.get("ceiling", {}), rate[ONE]),
  ]
  targets += loop["targets"]
  stats = res["stats"]
  by_source = stats[OURS][1]["by source"]
  floor = by_source[SOURCES[0]] + by_source[SOURCES[2]] + by_source[SOURCES[3]] + by_source[SOURCES[4]]
  half = int(BEFORE_ALL_REDUCES.split()[0]) / 2
  targets.append(
      f"* all-reduces per step on the 2x4 HLO down by at least half (from {BEFORE_ALL_REDUCES.split()[0]}, ChunkedLogitKD"
      f"): student split over `tensor` {stats[OURS][1]['total']} **{verdict(stats[OURS][1]['total'] <= half)}**; student "
      f"over the batch {stats[OURS + ROWS][1]['total']} (LogitKD {stats[REF + ROWS][1]['total']}) "
      f"**{verdict(stats[OURS + ROWS][1]['total'] <= half)}**, with the parity tests unchanged (tests/test_step.py and "
      "the other layout tests pass as before; tests/test_student_split.py checks this layout against one device).")
  lines += [
      "## Targets (issue 20), as measured here",
      "",
      *targets,
      "",
      "## Compiled step: FLOPs and all-reduces",
      "",
      "| step | cost_analysis GFLOP (per device program) | analytic GFLOP (whole step) | all-reduces in the HLO: total "
      "| over `data` | over `tensor` | over both (all 8 devices) | over part of `tensor` |",
      "|---|---:|---:|---:|---:|---:|---:|---:|",
      *[f"| {k} | {f / 1e9:.2f} | {fl['step'] / 1e9:.2f} | {c['total']} | {c.get('data', 0)} | {c.get('tensor', 0)} | "
        f"{c.get('data+tensor', 0)} | {c.get('other', 0)} |" for k, (f, c) in stats.items()],
      "",
      f"**All-reduce count per step on the 2x4 HLO: {stats[OURS][1]['total']} (ChunkedLogitKD), "
      f"{stats[REF][1]['total']} (LogitKD); metrics-light {stats[OURS + LIGHT][1]['total']}, "
      f"{stats[REF + LIGHT][1]['total']}; with the student over the batch {stats[OURS + ROWS][1]['total']} "
      f"(ChunkedLogitKD), {stats[REF + ROWS][1]['total']} (LogitKD).** Before the step-performance changes: "
      f"{BEFORE_ALL_REDUCES}. See the reading below for what the count is made of.",
      "",
      "All-reduces of the 2x4 steps by what produced them (`op_name` metadata of each compiled instruction):",
      "",
      "| source | " + " | ".join(k.removeprefix("meshdistill ") for k in stats if not k.startswith(ONE)) + " |",
      "|---|" + "---:|" * sum(not k.startswith(ONE) for k in stats),
      *[f"| {src} | " + " | ".join(str(c["by source"][src]) for k, (_, c) in stats.items() if not k.startswith(ONE))
        + " |" for src in SOURCES],
      "",
      f"With both models Megatron-style over `tensor`, the model's own all-reduces (embedding lookups "
      f"and matmuls), the data-axis sums and the optimizer's one gradient-norm sum are {floor} of ChunkedLogitKD's "
      f"{stats[OURS][1]['total']}: halving (to {half:.1f} or fewer) needs another split of the student, not fewer sums. "
      f"With the student over the batch: {stats[OURS + ROWS][1]['total']}: **all-reduces halved: "
      f"{verdict(stats[OURS + ROWS][1]['total'] <= half)}**.",
      "XLA CPU's cost analysis counts the per-device program (on the mesh: 1/8 of the batch rows, 1/4",
      "of the tensor-split weights) and includes elementwise work, so it is not comparable one to one",
      "with the analytic matmul count.",
      "",
      "## Losses side by side (same batches, same start)",
      "",
      "| step | " + " | ".join(res["losses"]) + " |",
      "|---:|" + "---:|" * len(res["losses"]),
  ]
  n = min(len(v) for v in res["losses"].values())
  for i in range(n):
    lines.append(f"| {i + 1} | " + " | ".join(f"{v[i]:.5f}" for v in res["losses"].values()) + " |")
  final = {k: v[n - 1] for k, v in res["losses"].items()}
  rel = max(abs(final[OURS] - final[k]) / abs(final[k]) for k in final)
  lines += [
      "",
      f"Final loss: ours {final[OURS]:.5f}, tunix {final[TUNIX]:.5f}; largest relative difference between any two "
      f"columns {rel:.1e}.",
      "",
      "Compile + warm-up seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in res["compile_s"].items()) + ".",
  ]
  structure = paired(t, CE_ONLY, (BARE_S,))
  lines += [
      "",
      "## Reading the numbers",
      "",
      "Where the difference to tunix comes from. Given host numpy batches, tunix's teacher forward runs",
      "on the unsplit batch on every `data` replica (its logits come out split over `tensor` only):",
      f"here its numpy-input step is {tunix_split[0]:.2f}x (paired {tunix_split[1]:.2f}x) its step with split input.",
      "Given split input, tunix runs the same model matmuls as we do; what differs is the structure:",
      "tunix runs the teacher forward as one jitted call and the student step as another, with its",
      "Python loop (metric buffering, a host read of the previous loss) around them; meshdistill runs",
      "the teacher forward, the student forward/backward and the update as one program. The teacher",
      f"logits handed between tunix's two programs are {B * T * args.vocab * 4 / 2**20:.0f} MiB here, cheap to pass.",
      f"Measured: ChunkedLogitKD / tunix (split input) = {sp[OURS][0]:.2f}x by medians, {sp[OURS][1]:.2f}x paired; "
      f"LogitKD / tunix = {sp[REF][0]:.2f}x / {sp[REF][1]:.2f}x.",
      f"The hand-written one-program step (the same math in plain JAX, one jit) is {hand_tunix[0]:.2f}x tunix by medians "
      f"({hand_tunix[1]:.2f}x paired): that much of the gain is running the teacher forward and the student update as "
      f"one program; ours / the hand-written step on the mesh is {hand[OURS][0]:.2f}x (ChunkedLogitKD) and "
      f"{hand[REF][0]:.2f}x (LogitKD) by medians, what the framework's step adds or saves beyond that (the chunked "
      "loss, the one-pass loss and metrics, the bundled sums).",
      *dp_reading(t, med, ratio),
      "An earlier version of this file compared against tunix's numpy-input row only.",
      "",
      "Where our step's time goes beyond the bare programs (2x4 mesh, paired): the same step with a",
      f"CE-only strategy (teacher dropped) is {structure:.2f}x the bare student step: the cost of the step's",
      "structure (shard_map manual over `data` with compiler-managed `tensor`, the explicit gradient",
      "psum, the metrics). On one device that structure is absent, see the one-device ratio above.",
      "",
      "Roofline: the matmul rate is what this machine reaches on one large float32 matmul on the same device set",
      "in the same rounds; the step's fraction of it is bounded by its non-matmul work (softmaxes, norms, the",
      "optimizer, copies), by matmuls too thin to reach the rate (the student's), and, on the mesh, by the",
      "all-reduces between 8 simulated devices that share 2 cores. The hand-written step and the bare programs",
      "(the targets' line above) show what these models allow before any framework code runs;",
      "`benchmarks/matmul_shapes.py` (results/matmul_shapes.md) times the step's own matmul shapes alone, with",
      "nothing else in the program: the fraction of the rate they reach is the most a step of these models can.",
      "",
      "What the all-reduces are (the by-source table above). Sums over `data` are 2 per step: the token count",
      "(needed before the loss) and one tuple all-reduce of every gradient and metric sum (JAX emits one",
      "all-reduce per gradient leaf; XLA's all-reduce combiner fuses them, and `psum_bundled` stacks the",
      "scalars into one). The optimizer, at jit level outside the shard_map, sums the squares of the",
      "`tensor`-split gradients once, one all-reduce over `tensor` (it did three times: an `and` of `isfinite`",
      "per leaf, the clipping norm inside the skip's `cond`, the `grad_norm` metric). The loss and its metrics",
      "reduce over the `tensor`-split vocabulary with one stacked max and one stacked sum per chunk for the",
      "default recipe (`meshdistill.losses.forward_kl_terms`: the loss's sums and the metrics' sums leave as one",
      "all-reduce, correlation's centred sums ride with the hidden-state gradient's, and the backward pass needs",
      "no reduction over V): 3 all-reduces in the chunk loop, 8 before. The rest are the models' own: under the",
      "Megatron-style split each row-parallel matmul's output (attention output and MLP down projection: 2 per",
      "layer in each forward), the input gradients of the column-parallel matmuls in the student backward, the",
      "embedding lookups, and (over part of `tensor`) the gradients of key/value heads that fewer heads than",
      "`tensor` devices share. Those alone exceed half the count before the step-performance changes, so",
      "halving needs another split, not fewer sums.",
      "",
      "The student over the batch (`mesh.student_split: batch`, `meshdistill.parallel.layout.ShardMapLayout`) is that split:",
      "the teacher stays split over `tensor`; the student, small enough to hold whole on every device, is",
      "replicated and runs its forward, loss and backward in a nested `shard_map` on the rows of its device (the",
      "batch split over `data` x `tensor`). Its activations then need no all-reduce; what is left is the teacher's",
      "forward (Megatron-style: 2 all-reduces a layer, and its embedding lookup), moving the teacher's outputs to",
      "the student's rows (an all-to-all of the logits, or for the chunked loss one gather of the teacher's LM",
      "head; neither is an all-reduce), and one bundled sum of the gradients and token sums over all 8 devices.",
      "The optimizer needs no collective at all (whole gradients). The teacher's inputs and outputs are pinned",
      "whole over rows (`meshdistill.train.step`): unpinned, the compiler carried the student's row split into the",
      "teacher, gathered its attention weights and gathered the activations back before each MLP (then 7",
      "all-reduces here, and 14 all-gathers that this census does not count; see throughput_notes.md).",
      "tunix splits its batch over the axes of `data_sharding_axis` for both models at once; with `data` (as its",
      "examples do) a replicated student (the *tunix, student replicated* row) computes the same rows on every",
      "`tensor` device.",
      "",
  ]
  lines += profile_section()
  lines.append(f"Environment: {res.get('machine') or machine()}.")
  return "\n".join(lines) + "\n"
