"""Timing of several systems side by side: warm-up, interleaved rounds, paired medians, machine and load, JSON.

A shared machine's speed drifts (other jobs come and go), so systems compared with each other are timed in the
same rounds: every round runs each system once on the same input, one after the other (`interleave`). A ratio
is then reported two ways: the ratio of the medians, and the median of the ratios within each round ("paired",
`paired`), with the spread of those per-round ratios (`spread`). `machine` and `load` say where and under
what load a result was measured; `write_json` keeps the raw times so a report can be rendered again later.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import time
from typing import Any, Callable, Sequence


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
  """(wall seconds, CPU seconds of this process) of ``fn()``."""
  wall, cpu = time.perf_counter(), time.process_time()
  fn()
  return time.perf_counter() - wall, time.process_time() - cpu


def interleave(fns: dict[str, Callable[[Any], Any]], inputs: Sequence[Any], warmup: int = 0,
               per: float = 1.0) -> dict[str, dict[str, Any]]:
  """Runs every ``fns[name](x)`` for each ``x`` of ``inputs`` in turn, round by round: round ``i`` runs each
  system on ``inputs[i]`` before the next round starts. Each call must return once its work is done (wait on
  the device inside it). The first ``warmup`` rounds (compilation) are summed into ``compile_s``; the others
  give one time per round.

  Returns ``{"times": {name: [seconds / per]}, "cpu": {name: [CPU seconds / per]}, "compile_s": {name: s}}``;
  ``per``: what one call covers (e.g. the steps of a block) for per-step times.
  """
  if warmup < 0 or warmup > len(inputs):
    raise ValueError(f"interleave: warmup={warmup} rounds of {len(inputs)} inputs; choose 0..{len(inputs)}")
  times: dict[str, list[float]] = {name: [] for name in fns}
  cpu: dict[str, list[float]] = {name: [] for name in fns}
  compile_s: dict[str, float] = {}
  for i, x in enumerate(inputs):
    for name, fn in fns.items():
      wall, cpu_s = timed(lambda: fn(x))  # noqa: B023
      if i < warmup:
        compile_s[name] = compile_s.get(name, 0.0) + wall
      else:
        times[name].append(wall / per)
        cpu[name].append(cpu_s / per)
  return {"times": times, "cpu": cpu, "compile_s": compile_s}


def median_call(fn: Callable[[], Any], calls: int) -> float:
  """Median seconds of ``calls`` calls of ``fn`` (a JAX computation, waited on), after one call to compile."""
  import jax  # pylint: disable=g-import-not-at-top  (the harness itself needs no JAX)

  jax.block_until_ready(fn())
  ts = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def best_call(fn: Callable[[], Any], calls: int) -> tuple[float, Any]:
  """(fastest seconds of ``calls`` calls of ``fn``, the last call's output), after one call to compile: the
  run least disturbed by other work on a shared machine, for a system timed alone (not against another)."""
  import jax  # pylint: disable=g-import-not-at-top

  if calls < 1:
    raise ValueError(f"best_call: calls={calls}; time at least 1 call")
  out = jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(calls):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best, out


def medians(times: dict[str, list[float]]) -> dict[str, float]:
  return {name: statistics.median(ts) for name, ts in times.items()}


def per_round(t: dict[str, list[float]], num: str, den: tuple[str, ...]) -> list[float]:
  """t[num] / sum(t[d] for d in den) within each round."""
  return [t[num][i] / sum(t[d][i] for d in den) for i in range(len(t[num]))]


def paired(t: dict[str, list[float]], num: str, den: tuple[str, ...]) -> float:
  """Median over rounds of t[num] / sum(t[d] for d in den) within the round."""
  return statistics.median(per_round(t, num, den))


def spread(t: dict[str, list[float]], num: str, den: tuple[str, ...]) -> str:
  """The range of the per-round ratios between their quartiles (the middle half of the rounds)."""
  q1, _, q3 = statistics.quantiles(per_round(t, num, den), n=4)
  return f"{q1:.2f}-{q3:.2f}x"


def ratio_of(t: dict[str, list[float]], med: dict[str, float], num: str,
             den: tuple[str, ...]) -> tuple[float, float, str]:
  """(ratio of medians, median of per-round ratios, their interquartile range) of num / sum(den)."""
  return med[num] / sum(med[d] for d in den), paired(t, num, den), spread(t, num, den)


def verdict(ok: bool) -> str:
  return "met" if ok else "NOT met"


def load() -> tuple[float, float, float]:
  """The load average (1/5/15 min), as ``uptime`` prints it; it counts the benchmark's own threads too."""
  return os.getloadavg()


def machine() -> str:
  """Versions and the processor this process runs on (its model name and vector extensions: XLA's CPU kernels,
  and so the times and the last bits of the losses, differ between processors)."""
  import jax  # pylint: disable=g-import-not-at-top

  cpu, isa = platform.machine(), ""
  try:
    info = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    info = ""
  for line in info.splitlines():
    key, _, value = line.partition(":")
    if key.strip() == "model name" and cpu == platform.machine():
      cpu = f"{value.strip()} ({platform.machine()})"
    elif key.strip() == "flags" and not isa:
      flags = value.split()
      isa = ", ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
  return (f"jax {jax.__version__}, Python {platform.python_version()}, {cpu}, {os.cpu_count()} CPU cores"
          + (f" ({isa})" if isa else ""))


def write_json(path: pathlib.Path, raw: dict) -> None:
  """The raw results as one JSON line (what a renderer reads back), the folder made if missing."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(raw) + "\n")


def read_json(path: pathlib.Path) -> dict:
  """Raw results written by `write_json`; a missing file is an error naming it and what writes it."""
  if not path.exists():
    raise FileNotFoundError(f"{path}: no raw results to render; a full run of the benchmark writes it "
                            "(run it without --render first, or pass --out beside an existing .json)")
  return json.loads(path.read_text())
