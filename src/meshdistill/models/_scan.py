"""Scanned blocks (``ModelConfig.scan_layers``): the decoder's blocks built once with a leading layer axis
and run under ``nnx.scan``, so XLA compiles one block body instead of ``n_layers`` copies.

* `stacked_blocks` creates ``n_layers`` blocks under ``nnx.vmap`` (one RNG stream split per layer): every
  weight becomes ``[L, ...]`` and its partitioning ``("layers", *per-layer)``: no rules table splits the layer axis.
* `scan_blocks` runs them with the same ``run_block(block, x, want_probs)`` as the unrolled loop (so the
  per-block rematerialisation, and any per-block step inside it, is unchanged); the per-layer hidden states
  and attention probabilities come out of the scan stacked and are returned as the unrolled model's tuples.
* `scan_blocks_cached` is the decoding form: the key/value caches are stacked ``[L, ...]`` and scanned
  alongside the weights (`Decoder.decode_step`, which `meshdistill.models.generate` runs).

Conversions between stacked and per-layer weights live in `meshdistill.models.stacking`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from meshdistill.models._attention import KVCache

# The layer axis added in front of every block weight: the logical name ``layers`` (no rule splits it).
LAYER_AXIS = {nnx.PARTITION_NAME: "layers"}


def save_all_but_casts(prim, *_, **__) -> bool:
  """Remat policy of a scanned block without rematerialisation: keep every value but dtype casts.

  Without it the scan stacks the compute-dtype copies of each layer's weights for the backward pass (measured:
  8 bf16 blocks, d=256: 38.5 MiB of temporaries instead of 8.5); a cast is recomputed for free.
  """
  return prim is not jax.lax.convert_element_type_p


def stacked_blocks(make_block: Callable[[nnx.Rngs], nnx.Module], n_layers: int, rngs: nnx.Rngs) -> nnx.Module:
  """``n_layers`` blocks as ONE module whose variables are stacked ``[n_layers, ...]``."""

  @nnx.split_rngs(splits=n_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=LAYER_AXIS)
  def make(rngs):
    return make_block(rngs)

  return make(rngs)


def scan_blocks(blocks: nnx.Module, x_BxTxD: jax.Array, run_block, want_hidden: bool, want_attn: bool,
                want_router: bool = False):
  """``(x after the last block, hidden L x [B, T, D] or (), attn L x [B, H, T, T] or (), router L x Routing or
  ())``.

  ``run_block(block, x, want_probs) -> (x, probs, routing)`` runs one (sliced) block, as in the unrolled loop.
  """

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=LAYER_AXIS)
  def body(x, block):
    x, probs, routing = run_block(block, x, want_attn)
    return x, (x if want_hidden else None, probs if want_attn else None, routing if want_router else None)

  x_BxTxD, (hidden_LxBxTxD, attn_LxBxHxTxT, router_L) = body(x_BxTxD, blocks)
  return x_BxTxD, _layers(hidden_LxBxTxD), _layers(attn_LxBxHxTxT), _layers(router_L)


def _layers(stacked) -> tuple:
  """The per-layer entries of a scan's stacked output (an array or a pytree of arrays [L, ...]), or ()."""
  if stacked is None:
    return ()
  n = jax.tree.leaves(stacked)[0].shape[0]
  return tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n))


def scan_blocks_cached(blocks: nnx.Module, x_BxTxD: jax.Array, kv, valid_BxS, index, positions_BxT):
  """The decoding pass over stacked blocks: ``(x, (k_LxBxSxGxK, v_LxBxSxGxK))`` with this call's keys/values
  written at ``index`` (``kv``: the stacked caches, see `KVCache`).

  A plain ``jax.lax.scan`` over the blocks' state: decoding runs inside a ``while_loop``, whose body may not
  hand the outer trace's modules to ``nnx.scan``.
  """
  graphdef, state = nnx.split(blocks)

  def body(x, layer):
    state_l, kv_l = layer
    x, cache = nnx.merge(graphdef, state_l)(x, False, KVCache(*kv_l, valid_BxS, index, positions_BxT))
    return x, (cache.k_BxSxGxK, cache.v_BxSxGxK)

  return jax.lax.scan(body, x_BxTxD, (state, tuple(kv)))
