"""Stopping a run cleanly on SIGTERM (a scheduler's preemption, ``kill``, ``docker stop``).

`stop_on_signals()` (the CLI wraps every training command in it) turns SIGTERM into a request
that `meshdistill.trainer.fit` reads between steps: it finishes the step in flight, writes a
checkpoint of it and raises `Stopped`, so rerunning the same command resumes exactly there. A
second SIGTERM while the first is being handled gets the default action (the process ends;
the previous checkpoint is intact, since saves are atomic). Library code installs no handler
itself: without `stop_on_signals`, `requested()` is always None.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator

log = logging.getLogger(__name__)

_requested: str | None = None


class Stopped(Exception):
  """A run stopped on a signal after writing a checkpoint of ``step`` (None: nothing was saved)."""

  def __init__(self, signame: str, step: int, checkpoint_dir: str | None):
    self.signame, self.step, self.checkpoint_dir = signame, step, checkpoint_dir
    where = f"; checkpoint of step {step} in {checkpoint_dir}" if checkpoint_dir else " (no checkpoint: none configured)"
    super().__init__(f"stopped by {signame} after step {step}{where}")


def requested() -> str | None:
  """The name of the signal that asked the run to stop (``"SIGTERM"``), or None."""
  return _requested


@contextlib.contextmanager
def stop_on_signals(signals: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[None]:
  """Within the block, the first of ``signals`` requests a clean stop (`requested`); handlers restored on exit."""
  global _requested
  previous = {}

  def handler(signum, frame):  # noqa: ARG001
    global _requested
    _requested = signal.Signals(signum).name
    log.warning("%s received: finishing the current step, then writing a checkpoint and stopping", _requested)
    signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once

  for s in signals:
    previous[s] = signal.signal(s, handler)
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
    _requested = None
