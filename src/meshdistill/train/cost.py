"""A compiled step's time on a TPU chip, estimated from the program alone: the one source the planner
(`meshdistill plan`) and the start-up tuning (`meshdistill.train.tuning`) read.

What turns a program compiled for a TPU into calibrated seconds, without running it:

* the program's loops counted whole (`parse`: each ``while`` body, its trip count, how many times it runs per step;
  scanned blocks, the chunked loss's chunks and the micro-batches of gradient accumulation are loops);
* the TPU compiler's own estimate of every instruction it schedules (`estimated_cycles`: the ``estimated_cycles``
  libtpu writes into the compiled program, loops counted whole, split into matmul fusions and the rest);
* the splash attention kernels the compiler does not estimate, at the FLOPs they execute (`kernel_flops`);
* the chip calibration (`ChipCalibration`, `CHIP_CALIBRATION`): seconds per estimated cycle of each kind and the
  kernels' fraction of peak, fitted on steps measured on one chip (the fitting itself is the planner's,
  `meshdistill.planner._calibrate.calibrate_chip`, over ``benchmarks/results/plan_calibration_chip.json``).

`step_seconds` puts them together for one device's program; `calibration_for` is the calibration of a device kind
(None for a device no steps were measured on: a CPU, another TPU generation).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import numpy as np

from meshdistill.core.chips import TPU_CHIPS, chip_of_kind
from meshdistill.models import splash_block_sizes
from meshdistill.models.decoder import ModelConfig

_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*?condition=%([^\s,]+), body=%([^\s,]+)")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"(?:calls|to_apply|condition|body)=%([^\s,)]+)|(?:branch_computations|called_computations)="
                     r"\{([^}]*)\}")
_BOUND = re.compile(r"compare\(%[^,]+, %([^\s,)]+)\), direction=(LT|LE)")
_CONST = re.compile(r"^\s*%(\S+) = s(?:32|64)\[\][^=]*constant\((-?\d+)\)")
_KNOWN = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_TUPLE_SHAPES = re.compile(r"\b(?:pred|[suf]\d+|bf16|f8\w+)\[([\d,]+)\]")


@dataclasses.dataclass
class Loop:
  """One ``while`` of the program: its body, trip count, how many times its parent runs, and what it carries."""

  body: str
  parent: str
  trip: int
  times: int  # runs of the computation holding this loop (the product of the enclosing loops' trip counts)
  op_name: str
  carry_dims: list[tuple[int, ...]]  # shapes in the loop's carried tuple


@dataclasses.dataclass
class Program:
  """The compiled text split into computations (name -> text), the entry's name and the loops."""

  header: str
  computations: dict[str, str]
  entry: str
  loops: list[Loop]
  times: dict[str, int]  # runs of each computation per step (1 outside loops)


def _split(hlo: str) -> tuple[str, dict[str, str], str]:
  header, comps, entry, name, lines = "", {}, "", None, []
  for line in hlo.splitlines():
    if name is None:
      m = _HEADER.match(line)
      if m:
        name, lines = m.group(2), [line]
        if m.group(1):
          entry = name
      elif line.startswith("HloModule"):
        header = line
      continue
    lines.append(line)
    if line.rstrip() == "}":
      comps[name], name = "\n".join(lines), None
  if not entry:
    raise ValueError("the program text names no ENTRY computation")
  return header, comps, entry


def _trip(line: str, condition: str) -> int | None:
  """The trip count of a counted loop (``i = 0; while i < N``): XLA's ``known_trip_count`` where the compiler
  wrote it on the ``while`` (XLA:CPU), else the bound its condition compares the counter with (XLA:TPU), directly
  or through a fused compare of the counter and one integer constant."""
  known = _KNOWN.search(line)
  if known:
    return int(known.group(1))
  consts = {m.group(1): int(m.group(2)) for m in map(_CONST.match, condition.splitlines()) if m}
  m = _BOUND.search(condition)
  if m is not None and m.group(1) in consts:
    return consts[m.group(1)] + (m.group(2) == "LE")
  root = next((ln for ln in condition.splitlines() if ln.lstrip().startswith("ROOT")), "")
  if " fusion(" in root and len(consts) == 1 and "compare" in root.split("calls=")[-1]:
    return next(iter(consts.values()))
  return None


def parse(hlo: str) -> Program:
  """The program's computations and loops, with how many times each computation runs in one step."""
  header, comps, entry = _split(hlo)
  times: dict[str, int] = {entry: 1}
  loops: list[Loop] = []
  order = [entry]
  while order:  # callers before callees: a computation's count is its caller's (times the trip, for a loop body)
    name = order.pop()
    text = comps.get(name, "")
    bodies = {}
    for line in text.splitlines():
      w = _WHILE.search(line)
      if w:
        trip = _trip(line, comps.get(w.group(1), ""))
        if trip is None:
          raise ValueError(f"loop {w.group(2)!r}: no trip count in its condition (not a counted loop)")
        op = _OPNAME.search(line)
        carry = line.split("=", 1)[1].split(" while(")[0]
        dims = [tuple(int(d) for d in s.split(",")) for s in _TUPLE_SHAPES.findall(carry)]
        loops.append(Loop(w.group(2), name, trip, times[name], op.group(1) if op else "", dims))
        bodies[w.group(2)] = trip
    for m in _CALLED.finditer(text):
      for callee in ([m.group(1)] if m.group(1) else [c.strip().lstrip("%") for c in m.group(2).split(",")]):
        if callee in comps and callee not in times:
          times[callee] = times[name] * bodies.get(callee, 1)
          order.append(callee)
  return Program(header, comps, entry, loops, times)


_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
# instructions whose computations are part of their caller's cost (a fusion's, a reduction's combiner): the TPU
# compiler estimates the caller; a loop body, a branch or a called computation runs its own instructions
_INNER = re.compile(r"\s(?:fusion|reduce|reduce-window|scatter|sort|map|select-and-scatter|all-reduce|reduce-scatter|"
                    r"all-reduce-start|reduce-scatter-start)\(.*?(?:calls|to_apply)=%([^\s,)]+)")
_CALLS = re.compile(r"calls=%([^\s,)]+)")
_MATMUL = (" convolution(", " dot(")
# Mosaic kernels of the package bound by HBM bandwidth (a kernel's name: its instruction's): their time on a chip is
# the bytes of their operands and results over its bandwidth (`estimated_cycles`' ``kernel_bytes``)
STREAMING_KERNELS = ("kl_value_and_grad",)
# an array shape in HLO text (``bf16[8192,2048]``): its element type and dimensions (`shape_bytes`)
HLO_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


def shape_bytes(dtype: str, dims: str) -> int:
  """The bytes of an HLO array of element type ``dtype`` and dimensions ``dims`` (`HLO_SHAPE`'s two groups)."""
  bits = _BITS.get(dtype) or (8 if dtype.startswith("f8") else int(re.sub(r"\D", "", dtype) or 32))
  return math.prod(int(d) for d in dims.split(",") if d) * bits // 8


def _call_bytes(line: str) -> int:
  """The bytes of a custom call's results (the shapes before ``custom-call(``) and operands (its
  ``operand_layout_constraints``)."""
  results, _, rest = line.partition(" custom-call(")
  operands = rest.partition("operand_layout_constraints={")[2]
  operands = operands[: operands.find("}}") + 1]  # the list's shapes, each with its layout in braces
  return sum(shape_bytes(*shape) for text in (results.partition("=")[2], operands) for shape in HLO_SHAPE.findall(text))


def estimated_cycles(prog: Program) -> dict[str, int] | None:
  """The TPU compiler's own estimate of the step: the ``estimated_cycles`` it writes on each instruction it
  schedules (XLA:TPU's backend config; other backends write none), summed over every computation that runs its
  own instructions, each times its runs per step (loops counted whole, as `parse` counts them), in two parts:
  ``matmul`` (a dot or convolution, or a fusion around one) and ``other`` (elementwise work, reductions, copies,
  layout changes). ``kernel_calls``: the runs of Mosaic kernels (``tpu_custom_call``: the splash attention kernel,
  the package's Pallas kernels), which carry no estimate; ``kernel_bytes``: the bytes the runs of the
  `STREAMING_KERNELS` among them read and write. None where no instruction carries one."""
  inner = set()
  for text in prog.computations.values():
    inner.update(_INNER.findall(text))
  out, seen = {"matmul": 0, "other": 0, "kernel_calls": 0, "kernel_bytes": 0}, False
  for name, text in prog.computations.items():
    runs = prog.times.get(name)
    if runs is None or name in inner:
      continue
    for line in text.splitlines():
      m = _CYCLES.search(line)
      if m is None:
        mosaic = 'custom_call_target="tpu_custom_call"' in line
        out["kernel_calls"] += runs * mosaic
        if mosaic and any(re.match(rf"\s*(?:ROOT\s+)?%{k}\b", line) for k in STREAMING_KERNELS):
          out["kernel_bytes"] += runs * _call_bytes(line)
        continue
      seen = True
      called = _CALLS.search(line)
      body = prog.computations.get(called.group(1), "") if called else line
      out["matmul" if any(op in body for op in _MATMUL) else "other"] += int(m.group(1)) * runs
  return out if seen else None


@dataclasses.dataclass(frozen=True)
class ChipCalibration:
  """The chip source: steps measured on one chip of ``generation``, predicted from what the TPU compiler itself
  estimates for the program and from the attention kernels it cannot see:

      step = matmul_cycles * s_matmul + other_cycles * s_other + kernel_s / kernel_fraction + kernel_bytes / bandwidth

  ``matmul_cycles`` / ``other_cycles``: the compiler's ``estimated_cycles`` of its matmul fusions and of the rest of
  the program (elementwise work, reductions, copies), loops counted whole (`estimated_cycles`);
  ``s_matmul`` / ``s_other``: the seconds one estimated cycle of each takes on the chip; ``kernel_s``: the Pallas
  attention kernels' executed FLOPs at peak (`kernel_flops(executed=True)`), ``kernel_fraction`` the
  share of peak they reach; ``kernel_bytes``: the `STREAMING_KERNELS`' bytes (`estimated_cycles`), at the HBM
  bandwidth of the generation's chip, added as they are (not fitted: no measured row had them). Fitted by least
  squares on the log of predicted / measured step time (the planner's `meshdistill.planner._calibrate.calibrate_chip`);
  ``band``: the largest leave-one-config-out error."""

  generation: str
  s_matmul: float
  s_other: float
  kernel_fraction: float
  band: float = math.nan
  rows: int = 0
  row_names: tuple[str, ...] = ()
  source: str = "chip"

  def step_seconds(self, matmul_cycles: float, other_cycles: float, kernel_s: float,
                   kernel_bytes: float = 0.0) -> float:
    return (matmul_cycles * self.s_matmul + other_cycles * self.s_other + kernel_s / self.kernel_fraction
            + (kernel_bytes / TPU_CHIPS[self.generation].hbm_bandwidth if kernel_bytes else 0.0))

  def predict(self, terms: Sequence[Sequence[float]]) -> np.ndarray:
    """Step seconds of rows of ``(matmul_cycles, other_cycles, kernel_s)``."""
    return np.array([self.step_seconds(*t) for t in np.asarray(terms, float).reshape(-1, 3)])

  def of(self, time: dict, generation: str) -> dict | None:
    """The calibrated figures of a plan's ``time``; None for a plan on another generation or without the compiler's
    cycle estimates (a program not compiled for a TPU)."""
    cycles = time.get("cycles")
    if generation != self.generation or not cycles or time.get("step_s") is None:
      return None
    step = self.step_seconds(cycles["matmul"], cycles["other"], time.get("kernel_s") or 0.0,
                             cycles.get("kernel_bytes", 0))
    scale = time["step_s"] / step
    band = None if math.isnan(self.band) else self.band
    return {"step_s": step, "low_s": None if band is None else step * (1 - band),
            "high_s": None if band is None else step * (1 + band), "mfu": time["mfu"] * scale,
            "tokens_per_s": time["tokens_per_s"] * scale, "band": band, "generation": generation,
            "source": self.source, "s_matmul": self.s_matmul, "s_other": self.s_other,
            "kernel_fraction": self.kernel_fraction, "pooled": False, "comm_share": 0.0,
            "published_comm_share": None, "extrapolated": None}


# the fit over the fitted rows of benchmarks/results/plan_calibration_chip.json (steps measured on one TPU v5e chip;
# plan_calibration.md's chip section; tests/test_plan_cost.py refits it from the json)
CHIP_CALIBRATION: ChipCalibration | None = ChipCalibration(
    generation="v5e", s_matmul=5.253512e-10, s_other=4.575759e-10, kernel_fraction=0.495459,
    band=0.061719, rows=15,
    row_names=(
        "gemma3 b=1,t=2048,remat=dots_no_batch,chunk=512,attn=splash",
        "gemma3 b=1,t=2048,remat=full,chunk=512,attn=splash",
        "gemma3 b=2,t=2048,remat=full,chunk=512,attn=splash",
        "llama b=1,t=2048,remat=full,chunk=1024,attn=splash,mu=bfloat16",
        "llama b=2,t=2048,remat=full,chunk=1024,attn=splash,mu=bfloat16",
        "llama b=2,t=2048,remat=full,chunk=512,attn=splash,mu=bfloat16",
        "qwen3 b=2,t=2048,remat=dots_no_batch,chunk=1024,attn=splash",
        "qwen3 b=2,t=2048,remat=dots_no_batch,chunk=2048,attn=splash",
        "qwen3 b=2,t=2048,remat=dots_no_batch,chunk=512,attn=splash",
        "qwen3 b=4,t=2048,remat=dots_no_batch,chunk=1024,attn=splash",
        "qwen3 b=4,t=2048,remat=dots_no_batch,chunk=1024,attn=splash,mu=bfloat16",
        "qwen3 b=4,t=2048,remat=dots_no_batch,chunk=2048,attn=splash",
        "qwen3 b=8,t=2048,remat=full,chunk=1024,attn=splash",
        "qwen3 b=8,t=2048,remat=full,chunk=2048,attn=splash",
        "qwen3 b=16,t=2048,remat=full,chunk=2048,attn=splash"))



def kernel_flops(teacher: ModelConfig | None, student: ModelConfig, remat: str, seq: int,
                 executed: bool = False) -> float:
  """FLOPs per token of the attention matmuls that run inside Pallas kernels (``attention='splash'``), which XLA's
  cost analysis cannot see. Causal attention of one layer: ``4 * keys * n_heads * head_dim`` per token forward
  (q.k and p.v over ``keys = seq / 2`` on average; a sliding layer's ``min(window, seq / 2)``, as
  ``benchmarks/tpu_step.py`` counts model FLOPs); the student adds its backward (twice the forward) and, under
  ``remat="full"``, the forward again (the ``dots`` policies keep the kernel's output and log-sum-exp,
  `meshdistill.models._config.ATTENTION_RESIDUALS`; ``full`` keeps nothing). The teacher runs forward only
  (``None``: no teacher).

  ``executed``: what the kernel computes rather than what the model needs: every block of queries x keys that the
  causal (and sliding) mask touches is computed whole, at the kernel's blocks (`_executed_keys`: the forward's
  compute blocks, the backward's own), and a head narrower than the matrix unit's 128 lanes costs as one of 128
  (Llama 3.2 1B's 64-wide heads: twice their FLOPs). The chip calibration times these (`ChipCalibration`)."""
  def forward(cfg: ModelConfig | None, backward: bool = False) -> float:
    if cfg is None or cfg.attention != "splash":
      return 0.0
    windows = [cfg.layer_attention(layer)[0] for layer in range(cfg.n_layers)]
    if not executed:
      keys = sum(seq / 2 if w is None else min(w, seq / 2) for w in windows)
      return 4.0 * keys * cfg.n_heads * cfg.hd
    block = _kernel_block(cfg, seq, backward)
    keys = sum(_executed_keys(seq, w, block) for w in windows)
    return 4.0 * keys * cfg.n_heads * max(cfg.hd, 128)
  again = remat == "full"  # the forward kernel run again in the backward pass
  if not executed:
    return forward(teacher) + forward(student) * (3 + again)
  return forward(teacher) + forward(student) * (1 + again) + 2 * forward(student, backward=True)


def _kernel_block(cfg: ModelConfig, seq: int, backward: bool) -> int:
  """The splash kernel's compute block over keys (queries and keys alike) for ``cfg`` at ``seq``: the package's
  own (`meshdistill.models.splash_block_sizes`)."""
  itemsize = cfg.compute_dtype.itemsize
  b = splash_block_sizes(seq, itemsize=itemsize, head_dim=cfg.hd, capped=cfg.attn_softcap is not None)
  return b.block_kv_dkv_compute if backward else b.block_kv_compute


def _executed_keys(seq: int, window: int | None, block: int) -> float:
  """Keys per query the kernel computes: the (query block, key block) pairs of ``block`` tokens that hold at least
  one pair the causal mask (and a ``window``) lets through, each computed whole."""
  block = min(block, seq)
  n, pairs = seq // block, 0
  for i in range(n):
    for j in range(i + 1):
      nearest = (i - j - 1) * block + 1 if i > j else 0  # the closest query-key distance of the pair of blocks
      pairs += window is None or nearest < window
  return pairs * block * block / seq


def calibration_for(device_kind: str) -> tuple[ChipCalibration, float] | None:
  """``(the chip calibration, the chip's peak bf16 FLOP/s)`` for a device of ``device_kind`` (jax's
  ``device_kind``; the peak from the chip table, `meshdistill.core.chips.TPU_CHIPS`), or None where no steps were
  measured on that chip (a CPU, another TPU generation)."""
  chip = chip_of_kind(device_kind)
  if chip is None or CHIP_CALIBRATION is None or CHIP_CALIBRATION.generation != chip.family:
    return None
  return CHIP_CALIBRATION, chip.peak_bf16_flops


def step_seconds(hlo: str, teacher: ModelConfig | None, student: ModelConfig, remat: str, seq: int, tokens: float,
                 calibration: ChipCalibration, peak_flops: float) -> float | None:
  """The calibrated seconds of one device's compiled step (``hlo``: its optimised program text, as
  ``compiled.as_text()`` gives it, compiled for a TPU): the compiler's estimated cycles (`estimated_cycles`) and
  the splash kernels of ``tokens`` tokens on this device at ``seq`` per row (`kernel_flops`, executed, at
  ``peak_flops``) through ``calibration``, and the `STREAMING_KERNELS`' bytes at the chip's HBM bandwidth.
  Collectives are not in it (one chip's). None where the program carries
  no estimate (not compiled for a TPU) or holds a loop without a trip count."""
  try:
    cycles = estimated_cycles(parse(hlo))
  except ValueError:  # a loop without a trip count
    return None
  if cycles is None:
    return None
  kernels = kernel_flops(teacher, student, remat, seq, executed=True) * tokens
  return calibration.step_seconds(cycles["matmul"], cycles["other"], kernels / peak_flops, cycles["kernel_bytes"])


__all__ = ["CHIP_CALIBRATION", "ChipCalibration", "Loop", "Program", "calibration_for",
           "estimated_cycles", "kernel_flops", "parse", "step_seconds"]
