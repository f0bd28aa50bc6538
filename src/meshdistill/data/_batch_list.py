"""`BatchList`: batches already in memory, as `meshdistill.train.loop.trainer.fit` reads its data."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class BatchList:
  """A finite list of host batches (``{"inputs", "targets", "mask"}`` dicts) as `fit` reads data: a training
  iterator whose position (``{"next_batch": i}``) resumes exactly, and no validation batches. The run ends with
  the list unless its ``steps`` come first."""

  def __init__(self, batches: Iterable[dict]):
    self.batches = list(batches)

  def val_batches(self, max_batches: int | None = None) -> list[dict]:
    del max_batches
    return []

  def train_iterator(self, state: dict[str, Any] | None = None) -> "BatchListIterator":
    return BatchListIterator(self.batches, (state or {}).get("next_batch", 0))


class BatchListIterator:
  """The batches of a `BatchList` from ``position`` on."""

  def __init__(self, batches: list[dict], position: int):
    self.batches, self.position = batches, position

  def __iter__(self) -> "BatchListIterator":
    return self

  def __next__(self) -> dict:
    if self.position >= len(self.batches):
      raise StopIteration
    self.position += 1
    return self.batches[self.position - 1]

  def get_state(self) -> dict[str, int]:
    return {"next_batch": self.position}

  def close(self) -> None:
    pass
