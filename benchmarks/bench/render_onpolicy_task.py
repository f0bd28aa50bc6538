"""The on-policy task report (``benchmarks/results/on_policy_task.md`` and its plot) from the raw results that
`benchmarks/onpolicy_task.py` writes: per task the learning-rate sweep, accuracy against steps and compute, the
comparison with off-policy KD and the gradient check; and, from runs made with ``--budget`` / ``--deadline`` (arms
in lockstep: their raw results hold ``lockstep``), the section "On the chip, larger student". Without such runs the
report is the CPU report alone."""

from __future__ import annotations

import os

import numpy as np


def is_lockstep(raw) -> bool:
  """Whether ``raw`` comes from a run whose arms ran in lockstep under a budget (the chip's runs)."""
  return "lockstep" in raw


def _reach(curve, flops, target):
  """The compute at which ``curve`` first reaches ``target`` (None if never)."""
  for (_, v), f in zip(curve, flops):
    if v >= target - 1e-9:
      return f
  return None


def _at(curve, flops, f):
  """Accuracy of ``curve`` at compute ``f`` (linear between evaluations; None past its end)."""
  xs, ys = np.asarray(flops), np.asarray([v for _, v in curve])
  return None if f > xs[-1] + 1e-6 else float(np.interp(f, xs, ys))


def aim(raw) -> dict:
  """Per on-policy arm and seed, against off-policy KD of the same seed: the accuracy gap at equal compute (at the
  smaller of the two arms' final compute, each curve interpolated there) and the compute the arm needs to first reach
  off-policy KD's final accuracy, as a share of the compute off-policy KD needed to first reach it (at the
  evaluations: every ``--eval-every`` steps)."""
  res = raw["results"]
  base = res.get("offpolicy")
  out = {}
  if base is None:
    return out
  for k in res:
    if k == "offpolicy":
      continue
    rows = []
    for i, _ in enumerate(raw["seeds"]):
      c, f = res[k]["curves"][i], res[k]["flops"][i]
      bc, bf = base["curves"][i], base["flops"][i]
      equal = min(f[-1], bf[-1])  # the compute both arms reached
      gap = _at(c, f, equal) - _at(bc, bf, equal)
      need, base_need = _reach(c, f, bc[-1][1]), _reach(bc, bf, bc[-1][1])
      share = None if need is None else need / max(base_need, 1.0)
      rows.append({"gap_at_equal_compute": gap, "compute_share_to_reach_offpolicy_final": share})
    out[k] = rows
  return out


def summary_lines(raw) -> list[str]:
  a, res = raw["args"], raw["results"]
  how = (f"lr {raw['lr_choice']['mode']}, {raw['lockstep']['steps_reached']} steps in lockstep" if is_lockstep(raw)
         else f"lr chosen from {a['lrs']}")
  lines = [f"{a['task']}: final held-out greedy accuracy per seed ({how}):"]
  for k, r in res.items():
    finals = [c[-1][1] for c in r["curves"]]
    lines.append(f"  {raw['labels'][k]:40s} lr {r['lr']:g}: " + ", ".join(f"{x:.3f}" for x in finals)
                 + f"  mean {np.mean(finals):.3f} sd {np.std(finals):.3f}; TFLOP {r['flops'][0][-1] / 1e12:.2f}")
  for k, rows in aim(raw).items():
    gaps = [r["gap_at_equal_compute"] for r in rows]
    shares = [r["compute_share_to_reach_offpolicy_final"] for r in rows]
    lines.append(f"  vs off-policy KD, {k}: gap at equal compute " + ", ".join("n/a" if g is None else f"{g:+.3f}"
                 for g in gaps) + "; compute to reach its final (share of its own) " + ", ".join("never" if s is None else
                 f"{s:.2f}" for s in shares))
  return lines


def _stats(curves):
  vals = np.array([[v for _, v in c] for c in curves])  # [seeds, evals]
  return [s for s, _ in curves[0]], vals.mean(0), vals.std(0), vals.min(0), vals.max(0)


def render(raws: list[dict], out: str, png: str, paths: list[str] | None = None) -> None:
  """The Markdown report (and the plot) from the raw results of one or more tasks; the runs in lockstep among them
  (``is_lockstep``; ``paths``: where each raw was read, for the render command) make the chip's section."""
  chip = [(raw, None if paths is None else paths[i]) for i, raw in enumerate(raws) if is_lockstep(raw)]
  raws = [raw for raw in raws if not is_lockstep(raw)]
  lines = ["# On-policy distillation on tasks with checkable answers", "",
           "Written by `benchmarks/onpolicy_task.py` (read `on_policy_task_notes.md` beside it for what it shows). "
           "Commands:", ""]
  lines += [f"    {raw['command']}" for raw in raws]
  lines += ["    python benchmarks/onpolicy_task.py --render " + " ".join(
      [f"benchmarks/results/on_policy_task_{raw['args']['task']}.json" for raw in raws] + [p for _, p in chip if p]), ""]
  for raw in raws:
    a, res = raw["args"], raw["results"]
    fl = raw["flops_per_step"]
    warm = ", ".join(f"seed {s}: {w['acc']:.3f} after {w['steps']} SFT steps ({w['off_path']:.3f} of its sampled "
                     "tokens after its first wrong one)" for s, w in raw["warm"].items())
    lines += [
        f"## `{a['task']}`", "",
        f"{raw['machine']}; {raw['total_seconds'] / 60:.1f} min. {a['train_problems']} train problems, "
        f"{a['eval_prompts']} held-out problems (disjoint by construction), held-out greedy exact match. Teacher d,L="
        f"{a['teacher']} ({raw['params']['teacher_matmul']:,} matmul parameters), {a['teacher_steps']} steps: "
        f"**{raw['teacher_acc']:.3f}**. Student d,L={a['student']} ({raw['params']['student_matmul']:,}). Shared warm "
        f"starts (SFT at lr {a['warm_lr']} until the first check at or above {a['warm_band'].split(',')[0]}; saved "
        f"once, loaded by every arm): {warm}. Each arm: {a['steps']} steps of {a['batch']} prompts, fresh Adam, its "
        f"learning rate the best of {a['lrs']} on seed {raw['seeds'][0]} (mean accuracy over its evaluations). "
        f"Compute per step: {fl['train'] / 1e9:.2f} GFLOP of training (student forward and backward, teacher "
        f"forward), plus {fl['sample'] / 1e9:.2f} GFLOP of sampling when the batch is generated.", "",
        "Learning-rate sweep (seed %d; mean accuracy over the evaluations after step 0 / final):" % raw["seeds"][0], "",
        "| arm | " + " | ".join(f"lr {x}" for x in a["lrs"].split(",")) + " | chosen |",
        "|---|" + "---|" * (len(a["lrs"].split(",")) + 1)]
    for k, r in res.items():
      cells = [f"{s['score']:.3f} / {s['curve'][-1][1]:.3f}" for s in r["sweep"].values()]
      lines.append(f"| {raw['labels'][k]} | " + " | ".join(cells) + f" | {r['lr']:g} |")
    steps = _stats(next(iter(res.values()))["curves"])[0]
    lines += ["", "Accuracy against steps, mean +- sd over seeds [min, max]; the compute of the last step (TFLOP, mean "
              "over seeds); off-path: the share of the final student's sampled completion tokens (temperature 1, the "
              "held-out prompts) that follow its first wrong token (mean over seeds):", "",
              "| arm | lr | " + " | ".join(f"step {s}" for s in steps) + " | TFLOP | off-path |",
              "|---|---|" + "---|" * (len(steps) + 2)]
    for k, r in res.items():
      _, mean, sd, lo, hi = _stats(r["curves"])
      cells = [f"{m:.3f} +- {s:.3f} [{x:.3f}, {y:.3f}]" for m, s, x, y in zip(mean, sd, lo, hi)]
      lines.append(f"| {raw['labels'][k]} | {r['lr']:g} | " + " | ".join(cells)
                   + f" | {np.mean([f[-1] for f in r['flops']]) / 1e12:.2f} | {np.mean(r['off_path']):.3f} |")
    rows = aim(raw)
    if rows:
      lines += ["", "Against off-policy KD of the same seed (the aim: +0.05 at equal compute, or off-policy KD's "
                "final accuracy in at most half the compute off-policy KD needs to reach it):", "",
                "| arm | seed | final | off-policy KD at equal compute | gap at equal compute | compute to reach "
                "off-policy KD's final, share of off-policy KD's own |", "|---|---|---|---|---|---|"]
      for k, per_seed in rows.items():
        for i, row in enumerate(per_seed):
          c, f = res[k]["curves"][i], res[k]["flops"][i]
          bf = res["offpolicy"]["flops"][i]
          base = _at(res["offpolicy"]["curves"][i], bf, min(f[-1], bf[-1]))
          share = row["compute_share_to_reach_offpolicy_final"]
          lines.append(f"| {raw['labels'][k]} | {raw['seeds'][i]} | {c[-1][1]:.3f} | "
                       + ("n/a" if base is None else f"{base:.3f}") + " | "
                       + ("n/a" if row["gap_at_equal_compute"] is None else f"{row['gap_at_equal_compute']:+.3f}")
                       + " | " + ("never" if share is None else f"{share:.2f}") + " |")
    check = raw.get("gradient_check")
    if check:
      lines += ["", f"Gradient noise at the warm starts (`{raw['gradient_check_command']}`; cosines, mean over 4 "
                "batches of samples): the sampled-token gradient against the reverse-KL GKD gradient on the same "
                "samples (its exact per-position expectation), and each loss's gradient on two sample sets of the "
                "same prompts:", "", "| seed | sampled-token vs reverse KL, same samples | sampled-token, two sample "
                "sets | reverse KL, two sample sets |", "|---|---|---|---|"]
      for seed, c in check.items():
        lines.append(f"| {seed} | {c['st_vs_rkl']:.3f} | {c['st_vs_st']:.3f} | {c['rkl_vs_rkl']:.3f} |")
    lines.append("")
  lines += [f"![accuracy vs compute]({os.path.basename(png)})", ""]
  if chip:
    lines += chip_section(chip, raws)
  with open(out, "w") as f:
    f.write("\n".join(lines))
  try:
    import matplotlib
  except ImportError:
    return
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(len(raws), 2, figsize=(11, 4.2 * len(raws)), squeeze=False)
  for row, raw in zip(axes, raws):
    for k, r in raw["results"].items():
      steps, mean, sd, _, _ = _stats(r["curves"])
      flops = np.mean(np.asarray(r["flops"]), axis=0) / 1e12
      for ax, x in ((row[0], steps), (row[1], flops)):
        line, = ax.plot(x, mean, marker=".", label=f"{raw['labels'][k]} (lr {r['lr']:g})")
        ax.fill_between(x, mean - sd, mean + sd, color=line.get_color(), alpha=0.15)
    warm = np.mean([w["acc"] for w in raw["warm"].values()])
    task = raw["args"]["task"]
    row[0].set_title(f"{task}: accuracy vs steps (mean +- sd, {len(raw['seeds'])} seeds; warm {warm:.2f})")
    row[1].set_title(f"{raw['args']['task']}: accuracy vs compute (sampling counted)")
    row[0].set_xlabel("steps after the shared warm start")
    row[1].set_xlabel("TFLOP (student fwd+bwd, teacher fwd, sampling)")
    for ax in row:
      ax.set_ylabel("held-out greedy exact match")
      ax.grid(alpha=0.3)
    row[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(png, dpi=110)


def final_means(raw) -> dict[str, float]:
  """Each arm's final held-out accuracy, mean over seeds."""
  return {k: float(np.mean([c[-1][1] for c in r["curves"]])) for k, r in raw["results"].items()}


def ranking(means: dict[str, float]) -> list[str]:
  """Arms from the best mean to the worst (ties in the order given)."""
  return sorted(means, key=lambda k: -means[k])


def same_order_pairs(first: dict[str, float], second: dict[str, float]) -> tuple[int, int]:
  """``(pairs ordered alike, pairs)`` over the arms both hold: a pair is alike where both put the same arm ahead (or
  both tie it)."""
  keys = [k for k in first if k in second]
  pairs = [(x, y) for i, x in enumerate(keys) for y in keys[i + 1:]]
  alike = sum(np.sign(first[x] - first[y]) == np.sign(second[x] - second[y]) for x, y in pairs)
  return int(alike), len(pairs)


_STOPPED = {"steps": "the step cap (--steps)", "budget": "the arms' budget (--budget)",
            "deadline": "the run's deadline (--deadline)"}
_TEACHER_STOPPED = {"steps": "its step cap (--teacher-steps)", "target": "its target accuracy (--teacher-target)",
                    "time": "its share of the deadline"}


def _nearest_eval(raw, step: int) -> int:
  """The index of ``raw``'s last evaluation at or before ``step`` (its first after step 0 when none)."""
  steps = [s for s, _ in next(iter(raw["results"].values()))["curves"][0]]
  return max([1] + [i for i, s in enumerate(steps) if s <= step])


def chip_section(chip: list[tuple[dict, str | None]], cpu_raws: list[dict]) -> list[str]:
  """"On the chip, larger student": per lockstep run its command, backend and device, sizes, the steps its arms
  reached, each arm's final accuracy per seed and the arms' ranking against the CPU run of the same task."""
  lines = ["## On the chip, larger student", "",
           "The same benchmark with larger models, its arms in lockstep (step k of every arm and seed before step "
           "k + 1: every arm trains the same number of steps on the same batches) until a wall-clock budget is spent; "
           "each arm at one stated learning rate (no sweep). Commands:", ""]
  lines += sorted({f"    {raw['command']}" for raw, _ in chip})
  lines.append("")
  cpu_by_task = {raw["args"]["task"]: raw for raw in cpu_raws}
  for raw, _ in chip:
    a, res, lock = raw["args"], raw["results"], raw["lockstep"]
    ph, teacher, choice = raw["phase_seconds"], raw["teacher"], raw["lr_choice"]
    lo, hi = (float(x) for x in a["warm_band"].split(","))
    warm = ", ".join(f"seed {s}: {w['acc']:.3f} after {w['steps']} SFT steps"
                     + ("" if lo <= w["acc"] <= hi else f" (outside the band {a['warm_band']})")
                     for s, w in raw["warm"].items())
    source = {"cpu": f"each arm's rate the one the CPU run's sweep chose (`{choice.get('source')}`)",
              "fixed": "each arm's rate given on the command line"}[choice["mode"]]
    lines += [
        f"### `{a['task']}` on the chip", "",
        f"Backend `{raw['backend']}` ({raw['device_kind']}), jax {raw['jax']}"
        + (f", libtpu {raw['libtpu']}" if raw.get("libtpu") else "") + f"; {raw['total_seconds']:.0f} s in all "
        f"(teacher {ph['teacher']:.0f} s, warm starts {ph['warm']:.0f} s, arms {ph['arms']:.0f} s, final evaluation "
        f"{ph['final_eval']:.0f} s; compiles included). Teacher d,L={a['teacher']} "
        f"({raw['params']['teacher_matmul']:,} matmul parameters), {teacher['steps']} steps at batch {a['batch']}, "
        f"stopped by {_TEACHER_STOPPED[teacher['stopped_by']]}: **{raw['teacher_acc']:.3f}**. "
        f"Student d,L={a['student']} "
        f"({raw['params']['student_matmul']:,}). Warm starts: {warm}. Arms: **{lock['steps_reached']} steps reached** "
        f"of at most {lock['max_steps']} (stopped by {_STOPPED[lock['stopped_by']]}; budget "
        + ("none" if lock["budget_s"] is None else f"{lock['budget_s']:g} s") + ", deadline "
        + ("none" if lock["deadline_s"] is None else f"{lock['deadline_s']:g} s") + f"), {a['batch']} prompts a "
        f"step, fresh Adam, {source}"
        + (f", warmed up linearly over the first {a['arm_warmup']} steps (--arm-warmup)" if a.get("arm_warmup") else "")
        + ". Compute per step: "
        f"{raw['flops_per_step']['train'] / 1e9:.2f} GFLOP of training, plus "
        f"{raw['flops_per_step']['sample'] / 1e9:.2f} GFLOP of sampling when the batch is generated.", "",
        f"Held-out greedy accuracy at step {lock['steps_reached']}, per seed (off-path: the share of the final "
        "student's sampled tokens after its first wrong one, mean over seeds):", "",
        "| arm | lr | " + " | ".join(f"seed {s}" for s in raw["seeds"]) + " | mean +- sd | off-path |",
        "|---|---|" + "---|" * (len(raw["seeds"]) + 2)]
    for k, r in res.items():
      finals = [c[-1][1] for c in r["curves"]]
      lines.append(f"| {raw['labels'][k]} | {r['lr']:g} | " + " | ".join(f"{x:.3f}" for x in finals)
                   + f" | {np.mean(finals):.3f} +- {np.std(finals):.3f} | {np.mean(r['off_path']):.3f} |")
    steps = [s for s, _ in next(iter(res.values()))["curves"][0]]
    lines += ["", "Mean accuracy over seeds at each evaluation:", "",
              "| arm | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for k, r in res.items():
      lines.append(f"| {raw['labels'][k]} | " + " | ".join(f"{m:.3f}" for m in _stats(r["curves"])[1]) + " |")
    chip_means = final_means(raw)
    order = " > ".join(f"{k} {chip_means[k]:.3f}" for k in ranking(chip_means))
    lines += ["", f"Ranking by mean final accuracy on the chip (step {lock['steps_reached']}): {order}."]
    cpu = cpu_by_task.get(a["task"])
    if cpu is None:
      lines.append("No CPU run of this task was rendered with it: no ranking to compare.")
    else:
      near = _nearest_eval(cpu, lock["steps_reached"])
      last = len(next(iter(cpu["results"].values()))["curves"][0]) - 1
      for i in dict.fromkeys([last, near]):  # its final evaluation, then the one nearest the chip's steps (once)
        cpu_means = {k: float(np.mean([c[i][1] for c in r["curves"]])) for k, r in cpu["results"].items()
                     if k in chip_means}
        at = next(iter(cpu["results"].values()))["curves"][0][i][0]
        alike, pairs = same_order_pairs(chip_means, cpu_means)
        verdict = "the same order" if alike == pairs else f"a different order ({alike} of {pairs} pairs ordered alike)"
        lines.append(f"On the CPU (student d,L={cpu['args']['student']}, its swept rates) at step {at}: "
                     + " > ".join(f"{k} {cpu_means[k]:.3f}" for k in ranking(cpu_means))
                     + f"; the chip's ranking: {verdict}.")
    lines.append("")
  return lines
