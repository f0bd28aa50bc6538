"""The TPU chips' published numbers, one table (`TPU_CHIPS`) for every layer that reads them: the planner's roofline
and report (`meshdistill.planner`) and the chip calibration's peak (`meshdistill.train.cost`).

Per TPU generation: HBM capacity, peak bf16 FLOP/s, HBM bandwidth and bidirectional inter-chip interconnect (ICI)
bandwidth, from Google Cloud's TPU documentation (``SOURCE``), and the ``device_kind`` JAX reports for its chips;
where measured, the part of the HBM the TPU runtime gives a program (``limit_bytes``), what a plan's fit and the
on-chip tuner's (`meshdistill.train.memory.device_memory_limit`) are both judged against.
"""

from __future__ import annotations

import dataclasses

SOURCE = ("Google Cloud TPU documentation, system architecture pages: cloud.google.com/tpu/docs/v5e, /v5p, /v6e, "
          "/v4, /system-architecture-tpu-vm (per-chip values)")


@dataclasses.dataclass(frozen=True)
class Chip:
  """Per-chip numbers of one TPU generation (``None``: not published / not known)."""

  family: str  # the topology prefix, e.g. "v5e"
  device_kind: str  # jax's device_kind
  hbm_bytes: int
  peak_bf16_flops: float
  hbm_bandwidth: float  # bytes/s
  ici_bandwidth: float | None  # bytes/s, bidirectional, per chip
  # what the TPU runtime lets a program hold on one chip (``device.memory_stats()["bytes_limit"]``, what libtpu refuses
  # a program beyond: "exceeds available HBM (15.75G)"), where measured; None: the HBM above
  limit_bytes: int | None = None

  @property
  def usable_bytes(self) -> int:
    """The memory a program may take on one chip: `limit_bytes` where measured, else the HBM."""
    return self.hbm_bytes if self.limit_bytes is None else self.limit_bytes


GIB = 2**30
TPU_CHIPS = {
    c.family: c
    for c in (
        # limit: a v5e chip under jax 0.10.2 / libtpu 0.0.42.1 (benchmarks/results/tpu_step.jsonl's rows, every one)
        Chip("v5e", "TPU v5 lite", 16 * GIB, 197e12, 819e9, 400e9, limit_bytes=16_909_336_064),
        Chip("v5p", "TPU v5", 95 * GIB, 459e12, 2765e9, 1200e9),
        Chip("v6e", "TPU v6 lite", 32 * GIB, 918e12, 1638e9, 800e9),
        Chip("v4", "TPU v4", 32 * GIB, 275e12, 1200e9, None),
        Chip("v3", "TPU v3", 32 * GIB, 123e12, 900e9, None),
    )
}


def chip_of_kind(device_kind: str) -> Chip | None:
  """The TPU generation whose chips JAX reports as ``device_kind`` (``jax.devices()[0].device_kind``, e.g. "TPU v5
  lite"), or None (not a TPU chip of the table)."""
  return next((c for c in TPU_CHIPS.values() if c.device_kind == device_kind), None)
