"""The roofline held against published pod measurements: a fraction of peak per TPU generation and one collective cost.

The roofline (`Planner._roofline`) takes the step as ``max(compute, hbm) + collectives`` at the chip's peak matmul
rate and full link bandwidth. Measured steps are slower, and by how much depends on the TPU generation (MaxText's
published runs reach 79-98% of the roofline's speed on v5e, 68-75% on v5p and 53-61% on v6e: a v6e chip has 4.7x
v5e's peak FLOP/s but 2x its HBM bandwidth and ICI). The rows are `meshdistill.planner._published.PUBLISHED`; the
planner compiles their plain training step and takes its roofline terms (``benchmarks/plan_calibration.py``). The
calibrated step is

    step = max(compute / a[generation], hbm, collectives) + k * collectives

``a[g]``: the fraction of peak the step's matmuls reach on generation ``g``; ``k``: the collectives' cost per second
of ideal ring traffic (``(1 - overlap) / link efficiency``: 0 when fully hidden behind compute), one for every
generation. Collectives hidden behind compute still
take their own time at full bandwidth, so a step is never shorter than them. The published rows spend 3-23% of
their roofline step in collectives, so ``k`` is fitted where they are a minor share: for a plan where they are a
larger one (e.g. a large teacher's weights gathered under FSDP) the overlap is an extrapolation, bounded by the
collectives' own time. All are fitted together by least squares on the log of the predicted / measured step time
(`fit`). A generation without rows takes ``a_pooled``, one fraction fitted over every row (with the same ``k``).
While no generation has two rows ``k`` cannot be told from the fractions: it is held at `HELD_K` (collectives not
hidden).

Checks: `leave_one_out` predicts each row from the fit over the others (a row alone in its generation is then
predicted with the pooled fraction); `leave_generation_out` predicts every row of a generation from the other
generations' rows (what a plan on a generation without published rows, e.g. tpu7x, can expect). `CALIBRATION` holds
the fit over every stored row with, per generation, its largest leave-one-out error as the band the planner prints
beside the estimate, and the largest leave-generation-out error as the band of a generation without rows.

Two sources, kept apart (``source`` names each, ``row_names`` its rows): ``published`` (`CALIBRATION`, the pod rows
above) and ``chip`` (`meshdistill.train.cost.CHIP_CALIBRATION`, a `ChipCalibration`: its constants and arithmetic
live there, below the planner, for the start-up tuning to read too; its fit is here): distillation steps measured on
one TPU v5e chip (``benchmarks/tpu_step.py``), each configuration planned for its per-chip program
(``benchmarks/plan_chip.py``). The
chip source does not scale the roofline: one fraction of peak and one of the HBM bandwidth for the whole program
left Qwen3 steps (62-65% of peak by the roofline) and Llama ones (54%) 18-23% apart. It reads instead what the TPU
compiler itself estimates for every instruction it schedules (``estimated_cycles``), split into matmul fusions and
the rest, and adds the splash attention kernels it cannot see at the FLOPs they execute: three parameters, fitted on
the measured steps (`calibrate_chip`). A plan for one local chip of the generation the chip source was measured on
uses it (`source_for`); every other target, the published source.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from scipy.optimize import least_squares

from meshdistill.train import cost
from meshdistill.train.cost import ChipCalibration

# while no generation has two rows, ``k`` is held here: collectives not hidden at all
HELD_K = 1.0
A_BOUNDS = (0.05, 1.0)
K_BOUNDS = (0.0, 10.0)


@dataclasses.dataclass(frozen=True)
class Fit:
  """``step = max(compute / a[generation], hbm, collectives) + k * collectives``; ``a_pooled`` for a generation
  not in ``a``."""

  a: dict[str, float]  # TPU generation (e.g. "v5e") -> achieved fraction of peak matmul rate
  a_pooled: float  # one fraction over every row: a generation without rows
  k: float  # seconds per second of ideal collective time (not hidden behind compute)

  def fraction(self, generation: str) -> float:
    return self.a.get(generation, self.a_pooled)

  def step_seconds(self, compute_s: float, hbm_s: float, comm_s: float | None, generation: str) -> float:
    terms = np.array([[compute_s, hbm_s, comm_s or 0.0]])
    return float(_step(np.array([self.fraction(generation)]), self.k, terms)[0])

  def predict(self, terms: Sequence[Sequence[float]], generations: Sequence[str]) -> np.ndarray:
    """Step seconds of rows of roofline ``(compute_s, hbm_s, comm_s)`` on ``generations``."""
    return np.array([self.step_seconds(*t, g) for t, g in zip(np.asarray(terms, float), generations)])


@dataclasses.dataclass(frozen=True)
class Calibration(Fit):
  """The fit over every published row and its error bands (relative, on step time)."""

  band: dict[str, float] = dataclasses.field(default_factory=dict)  # generation -> largest leave-one-out error
  band_unseen: float = math.nan  # largest leave-generation-out error: the band of a generation without rows
  rows: int = 0  # published rows fitted
  # the largest share of collectives in a fitted row's roofline step: a plan above it extrapolates their overlap
  comm_share: float = math.nan
  source: str = "published"  # which measurements: "published" (pod rows) or "chip" (steps measured on one chip)
  row_names: tuple[str, ...] = ()  # the fitted rows, named (the chip source's configurations)

  def band_of(self, generation: str) -> float | None:
    """The relative error band of an estimate on ``generation`` (None when too few rows to tell)."""
    band = self.band.get(generation, self.band_unseen)
    return None if math.isnan(band) else band

  def of(self, time: dict, generation: str) -> dict | None:
    """The calibrated figures of a plan's roofline ``time`` on TPU ``generation`` (None when it has no step time)."""
    if time.get("step_s") is None:
      return None
    step = self.step_seconds(time["compute_s"], time["hbm_s"], time["comm_s"], generation)
    scale = time["step_s"] / step
    band = self.band_of(generation)
    share = _comm_share(np.array([[time["compute_s"], time["hbm_s"], time["comm_s"] or 0.0]]))[0]
    return {"step_s": step, "low_s": None if band is None else step * (1 - band),
            "high_s": None if band is None else step * (1 + band),
            "mfu": time["mfu"] * scale, "tokens_per_s": time["tokens_per_s"] * scale, "band": band,
            "generation": generation, "source": self.source, "a": self.fraction(generation),
            "pooled": generation not in self.a,
            "k": self.k, "comm_share": float(share),
            "published_comm_share": None if math.isnan(self.comm_share) else self.comm_share,
            "extrapolated": bool(share > self.comm_share) if not math.isnan(self.comm_share) else None}


def _comm_share(terms: np.ndarray) -> np.ndarray:
  """The collectives' share of each row's roofline step ``max(compute, hbm) + collectives``."""
  roofline = np.maximum(terms[:, 0], terms[:, 1]) + terms[:, 2]
  return np.divide(terms[:, 2], roofline, out=np.zeros(len(terms)), where=roofline > 0)


def _step(a: np.ndarray, k: float, terms: np.ndarray) -> np.ndarray:
  return np.maximum(np.maximum(terms[:, 0] / a, terms[:, 1]), terms[:, 2]) + k * terms[:, 2]


def _solve(residual, x0s: Sequence[Sequence[float]], lower: Sequence[float], upper: Sequence[float]) -> np.ndarray:
  """`least_squares` from each start in ``x0s`` (the max() makes the cost piecewise): the lowest cost's solution."""
  best = None
  for x0 in x0s:
    res = least_squares(residual, x0=x0, bounds=(lower, upper))
    if best is None or res.cost < best.cost - 1e-12:
      best = res
  return best.x


def fit(terms: Sequence[Sequence[float]], measured: Sequence[float], generations: Sequence[str],
        k: float | None = None) -> Fit:
  """Least squares of ``log(predicted / measured)`` over rows of roofline ``(compute_s, hbm_s, comm_s)`` measured on
  TPU ``generations``: one ``a`` per generation in ``A_BOUNDS``, a shared ``k`` in ``K_BOUNDS`` (a given ``k`` is
  held; `HELD_K` while no generation has two rows), and ``a_pooled``, one ``a`` for every row at that ``k``."""
  terms, measured = np.asarray(terms, float).reshape(-1, 3), np.asarray(measured, float)
  if len(terms) == 0 or len(terms) != len(measured) or len(terms) != len(generations):
    raise ValueError(f"fit needs rows of terms, measured step times and generations of one length, got "
                     f"{len(terms)}, {len(measured)}, {len(generations)}")
  if np.any(measured <= 0) or np.any(terms[:, 0] <= 0):
    raise ValueError("fit needs positive measured step times and compute terms")
  gens = sorted(set(generations))
  idx = np.array([gens.index(g) for g in generations])
  if k is None and len(terms) <= len(gens):
    k = HELD_K
  n = len(gens)
  lower, upper = [A_BOUNDS[0]] * n, [A_BOUNDS[1]] * n
  if k is None:
    def residual(p):
      return np.log(_step(p[idx], p[n], terms) / measured)

    x = _solve(residual, [[0.6] * n + [k0] for k0 in (0.0, 0.5, 2.0)], lower + [K_BOUNDS[0]], upper + [K_BOUNDS[1]])
    k = float(x[n])
  else:
    x = _solve(lambda p: np.log(_step(p[idx], k, terms) / measured), [[0.6] * n], lower, upper)
  pooled = _solve(lambda p: np.log(_step(p[0], k, terms) / measured), [[0.6]], [A_BOUNDS[0]], [A_BOUNDS[1]])
  return Fit(a={g: float(x[i]) for i, g in enumerate(gens)}, a_pooled=float(pooled[0]), k=float(k))


def leave_one_out(terms: Sequence[Sequence[float]], measured: Sequence[float], generations: Sequence[str],
                  k: float | None = None) -> list[float]:
  """Each row's step time predicted by the fit over the other rows (its generation's ``a`` from that generation's
  other rows; the pooled one when it is the only row of its generation)."""
  terms, measured = np.asarray(terms, float), np.asarray(measured, float)
  out = []
  for i in range(len(terms)):
    keep = np.arange(len(terms)) != i
    f = fit(terms[keep], measured[keep], [g for j, g in enumerate(generations) if j != i], k)
    out.append(float(f.predict(terms[i:i + 1], [generations[i]])[0]))
  return out


def leave_group_out(terms: Sequence[Sequence[float]], measured: Sequence[float], generations: Sequence[str],
                    groups: Sequence[str], k: float | None = None) -> list[float]:
  """Each row's step time predicted by the fit over the rows of the OTHER ``groups`` (a generation, a model pair):
  how far off a plan can be for a group the fit has not seen. NaN for every row when there is one group."""
  terms, measured = np.asarray(terms, float), np.asarray(measured, float)
  gens, groups = np.asarray(generations), np.asarray(groups)
  out = []
  for i in range(len(terms)):
    keep = groups != groups[i]
    if not keep.any():
      out.append(math.nan)
      continue
    f = fit(terms[keep], measured[keep], list(gens[keep]), k)
    out.append(float(f.predict(terms[i:i + 1], [generations[i]])[0]))
  return out


def leave_generation_out(terms: Sequence[Sequence[float]], measured: Sequence[float], generations: Sequence[str],
                         k: float | None = None) -> list[float]:
  """Each row's step time predicted by the fit over the rows of the OTHER generations (the pooled ``a``): how far
  off a plan on a generation without published rows can be. NaN for every row when there is one generation."""
  return leave_group_out(terms, measured, generations, generations, k)


def calibrate(terms: Sequence[Sequence[float]], measured: Sequence[float], generations: Sequence[str]) -> Calibration:
  """The fit over every row; per generation, the band is its rows' largest leave-one-out error, and a generation
  without rows takes the largest leave-generation-out error (NaN where rows are too few to leave one out)."""
  f = fit(terms, measured, generations)
  loo = leave_one_out(terms, measured, generations) if len(terms) >= 2 else [math.nan] * len(terms)
  lgo = leave_generation_out(terms, measured, generations)
  err = lambda p, m: float(abs(p / m - 1))  # noqa: E731
  band = {g: max(err(p, m) for p, m, h in zip(loo, measured, generations) if h == g) for g in f.a}
  unseen = max((err(p, m) for p, m in zip(lgo, measured) if not math.isnan(p)), default=math.nan)
  share = float(_comm_share(np.asarray(terms, float)).max()) if len(terms) else math.nan
  return Calibration(a=f.a, a_pooled=f.a_pooled, k=f.k, band=band, band_unseen=unseen, rows=len(measured),
                     comm_share=share)


# the start of the chip fit, in cycles of v5e's clock per estimated cycle (the compiler's estimate as it stands, the
# work outside matmuls faster) and the kernels' fraction of peak
_CHIP_START = (1.0, 0.6, 0.7)
_CLOCK = 1.5e9  # the fit's unit of seconds per cycle (v5e's clock: 197 TFLOP/s / 4 matrix units of 128 x 128 x 2)


def fit_chip(terms: Sequence[Sequence[float]], measured: Sequence[float], names: Sequence[str] = (),
             generation: str = "v5e") -> ChipCalibration:
  """The least-squares fit of `ChipCalibration` over rows of ``(matmul_cycles, other_cycles, kernel_s)`` and their
  measured step seconds, without a band (`calibrate_chip` adds it); where no row runs a kernel nothing tells its
  fraction, held at its start."""
  terms, measured = np.asarray(terms, float).reshape(-1, 3), np.asarray(measured, float)
  kernels = bool(np.any(terms[:, 2] > 0))

  def params(p):
    return p[0] / _CLOCK, p[1] / _CLOCK, p[2] if kernels else _CHIP_START[2]

  def residual(p):
    m, o, f = params(p)
    return np.log((terms[:, 0] * m + terms[:, 1] * o + terms[:, 2] / f) / measured)

  x0 = list(_CHIP_START[:3 if kernels else 2])
  lower, upper = [0.01, 0.01, 0.05][:len(x0)], [10.0, 10.0, 1.0][:len(x0)]
  m, o, f = params(least_squares(residual, x0=x0, bounds=(lower, upper)).x)
  return ChipCalibration(generation=generation, s_matmul=float(m), s_other=float(o), kernel_fraction=float(f),
                         rows=len(terms), row_names=tuple(names))


def chip_leave_one_out(terms: Sequence[Sequence[float]], measured: Sequence[float]) -> list[float]:
  """Each row's step seconds predicted by `fit_chip` over the other rows (NaN with four rows or fewer: the other
  rows would not outnumber the three parameters)."""
  terms, measured = np.asarray(terms, float).reshape(-1, 3), np.asarray(measured, float)
  if len(terms) <= 4:
    return [math.nan] * len(terms)
  out = []
  for i in range(len(terms)):
    keep = np.arange(len(terms)) != i
    out.append(float(fit_chip(terms[keep], measured[keep]).predict(terms[i:i + 1])[0]))
  return out


def calibrate_chip(terms: Sequence[Sequence[float]], measured: Sequence[float], names: Sequence[str],
                   generation: str = "v5e") -> ChipCalibration:
  """The chip source (`ChipCalibration`) fitted over rows of ``(matmul_cycles, other_cycles, kernel_s)`` of one
  chip's programs and their measured step seconds (``names``: the configurations). Needs more rows than its three
  parameters; the band is the largest leave-one-config-out error (`chip_leave_one_out`; NaN with four rows)."""
  terms = np.asarray(terms, float).reshape(-1, 3)
  measured = np.asarray(measured, float)
  if len(names) != len(terms) or len(measured) != len(terms):
    raise ValueError(f"calibrate_chip needs one name and one measured step per row, got {len(names)} names and "
                     f"{len(measured)} steps for {len(terms)} rows")
  if len(terms) < 4:
    raise ValueError(f"calibrate_chip fits 3 parameters: give at least 4 measured rows, got {len(terms)}")
  if np.any(measured <= 0) or np.any(terms[:, :2] < 0) or np.any(terms[:, 0] + terms[:, 1] <= 0):
    raise ValueError("calibrate_chip needs positive measured step times and cycle counts")
  loo = chip_leave_one_out(terms, measured)
  band = math.nan if len(terms) <= 4 else max(abs(p / m - 1) for p, m in zip(loo, measured))
  return dataclasses.replace(fit_chip(terms, measured, names, generation), band=float(band))


def source_for(chips: int, generation: str) -> Calibration | ChipCalibration | None:
  """The calibration a plan takes: the chip source for one chip of the generation its rows were measured on, this
  machine's or compiled for from a host (a one-chip topology, ``v5e:1x1``: the same program, the same compiler's
  estimate), the published one for every other target (pod slices, a generation without chip rows)."""
  chip = cost.CHIP_CALIBRATION
  if chips == 1 and chip is not None and generation == chip.generation:
    return chip
  return CALIBRATION


# the fit over every row of benchmarks/results/plan_calibration.json (plan_calibration.md; tests/test_plan_cost.py
# refits it from the json)
CALIBRATION: Calibration | None = Calibration(
    a={"v5e": 0.769585, "v5p": 0.693404, "v6e": 0.521888}, a_pooled=0.632342, k=0.024404,
    band={"v5e": 0.132703, "v5p": 0.073663, "v6e": 0.148041}, band_unseen=0.470161, rows=14,
    comm_share=0.231630, source="published",
    row_names=(
        "Llama 3.1 8B on v6e:16x16",
        "Llama 3.1 70B on v6e:16x16",
        "Llama 2 70B on v6e:16x16",
        "Llama 2 70B on v5p:8x8x8",
        "MaxText 16B (2023) on v5e:16x16",
        "MaxText 32B (2023) on v5e:16x16",
        "MaxText 64B (2023) on v5e:16x16",
        "MaxText 128B (2023) on v5e:16x16",
        "MaxText 32B (2023) on v5p:4x4x4",
        "MaxText 64B (2023) on v5p:4x4x4",
        "MaxText 128B (2023) on v5p:4x4x8",
        "Llama 3.1 8B on v6e:2x4",
        "Llama 3.1 8B on v6e:4x4",
        "Mistral 7B on v6e:2x4"))

__all__ = ["A_BOUNDS", "CALIBRATION", "Calibration", "Fit", "HELD_K",
           "K_BOUNDS", "calibrate", "calibrate_chip", "chip_leave_one_out", "fit", "fit_chip", "leave_generation_out", "leave_group_out",
           "leave_one_out", "source_for"]
