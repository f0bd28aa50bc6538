"""``auto`` decided at start-up for the devices present: the student's remat policy (``student.remat``), the rows
each device runs per forward and backward pass (``train.micro_batch``: gradient accumulation) and the chunked
loss's chunk size (a ``ChunkedLogitKD`` the run chose itself, `meshdistill.strategies.default_recipe`).

`auto_tune` compiles the real step (nothing runs) for candidates of the settings left at ``auto`` and keeps the best
that fits ``headroom`` of the device's memory (the compiler's peak where it reports one; a compiler's out-of-memory
refusal is a candidate that does not fit, `meshdistill.train.memory.out_of_memory_report`):

* where no memory limit is known (a CPU, no budget given) nothing is compiled: remat ``none``, the whole local batch,
  the default chunk (1024 tokens) -- the step as it ran before ``auto`` existed;
* where the device has an estimate of a compiled step's time (`meshdistill.train.cost`: one chip of the generation
  the chip calibration was measured on, a TPU v5e), the fitting candidates are ranked by it. Candidates are tried in
  cost order and only where they can win: at each micro-batch size (the whole batch first, then smaller) the
  cheapest remat that fits, and a smaller micro-batch only with a remat cheaper than the best found so far (at one
  remat a larger micro-batch is never slower, and at one micro-batch a cheaper remat never; a micro-batch whose
  cheapest remat fits ends the search). The fastest of those is then compiled at the other chunk sizes;
* elsewhere the first candidate that fits in cost order: no remat, then ``dots``, ``dots_no_batch``, ``full``
  (`meshdistill.train.memory.REMAT_ORDER`), each at the whole local batch before any micro-batch, the default chunk.

Nothing fits: the leanest candidate measured, said so. The choice is said in one line (`Tuning.line`)
and kept by program fingerprint (`program_key`; whether it fits with it) in ``$MESHDISTILL_TUNING`` (default
``$XDG_CACHE_HOME/meshdistill/tuning.json``, ``~/.cache`` by default), so a restart of the same step compiles no
candidate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Callable, Sequence

import jax

from meshdistill.models.decoder import REMAT_POLICIES
from meshdistill.parallel.mesh import TENSOR, global_batch_size
from meshdistill.strategies import DEFAULT_CHUNK, ChunkedLogitKD
from meshdistill.train import cost
from meshdistill.train.accumulate import divisors
from meshdistill.train.memory import REMAT_ORDER, MemoryReport, device_memory_limit, out_of_memory_report
from meshdistill.train.teacher import MODEL

log = logging.getLogger(__name__)

# chunk sizes of an `auto` chunked loss, the default first (the outcome where nothing is measured)
CHUNKS = (DEFAULT_CHUNK, 512, 2048)
RULES = 1  # the version of the search: part of every program key, so a changed search chooses again


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One configuration of the step: its remat policy, rows per forward and backward pass (the local batch's rows:
  the whole batch at once) and chunk size (None: no chunked loss)."""

  remat: str
  micro_batch: int
  chunk: int | None


@dataclasses.dataclass(frozen=True)
class Measured:
  """A compiled candidate: its memory, and its estimated step seconds where the device has an estimate."""

  report: MemoryReport
  seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Tuning:
  """The outcome of `auto_tune`: the candidate chosen, whether it fits, why, and every candidate measured."""

  chosen: Candidate
  fits: bool
  why: str
  rows: int  # the rows each device holds per step
  budget_bytes: int | None = None
  measured: dict = dataclasses.field(default_factory=dict)  # Candidate -> Measured
  cached: bool = False

  @property
  def remat(self) -> str:
    return self.chosen.remat

  @property
  def reports(self) -> dict[str, MemoryReport]:
    """Each measured candidate's memory by its label (``remat``, ``/micro_batch`` and ``/chunk`` where they vary)."""
    return {label(c, self.rows): m.report for c, m in self.measured.items()}

  def line(self) -> str:
    """The choice in one line: ``auto: remat=..., micro_batch=..., chunk=... (why)``."""
    c = self.chosen
    chunk = "n/a" if c.chunk is None else c.chunk
    return f"auto: remat={c.remat}, micro_batch={c.micro_batch}, chunk={chunk} ({self.why})"


def label(c: Candidate, rows: int) -> str:
  """``dots``, ``dots/mb4`` (4 rows at a time), ``dots/mb4/chunk2048``: a candidate in a report."""
  return c.remat + (f"/mb{c.micro_batch}" if c.micro_batch != rows else "") + (
      f"/chunk{c.chunk}" if c.chunk not in (None, DEFAULT_CHUNK) else "")


def search(remats: Sequence[str], micro_batches: Sequence[int], chunks: Sequence[int | None],
           measure: Callable[[Candidate], Measured], limit: float | None, estimated: bool) -> tuple:
  """``(candidate, fits, why, measured)`` over ``remats`` (cost order), ``micro_batches`` (the whole batch first) and
  ``chunks`` (the default first), compiling through ``measure`` only what can be chosen (the module doc); ``limit``:
  the bytes a step may need (None: unknown, nothing measured); ``estimated``: rank by ``Measured.seconds``."""
  first = Candidate(remats[0], micro_batches[0], chunks[0])
  if limit is None:
    return first, True, "no memory limit known: nothing compiled", {}
  measured: dict[Candidate, Measured] = {}

  def fits(c: Candidate) -> bool:
    if c not in measured:
      measured[c] = measure(c)
    return measured[c].report.need_bytes <= limit

  if not estimated:
    for mb in micro_batches:
      for remat in remats:
        c = Candidate(remat, mb, chunks[0])
        if fits(c):
          return c, True, f"the first of {len(measured)} compiled in cost order that fits", measured
  else:
    fitting: list[Candidate] = []
    cheapest = len(remats)
    for mb in micro_batches:
      for i, remat in enumerate(remats[:cheapest]):  # only a remat cheaper than a larger micro-batch's can win
        if fits(c := Candidate(remat, mb, chunks[0])):
          fitting.append(c)
          cheapest = i
          break
      if cheapest == 0:
        break
    if fitting:
      best = _fastest(fitting, measured)
      fitting += [c for ch in chunks[1:] if fits(c := dataclasses.replace(best, chunk=ch))]
      best = _fastest(fitting, measured)
      seconds = measured[best].seconds
      est = "" if seconds is None else f": {1e3 * seconds:.0f} ms"
      return best, True, f"the fastest estimated of {len(fitting)} that fit, {len(measured)} compiled{est}", measured
  if not measured:
    raise ValueError("no candidate to measure")
  leanest = min(measured, key=lambda c: measured[c].report.need_bytes)
  need = size(measured[leanest].report.need_bytes)
  return leanest, False, f"none of {len(measured)} compiled fits; the leanest, which needs {need}", measured


def _fastest(fitting: list[Candidate], measured: dict) -> Candidate:
  """The candidate of least estimated seconds (one without an estimate after every one with; ties: cost order)."""
  order = {c: i for i, c in enumerate(fitting)}
  return min(fitting, key=lambda c: (measured[c].seconds is None, measured[c].seconds or 0.0, order[c]))


def local_rows(trainer, batch: dict) -> int:
  """The rows each ``data`` shard of ``trainer``'s layout holds of ``batch`` (a process passes its own rows)."""
  B = len(batch["inputs"])
  mesh = trainer.mesh
  return (B if mesh is None else global_batch_size(B, mesh)) // trainer.layout.n_replicas


def pending(trainer) -> tuple[str, ...]:
  """The settings of ``trainer`` still ``auto``: of ``remat``, ``micro_batch``, ``chunk``."""
  return tuple(name for name, auto in (
      ("remat", trainer.student_cfg.remat == "auto"), ("micro_batch", trainer.micro_batch == "auto"),
      ("chunk", trainer.chunk_size == "auto" and isinstance(trainer.strategy, ChunkedLogitKD))) if auto)


def variant(trainer, c: Candidate, rows: int):
  """``trainer`` running candidate ``c`` (each of its settings changed only where it differs)."""
  if trainer.student_cfg.remat != c.remat:
    trainer = trainer.with_remat(c.remat)
  if trainer.micro_batch == "auto" or (trainer.micro_batch or rows) != c.micro_batch:
    trainer = trainer.with_micro_batch(None if c.micro_batch == rows else c.micro_batch)
  if "chunk" in pending(trainer) or (c.chunk is not None and c.chunk != getattr(trainer.strategy, "chunk_size", None)):
    trainer = trainer.with_chunk_size(c.chunk)
  return trainer


def measure_step(trainer, state, batch, estimate: Callable | None) -> Measured:
  """Compiles ``trainer``'s step for ``batch`` (runs nothing; ``state`` is not consumed): its memory, and its
  estimated seconds through ``estimate(trainer, compiled, batch)`` when given. A compiler's out-of-memory refusal is
  a measurement of what it said it needed (`out_of_memory_report`)."""
  lowered = trainer.lower(state, batch)
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    report = out_of_memory_report(str(e))
    if report is None:
      raise
    return Measured(report)
  return Measured(MemoryReport.of(compiled), None if estimate is None else estimate(trainer, compiled, batch))


def chip_estimate(trainer) -> Callable | None:
  """``estimate(trainer, compiled, batch) -> seconds`` of the chip calibration (`meshdistill.train.cost`) where
  ``trainer`` runs on one device of a chip it was measured on; None elsewhere (a CPU, a mesh of several devices: the
  calibration is one chip's, without collectives)."""
  devices = list(trainer.mesh.devices.flat) if trainer.mesh is not None else jax.devices()[:1]
  found = cost.calibration_for(devices[0].device_kind) if len(devices) == 1 else None
  if found is None:
    return None
  calibration, peak = found

  def estimate(variant, compiled, batch) -> float | None:
    B, T = (int(n) for n in batch["inputs"].shape)
    concrete = lambda cfg: cfg.replace(attention=cfg.kernel(T, platform="tpu", tensor=1))  # noqa: E731
    teacher = concrete(variant.teacher_cfg) if variant.teacher_output.kind is MODEL else None
    return cost.step_seconds(compiled.as_text(), teacher, concrete(variant.student_cfg), variant.student_cfg.remat,
                             T, B * T, calibration, peak)

  return estimate


def auto_tune(trainer, state, batch, *, budget_bytes: int | None = None, headroom: float = 0.9,
              compiler_options: dict | None = None, remats: Sequence[str] | None = None,
              estimate: Callable | None | str = "chip", say: Callable[[str], None] | None = None):
  """``(trainer with its auto settings decided, Tuning)``: the search of the module doc over the settings
  ``trainer`` leaves at ``auto`` (`pending`), for the step on ``batch`` (nothing runs; ``state`` is kept).

  ``budget_bytes``: the device's memory (default its ``bytes_limit``; None on a CPU); ``headroom``: the fraction of
  it a step may use; ``compiler_options``: XLA options of the measured steps and of the returned trainer's;
  ``remats``: the remat policies to try (default: `REMAT_ORDER` where remat is ``auto``, else the student's own);
  ``estimate``: ``estimate(trainer, compiled, batch) -> seconds``, None (first fit), or ``"chip"``
  (`chip_estimate`); ``say``: where the one line goes (default: this module's log, at INFO)."""
  if budget_bytes is None:
    devices = trainer.mesh.devices.flat if trainer.mesh is not None else jax.devices()[:1]
    budget_bytes = device_memory_limit(next(iter(devices)))
  tuned, rows = pending(trainer), local_rows(trainer, batch)
  base = trainer.with_compiler_options(compiler_options) if compiler_options else trainer
  if remats is None:
    remats = REMAT_ORDER if "remat" in tuned else (trainer.student_cfg.remat,)
  if "micro_batch" not in tuned:
    micro_batches = [rows if trainer.micro_batch is None else trainer.micro_batch]
  elif getattr(trainer.student_cfg, "moe", None) is not None:
    micro_batches = [rows]  # an MoE student's load-balancing loss needs the whole batch (`accumulate`)
  else:
    multiple = (2 if trainer.strategy.needs_pairs else 1) * (trainer.mesh.shape[TENSOR] if
                                                            trainer.layout.student_rows else 1)
    micro_batches = divisors(rows, multiple) or [rows]
  given_chunk = getattr(trainer.strategy, "chunk_size", None)
  chunks = CHUNKS if "chunk" in tuned else (given_chunk,)
  estimator: Callable | None
  if isinstance(estimate, str):
    if estimate != "chip":
      raise ValueError(f"estimate={estimate!r}: a function (trainer, compiled, batch) -> seconds, None or 'chip'")
    estimator = chip_estimate(trainer)
  else:
    estimator = estimate
  limit = None if budget_bytes is None else headroom * budget_bytes
  path, key = _tuning_file(), None
  if limit is not None:
    key = program_key(trainer, state, batch, budget_bytes, headroom, {
        "tuned": tuned, "remats": list(remats), "micro_batches": micro_batches, "chunks": list(chunks),
        "estimate": None if estimator is None else getattr(estimator, "__qualname__", repr(estimator)),
        "calibration": repr(cost.CHIP_CALIBRATION) if estimator is not None else None, "rules": RULES})
    known: Any = _read_choices(path).get(key)
    if _valid(known, rows, chunks):
      c, fits = Candidate(known["remat"], known["micro_batch"], known["chunk"]), known.get("fits") is not False
      why = f"chosen before for this program, {path}" + (
          "" if fits or budget_bytes is None else
          f"; the leanest, none of the candidates fits {headroom:.0%} of {size(budget_bytes)}")
      tuning = Tuning(c, fits, why, rows, budget_bytes, cached=True)
      (say or log.info)(tuning.line())
      return variant(base, c, rows), tuning
  c, fits, why, measured = search(remats, micro_batches, chunks,
                                  lambda c: measure_step(variant(base, c, rows), state, batch, estimator), limit,
                                  estimated=estimator is not None)
  if budget_bytes is not None:
    why += f", {'in' if fits else 'over'} {headroom:.0%} of {size(budget_bytes)}"
  tuning = Tuning(c, fits, why, rows, budget_bytes, measured)
  (say or log.info)(tuning.line())
  if key is not None:  # a search where nothing fits is kept too: the same program and budget find the same leanest
    _write_choice(path, key, {**dataclasses.asdict(c), "fits": fits})
  return variant(base, c, rows), tuning


def size(n: int) -> str:
  """``n`` bytes in GiB (MiB below one GiB)."""
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _valid(known: Any, rows: int, chunks: Sequence[int | None]) -> bool:
  """Whether a kept choice still names a candidate of this search."""
  return (isinstance(known, dict) and known.get("remat") in REMAT_POLICIES and isinstance(known.get("micro_batch"),
          int) and known["micro_batch"] > 0 and rows % known["micro_batch"] == 0 and known.get("chunk") in chunks
          and known.get("fits", True) in (True, False))


def _tuning_file() -> str:
  """Where `auto_tune` keeps its choices: ``$MESHDISTILL_TUNING`` or ``$XDG_CACHE_HOME/meshdistill/tuning.json``
  (``~/.cache`` by default)."""
  if os.environ.get("MESHDISTILL_TUNING"):
    return os.environ["MESHDISTILL_TUNING"]
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache, "meshdistill", "tuning.json")


def program_key(trainer, state, batch, budget_bytes: int | None, headroom: float, extra: dict | None = None) -> str:
  """A fingerprint of the step `auto_tune` chose for: both models' configs, the strategy, the optimizer state's and
  the batch's shapes and dtypes, the layout and its devices, the memory budget, the JAX version, and ``extra`` (what
  the search was over)."""
  shapes = lambda tree: [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(tree)]  # noqa: E731
  devices = trainer.mesh.devices.flat if trainer.mesh is not None else jax.devices()[:1]
  what = {
      "student": repr(trainer.student_cfg), "teacher": repr(trainer.teacher_cfg),
      "strategy": repr(trainer.strategy), "state": shapes(state), "batch": shapes(batch),
      "layout": trainer.backend, "mesh": None if trainer.mesh is None else dict(trainer.mesh.shape),
      "device": next(iter(devices)).device_kind, "budget": budget_bytes, "headroom": headroom, "jax": jax.__version__,
      "micro_batch": trainer.micro_batch, "chunk_size": trainer.chunk_size, "extra": extra,
  }
  return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _read_choices(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    return data if isinstance(data, dict) else {}
  except (OSError, ValueError):
    return {}


def _write_choice(path: str, key: str, choice: dict) -> None:
  """Adds one choice to the file (written whole through a temporary sibling; a failure to write is logged, the
  choice is then made again next time)."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = _read_choices(path)
    data[key] = choice
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=0, sort_keys=True)
    os.replace(tmp, path)
  except OSError as e:
    log.warning("auto: could not keep the choice in %s (%s)", path, e)
