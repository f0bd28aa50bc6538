"""Gradient accumulation: a device's rows of one step run as micro-batches, one after another, in the one program.

``train.micro_batch`` (`meshdistill.Distiller`'s ``micro_batch``) is the number of rows each device runs through a
forward and backward pass at a time. The step (`meshdistill.train.step.per_device_gradients`) cuts its local rows
into ``k = rows / micro_batch`` contiguous micro-batches and runs them in a ``jax.lax.scan``: the teacher's forward and
the student's gradient of each, their gradients and token sums added up in float32. Only one micro-batch's
activations (teacher outputs, the student's saved activations) are alive at a time, so a global batch too large for
a device's memory runs whole, at the cost of a loop.

The loss stays the token mean over the unmasked tokens of the GLOBAL batch: its denominator (the tokens, or a
strategy's ``count``) is the whole local batch's, summed over ``data`` BEFORE the loop, and each micro-batch adds its
token sums over that one denominator, so the micro-batches' gradients and metrics add up to the unaccumulated step's
(a mean per micro-batch would weigh a micro-batch of few unmasked tokens like a full one). Gradients and sums are
summed over ``data`` once, after the loop. Same numbers as ``k = 1`` up to float32 summation order.

What cannot be cut so is refused with a named error: a mixture-of-experts student's load-balancing loss multiplies
every expert's assignments over the GLOBAL batch by its router probabilities, so it needs every micro-batch's
routing before any micro-batch's loss; a strategy of row pairs (``needs_pairs``, preference losses) takes even
micro-batches, so no pair is cut.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

SETTING = "train.micro_batch"


def check_micro_batch(micro_batch: int | str | None, auto: bool = True) -> None:
  """Raises for a ``micro_batch`` that is neither a positive number of rows, ``None`` (the whole batch) nor, with
  ``auto``, ``"auto"``."""
  if micro_batch is None or (auto and micro_batch == "auto"):
    return
  if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
    raise ValueError(f"{SETTING}={micro_batch!r} must be a positive number of rows per device"
                     + (", or auto" if auto else ""))


def divisors(rows: int, multiple: int = 1) -> list[int]:
  """The micro-batch sizes that cut ``rows`` evenly and are multiples of ``multiple``, largest (the whole) first."""
  return [m for m in range(rows, 0, -1) if rows % m == 0 and m % multiple == 0]


def micro_batches(rows: int, micro_batch: int | None, multiple: int = 1, why: str = "") -> int:
  """How many micro-batches of ``micro_batch`` rows the ``rows`` a device holds per step make (``None``: 1, the
  whole). Raises naming `SETTING` and the sizes that work for a size that does not divide ``rows`` or is not a
  multiple of ``multiple`` (``why`` says what asks for it)."""
  if micro_batch is None:
    return 1
  check_micro_batch(micro_batch, auto=False)
  if rows % micro_batch or micro_batch % multiple:
    need = f" and a multiple of {multiple}{why}" if multiple > 1 else ""
    raise ValueError(f"{SETTING}={micro_batch} must divide the {rows} rows each device holds per step "
                     f"(train.batch_size over the mesh's data devices){need}; use one of {divisors(rows, multiple)}, "
                     "or auto")
  return rows // micro_batch


def split_rows(tree: Any, k: int) -> Any:
  """Every array of ``tree`` ([rows, ...]) as ``[k, rows / k, ...]``: ``k`` contiguous micro-batches."""
  def cut(x):
    if x.shape[0] % k:
      raise ValueError(f"an input of shape {x.shape} cannot be cut into {k} micro-batches of rows")
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])

  return jax.tree.map(cut, tree)


def accumulate(fn: Callable[[Any, Any], Any], micro: Any, operands: Any = None) -> Any:
  """``sum_i fn(micro[i], operands)`` over the leading axis of ``micro`` (from `split_rows`), in a ``jax.lax.scan``:
  the sum kept in float32 (a bfloat16 or float16 output is added in float32), each leaf returned in its own dtype.
  ``operands`` (e.g. the models' weights) are the same for every micro-batch; they enter the loop as its operands,
  carried unchanged, so ``fn`` sees them as values of the loop's own trace (a Flax model merged inside the loop from
  weights it closed over would hold values of the enclosing trace, which a scanned model's ``nnx.scan`` refuses)."""
  first = jax.tree.map(lambda x: x[0], micro)
  shapes = jax.eval_shape(fn, first, operands)
  wide = lambda s: jnp.promote_types(s.dtype, jnp.float32)  # noqa: E731 -- float32 at least
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, wide(s)), shapes)

  def body(carry, x):
    total, ops = carry
    return (jax.tree.map(lambda t, y: t + y.astype(t.dtype), total, fn(x, ops)), ops), None

  (total, _), _ = jax.lax.scan(body, (zeros, operands), micro)
  return jax.tree.map(lambda t, s: t.astype(s.dtype), total, shapes)
