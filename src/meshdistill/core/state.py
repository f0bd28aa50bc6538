"""What a step updates and how a layout may run it: `TrainState`, the trained / frozen split of the parameters,
and `SplitStep`, the contract of a step that a layout may run in two halves.

The step (`meshdistill.train.step`), the layouts (`meshdistill.parallel`), checkpoints (`meshdistill.storage`) and
the loop all hold a `TrainState`; none of them owns it, so it lives here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
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

  The step's keywords are one set: each half receives those its signature names (`split_keywords`), and a keyword
  neither half names is a ``TypeError`` (a misspelt setting is never dropped).
  """

  gradients: Callable[..., Any]
  update: Callable[..., Any]

  def __call__(self, state: TrainState, teacher_params: Any, batch: dict, **keywords):
    for_gradients, for_update = self.split_keywords(keywords)
    grads, metrics = self.gradients(state, teacher_params, batch, **for_gradients)
    return self.update(state, grads, metrics, **for_update)

  def split_keywords(self, keywords: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``keywords`` of the whole step as ``(the gradient half's, the update half's)``, each the ones its signature
    names (a half with ``**kwargs`` takes them all). Raises ``TypeError`` naming a keyword neither half takes."""
    taken = (_keyword_names(self.gradients), _keyword_names(self.update))
    unknown = sorted(k for k in keywords if all(names is not None and k not in names for names in taken))
    if unknown:
      raise TypeError(
          f"step keyword(s) {unknown} are taken by neither half of the step: "
          f"{getattr(self.gradients, '__name__', 'gradients')} takes {sorted(taken[0] or ())}, "
          f"{getattr(self.update, '__name__', 'update')} takes {sorted(taken[1] or ())}; check the spelling")
    pick = lambda names: dict(keywords) if names is None else {k: v for k, v in keywords.items() if k in names}  # noqa: E731
    return pick(taken[0]), pick(taken[1])

  @staticmethod
  def halves(step_fn: Any) -> tuple[Any, Any] | None:
    """``(gradients, update)`` of ``step_fn``, a `functools.partial` of a `SplitStep` with keywords only (each half
    bound to the keywords it takes, `split_keywords`), or None for any other function."""
    if not isinstance(step_fn, functools.partial) or not isinstance(step_fn.func, SplitStep) or step_fn.args:
      return None
    split = step_fn.func
    for_gradients, for_update = split.split_keywords(step_fn.keywords)
    return functools.partial(split.gradients, **for_gradients), functools.partial(split.update, **for_update)


@functools.lru_cache(maxsize=None)
def _keyword_names(fn: Callable[..., Any]) -> frozenset[str] | None:
  """The names ``fn`` takes by keyword; None when it takes any (``**kwargs``)."""
  parameters = inspect.signature(fn).parameters.values()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return None
  return frozenset(p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
