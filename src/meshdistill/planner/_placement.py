"""Where the teacher should live: the planned step beside a sub-mesh teacher, an offline cache and a remote teacher.

From one compiled plan (the teacher inside the step, `Planner.plan`) the other placements are estimated, not
compiled: each share of the step's model FLOPs (`_cost.flops_split`) runs at the rate the plan reaches (its
calibrated step time when it has one, else the roofline's) and top-k teacher outputs cost the cache's bytes per
token (`meshdistill.teachers.cache`: ``k`` ids of ``ceil(log2 V)`` bits, ``k`` float16 log-probabilities and a
float16 tail mass). Options, per step of ``batch x seq`` tokens:

- ``in_step``: the plan itself (teacher and student on every chip, split as the plan's mesh says).
- ``sub_mesh``: the teacher's forward on ``c_t`` chips and the student's training on the other ``C - c_t``, in
  parallel; ``c_t`` balances the two shares (and holds the teacher's weights); top-k outputs cross the
  interconnect.
- ``offline_cache``: a pass of the teacher over the data first (its share of the step on every chip), then steps
  of the student alone reading top-k outputs from disk; bytes on disk per step and for ``epoch_tokens``.
- ``remote``: a teacher served elsewhere; the student's steps alone, top-k outputs over the network per step.

``recommended``: the option of least time per step (the cache pass counted once over ``epochs`` passes of the
data) among those whose memory fits.
"""

from __future__ import annotations

import math
from typing import Any

from meshdistill.parallel.mesh import shape_label

GIB = 2**30


def topk_bytes_per_token(vocab: int, k: int) -> float:
  """Bytes of one token's top-k teacher output as the cache stores it (ids packed, float16 values and tail)."""
  bits = max(1, math.ceil(math.log2(vocab)))
  return math.ceil(k * bits / 8) + 2 * k + 2


def placements(plan, *, vocab: int, k: int = 32, epochs: float = 1.0, network_gbps: float = 100.0,
               ici_bytes_per_s: float | None = None) -> dict[str, Any]:
  """The placement options of ``plan`` (a `Plan` of the teacher in the step) and the one recommended.

  ``vocab``: the shared vocabulary; ``k``: top-k kept per token by the cache / a remote teacher;
  ``epochs``: passes of the data the cache serves (its pass is shared by them); ``network_gbps``: a remote
  teacher's link to this slice, gigabits per second; ``ici_bytes_per_s``: a chip's interconnect bandwidth (the
  sub-mesh's top-k transfer; None: not counted).
  """
  if k < 1 or not isinstance(k, int):
    raise ValueError(f"placement k={k!r} must be a positive integer (top-k teacher outputs per token)")
  if not epochs > 0:
    raise ValueError(f"placement epochs={epochs!r} must be positive (passes of the data the cache serves)")
  chips = max(1, plan.devices // plan.devices_per_chip)
  tokens = plan.batch * plan.seq
  split = plan.flops.get("split") or {}
  teacher, student = split.get("teacher_forward", 0.0), split.get("student_forward_backward", 0.0)
  cal = plan.time.get("calibrated") or {}
  step = cal.get("step_s") or plan.time.get("step_s")
  per_token = topk_bytes_per_token(vocab, k)
  step_bytes = per_token * tokens
  mem = plan.memory
  teacher_mem = mem.get("teacher_weights") or 0
  total = plan.need_bytes  # what a chip must hold at once (the compiler's peak where it gives one)
  out: dict[str, Any] = {"k": k, "topk_bytes_per_token": per_token, "topk_bytes_per_step": step_bytes,
                         "chips": chips, "options": {}}
  share = None if step is None or not teacher + student else step / (teacher + student)  # s per FLOP per device
  student_alone = None if share is None else share * student
  limit = plan.limit_bytes

  def fits(b):
    return None if limit is None or b is None else b <= limit

  out["options"]["in_step"] = {"step_s": step, "memory_bytes": total, "fits": plan.fits,
                               "how": f"teacher and student on all {chips} chips, mesh {shape_label(plan.mesh_axes)}"}
  # sub-mesh: teacher on c_t chips, student on the rest; per-device FLOPs scale as chips / group size
  if chips >= 2:
    need = 1 if limit is None else max(1, math.ceil(teacher_mem * chips / plan.devices_per_chip / limit))
    balanced = round(chips * teacher / (teacher + student)) if teacher + student else 1
    c_t = min(chips - 1, max(need, balanced, 1))
    c_s = chips - c_t
    t_time = None if share is None else share * teacher * chips / c_t
    s_time = None if share is None else share * student * chips / c_s
    xfer = None if not ici_bytes_per_s else step_bytes / c_s / ici_bytes_per_s  # top-k into each student chip
    sub_step = None if t_time is None else max(t_time, s_time) + (xfer or 0.0)
    out["options"]["sub_mesh"] = {"step_s": sub_step, "teacher_chips": c_t, "student_chips": c_s,
                                  "memory_bytes": None if total is None else total - teacher_mem,
                                  "teacher_memory_bytes": teacher_mem * chips / c_t,
                                  "fits": None if limit is None else teacher_mem * chips / c_t <= limit,
                                  "how": f"teacher forward on {c_t} chips, student on {c_s}, top-k over the ICI"}
  cache_pass = None if share is None else share * teacher  # per step's tokens, on every chip
  amortised = None if student_alone is None else student_alone + cache_pass / epochs
  without_teacher = None if total is None else total - teacher_mem
  out["options"]["offline_cache"] = {"step_s": student_alone, "amortised_step_s": amortised,
                                     "cache_pass_s_per_step": cache_pass, "disk_bytes_per_step": step_bytes,
                                     "memory_bytes": without_teacher, "fits": fits(without_teacher),
                                     "how": f"teacher pass first, then the student alone; top-{k} from disk"}
  net = step_bytes * 8 / (network_gbps * 1e9)
  out["options"]["remote"] = {"step_s": None if student_alone is None else max(student_alone, net),
                              "network_bytes_per_step": step_bytes, "network_s_per_step": net,
                              "memory_bytes": without_teacher, "fits": fits(without_teacher),
                              "how": f"teacher served elsewhere; top-{k} over a {network_gbps:g} Gb/s link"}

  def cost(item):
    name, o = item
    t = o.get("amortised_step_s", o.get("step_s"))
    return (o.get("fits") is False, math.inf if t is None else t)

  best = min(out["options"].items(), key=cost)
  out["recommended"] = best[0] if best[1].get("fits") is not False else None
  return out


def placement_table(p: dict[str, Any]) -> str:
  """The options one per line (what ``meshdistill plan --placement`` prints)."""
  lines = [f"where the teacher lives (top-{p['k']}: {p['topk_bytes_per_token']:.0f} B/token, "
           f"{p['topk_bytes_per_step'] / 2**20:.1f} MiB/step):"]
  for name, o in p["options"].items():
    step = "n/a" if o.get("step_s") is None else f"{1e3 * o['step_s']:.1f} ms/step"
    if o.get("amortised_step_s") is not None:
      step += f" ({1e3 * o['amortised_step_s']:.1f} with the cache pass)"
    mem = "n/a" if o.get("memory_bytes") is None else f"{o['memory_bytes'] / GIB:.2f} GiB/chip"
    fits = {True: "fits", False: "does not fit", None: "fit unknown"}[o.get("fits")]
    lines.append(f"  {name:<14} {step:<40} {mem:<16} {fits:<13} {o['how']}")
  lines.append(f"recommended: {p['recommended'] or 'none fits'}")
  return "\n".join(lines)


__all__ = ["placement_table", "placements", "topk_bytes_per_token"]
