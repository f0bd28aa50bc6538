"""A training iterator whose teacher works one batch ahead: batch s+1's teacher work is started before batch s is
handed out, so it runs while step s does. Its state is the position of the next batch it hands out, so checkpoints
and resume are those of the plain data. Used by the sub-mesh teacher (`meshdistill.teachers.mesh`) and the served
teacher (`meshdistill.teachers.kinds.remote`)."""

from __future__ import annotations

import abc
from typing import Any


class AheadIterator(abc.ABC):
  """Wraps a checkpointable data iterator (``get_state`` / ``set_state`` / ``close``). Subclasses say how a batch's
  teacher work starts (`dispatch`) and how the batch is handed out with its result (`collect`); when `collect`
  raises, that batch stays the next one to hand out (the state a checkpoint or a rerun reads)."""

  def __init__(self, it):
    self._it, self._ahead, self._index = it, None, 0

  @abc.abstractmethod
  def dispatch(self, batch: dict, index: int) -> Any:
    """Start the teacher's work for ``batch`` (the ``index``-th this iterator read); returns what `collect` gets."""

  @abc.abstractmethod
  def collect(self, batch: dict, work: Any, index: int) -> dict:
    """``batch`` with the teacher's outputs, from ``work`` (`dispatch`'s result)."""

  def _read(self):
    position = self._it.get_state()
    try:
      batch = next(self._it)
    except StopIteration:
      return None
    self._index += 1
    return position, self._index - 1, batch, self.dispatch(batch, self._index - 1)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    current = self._ahead if self._ahead is not None else self._read()
    if current is None:
      raise StopIteration
    self._ahead = self._read()  # batch s+1's teacher work starts before batch s is handed out
    _, index, batch, work = current
    try:
      return self.collect(batch, work, index)
    except BaseException:
      self._ahead = current  # never handed out without its teacher's outputs: it is the next one to hand out
      raise

  def get_state(self):
    return self._ahead[0] if self._ahead is not None else self._it.get_state()

  def set_state(self, state):
    self._ahead = None
    self._it.set_state(state)

  def close(self):
    self._it.close()
