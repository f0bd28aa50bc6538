"""What a run trains from, as the distill job and the loop ask it (`TrainingData`), and the base of a data bundle whose
training batches are another bundle's with something added (`WrappedData`).

`TrainingData` is one small Protocol: the tokenizers (the student's and, for a teacher of its own tokenizer, the
teacher's), the statistics, a resumable training iterator and the fixed validation batches. Every kind of training
data implements it: `meshdistill.data.DataBundle` (the corpus), `meshdistill.data.prompts.PromptData` (prompt /
completion pairs), and each `WrappedData`: `meshdistill.data.PreferencePairs` ((chosen, rejected) row pairs), and the
teacher sources' bundles whose batches carry a teacher's top-k (a cache, a teacher on its own devices, a served
teacher, several teachers combined: `meshdistill.teachers`).

A `WrappedData` names what it takes from the bundle it wraps (``bundle``) one attribute at a time; nothing else of the
inner bundle is read through it (no attribute forwarding), so what a wrapper offers is what its class says. Code that
needs more of the corpus (its packed rows, its config) holds the bundle itself.
"""

from __future__ import annotations

import abc
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrainingData(Protocol):
  """What `meshdistill.jobs.distill` and `meshdistill.train.loop.trainer.fit` ask of the data a run trains from."""

  @property
  def tokenizer(self) -> Any:
    """The student's tokenizer."""

  @property
  def teacher_tokenizer(self) -> Any:
    """The teacher's own tokenizer (``data.teacher_tokenizer``), or None: one tokenizer."""

  @property
  def stats(self) -> dict[str, Any]:
    """Counts of the data (tokens, rows, ...), for the run's report."""

  def train_iterator(self, state: dict[str, Any] | None = None) -> Any:
    """A fresh training iterator (with ``get_state``), positioned at ``state`` if given."""

  def val_batches(self, max_batches: int | None = None) -> list[dict[str, Any]]:
    """The fixed validation batches; ``[]`` when there are none."""


class WrappedData(abc.ABC):
  """A `TrainingData` whose training batches are ``bundle``'s with something added or changed (a subclass gives
  `train_iterator`); its tokenizers, statistics, batch size and validation batches are ``bundle``'s."""

  bundle: Any

  def __init__(self, bundle: Any):
    self.bundle = bundle

  @property
  def tokenizer(self) -> Any:
    return self.bundle.tokenizer

  @property
  def teacher_tokenizer(self) -> Any:
    return self.bundle.teacher_tokenizer

  @property
  def stats(self) -> dict[str, Any]:
    return self.bundle.stats

  @property
  def global_batch_size(self) -> int:
    """Rows per step over all processes."""
    return self.bundle.global_batch_size

  def val_batches(self, *args, **kwargs) -> list[dict[str, Any]]:
    """The inner bundle's validation batches (the arguments of its ``val_batches``)."""
    return self.bundle.val_batches(*args, **kwargs)

  @abc.abstractmethod
  def train_iterator(self, state: dict[str, Any] | None = None, **kwargs) -> Any:
    """The training iterator of these batches, positioned at ``state``."""
