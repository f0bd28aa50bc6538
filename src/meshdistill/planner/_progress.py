"""Progress of a planning run: what is being compiled and for how long, and a rough estimate up front.

Compiling a billion-parameter pair for a TPU slice takes minutes per configuration, and a plan may
compile several (the configuration asked for, then the nearest that fit; ``search``: up to
``max_compiles``). Lines are logged at INFO on ``meshdistill.planner`` (``meshdistill plan`` shows them
on stderr; API users see them with ``logging.basicConfig(level=logging.INFO)``).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("meshdistill.planner")

# Rough seconds per compilation: a fixed cost plus a cost per unrolled block of the two models (a scanned
# model compiles one body). Fitted loosely to CPU runs of the test pairs and to TPU reports of 1-2 B pairs
# (28 + 28 unrolled blocks on v5e: several minutes per compilation); good to a factor of a few.
_SECONDS = {"tpu": (10.0, 4.0), "cpu": (6.0, 1.0)}


def rough_compile_seconds(teacher, student, platform: str) -> float:
  """A rough guess of one compilation's seconds for ``teacher`` / ``student`` (`ModelConfig`) on ``platform``."""
  fixed, per_block = _SECONDS.get(platform, _SECONDS["tpu"])
  blocks = sum(_compiled_blocks(m) for m in (teacher, student))
  return fixed + per_block * blocks


def _compiled_blocks(cfg) -> int:
  """Blocks in the compiled program: every layer unrolled; scanned, one group of ``scan_period`` layers and the
  layers after the last whole group (`meshdistill.models._scan`)."""
  if not cfg.scan_layers:
    return cfg.n_layers
  period = getattr(cfg, "scan_period", 1)
  return period + cfg.n_layers % period


def rough_params(cfg) -> int:
  """About how many parameters a `ModelConfig` has (attention, a gated MLP, embeddings; for the estimate only)."""
  attn = cfg.d_model * cfg.hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
  mlp = 3 * cfg.d_model * cfg.mlp_hidden * max(1, getattr(cfg, "n_experts", 0) or 1)
  return cfg.n_layers * (attn + mlp) + cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)


def _count(n: int) -> str:
  return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.0f} K"


def _duration(seconds: float) -> str:
  return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class Progress:
  """Counts a planner's compilations and logs each with the time since planning began."""

  def __init__(self):
    self.t0 = time.perf_counter()
    self.total: int | None = None
    self.done = 0

  def elapsed(self) -> str:
    return _duration(time.perf_counter() - self.t0)

  def announce(self, teacher, student, platform: str, target: str, first: int, more: int = 0) -> None:
    """Logs the compilations ahead (``first`` certain, up to ``more`` besides) and a rough time for them."""
    self.total = first + more
    each = rough_compile_seconds(teacher, student, platform)
    size = f" (teacher about {_count(rough_params(teacher))}, student {_count(rough_params(student))} parameters)"
    extra = f", up to {more} more if it does not fit" if more else ""
    log.info("planning for %s%s: %d compilation(s)%s; rough estimate %s each, %s in all at most (a guess from the "
             "models' unrolled blocks, good to a factor of a few)", target, size, first, extra, _duration(each),
             _duration(each * self.total))

  def start(self, what: str) -> str:
    """Logs that compilation ``what`` begins; returns its label (``compilation i/N``) for the lines that follow."""
    self.done += 1
    label = f"compilation {self.done}" + (f" of up to {self.total}" if self.total else "")
    log.info("[%s] %s: %s", self.elapsed(), label, what)
    return label

  def step(self, label: str, message: str) -> None:
    log.info("[%s] %s: %s", self.elapsed(), label, message)
