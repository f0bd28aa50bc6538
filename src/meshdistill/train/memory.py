"""Will the step fit? Per-device memory of the compiled step, and turning remat on when it would not.

Before the first step a trainer can call `fit_remat(distiller, state, batch)`: it compiles
(without running) the step, reads XLA's per-device memory analysis and compares it with
the device's memory (``device.memory_stats()["bytes_limit"]``; on CPU there is none, so
pass ``budget_bytes``). When the step would not fit it tries rematerialisation policies
(`meshdistill.models.decoder.REMAT_POLICIES`, applied per student block) from the
cheapest in compute to the leanest in memory, and returns a `Distiller` using the first
that fits, logging the decision, instead of dying with out-of-memory at step 1.

The teacher runs under ``stop_gradient``: none of its activations are kept for a backward
pass, so only the student's remat setting matters.

Estimate used: `MemoryReport.need_bytes`, the compiler's own peak of live buffers where the
backend reports one (libtpu does), else ``argument + output - alias + temp`` bytes per device
(donated state buffers alias outputs). Measuring compiles the step once per tried policy; the chosen
distiller compiles its own step again on first use.

On CPU, XLA's default scheduler optimises for concurrency and computes the recomputed
activations early, so remat saves nothing there; `CPU_MEMORY_SCHEDULER` (pass it as
``compiler_options``) selects the memory-optimised scheduler, under which remat shows its
saving (a 8-layer student: temp 46 -> 24 MB). GPU and TPU schedulers are memory-aware.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Callable, Sequence

import jax
from flax import nnx

from meshdistill.models import Decoder, abstract_params
from meshdistill.models.decoder import REMAT_POLICIES

log = logging.getLogger(__name__)

# Tried in this order: cheapest recomputation first, most memory saved last.
REMAT_ORDER = ("none", "dots", "dots_no_batch", "full")

# XLA compiler options selecting the memory-optimised scheduler of the CPU backend.
CPU_MEMORY_SCHEDULER = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Per-device bytes of a compiled program (from ``compiled.memory_analysis()``)."""

  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  # the compiler's own peak of live buffers (``peak_memory_in_bytes``) of a program compiled for TPUs (libtpu's, its
  # temporaries included); None elsewhere (XLA:CPU reports one without its temporaries). It is not `total_bytes`, which counts every temporary as live beside every argument, and the
  # two differ either way: the Gemma-3 1B pair's step on one v5e chip 14.13 GiB against 16.83, a bare optimizer
  # update above it. What a fit is judged on: `need_bytes`.
  peak_bytes: int | None = None

  @property
  def total_bytes(self) -> int:
    """Arguments + outputs + temporaries, counting donated (aliased) buffers once."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def need_bytes(self) -> int:
    """What the device must hold at once: the compiler's peak (`peak_bytes`) where the backend reports one, else
    `total_bytes`. On one TPU v5e chip (15.75 GiB) every measured step whose total exceeded the chip ran, its
    peak below it: Qwen3 1.7B -> 0.6B at 4 x 2048 with 2048-token loss chunks, a total of 18.09 GiB and a peak of
    14.87 (benchmarks/results/tpu_step.md); libtpu refuses a program by its peak."""
    return self.peak_bytes if self.peak_bytes is not None else self.total_bytes

  @classmethod
  def of(cls, compiled) -> "MemoryReport":
    m = compiled.memory_analysis()
    if m is None:
      raise RuntimeError(f"the {jax.default_backend()} backend gives no memory analysis of compiled programs")
    return cls(
        temp_bytes=int(m.temp_size_in_bytes),
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        peak_bytes=(int(m.peak_memory_in_bytes) if getattr(m, "peak_memory_in_bytes", 0)
                    and _platform(compiled) == "tpu" else None),
    )

  def __str__(self) -> str:
    peak = "" if self.peak_bytes is None else f"compiler's peak {_mib(self.peak_bytes)}; "
    return (f"{_mib(self.total_bytes)} per device ({peak}temp {_mib(self.temp_bytes)}, arguments "
            f"{_mib(self.argument_bytes)}, outputs {_mib(self.output_bytes)}, aliased {_mib(self.alias_bytes)})")


def _platform(compiled) -> str | None:
  """The platform of the devices ``compiled`` runs on (abstract TPU devices of a topology included)."""
  for sharding in jax.tree.leaves(compiled.input_shardings):
    for device in getattr(sharding, "device_set", ()):
      return device.platform
  return None


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB"


def step_memory(distiller, state, batch, compiler_options: dict | None = None) -> MemoryReport:
  """Per-device memory of ``distiller``'s step on ``batch`` (compiles; runs nothing; ``state`` is not consumed).

  ``compiler_options``: XLA options for this compilation (e.g. `CPU_MEMORY_SCHEDULER`). A compiler that refuses
  the program for the device's memory (libtpu: ``RESOURCE_EXHAUSTED ... required for HLO temporaries (20.22G)
  exceeds available HBM``) gives a report of what it said it needed (`out_of_memory_report`).
  """
  lowered = distiller.lower(state, batch)
  try:
    return MemoryReport.of(lowered.compile(compiler_options=compiler_options))
  except jax.errors.JaxRuntimeError as e:
    report = out_of_memory_report(str(e))
    if report is None:
      raise
    return report


def out_of_memory_report(message: str) -> MemoryReport | None:
  """A `MemoryReport` of a compiler's out-of-memory refusal (its temporaries as the message states them, in
  ``G`` / ``M`` / ``K`` units, else more than any device holds); None for any other error."""
  if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
    return None
  found = re.search(r"required for HLO temporaries \(([\d.]+)([KMG])", message)
  need = int(float(found.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30}[found.group(2)]) if found else 2**62
  return MemoryReport(temp_bytes=need, argument_bytes=0, output_bytes=0, alias_bytes=0)


def device_memory_limit(device: jax.Device | None = None) -> int | None:
  """``bytes_limit`` of ``device`` (default: the first device), or None where the backend has none (CPU)."""
  device = device if device is not None else jax.devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 -- backends without allocator statistics raise various errors
    return None
  return None if not stats or "bytes_limit" not in stats else int(stats["bytes_limit"])


def with_remat(model: Decoder, remat: str) -> Decoder:
  """``model`` with rematerialisation policy ``remat`` (same parameter arrays; nothing is copied)."""
  cfg = model.cfg.replace(remat=remat)  # validates the name
  graphdef, _, _ = abstract_params(cfg)
  return nnx.merge(graphdef, nnx.state(model))


@dataclasses.dataclass(frozen=True)
class RematChoice:
  """The outcome of `choose_remat`: the policy, whether it fits, and every measurement made."""

  remat: str
  fits: bool
  budget_bytes: int | None
  reports: dict[str, MemoryReport]


def choose_remat(
    measure: Callable[[str], MemoryReport],
    budget_bytes: int | None,
    *,
    candidates: Sequence[str] = REMAT_ORDER,
    headroom: float = 0.9,
) -> RematChoice:
  """The first of ``candidates`` whose ``measure(remat).need_bytes <= headroom * budget_bytes``.

  With ``budget_bytes=None`` (unknown) the first candidate is kept without measuring.
  When none fits, the leanest measured policy is returned with ``fits=False`` (logged).
  """
  bad = [c for c in candidates if c not in REMAT_POLICIES]
  if bad or not candidates:
    raise ValueError(f"remat candidates {tuple(candidates)!r}: choose from {tuple(REMAT_POLICIES)}")
  if not 0 < headroom <= 1:
    raise ValueError(f"headroom={headroom!r} must lie in (0, 1] (fraction of device memory the step may use)")
  if budget_bytes is None:
    log.info("no device memory limit known (pass budget_bytes); keeping remat=%r", candidates[0])
    return RematChoice(candidates[0], True, None, {})
  limit = headroom * budget_bytes
  reports: dict[str, MemoryReport] = {}
  for name in candidates:
    reports[name] = report = measure(name)
    if report.need_bytes <= limit:
      if name != candidates[0]:
        log.warning("step with remat=%r needs %s > %.0f%% of %s; turned on remat=%r: %s", candidates[0],
                    reports[candidates[0]], 100 * headroom, _mib(budget_bytes), name, report)
      else:
        log.info("step fits with remat=%r: %s (budget %s)", name, report, _mib(budget_bytes))
      return RematChoice(name, True, budget_bytes, reports)
  best = min(reports, key=lambda k: reports[k].need_bytes)
  log.warning("no remat policy fits the step in %.0f%% of %s (leanest: remat=%r, %s); reduce the batch or "
              "sequence length, or split weights over more tensor devices", 100 * headroom, _mib(budget_bytes),
              best, reports[best])
  return RematChoice(best, False, budget_bytes, reports)


def rebuild_with_remat(trainer, remat: str):
  """``trainer`` (a `Distiller` or `HardLabelTrainer`) with its student using ``remat`` (``trainer.with_remat``).

  Train states of ``trainer`` are valid for it (remat changes no parameter), and its
  ``init_state()`` starts from the same initial student.
  """
  return trainer.with_remat(remat)


def fit_remat(
    distiller,
    state,
    batch,
    *,
    budget_bytes: int | None = None,
    candidates: Sequence[str] | None = None,
    headroom: float = 0.9,
    compiler_options: dict | None = None,
):
  """Returns ``(trainer, RematChoice)``: ``distiller``, or a copy with remat on if the step would not fit.

  Args:
    distiller, state, batch: what the first step would run (nothing runs; ``state`` is kept).
    budget_bytes: per-device memory; default the device's ``bytes_limit`` (None on CPU:
      then nothing is measured and ``distiller`` is returned as is).
    candidates: policies to try in order; default: the student's current one, then the
      leaner ones of `REMAT_ORDER`.
    headroom: fraction of the budget the step may use.
    compiler_options: XLA options of the measured steps (e.g. `CPU_MEMORY_SCHEDULER`); the
      returned trainer's step compiles with them too, so it runs the program that was measured.
  """
  given = distiller.student_cfg.remat
  current = REMAT_ORDER[0] if given == "auto" else given  # auto, not chosen yet: from the cheapest policy on
  if candidates is None:
    candidates = (current,) + tuple(r for r in REMAT_ORDER[REMAT_ORDER.index(current) + 1:])
  if budget_bytes is None:
    devices = distiller.mesh.devices.flat if distiller.mesh is not None else jax.devices()[:1]
    budget_bytes = device_memory_limit(next(iter(devices)))
  base = distiller.with_compiler_options(compiler_options) if compiler_options else distiller
  built = {} if given == "auto" else {current: base}

  def measure(remat: str) -> MemoryReport:
    if remat not in built:
      built[remat] = rebuild_with_remat(base, remat)
    return step_memory(built[remat], state, batch)

  choice = choose_remat(measure, budget_bytes, candidates=candidates, headroom=headroom)
  if budget_bytes is None:
    return distiller, choice
  chosen = built.get(choice.remat) or rebuild_with_remat(base, choice.remat)
  return chosen, choice
