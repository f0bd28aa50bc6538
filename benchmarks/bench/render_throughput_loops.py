"""The training-loops section of the throughput report: each system's own loop, block by block (`loop_section`)."""

from __future__ import annotations

import statistics

from bench.harness import ratio_of, verdict
from bench.systems import B, BARE, BARE_S, BARE_T, DP, LIGHT, ONE, OURS, REF, ROWS, T, TUNIX, TUNIX_DP, TUNIX_REP

NOTES = "throughput_notes.md, *Reading throughput.md*"  # where the report's narrative lives


def where(row: str) -> str:
  """A row's system and device set, for a ratio's label: ``"one device, LogitKD"``, ``"LogitKD, 2x4 mesh"``."""
  if row.startswith(ONE):
    return row.replace(ONE, "one device, ").replace("meshdistill ", "")
  return row.removeprefix("meshdistill ") + ", 2x4 mesh"

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
  lines = [
      "",
      "## Training loops side by side",
      "",
      f"Each system's own training loop over the same {k} batches per block (ours: `log_every={k}`, one logged step "
      f"and {k - 1} metrics-light ones), {len(t[TUNIX])} timed blocks interleaved round by round after a warm-up "
      f"block; time per step = the block's wall time / {k}. What each loop runs: {NOTES}.",
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
      f"device {slow['bare1']:.2f}x). Why a loop need not be the faster form on a shared CPU: {NOTES}.",
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
