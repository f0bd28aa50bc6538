"""`BlockOutput`: what every layer of the decoder returns -- its attention, its MLP (dense or mixture of experts) and
the block around them -- so that the decoder's loop, the scanned layers (`meshdistill.models._scan`), the cached
decoding pass (`Decoder.decode_step`) and `meshdistill.models.compress` read one shape of result by field, never by
its type or length."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockOutput:
  """A layer's result.

  ``x``: its output ``[B, T, D]`` (a block's: the residual stream after it); ``cache``: the `KVCache` with this call's
  keys and values written, when called with one (decoding); ``probs``: the attention probabilities ``[B, H, T, S]``
  when asked for (``want_probs``) and the kernel forms them; ``aux``: what a mixture-of-experts MLP reports
  (`meshdistill.models.moe.Routing`). A field a layer does not produce is None.

  A pytree whose fields are its children (None ones empty), so it passes through ``nnx.scan``, ``nnx.remat``,
  `jax.custom_vjp` and ``jit`` as the tuples it replaces did, with the same arrays (the same compiled program). It is
  not a tuple: a caller reads a field by name.
  """

  x: jax.Array
  cache: Any = None  # a `KVCache` (the attention module imports this one: named by its doc, not its type)
  probs: jax.Array | None = None
  aux: Any = None  # a `Routing` (moe imports this module: named by its doc, not its type)
