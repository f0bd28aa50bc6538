"""Stopping a run cleanly on SIGTERM (a scheduler's preemption, ``kill``, ``docker stop``) or SIGINT (Ctrl-C).

`stop_on_signals()` (the CLI wraps ``distill``, ``pretrain`` and ``cache-teacher`` in it) turns each of
its signals into a request that the long loops read at safe points: `meshdistill.train.loop.trainer.fit` between
steps (it finishes the step in flight, writes a checkpoint of it and raises `Stopped`) and the teacher
cache writer between shards (it finishes the shard in flight, records it in its progress file and raises
`Stopped`). Rerunning the same command resumes exactly there. The command exits ``128 + signal``
(`Stopped.exit_code`): 143 for SIGTERM, 130 for SIGINT.

SIGINT is handled as a stop request, not as Python's ``KeyboardInterrupt``: an exception raised from a
signal handler lands wherever the main thread happens to be, and in a JAX program that is often a
callback whose exceptions are printed and dropped (JAX's garbage-collection callback prints "Exception
ignored" and the run goes on), or a ``finally`` block half-way through a save. A flag read by the loop at
a step or shard boundary is seen every time and leaves the files consistent.

A loop blocked waiting for its data (a served teacher's answer that does not come) would see the request only when
the answer comes: an iterator that can wait in slices offers ``ready(seconds)``, and the loop waits through
`wait_for`, which returns as soon as a stop is requested (within `POLL_S`); the loop then stops after its last
finished step as above, and the iterator's ``close`` cancels what it waited for.

A second signal while the first is being handled gets the default action (the process ends at once;
the previous checkpoint and the finished shards are intact, since their writes are atomic). Library
code installs no handler itself: without `stop_on_signals`, `requested()` is always None.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

_requested: str | None = None

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
  """A run stopped on a signal after writing a checkpoint of ``step`` (None: nothing was saved).

  ``detail`` replaces the checkpoint wording for loops that are not training (the teacher cache's shards).
  """

  def __init__(self, signame: str, step: int, checkpoint_dir: str | None, detail: str | None = None):
    self.signame, self.step, self.checkpoint_dir = signame, step, checkpoint_dir
    if detail is not None:
      message = f"stopped by {signame} {detail}"
    else:
      where = (f"; checkpoint of step {step} in {checkpoint_dir}" if checkpoint_dir
               else " (no checkpoint: none configured)")
      message = f"stopped by {signame} after step {step}{where}"
    super().__init__(message)

  @property
  def exit_code(self) -> int:
    """``128 + signal number``, the shell's convention: 143 for SIGTERM, 130 for SIGINT."""
    try:
      return 128 + int(signal.Signals[self.signame])
    except KeyError:
      return 143


def requested() -> str | None:
  """The name of the signal that asked the run to stop (``"SIGTERM"``, ``"SIGINT"``), or None."""
  return _requested


# seconds between two looks at a stop request while `wait_for` waits
POLL_S = 0.1


def wait_for(ready: Callable[[float], bool]) -> bool:
  """Waits until ``ready(seconds)`` (which waits at most that long) says the awaited thing is there: True; False as
  soon as a stop is requested first (seen within `POLL_S`)."""
  while not ready(POLL_S):
    if _requested is not None:
      return False
  return True


@contextlib.contextmanager
def stop_on_signals(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
  """Within the block, the first of ``signals`` requests a clean stop (`requested`); handlers restored on exit."""
  global _requested
  previous = {}

  def handler(signum, frame):  # noqa: ARG001
    global _requested
    _requested = signal.Signals(signum).name
    log.warning("%s received: finishing the current step (or teacher-cache shard), saving it, then stopping; "
                "send it again to end at once", _requested)
    signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once

  for s in signals:
    previous[s] = signal.signal(s, handler)
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
    _requested = None
