"""The `Planner`: the plans of one teacher / student pair on one target, each configuration compiled once."""

from __future__ import annotations

import dataclasses
import logging
import math

from meshdistill.config import Config
from meshdistill.train import cost
from meshdistill.train.cost import kernel_flops
from meshdistill.train.memory import CPU_MEMORY_SCHEDULER, REMAT_ORDER
from meshdistill.parallel.backends import layout_class
from meshdistill.parallel.mesh import AXES, DATA, TENSOR, mesh_of, mesh_shape, shape_label
from meshdistill.models.decoder import ModelConfig
from meshdistill.models.moe import inactive_params
from meshdistill.strategies import DEFAULT_CHUNK  # tokens per chunk tried by `search` and the suggestions
from meshdistill.planner._compile import (FAST_COMPILE, abstract_distiller, collectives, compile_step,
                                         shard_bytes)
from meshdistill.planner import _calibrate
from meshdistill.planner._cost import flops_split, loop_counts, mfu_split
from meshdistill.planner._hardware import Target
from meshdistill.planner._presets import PRESETS
from meshdistill.planner._progress import Progress
from meshdistill.planner._report import Plan, model_notes
from meshdistill.jobs import strategy_and_optimizer

log = logging.getLogger(__name__)

GIB = 2**30
_UNSET = object()


@dataclasses.dataclass(frozen=True)
class Knobs:
  """What a search varies: the mesh, the student's remat policy, the loss's chunk size, the batch size.

  The mesh is ``data`` x ``tensor`` and ``axes``: the layout's other declared axes above size 1, in mesh order (e.g.
  ``(("expert", 2),)``); `shape` is the whole mesh."""

  data: int
  tensor: int
  remat: str
  chunk_size: int | None
  batch: int
  axes: tuple[tuple[str, int], ...] = ()

  @classmethod
  def on(cls, shape: dict[str, int], remat: str, chunk_size: int | None, batch: int) -> Knobs:
    """The knobs of a mesh ``shape`` (``{axis: size}``, `meshdistill.parallel.mesh.mesh_shape`)."""
    axes = tuple((a, v) for a, v in shape.items() if a not in AXES and v != 1)
    return cls(shape.get(DATA, 1), shape.get(TENSOR, 1), remat, chunk_size, batch, axes)

  @property
  def shape(self) -> dict[str, int]:
    """The mesh, ``{axis: size}`` in mesh order."""
    return {DATA: self.data, **dict(self.axes), TENSOR: self.tensor}


def mesh_shapes(n: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
  """Every ``{axis: size}`` over ``axes`` whose sizes multiply to ``n``, ordered by the last axis's size first (then
  the one before, ...): for ``(data, tensor)``, least ``tensor`` first."""
  if not axes:
    return [{}] if n == 1 else []
  *rest, last = axes
  return [{**head, last: k} for k in _divisors(n) for head in mesh_shapes(n // k, tuple(rest))]


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _block_trips(cfg: ModelConfig) -> int:
  """Trips of a model's block loop (`_cost.loop_counts` names the loops by it): one per ``scan_period`` layers when
  scanned (groups of layers that attend differently: `meshdistill.models._scan`; the layers after the last whole
  group run outside that loop, so their FLOPs count as the rest), ``n_layers`` otherwise."""
  if not getattr(cfg, "scan_layers", False):
    return cfg.n_layers
  return cfg.n_layers // cfg.scan_period


def _matmul_params(cfg: ModelConfig, total: int) -> int:
  """Parameters that take part in a token's matmuls: all but an untied input embedding (a lookup) and the experts a
  token is not routed to (a mixture of experts counts its active parameters: `meshdistill.models.moe.inactive_params`)."""
  return (total if cfg.tie_embeddings else total - cfg.vocab_size * cfg.d_model) - inactive_params(cfg)


class Planner:
  """Plans of one teacher / student pair and distillation config on one target, compiled on demand."""

  def __init__(self, cfg: Config, teacher: ModelConfig, student: ModelConfig, labels: tuple[str, str],
               target: Target, seq: int, fast_compile: bool = False):
    self.cfg, self.teacher, self.student, self.labels = cfg, teacher, student, labels
    self.target, self.seq = target, seq
    self.headroom = cfg.safeguards.remat.headroom
    # On CPU with a budget, `distill` measures and runs the step under the memory-optimised scheduler.
    self.options = CPU_MEMORY_SCHEDULER if target.platform == "cpu" and target.budget_bytes is not None else None
    self.fast_compile = fast_compile  # `FAST_COMPILE`: a faster compile of another program (see its note)
    if fast_compile:
      self.options = {**(self.options or {}), **FAST_COMPILE}
    self._plans: dict[Knobs, Plan] = {}
    self._static: dict[Knobs, int] = {}
    self.progress = Progress()

  # ------------------------------------------------------------------ layouts
  def split_error(self, tensor: int) -> str | None:
    for who, m in (("teacher", self.teacher), ("student", self.student)):
      try:
        m.check_tensor_split(tensor)
      except ValueError as e:
        return f"{who} ({self.labels[who == 'student']}): {e}"
    return None

  def layouts(self, batch: int) -> list[dict[str, int]]:
    """Mesh shapes (``{axis: size}``, `Knobs.on`) of the target's devices the models split over and ``batch``
    divides: every factorisation of the device count over the axes the layout declares
    (`meshdistill.parallel.layout.Layout.axes`, e.g. ``data``, ``expert``, ``tensor``), least ``tensor`` first."""
    n, axes = len(self.target.devices), layout_class(self.cfg.mesh.backend).axes
    out = []
    for shape in mesh_shapes(n, axes):
      shape = {DATA: shape.get(DATA, 1), **{a: v for a, v in shape.items() if a not in AXES},
               TENSOR: shape.get(TENSOR, 1)}
      if batch % self._row_split(shape[DATA], shape[TENSOR]) == 0 and self.split_error(shape[TENSOR]) is None:
        out.append(shape)
    return out

  def _row_split(self, data: int, tensor: int) -> int:
    """How many devices a batch's rows are split over: ``data``, times ``tensor`` with ``mesh.student_split: batch``
    (the student on rows split over both axes)."""
    return data * tensor if self.cfg.mesh.student_split == "batch" else data

  def check_mesh(self, data: int, tensor: int, batch: int, axes: dict[str, int] | None = None) -> None:
    """Raises a clear error for a mesh ``data`` x ``tensor`` (``axes``: its other axes) this target, these models or
    ``batch`` cannot take, listing the layouts that can."""
    n = len(self.target.devices)
    for name, v in (("data", data), ("tensor", tensor), *(axes or {}).items()):
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"mesh {name}={v!r} must be a positive integer")
    ok = ", ".join(shape_label(s) for s in self.layouts(batch)) or "none"
    shape = {DATA: data, **(axes or {}), TENSOR: tensor}
    refused = layout_class(self.cfg.mesh.backend).check_settings(data, tensor, axes)  # e.g. pmap: data only
    if refused:
      raise ValueError(f"mesh {shape_label(shape)}: {refused}")
    need = math.prod(shape.values())
    if need != n:
      raise ValueError(f"mesh {shape_label(shape)} ({' x '.join(shape)}) needs {need} devices but {self.target.name} "
                       f"has {n}; layouts of {n} devices that fit these models and batch {batch}: {ok}")
    err = self.split_error(tensor)
    if err:
      raise ValueError(f"mesh tensor={tensor}: {err}; layouts that split both models: {ok}")
    rows = self._row_split(data, tensor)
    if batch % rows:
      split = f"data={data}" if rows == data else f"data x tensor={rows} (mesh.student_split: batch)"
      other = "" if rows == data else " (or mesh.student_split: tensor)"
      raise ValueError(f"batch {batch} is not divisible by mesh {split}; use a multiple of {rows}, or one of "
                       f"the layouts {ok}{other}")

  # ------------------------------------------------------------------- builds
  def _distiller(self, k: Knobs, teacher: ModelConfig | None = None, student: ModelConfig | None = None):
    """The abstract Distiller of ``k`` (``teacher`` / ``student``: other model configs, e.g. shallow copies)."""
    mesh = mesh_of(k.shape, self.target.devices)
    cfg = self.cfg.replace(distill=dataclasses.replace(self.cfg.distill, chunk_size=k.chunk_size)) \
        if k.chunk_size != self.cfg.distill.chunk_size else self.cfg

    strategy, optimizer = strategy_and_optimizer(cfg, self.student.n_layers)
    student = student or self.student
    student = student.replace(remat=k.remat) if k.remat != student.remat else student
    return abstract_distiller(teacher or self.teacher, student, strategy, optimizer, mesh, self.options,
                              lora=self.cfg.models.student_lora, teacher_quantize=self.cfg.models.teacher_quantize,
                              fsdp=self.cfg.mesh.fsdp, student_split=self.cfg.mesh.student_split,
                              loss_scale=self.cfg.safeguards.loss_scale,
                              quantize_aware=self.cfg.models.student_quantize_aware)

  def static_bytes(self, k: Knobs) -> int:
    """Per-device bytes of the step's inputs (weights, optimizer state, batch): a lower bound, without compiling."""
    if k not in self._static:
      d = self._distiller(k)
      state = d.init_state()
      self._static[k] = shard_bytes((state, d.teacher_params)) + 12 * k.batch * self.seq // k.data
    return self._static[k]

  def plan(self, k: Knobs) -> Plan:
    """Compiles configuration ``k`` (once) and returns its `Plan`."""
    if k in self._plans:
      return self._plans[k]
    self.check_mesh(k.data, k.tensor, k.batch, dict(k.axes))
    label = self.progress.start(f"{self.labels[0]} -> {self.labels[1]} for {self.target.name}: mesh "
                                f"{shape_label(k.shape)}"
                                f", remat={k.remat}, chunk_size={k.chunk_size}, batch {k.batch}x{self.seq}")
    d = self._distiller(k)
    c = compile_step(d, k.batch, self.seq, report=lambda message: self.progress.step(label, message))
    self.progress.finished(c.compile_seconds)
    mem = c.memory
    memory = dict(c.parts)
    budget = self.target.budget_bytes
    if mem is None:  # the TPU compiler refused: out of HBM
      temp = c.oom_bytes[0]
      args = sum(c.parts.values())
      total = None if temp is None else args + temp
      memory.update(temp=temp, outputs=None, total=total, arguments=args, output=None, alias=None,
                    compiler_peak=None, need=total)
      fits = False
    else:
      memory.update(temp=mem.temp_bytes, outputs=mem.output_bytes - mem.alias_bytes, total=mem.total_bytes,
                    compiler_peak=mem.peak_bytes, need=mem.need_bytes,
                    arguments=mem.argument_bytes, output=mem.output_bytes, alias=mem.alias_bytes)
      fits = None if budget is None else mem.need_bytes <= self.headroom * budget
    n = len(self.target.devices)
    tokens = k.batch * self.seq
    n_t = _matmul_params(self.teacher, c.params["teacher"])
    n_s = _matmul_params(self.student, c.params["student"])
    analytic = (2 * n_t + 6 * n_s) * tokens / n
    kernels = kernel_flops(self.teacher, self.student, k.remat, self.seq) * tokens / n  # not in XLA's count
    colls = collectives(c.hlo, k.shape)
    counts, uncounted, prog = None, None, None
    try:  # scanned blocks and the chunked loss are loops: counted whole from the program's text (`_cost`)
      if " while(" in c.hlo or "estimated_cycles" in c.hlo:
        prog = cost.parse(c.hlo)
      counts = loop_counts(c, k.shape, (_block_trips(d.teacher_cfg) if d.teacher_cfg else 0,  # the built models'
                                        _block_trips(d.student_cfg)), prog)  # layouts (`scan_layers: auto` decided)
    except ValueError as e:  # a loop without a trip count: memory stands, no step time
      uncounted, prog = str(e), None
    flops, bytes_accessed = (None, None) if uncounted else (c.flops, c.bytes_accessed)
    if counts is not None:  # the scanned loops counted whole (see `_cost`)
      flops, bytes_accessed, colls = counts.flops, counts.bytes_accessed, counts.collectives
    p = Plan(
        teacher=self.labels[0], student=self.labels[1], params=c.params, target=self.target.name,
        device_kind=str(getattr(self.target.devices[0], "device_kind", self.target.platform)), devices=n,
        devices_per_chip=self.target.devices_per_chip, mesh=(k.data, k.tensor), axes=k.shape, batch=k.batch,
        seq=self.seq,
        remat=k.remat, chunk_size=k.chunk_size, dtype=self.student.dtype, strategy=type(d.strategy).__name__,
        memory=memory, budget_bytes=budget, headroom=self.headroom, fits=fits,
        flops={"compiled": c.flops, "counted": flops, "analytic": analytic,
               "analytic_per_token": float(2 * n_t + 6 * n_s),
               "matmul_params_teacher": n_t, "matmul_params_student": n_s, "kernels": kernels},
        collectives=colls, time=self._roofline(flops, bytes_accessed, colls, analytic * n, tokens, kernels),
        compile_seconds=c.compile_seconds + (counts.compile_seconds if counts is not None else 0.0),
        compiler_options=self.options, fsdp=self.cfg.mesh.fsdp, attention=self._attention(),
        student_split=self.cfg.mesh.student_split,
    )
    on_policy = getattr(self.cfg.distill, "on_policy", None)
    p.flops["split"] = flops_split(n_t, n_s, k.batch, self.seq, n, on_policy, counts)
    chip = self.target.chip
    peak = None if chip is None else self.target.per_device(chip.peak_bf16_flops)
    p.time["mfu_split"] = mfu_split(p.flops["split"], p.time.get("step_s"), peak)
    cal = None if chip is None else self.calibration()
    if chip is not None and prog is not None:  # the TPU compiler's own per-instruction estimate
      cycles = cost.estimated_cycles(prog)
      if cycles is not None:
        executed = kernel_flops(self.teacher, self.student, k.remat, self.seq, executed=True) * tokens / n
        p.time["cycles"] = cycles
        p.time["kernel_s"] = executed / self.target.per_device(chip.peak_bf16_flops)
    p.time["calibrated"] = None if cal is None else cal.of(p.time, chip.family)
    if p.time["calibrated"] is None and cal is not None and cal is not _calibrate.CALIBRATION:
      p.time["calibrated"] = _calibrate.CALIBRATION.of(p.time, chip.family)  # a program without the chip's terms
    if uncounted:
      p.time["why"] = f"loops: {uncounted}"
    if counts is not None:
      p.notes.append("loops (scanned blocks, the chunked loss): FLOPs, bytes and collectives counted whole, each loop "
                     "body's XLA count times its trip count, read from the compiled program "
                     f"({counts.compile_seconds:.1f} s); flops['compiled'] is the program's own count (one "
                     "iteration per loop)")
      p.flops["loops"] = counts.loops
    if self.fast_compile:
      p.notes.append("--fast-compile: compiled with XLA's least execution-time effort (2-3x less compile time); its "
                     "program is not the one distill runs: per-chip memory moved by -13% to +3% and bytes accessed "
                     "by up to -41% against the default compile on the pairs measured, FLOPs and collectives within "
                     "0.5%; it may run out of HBM where the default compile would not "
                     "(benchmarks/results/plan_speed.md); plan without it before renting")
    if c.oom:
      p.notes.append(f"the TPU compiler stopped: {c.oom} (the memory above: the step's inputs plus the temporaries "
                     "it names; FLOPs and collectives need a program that fits)")
    if on_policy is not None and getattr(on_policy, "active", False):
      p.notes.append("distill.on_policy is active: this plans the train step only; flops['split']['generation'] is "
                     "the sampling's expected FLOPs per step (analytic), outside the step time")
    lora = self.cfg.models.student_lora
    if lora.enabled:
      base = f", {lora.quantize} base" if lora.quantize else ""
      p.notes.append(f"student.lora: rank {lora.rank}{base}; only the {c.params['student_trained']:,} adapter "
                     "parameters train (the analytic 6*N_s also counts the frozen base's weight gradients, which "
                     "the step does not compute)")
    if self.cfg.models.teacher_quantize:
      p.notes.append(f"teacher.quantize={self.cfg.models.teacher_quantize}: the teacher's block projections stored "
                     "quantized, dequantised in the step")
    if k.remat != "none":
      p.notes.append(f"remat={k.remat} recomputes student activations: compiled FLOPs include the recomputation, "
                     "the analytic 6*N_s does not")
    p.notes += model_notes(self.teacher, self.student)
    self._plans[k] = p
    return p

  def calibration(self) -> _calibrate.Calibration | None:
    """The calibration source of this target's estimates (`_calibrate.source_for`): the chip source for one chip
    (``devices="local"`` on it, or a one-chip topology such as ``v5e:1x1``) of a generation it has rows for, else the
    published pod rows'."""
    t = self.target
    chips = len(t.devices) // max(t.devices_per_chip, 1)
    return _calibrate.source_for(chips, t.chip.family)

  def _attention(self) -> str:
    t, s = self.teacher.attention, self.student.attention
    return t if t == s else f"teacher {t}, student {s}"

  def _roofline(self, flops, bytes_accessed, colls, model_flops: float, tokens: int,
                kernels: float) -> dict[str, float | str | None]:
    chip, t = self.target.chip, self.target
    none = {"compute_s": None, "hbm_s": None, "comm_s": None, "step_s": None, "mfu": None, "tokens_per_s": None}
    if chip is None or flops is None:
      return none
    compute = (flops + kernels) / t.per_device(chip.peak_bf16_flops)
    hbm = (bytes_accessed or 0.0) / t.per_device(chip.hbm_bandwidth)
    wire = sum(x["wire_bytes"] for x in colls)
    comm = None if chip.ici_bandwidth is None else wire / t.per_device(chip.ici_bandwidth)
    step = max(compute, hbm) + (comm or 0.0)
    chips = len(t.devices) / t.devices_per_chip
    return {"compute_s": compute, "hbm_s": hbm, "comm_s": comm, "step_s": step,
            "mfu": model_flops / (step * chip.peak_bf16_flops * chips), "tokens_per_s": tokens / step}

  def announce(self, first: int, more: int = 0) -> None:
    self.progress.announce(self.teacher, self.student, self.target.platform, self.target.name, first, more)

  # ------------------------------------------------------------- alternatives
  def fits_statically(self, k: Knobs) -> bool:
    limit = None if self.target.budget_bytes is None else self.headroom * self.target.budget_bytes
    return limit is None or self.static_bytes(k) <= limit

  def nearest(self, k: Knobs, want: int, max_compiles: int) -> list[Plan]:
    """Up to ``want`` configurations near ``k`` that fit, each compiled: leaner remat (``full`` first), a chunked
    loss, more ``tensor``, then smaller batches, tried in that order (at most ``max_compiles`` compilations)."""
    leaner = list(REMAT_ORDER[REMAT_ORDER.index(k.remat) + 1:]) if k.remat in REMAT_ORDER else []
    chunk = k.chunk_size if k.chunk_size is not None else min(DEFAULT_CHUNK, k.batch * self.seq)
    more_tensor = [s for s in self.layouts(k.batch) if s[TENSOR] > k.tensor]
    order: list[Knobs] = []
    # the leanest remat first (one knob, the largest saving), then the policies between
    order += [dataclasses.replace(k, remat=r) for r in leaner[::-1]]
    if k.chunk_size is None:
      order += [dataclasses.replace(k, chunk_size=chunk), dataclasses.replace(k, chunk_size=chunk, remat="full")]
    for s in more_tensor:
      order += [Knobs.on(s, k.remat, k.chunk_size, k.batch), Knobs.on(s, "full", chunk, k.batch)]
    b = k.batch // 2
    while b >= 1 and b % k.data == 0:
      order.append(dataclasses.replace(k, batch=b, remat="full", chunk_size=chunk))
      b //= 2
    found, compiled, seen = [], 0, {k}
    for cand in order:
      if cand in seen:
        continue
      seen.add(cand)
      if len(found) >= want or compiled >= max_compiles:
        break
      if not self.fits_statically(cand):
        continue
      compiled += 1
      p = self.plan(cand)
      if p.fits:
        found.append(p)
    return found

  def candidates(self, batch: int, meshes=None, remats=None, chunk_sizes=None, batches=None) -> list[Knobs]:
    """Every combination of ``meshes`` (each a `mesh_shape` form: ``(data, tensor)``, ``"2x4"``, a mapping;
    default `layouts`), remat policies, chunk sizes and ``batches``."""
    batches = list(batches or [batch])
    remats = list(remats or dict.fromkeys(["none" if self.student.remat == "auto" else self.student.remat, "full"]))
    chunks = list(chunk_sizes or dict.fromkeys([self.cfg.distill.chunk_size, DEFAULT_CHUNK]))
    out = []
    for b in batches:
      layouts = [mesh_shape(m, "meshes") for m in meshes] if meshes else self.layouts(b)
      for shape in layouts:
        for r in remats:
          for c in chunks:
            out.append(Knobs.on(shape, r, c, b))
    return out


__all__ = ["Knobs", "PRESETS", "Plan", "Planner"]
