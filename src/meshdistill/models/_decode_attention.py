"""One decoded token's attention over a key/value cache, with the token's own key and value written into the cache,
in one Pallas kernel on a TPU (`decode_attention`).

In XLA a decoding step writes the new slot with a ``dynamic_update_slice`` and then attends: on a TPU the cache is
laid out in tiles of 16 slots (bfloat16) per row and key/value head, so the write reads and rewrites one tile per
row and head, a pass of its own over scattered memory, before the attention reads the cache again. Here a grid step
reads a block of rows and heads (every attended slot), puts the new key and value into the block's tile holding
their slot while the block is on chip, attends to the block, and writes back that tile only (the output caches
alias the input ones: the other slots are never rewritten). What this saves on a chip:
``benchmarks/results/tpu_step.md``, sampling.

The values are those of the XLA path (`meshdistill.models._attention._explicit_attention` on one query token):
float32 scores, scaled, soft-capped, masked, a float32 softmax whose probabilities are rounded to the values' dtype
before their product. The cache is ``[B, G, S, K]`` (`meshdistill.models._visible.KVCache`): a step's block holds
each (row, head)'s slots contiguously.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshdistill.models._variants import band, softcap

# the slots of one on-chip tile of a cache of 2-byte values (sublanes x packing): the unit a slot's write rewrites
TILE = 16
# the bytes of keys and values one grid step reads (both caches): large enough that a step's copy hides its fixed
# cost, small enough that two steps' blocks (the pipeline's double buffer) stay within the 16 MiB of scoped on-chip
# memory beside the scores (a cache whose one (row, head) would not fit keeps the XLA path: `usable`). Measured on a
# v5e chip at batch 64 (`benchmarks/results/tpu_step.md`, sampling): 4 MiB the fastest of 0.5, 1, 2 and 4
STEP_BYTES = 4 << 20


def usable(S: int, itemsize: int, K: int) -> bool:
  """Whether `decode_attention` applies to a cache of ``S`` slots of ``itemsize``-byte values, heads ``K`` wide:
  whole tiles of slots (a slot's write rewrites its tile: `TILE`), 2-byte values, heads a multiple of 64 wide, and
  one (row, key/value head)'s keys and values within a grid step's `STEP_BYTES` (a grid step reads every slot of its
  rows and heads: 8,192 slots of 128-wide heads at 4 MiB; longer caches overflow the chip's scoped memory)."""
  return itemsize == 2 and S % TILE == 0 and K % 64 == 0 and 2 * S * K * itemsize <= STEP_BYTES


def _blocks(B: int, G: int, slots: int, K: int, itemsize: int) -> tuple[int, int]:
  """Rows and key/value heads per grid step: as many heads, then rows, as keep a step's keys and values within
  `STEP_BYTES` (at least one of each; each a divisor of its dimension)."""
  per = 2 * slots * K * itemsize  # one (row, head)'s keys and values
  heads = max(g for g in range(1, G + 1) if G % g == 0 and (g == 1 or g * per <= STEP_BYTES))
  rows = max(b for b in range(1, B + 1) if B % b == 0 and (b == 1 or b * heads * per <= STEP_BYTES))
  return rows, heads


def _kernel(index_ref, q_ref, kn_ref, vn_ref, valid_ref, k_ref, v_ref, o_ref, ko_ref, vo_ref, *, scale, cap, window):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  index = index_ref[0]
  start = pl.multiple_of(jax.lax.div(index, TILE) * TILE, TILE)  # (a slot is never negative: no floor)
  for cache, new, out in ((k_ref, kn_ref, ko_ref), (v_ref, vn_ref, vo_ref)):
    tile = cache[:, :, pl.ds(start, TILE), :]  # [rows, heads, TILE, K]
    slot = jax.lax.broadcasted_iota(jnp.int32, tile.shape, 2) == index - start
    tile = jnp.where(slot, new[...], tile)
    cache[:, :, pl.ds(start, TILE), :] = tile  # the block attended to holds the new slot
    out[...] = tile  # the only part of the cache written back
  rows, heads, S, K = k_ref.shape
  R = q_ref.shape[2]
  n = rows * heads
  q, k, v = q_ref[...].reshape(n, R, K), k_ref[...].reshape(n, S, K), v_ref[...].reshape(n, S, K)
  s = softcap(jax.lax.dot_general(q, k, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32) * scale,
              cap)
  col = jax.lax.broadcasted_iota(jnp.int32, (rows, heads, R, S), 3)
  visible = (col <= index) & band(index, col, window)  # causal, and the sliding window's band (`KVCache.visible`)
  ok = (jnp.broadcast_to(valid_ref[...][:, :, None, :], (rows, heads, R, S)) != 0) & visible
  s = jnp.where(ok.reshape(n, R, S), s, jnp.finfo(jnp.float32).min)
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  p = (p / jnp.sum(p, axis=-1, keepdims=True)).astype(v.dtype)
  o = jax.lax.dot_general(p, v, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
  o_ref[...] = o.reshape(rows, heads, R, K).astype(o_ref.dtype)


def decode_attention(q_BxGxRxK, k_new_BxGxK, v_new_BxGxK, k_BxGxSxK, v_BxGxSxK, valid_BxN, index, *,
                     scale: float, cap: float | None = None, window: int | None = None, interpret: bool = False):
  """``(out [B, G, R, K], k, v)``: the attention of one query token per row over the cache's first ``N`` slots
  (``valid_BxN``'s), the token's key and value written at slot ``index`` first (and attended to).

  ``q_BxGxRxK``: the token's queries grouped by the key/value head they read (query head ``g R + r``);
  ``k_new_BxGxK`` / ``v_new_BxGxK``: its key (after RoPE) and value; ``k_BxGxSxK`` / ``v_BxGxSxK``: the caches
  (`usable`), returned with slot ``index`` written and nothing else changed (donate them: the kernel writes in
  place); ``valid_BxN``: the slots a row may attend to (left padding excluded), besides which a query sees slots
  ``<= index`` and, with a sliding ``window``, the last ``window`` of them; ``scale``: of the scores; ``cap``: a
  soft cap of the scaled scores (`meshdistill.models._variants.softcap`). ``interpret``: Pallas interpret mode (any
  backend; for checks).
  """
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  B, G, S, K = k_BxGxSxK.shape
  R, N = q_BxGxRxK.shape[2], valid_BxN.shape[1]
  itemsize = k_BxGxSxK.dtype.itemsize
  if not usable(S, itemsize, K) or N > S:
    raise ValueError(f"decode_attention needs a cache of 2-byte values in whole {TILE}-slot tiles, heads a multiple "
                     f"of 64 wide, a (row, head)'s keys and values within {STEP_BYTES} bytes and at most S attended "
                     f"slots; got a {k_BxGxSxK.dtype} cache [B, G, S, K] = "
                     f"{(B, G, S, K)} with {N} attended (keep the XLA path there)")
  slots = min(S, -(-N // TILE) * TILE)  # the tiles holding the attended slots
  valid = jnp.pad(valid_BxN.astype(jnp.int32), ((0, 0), (0, slots - N)))[:, None, :]  # [B, 1, slots]
  rows, heads = _blocks(B, G, slots, K, itemsize)
  index = jnp.reshape(jnp.asarray(index, jnp.int32), (1,))
  new = pl.BlockSpec((rows, heads, 1, K), lambda b, g, i: (b, g, 0, 0))
  cache = pl.BlockSpec((rows, heads, slots, K), lambda b, g, i: (b, g, 0, 0))
  tile = pl.BlockSpec((rows, heads, TILE, K), lambda b, g, i: (b, g, jax.lax.div(i[0], TILE), 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(B // rows, G // heads),
      in_specs=[pl.BlockSpec((rows, heads, R, K), lambda b, g, i: (b, g, 0, 0)), new, new,
                pl.BlockSpec((rows, 1, slots), lambda b, g, i: (b, 0, 0)), cache, cache],
      out_specs=[pl.BlockSpec((rows, heads, R, K), lambda b, g, i: (b, g, 0, 0)), tile, tile],
  )
  read = 2 * B * G * slots * K * itemsize
  cost = pl.CostEstimate(flops=4 * B * G * R * slots * K, transcendentals=B * G * R * slots,
                         bytes_accessed=read + 2 * B * G * TILE * K * itemsize + 2 * q_BxGxRxK.size * itemsize)
  kernel = functools.partial(_kernel, scale=float(scale), cap=cap, window=window)
  out, k, v = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct(q_BxGxRxK.shape, q_BxGxRxK.dtype), jax.ShapeDtypeStruct(k_BxGxSxK.shape,
                 k_BxGxSxK.dtype), jax.ShapeDtypeStruct(v_BxGxSxK.shape, v_BxGxSxK.dtype)],
      input_output_aliases={5: 1, 6: 2}, interpret=interpret, name="decode_attention", cost_estimate=cost,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
  )(index, q_BxGxRxK, k_new_BxGxK[:, :, None].astype(k_BxGxSxK.dtype), v_new_BxGxK[:, :, None].astype(
      v_BxGxSxK.dtype), valid, k_BxGxSxK, v_BxGxSxK)
  return out, k, v


__all__ = ["TILE", "decode_attention", "usable"]
