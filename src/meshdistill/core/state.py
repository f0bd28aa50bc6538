"""What a step updates and how a layout may run it: `TrainState`, the trained / frozen split of the parameters,
and `SplitStep`, the contract of a step that a layout may run in two halves.

The step (`meshdistill.train.step`), the layouts (`meshdistill.parallel`), checkpoints (`meshdistill.storage`) and
the loop all hold a `TrainState`; none of them owns it, so it lives here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx


class TrainState(NamedTuple):
  """Everything a step updates. ``params = {"student": nnx.State, "strategy": pytree}``."""

  step: jax.Array  # int32 scalar
  params: Any
  opt_state: Any


def split_trainable(params: dict, trainable: Any) -> tuple[dict, Any]:
  """``(trained, frozen)``: ``params`` with only the student parameters matching the nnx filter
  ``trainable`` (strategy parameters always train), and the rest of the student; ``trainable=None``:
  ``(params, None)``. The optimizer sees ``trained`` only."""
  if trainable is None:
    return params, None
  trained, frozen = nnx.split_state(params["student"], trainable, ...)
  return {**params, "student": trained}, frozen


def join_trainable(trained: dict, frozen: Any) -> dict:
  """The inverse of `split_trainable`."""
  if frozen is None:
    return trained
  return {**trained, "student": nnx.merge_state(trained["student"], frozen)}


@dataclasses.dataclass(frozen=True)
class SplitStep:
  """A per-device step written as two halves, the contract between a step and the layouts that split it.

  ``gradients(state, teacher_params, batch, **keywords) -> (grads, metrics)``: the forward and backward passes and
  the sums over ``data`` (``keywords`` hold ``data_axis`` and, for a student on rows split over ``tensor``,
  ``student_axis``); ``update(state, grads, metrics, **keywords) -> (new_state, metrics)``: the optimizer update
  (a layout that runs it on a mesh of one device passes ``one_device=True``).
  Called whole it runs one after the other. A layout given a `functools.partial` of one (its keywords bound) reads
  the halves with `halves` and may run them apart: the shard_map layout runs the first per ``data`` shard and the second
  on the global arrays (needed for ``mesh.fsdp`` and ``mesh.student_split: batch``); any other step function runs
  whole. `meshdistill.train.step.per_device_step` is one.
  """

  gradients: Callable[..., Any]
  update: Callable[..., Any]

  def __call__(self, state: TrainState, teacher_params: Any, batch: dict, **keywords):
    grads, metrics = self.gradients(state, teacher_params, batch, **keywords)
    return self.update(state, grads, metrics, **keywords)

  @staticmethod
  def halves(step_fn: Any) -> tuple[Any, Any] | None:
    """``(gradients, update)`` of ``step_fn``, a `functools.partial` of a `SplitStep` with keywords only (bound to
    both halves), or None for any other function."""
    if not isinstance(step_fn, functools.partial) or not isinstance(step_fn.func, SplitStep) or step_fn.args:
      return None
    kw = step_fn.keywords
    return functools.partial(step_fn.func.gradients, **kw), functools.partial(step_fn.func.update, **kw)
