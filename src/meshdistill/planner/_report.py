"""`Plan`: what one compiled configuration needs per device, how long it should take, and its table / JSON form."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from meshdistill.parallel.mesh import shape_label
from meshdistill.planner._placement import placement_table

GIB = 2**30

MEMORY_ROWS = (
    ("teacher_weights", "teacher weights"),
    ("student_weights", "student weights"),
    ("optimizer_state", "optimizer state"),
    ("other_state", "step + strategy params"),
    ("batch", "batch"),
    ("temp", "compiler temp (activations)"),
    ("outputs", "outputs (not aliased)"),
)


@dataclasses.dataclass
class Plan:
  """One configuration compiled for a target. Memory in bytes per device, FLOPs per device per step.

  ``fits``: ``memory["need"] <= headroom * budget_bytes`` (the rule ``distill``'s automatic remat
  uses; ``need``: the compiler's peak of live buffers where the backend reports one, as libtpu does, else
  ``total``, `MemoryReport.need_bytes`); ``None`` without a budget (CPU devices without ``hbm_gib``). ``time`` (seconds, per step) is
  a roofline estimate: ``max(compute, hbm) + communication`` with ``compute = flops / peak``,
  ``hbm = bytes accessed / HBM bandwidth``, ``communication = ring bytes sent / ICI bandwidth``;
  ``mfu`` = analytic model FLOPs / (step time * peak * chips). ``suggestions``: configurations that
  fit, each compiled, when this one does not.
  """

  teacher: str
  student: str
  params: dict[str, int]
  target: str
  device_kind: str
  devices: int
  devices_per_chip: int
  mesh: tuple[int, int]
  batch: int
  seq: int
  remat: str
  chunk_size: int | None
  dtype: str
  strategy: str
  memory: dict[str, int]
  budget_bytes: int | None
  headroom: float
  fits: bool | None
  flops: dict[str, float | None]
  collectives: list[dict[str, Any]]
  time: dict[str, float | None]
  compile_seconds: float
  compiler_options: dict | None = None
  fsdp: bool = False  # weights and optimizer moments split over `data` too (`mesh.fsdp`)
  student_split: str = "tensor"  # `mesh.student_split`: "batch" = a replicated student on rows split over both axes
  axes: dict[str, int] | None = None  # the whole mesh, {axis: size} in mesh order (None: data x tensor, `mesh`)

  @property
  def mesh_axes(self) -> dict[str, int]:
    """Every mesh axis and its size, in mesh order (``mesh`` holds ``(data, tensor)`` only)."""
    return dict(self.axes) if self.axes else {"data": self.mesh[0], "tensor": self.mesh[1]}
  attention: str = "auto"  # the models' `ModelConfig.attention` ("teacher X, student Y" when they differ)
  suggestions: list["Plan"] = dataclasses.field(default_factory=list)
  placement: dict | None = None  # where the teacher should live (`_placement.placements`), when asked
  notes: list[str] = dataclasses.field(default_factory=list)

  @property
  def limit_bytes(self) -> float | None:
    return None if self.budget_bytes is None else self.headroom * self.budget_bytes

  @property
  def over_bytes(self) -> float | None:
    """Bytes per device above the limit (negative: room left); None without a budget or a known need."""
    if self.limit_bytes is None or self.need_bytes is None:
      return None
    return self.need_bytes - self.limit_bytes

  @property
  def need_bytes(self) -> float | None:
    """What a device must hold at once (``memory["need"]``; plans stored before it: ``total``)."""
    return self.memory.get("need", self.memory.get("total"))

  @property
  def step_seconds(self) -> float | None:
    """The roofline step time (peak rates; `estimate_seconds` is the figure to compare configurations by)."""
    return self.time.get("step_s")

  @property
  def estimate_seconds(self) -> float | None:
    """The step time the plan stands behind: the calibrated estimate where a calibration covers this target,
    else the roofline (`estimate_label` says which)."""
    cal = self.time.get("calibrated")
    return cal["step_s"] if cal else self.step_seconds

  def estimate_label(self) -> str:
    """``est. X ms/step`` (calibrated, with its band) or ``roofline X ms/step``; empty without an estimate."""
    cal, step = self.time.get("calibrated"), self.estimate_seconds
    if step is None:
      return ""
    if not cal:
      return f"roofline {1e3 * step:.1f} ms/step"
    band = "" if cal.get("band") is None else f" (band {1e3 * cal['low_s']:.1f}-{1e3 * cal['high_s']:.1f})"
    return f"est. {1e3 * step:.1f} ms/step{band}"

  def describe(self) -> str:
    """The knobs of this configuration in one line (what a suggestion changes)."""
    chunk = "full logits" if self.chunk_size is None else f"chunk_size={self.chunk_size}"
    fsdp = (" fsdp" if self.fsdp else "") + (" student over batch" if self.student_split == "batch" else "")
    return f"mesh {shape_label(self.mesh_axes)}{fsdp}, remat={self.remat}, {chunk}, batch {self.batch}x{self.seq}"

  def to_dict(self) -> dict[str, Any]:
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "suggestions"}
    out["mesh"] = self.mesh_axes
    del out["axes"]
    out["limit_bytes"] = self.limit_bytes
    out["over_bytes"] = self.over_bytes
    out["suggestions"] = [s.to_dict() for s in self.suggestions]
    return out

  def to_json(self, **kw) -> str:
    return json.dumps(self.to_dict(), **kw)

  def table(self) -> str:
    """A readable report (what ``meshdistill plan`` prints)."""
    m, lines = self.memory, []
    per = "chip" if self.devices_per_chip == 1 else f"device ({self.devices_per_chip} per chip)"
    lines.append(f"plan: {self.teacher} ({count_label(self.params['teacher'])} params) -> {self.student} "
                 f"({count_label(self.params['student'])} params), {self.strategy}")
    lines.append(f"target: {self.target} = {self.devices} x {self.device_kind}, mesh "
                 f"{' x '.join(f'{a}={v}' for a, v in self.mesh_axes.items())}{' (fsdp: weights split over data too)' if self.fsdp else ''}{' (student replicated, on rows split over data x tensor)' if self.student_split == 'batch' else ''}; batch {self.batch} x seq {self.seq} = {self.batch * self.seq:,} tokens/step; "
                 f"dtype {self.dtype}, remat {self.remat}, attention {self.attention}, "
                 + ("full logits" if self.chunk_size is None else f"chunk_size {self.chunk_size}"))
    lines.append("")
    lines.append(f"memory per {per}:")
    for key, label in MEMORY_ROWS:
      lines.append(f"  {label:<30} {_gib(m[key]):>11}")
    lines.append(f"  {'total':<30} {_gib(m['total']):>11}   (compiler: arguments {_gib(m['arguments'])}, "
                 f"temp {_gib(m['temp'])}, outputs {_gib(m['output'])}, aliased {_gib(m['alias'])})")
    if self.budget_bytes is None:
      lines.append("  budget: none known for this device (give hbm_gib / --hbm-gib to check the fit)")
    else:
      verdict = "FITS" if self.fits else "DOES NOT FIT"
      head = f"  budget {_gib(self.budget_bytes)} x headroom {self.headroom:g} = {_gib(self.limit_bytes)}: {verdict}"
      if m.get("total") is None:
        lines.append(head + " (the compiler ran out of memory; see the note)")
      else:
        if m.get("compiler_peak") is not None:
          lines.append(f"  {'compiler peak (live at once)':<30} {_gib(m['compiler_peak']):>11}   (what the fit is "
                       "judged on)")
        lines.append(head + f" ({100 * self.need_bytes / self.budget_bytes:.0f}% of the budget; "
                     + (f"{_gib(-self.over_bytes)} to spare)" if self.fits else f"{_gib(self.over_bytes)} over)"))
    lines.append("")
    f = self.flops
    lines.append("FLOPs per step, per device:")
    lines.append(f"  compiled (XLA cost analysis)   {_e(f['compiled'])}")
    if f.get("counted") is not None and f["counted"] != f["compiled"]:
      lines.append(f"  loops counted whole            {_e(f['counted'])}   (scanned blocks, chunked loss: body x trips)")
    if f.get("kernels"):
      lines.append(f"  + Pallas kernels (analytic)    {_e(f['kernels'])}   (attention inside the splash kernel)")
    lines.append(f"  analytic 2*N_t + 6*N_s /token  {_e(f['analytic'])}   (compiled / analytic = "
                 + (f"{_counted(f) / f['analytic']:.3f})" if _counted(f) and f["analytic"] else "n/a)"))
    if f.get("analytic_per_token"):
      lines.append(f"  analytic per token             {_e(f['analytic_per_token'])}   (N_t = "
                   f"{count_label(f['matmul_params_teacher'])}, N_s = {count_label(f['matmul_params_student'])} "
                   "matmul parameters)")
    split, shares = f.get("split") or {}, self.time.get("mfu_split") or {}
    names = (("teacher_forward", "teacher forward"), ("student_forward_backward", "student forward+backward"),
             ("generation", "generation (sampling, not in the step time)"))
    for key, label in names:
      if key in split:
        mfu = f"   MFU share {100 * shares[key]:.1f}%" if key in shares else ""
        lines.append(f"  {label:<30} {_e(split[key])}{mfu}")
    if "compiled_rest" in split:
      lines.append(f"  compiled: teacher blocks {_e(split['compiled_teacher_blocks'])}, student blocks "
                   f"{_e(split['compiled_student_blocks'])}, the rest {_e(split['compiled_rest'])}")
    lines.append("")
    lines.append("collectives (per device, ops in the program text):")
    if not self.collectives:
      lines.append("  none")
    for c in self.collectives:
      lines.append(f"  {c['kind']:<19} over {c['axis']:<12} {c['count']:>5} ops  {_gib(c['bytes']):>11}")
    lines.append("")
    lines += step_time_lines(self.time, m)
    lines.append(f"compile time on this machine: {self.compile_seconds:.1f} s")
    for note in self.notes:
      lines.append(f"note: {note}")
    if self.placement is not None:
      lines.append("")
      lines.append(placement_table(self.placement))
    if self.suggestions:
      lines.append("")
      lines.append("nearest configurations that fit (each compiled):")
      for s in self.suggestions:
        step = s.estimate_label()
        need = s.need_bytes if s.need_bytes is not None else s.memory["total"]
        lines.append(f"  {s.describe()}: {_gib(need)} per device{', ' + step if step else ''}, compiled in "
                     f"{s.compile_seconds:.0f} s")
    elif self.fits is False:
      lines.append("")
      lines.append("no configuration that fits was found among those tried; see --search, a larger topology, "
                   "or a smaller batch")
    return "\n".join(lines)


def model_notes(teacher, student) -> list[str]:
  """Notes on what the compiler's numbers leave out for these models' settings (`ModelConfig`s)."""
  notes = []
  if "splash" in (teacher.attention, student.attention):
    notes.append("attention=splash: XLA's cost analysis does not see inside the Mosaic kernel; the roofline adds its "
                 "attention matmuls counted analytically (flops['kernels'], causal: half of T x T), the compiled "
                 "FLOPs leave them out")
  return notes


def search_table(plans: list[Plan]) -> str:
  """Ranked configurations of a search, one row each."""
  rows = ["rank  mesh     remat          loss           batch      GiB/dev  fits   est. ms/step   MFU   compile s"]
  roofline_only = False
  for i, p in enumerate(plans, 1):
    loss = "full logits" if p.chunk_size is None else f"chunk {p.chunk_size}"
    cal = p.time.get("calibrated")
    roofline_only |= p.estimate_seconds is not None and not cal
    ms = "-" if p.estimate_seconds is None else f"{1e3 * p.estimate_seconds:.1f}" + ("" if cal else "*")
    mfu = cal["mfu"] if cal else p.time.get("mfu")
    mfu = "-" if mfu is None else f"{100 * mfu:.1f}%"
    fits = {True: "yes", False: "no", None: "?"}[p.fits]
    total = "oom" if p.need_bytes is None else f"{p.need_bytes / GIB:.2f}"
    mesh = f"{p.mesh[0]:>2}x{p.mesh[1]:<4}" if len(p.mesh_axes) == 2 else shape_label(p.mesh_axes)
    rows.append(f"{i:>4}  {mesh} {p.remat:<14} {loss:<14} {p.batch:>4}x{p.seq:<5} "
                f"{total:>8}  {fits:<5} {ms:>13} {mfu:>6} {p.compile_seconds:>10.1f}")
  if roofline_only:
    rows.append("* the roofline (no calibration covers this target); the others are calibrated estimates")
  return "\n".join(rows)


def _counted(f: dict) -> float | None:
  return f.get("counted") if f.get("counted") is not None else f.get("compiled")


def count_label(n: float | None) -> str:
  """A count in the unit that keeps three significant digits: ``8.03 B``, ``1.05 M``, ``280 K``, ``96``."""
  if n is None:
    return "n/a"
  n = float(f"{n:.3g}")  # rounded first: 999,999 is 1 M, not 1e+03 K
  for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n:.0f}"


def _gib(n: float | None) -> str:
  return "n/a" if n is None else f"{n / GIB:.3f} GiB"


def _e(x: float | None) -> str:
  return "n/a" if x is None else f"{x:.3e}"


def step_time_lines(t: dict, memory: dict | None = None) -> list[str]:
  """The report's step-time lines of a plan's ``time``: the calibrated estimate (with its band) above the roofline.

  The roofline counts collectives on top of compute, none hidden; the calibrated model hides them as far as the
  published pod runs did. So the roofline is an upper bound on speed unless collectives are a large share of the step,
  where the calibrated estimate can be the shorter one: the roofline line then says why, and the calibrated line
  says when the collectives' share is beyond every published run's (an extrapolation)."""
  if t.get("step_s") is None:
    why = t.get("why") or ("the compiler produced no program" if (memory or {}).get("output") is None
                           else "no peak FLOP/s / bandwidth known for this device")
    return [f"step time: no estimate ({why})"]
  lines = []
  comm = "n/a (no ICI bandwidth known)" if t["comm_s"] is None else f"{1e3 * t['comm_s']:.1f} ms"
  cal = t.get("calibrated")
  if cal:
    chip = cal.get("source") == "chip"
    what = (f"no published {cal['generation']} rows: the pooled fraction of peak, the band the largest "
            "leave-generation-out error" if cal.get("pooled") else
            f"the largest leave-one-config-out error on steps measured on one {cal.get('generation', '')} chip"
            if chip else f"the largest leave-one-out error on published {cal.get('generation', '')} pod runs")
    band = (f"no band: too few {'measured' if chip else 'published'} rows" if cal["band"] is None else
            f"band {1e3 * cal['low_s']:.1f}-{1e3 * cal['high_s']:.1f} ms: +-{100 * cal['band']:.0f}%, {what}")
    if cal.get("extrapolated"):
      band += (f"; collectives are {100 * cal['comm_share']:.0f}% of the roofline step, more than on any published "
               f"run ({100 * cal['published_comm_share']:.0f}%): how far they hide behind compute is extrapolated")
    lines.append(f"calibrated step time {1e3 * cal['step_s']:.1f} ms ({band}); MFU {100 * cal['mfu']:.1f}%, "
                 f"{cal['tokens_per_s']:,.0f} tokens/s")
    if chip and t.get("cycles"):
      c = t["cycles"]
      lines.append(f"  = the TPU compiler's estimate {c['matmul'] / 1e6:,.0f} + {c['other'] / 1e6:,.0f} M cycles "
                   f"(matmul fusions + the rest, at the chip source's measured rates) + attention kernels "
                   f"{1e3 * t['kernel_s']:.1f} ms at peak / {cal['kernel_fraction']:.2f}")
  bound = "an upper bound on speed"
  if cal and cal["step_s"] < t["step_s"]:
    bound = ("peak rates, collectives on top of compute: here not an upper bound, the calibrated estimate hides "
             "collectives behind compute and is shorter")
  lines.append(f"roofline step time {1e3 * t['step_s']:.1f} ms ({bound}) = max(compute {1e3 * t['compute_s']:.1f} ms, "
               f"HBM {1e3 * t['hbm_s']:.1f} ms) + collectives {comm}; MFU {100 * t['mfu']:.1f}%, "
               f"{t['tokens_per_s']:,.0f} tokens/s")
  return lines
