"""Progress of a planning run: what is being compiled and for how long.

Compiling a billion-parameter pair for a TPU slice takes minutes per configuration, and a plan may
compile several (the configuration asked for, then the nearest that fit; ``search``: up to
``max_compiles``). Lines are logged at INFO on ``meshdistill.planner`` (``meshdistill plan`` shows them
on stderr; API users see them with ``logging.basicConfig(level=logging.INFO)``).

No time is guessed before the first compilation: a formula over the models' blocks said 18 s for a compilation that
took 353 s (two scanned models compiled for a TPU), because what the TPU compiler spends its
time on (fusion and layout search, Pallas kernels, the chip's memory) is not in the model's shape. From the second
compilation on, each line names how long the last one took, which is a measurement of this program on this machine.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("meshdistill.planner")


def rough_params(cfg) -> int:
  """About how many parameters a `ModelConfig` has (attention, a gated MLP, embeddings; for the announcement only)."""
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
    self.last_seconds: float | None = None  # how long the last compilation took

  def elapsed(self) -> str:
    return _duration(time.perf_counter() - self.t0)

  def announce(self, teacher, student, platform: str, target: str, first: int, more: int = 0) -> None:
    """Logs the compilations ahead (``first`` certain, up to ``more`` besides); their time is not guessed."""
    del platform  # the time of a compilation is not predicted from the target either (see the module docstring)
    self.total = first + more
    size = f" (teacher about {_count(rough_params(teacher))}, student {_count(rough_params(student))} parameters)"
    extra = f", up to {more} more if it does not fit" if more else ""
    log.info("planning for %s%s: %d compilation(s)%s; each one's time is logged when it ends (seconds for small "
             "models on CPU devices, minutes for a billion-parameter pair for a TPU)", target, size, first, extra)

  def start(self, what: str) -> str:
    """Logs that compilation ``what`` begins (with the last one's time, once there is one); returns its label
    (``compilation i/N``) for the lines that follow."""
    self.done += 1
    label = f"compilation {self.done}" + (f" of up to {self.total}" if self.total else "")
    last = "" if self.last_seconds is None else f" (the last one took {_duration(self.last_seconds)})"
    log.info("[%s] %s: %s%s", self.elapsed(), label, what, last)
    return label

  def finished(self, seconds: float) -> None:
    """Records that a compilation took ``seconds`` (named when the next one starts)."""
    self.last_seconds = seconds

  def step(self, label: str, message: str) -> None:
    log.info("[%s] %s: %s", self.elapsed(), label, message)
