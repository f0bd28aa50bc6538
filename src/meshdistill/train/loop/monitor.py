"""Watching a run: progress line, metrics.jsonl, TensorBoard events, plots and profiler traces.

Everything lands in the run directory:

* ``metrics.jsonl`` -- one JSON object per line: ``{"step", "split": "train"|"val", ...metrics}``;
  train lines are means over the last ``log_every`` steps, plus ``lr``, ``tokens_per_s`` and
  ``step_s``;
* ``tb/`` -- TensorBoard event files (``tensorboardX``; skipped with a warning when it is not
  installed), scalars named ``train/loss``, ``val/ppl``, ...;
* with ``wandb`` among the loggers (``run.loggers``): a Weights & Biases run of the same rows, the run's config
  and its final summary (`meshdistill.train.loop.loggers`);
* ``plots/*.png`` -- from `plot_run` (``meshdistill plot RUN_DIR``; in `meshdistill.train.loop.plots`);
* ``profile/`` -- a JAX profiler trace of the steps chosen with `ProfileWindow`.

The progress line (step, loss, tokens/s, ETA) goes to a stream the caller passes (the CLI
passes stderr); library users without a stream get the same line through `logging`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import IO, Any

import jax
import numpy as np

from meshdistill.core.fsutil import open_append, write_text_atomic
from meshdistill.train.loop.loggers import WandbLogger, check_loggers
from meshdistill.train.loop.plots import PLOTS, plot_run, read_metrics  # noqa: F401 -- re-exported: plots live in plots.py

log = logging.getLogger(__name__)

def _fmt_duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = round(seconds)
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


class ProgressBar:
  """A one-line progress display: ``[name] step 120/300 40% | loss 1.234 | 5.1k tok/s | ETA 0:35``.

  On a terminal the line is redrawn in place; otherwise (a log file) each update is a new line.
  """

  def __init__(self, total: int, stream: IO[str] | None = None, name: str = "", width: int = 24):
    self.total, self.stream, self.name, self.width = total, stream, name, width
    self._tty = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
    self._last_len = 0

  def render(self, step: int, loss: float | None, tokens_per_s: float | None, eta_s: float | None) -> str:
    frac = min(max(step / max(self.total, 1), 0.0), 1.0)
    filled = round(frac * self.width)
    bar = "#" * filled + "-" * (self.width - filled)
    parts = [f"{self.name + ' ' if self.name else ''}[{bar}] {step}/{self.total} {frac:4.0%}"]
    if loss is not None:
      parts.append(f"loss {loss:.4f}")
    if tokens_per_s is not None:
      parts.append(f"{tokens_per_s / 1000:.1f}k tok/s" if tokens_per_s >= 1000 else f"{tokens_per_s:.0f} tok/s")
    if eta_s is not None:
      parts.append(f"ETA {_fmt_duration(eta_s)}")
    return " | ".join(parts)

  def update(self, step: int, loss: float | None = None, tokens_per_s: float | None = None, eta_s: float | None = None):
    line = self.render(step, loss, tokens_per_s, eta_s)
    if self.stream is None:
      log.info("%s", line)
      return
    if self._tty:
      pad = max(self._last_len - len(line), 0)
      self.stream.write("\r" + line + " " * pad)
      self._last_len = len(line)
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def message(self, text: str) -> None:
    """A line that stays (e.g. an evaluation result), printed above the progress line."""
    if self.stream is None:
      log.info("%s", text)
      return
    if self._tty and self._last_len:
      self.stream.write("\r" + " " * self._last_len + "\r")
      self._last_len = 0
    self.stream.write(text + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self.stream is not None and self._tty and self._last_len:
      self.stream.write("\n")
      self.stream.flush()
      self._last_len = 0


def _tensorboard_writer(logdir: str, purge_step: int | None = None):
  """A TensorBoard writer of ``logdir``; ``purge_step``: TensorBoard hides the earlier events of steps >= it.

  Event file names carry the second they were opened in; ours carry the process id (and the purge step) too, so
  a writer never reuses, and truncates, a file that another one opened in the same second."""
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  except ImportError:
    log.warning("tensorboardX is not installed: no TensorBoard events (pip install tensorboardX)")
    return None
  suffix = f".{os.getpid()}" + ("" if purge_step is None else f".from_step_{purge_step}")
  return SummaryWriter(logdir=logdir, flush_secs=10, purge_step=purge_step, filename_suffix=suffix)


class Monitor:
  """Collects step metrics, writes them (JSONL, TensorBoard) and drives the progress line.

  Args:
    run_dir: where ``metrics.jsonl`` and ``tb/`` go (created); None writes nothing.
    total_steps: the run's last step (for the progress line and the ETA).
    stream: where the progress line goes (None: `logging`).
    name: a label shown in the progress line (``pretrain``, ``distill``).
    tensorboard: write TensorBoard events (when ``loggers`` is None).
    loggers: the loggers besides ``metrics.jsonl`` (``run.loggers``: ``tensorboard``, ``wandb``); None:
      TensorBoard as ``tensorboard`` says.
    config: the run's config as a plain dict, for loggers that record it (W&B).
  """

  def __init__(
    self, run_dir: str | None, total_steps: int, *, stream: IO[str] | None = None, name: str = "", tensorboard=True,
    loggers=None, config: dict | None = None,
  ):
    loggers = ("tensorboard",) * bool(tensorboard) if loggers is None else check_loggers(loggers)
    self.run_dir = run_dir
    self.bar = ProgressBar(total_steps, stream, name)
    self.total = total_steps
    self._jsonl = None
    self._tb = None  # opened at the first write (after a resumed run's `rewind`)
    self._tb_dir = None
    self._tb_purge = None
    if run_dir is not None:
      os.makedirs(run_dir, exist_ok=True)
      self._jsonl_path = os.path.join(run_dir, "metrics.jsonl")
      self._jsonl = open_append(self._jsonl_path)  # a link there is refused; closed in close()
      if "tensorboard" in loggers:
        self._tb_dir = os.path.join(run_dir, "tb")
    self._wandb = None
    if run_dir is not None and "wandb" in loggers:
      try:
        self._wandb = WandbLogger(run_dir, config=config, job=name)
      except BaseException:
        self.close()
        raise
    self._window: list[dict[str, Any]] = []
    self._window_tokens = 0.0
    self._t_window = None
    self._t_start = None
    self._first_step = None
    self._timed_steps = 0
    self._timed_seconds = 0.0

  def start(self, step: int) -> None:
    """Marks the start (or resumption) of training at ``step``."""
    self._first_step = step
    self._t_start = self._t_window = time.perf_counter()
    self.bar.update(step)

  def step(self, step: int, metrics: dict[str, Any], tokens: float) -> None:
    """Records one finished step (``metrics`` may still be device arrays: nothing blocks here)."""
    self._window.append(metrics)
    self._window_tokens += tokens

  def exclude(self, seconds: float) -> None:
    """Keeps the last ``seconds`` (evaluation, checkpointing) out of the current window's step timing.

    Only their part after the window's start counts: a flush among them (which waits for the steps of
    the window it closes) has already started a new window.
    """
    if self._t_window is not None:
      now = time.perf_counter()
      self._t_window += max(0.0, now - max(self._t_window, now - seconds))

  def flush_train(self, step: int, extra: dict[str, float] | None = None) -> dict[str, float]:
    """Means of the metrics recorded since the last flush; writes and displays them."""
    if not self._window:
      return {}
    host = jax.device_get(self._window)
    # Each metric over the steps that report it (a fallback loss adds metrics of its own).
    keys = list(dict.fromkeys(k for m in host for k in m if k != "tokens"))
    means = {k: float(np.mean([float(m[k]) for m in host if k in m])) for k in keys}
    now = time.perf_counter()
    seconds = now - self._t_window
    n = len(host)
    # The window holding the first step includes compilation: keep it out of the ETA.
    if step - n > self._first_step:
      self._timed_steps += n
      self._timed_seconds += seconds
    means["tokens_per_s"] = self._window_tokens / max(seconds, 1e-9)
    means["step_s"] = seconds / n
    means.update(extra or {})
    self._window, self._window_tokens, self._t_window = [], 0.0, now
    # Until a window without compilation has been timed, the ETA is unknown.
    eta = self._timed_seconds / self._timed_steps * (self.total - step) if self._timed_steps else None
    self.write(step, "train", means)
    self.bar.update(step, means.get("loss"), means["tokens_per_s"], eta)
    return means

  def eval(self, step: int, metrics: dict[str, float]) -> None:
    """Writes and displays validation metrics."""
    self.write(step, "val", metrics)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "tokens")
    self.bar.message(f"{self.bar.name + ' ' if self.bar.name else ''}eval @ step {step}: {shown}")

  def write(self, step: int, split: str, metrics: dict[str, float]) -> None:
    row = {"step": int(step), "split": split, **{k: float(v) for k, v in metrics.items()}}
    if self._jsonl is not None:
      self._jsonl.write(json.dumps(row) + "\n")
      self._jsonl.flush()
    if self._tb is None and self._tb_dir is not None:
      self._tb = _tensorboard_writer(self._tb_dir, self._tb_purge)
      self._tb_dir = None if self._tb is None else self._tb_dir  # no tensorboardX: warned once
    if self._tb is not None:
      for k, v in metrics.items():
        if math.isfinite(float(v)):
          self._tb.add_scalar(f"{split}/{k}", float(v), int(step))
    if self._wandb is not None:
      self._wandb.log(step, split, metrics)

  def summary(self, summary: dict) -> None:
    """The run's final summary (``summary.json``), for loggers that keep one (W&B's run summary)."""
    if self._wandb is not None:
      self._wandb.summary(summary)

  def event(self, step: int, kind: str, **fields: Any) -> None:
    """Writes one event row ``{"step", "split": "event", "event": kind, **fields}`` to ``metrics.jsonl``
    (divergence restores, fallback switches, remat decisions); JSON values, not sent to TensorBoard."""
    if self._jsonl is not None:
      self._jsonl.write(json.dumps({"step": int(step), "split": "event", "event": kind, **fields}) + "\n")
      self._jsonl.flush()

  def message(self, text: str) -> None:
    self.bar.message(text)

  def rewind(self, step: int) -> int:
    """Drops the ``metrics.jsonl`` rows of steps after ``step`` and any torn (unparseable) line; returns how many.

    A resumed run calls it with the restored step: the rows a killed run wrote after its last
    checkpoint are redone, and would otherwise appear twice. The file is rewritten through a
    temporary sibling and a rename. TensorBoard's event files are append-only: the next event file
    starts with a purge marker at ``step + 1`` (TensorBoard's ``purge_step``), so TensorBoard hides
    the earlier events of the redone steps.
    """
    if self._tb_dir is not None:
      if self._tb is not None:
        self._tb.close()
        self._tb = None
      self._tb_purge = int(step) + 1
    if self._jsonl is None:
      return 0
    path = self._jsonl_path
    self._jsonl.close()
    kept, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
      for line in f:
        try:
          row = json.loads(line)
          ok = isinstance(row, dict) and int(row.get("step", 0)) <= step
        except (ValueError, TypeError):
          ok = False
        if ok:
          kept.append(line if line.endswith("\n") else line + "\n")
        elif line.strip():
          dropped += 1
    if dropped:
      write_text_atomic(path, "".join(kept))
      log.info("%s: dropped %d rows after step %d (or torn)", path, dropped, step)
    self._jsonl = open_append(path)  # closed in close()
    return dropped

  def close(self) -> None:
    self.bar.close()
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if getattr(self, "_wandb", None) is not None:
      self._wandb.close()
      self._wandb = None


class ProfileWindow:
  """Writes a JAX profiler trace of steps ``start`` .. ``stop`` (1-based, inclusive) to ``directory``.

  Parse ``"START:STOP"`` with `ProfileWindow.parse`. View the trace with TensorBoard's profile
  plugin or Perfetto (``.trace.json.gz`` under ``directory``).
  """

  def __init__(self, start: int, stop: int, directory: str):
    if not 1 <= start <= stop:
      raise ValueError(f"profile window {start}:{stop} must satisfy 1 <= START <= STOP (steps are 1-based)")
    self.start, self.stop, self.directory = start, stop, directory
    self.active = False
    self.done = False  # one trace per run, even when a divergence restore passes the window again

  @classmethod
  def parse(cls, spec: str | None, directory: str) -> ProfileWindow | None:
    if not spec:
      return None
    try:
      a, b = spec.split(":")
      return cls(int(a), int(b), directory)
    except ValueError as e:
      raise ValueError(f"--profile {spec!r} must be START:STOP with 1 <= START <= STOP, e.g. 10:15 ({e})") from None

  def before_step(self, step: int) -> None:
    """Call before running step number ``step`` (1-based)."""
    if step == self.start and not self.active and not self.done:
      os.makedirs(self.directory, exist_ok=True)
      jax.profiler.start_trace(self.directory)
      self.active = True
      log.info("profiler: tracing steps %d..%d into %s", self.start, self.stop, self.directory)

  def after_step(self, step: int, result: Any) -> None:
    """Call after step ``step``; stops the trace (after the step finished) at ``stop``."""
    if self.active and step >= self.stop:
      jax.block_until_ready(result)
      jax.profiler.stop_trace()
      self.active, self.done = False, True
      log.info("profiler: trace written to %s", self.directory)

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
