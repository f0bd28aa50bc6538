"""Attention kernels of the decoder: rotary position embedding (`rope`), the decoding key/value cache
(`KVCache`), and causal grouped-query attention with explicit float32 scores (`_explicit_attention`) or the
Pallas splash kernel (`_splash_attention`). `meshdistill.models.decoder.Attention` chooses among them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp

from meshdistill.models._config import RopeScaling


class KVCache(NamedTuple):
  """One attention layer's key/value cache for decoding (`meshdistill.generate`).

  ``k_BxSxGxK`` / ``v_BxSxGxK``: keys (after RoPE) and values of ``S`` slots (G = n_kv_heads, split
  over ``tensor`` like the k/v projections); ``valid_BxS``: slots holding a real token (left padding
  is never attended); ``index``: the slot of the first token of this call; ``positions_BxT``: the
  RoPE positions of this call's tokens, per row.
  """

  k_BxSxGxK: jax.Array
  v_BxSxGxK: jax.Array
  valid_BxS: jax.Array
  index: jax.Array
  positions_BxT: jax.Array

  def write(self, k_BxTxGxK: jax.Array, v_BxTxGxK: jax.Array) -> "KVCache":
    at = (0, self.index, 0, 0)
    return self._replace(
        k_BxSxGxK=jax.lax.dynamic_update_slice(self.k_BxSxGxK, k_BxTxGxK.astype(self.k_BxSxGxK.dtype), at),
        v_BxSxGxK=jax.lax.dynamic_update_slice(self.v_BxSxGxK, v_BxTxGxK.astype(self.v_BxSxGxK.dtype), at),
    )

  def visible(self, T: int) -> jax.Array:
    """``[B, 1, T, S]``: query ``t`` (slot ``index + t``) sees valid slots ``<= index + t``."""
    S = self.k_BxSxGxK.shape[1]
    causal_TxS = jnp.arange(S)[None, :] <= self.index + jnp.arange(T)[:, None]
    return causal_TxS[None, None] & self.valid_BxS[:, None, None, :]


def rope(
    x_BxTxHxK: jax.Array, theta: float, scaling: RopeScaling | None = None, positions_BxT: jax.Array | None = None
) -> jax.Array:
  """Rotary position embedding on the last axis (rotate-half convention).

  Positions are ``0 .. T-1`` unless ``positions_BxT`` gives each row its own (left-padded decoding).
  """
  T, K = x_BxTxHxK.shape[1], x_BxTxHxK.shape[-1]
  inv = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)  # [K/2]
  if scaling is not None:
    inv = scaling.apply(inv)
  if positions_BxT is None:
    ang_TxK2 = jnp.arange(T, dtype=jnp.float32)[:, None] * inv[None, :]
    sin = jnp.sin(ang_TxK2)[None, :, None, :]
    cos = jnp.cos(ang_TxK2)[None, :, None, :]
  else:
    ang_BxTxK2 = positions_BxT.astype(jnp.float32)[..., None] * inv
    sin, cos = jnp.sin(ang_BxTxK2)[:, :, None, :], jnp.cos(ang_BxTxK2)[:, :, None, :]
  x = x_BxTxHxK.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxK.dtype)


def _explicit_attention(q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, visible_Bx1xTxS=None):
  """Causal grouped-query attention with explicit float32 scores: ``(out [B, T, H, K], probs [B, H, T, S])``.

  Query head ``h`` reads key/value head ``h // (H / G)``; the einsums run over the groups, so
  key/value heads are never copied.
  """
  G, K = k_BxSxGxK.shape[2], q_BxTxHxK.shape[-1]
  T, S = q_BxTxHxK.shape[1], k_BxSxGxK.shape[1]
  q_BxTxGxRxK = einops.rearrange(q_BxTxHxK, "b t (g r) k -> b t g r k", g=G)
  scores = jnp.einsum("btgrk,bsgk->bgrts", q_BxTxGxRxK, k_BxSxGxK).astype(jnp.float32) / jnp.sqrt(K)
  scores_BxHxTxS = einops.rearrange(scores, "b g r t s -> b (g r) t s")
  visible = jnp.tril(jnp.ones((T, S), dtype=bool)) if visible_Bx1xTxS is None else visible_Bx1xTxS
  scores_BxHxTxS = jnp.where(visible, scores_BxHxTxS, jnp.finfo(jnp.float32).min)
  probs_BxHxTxS = jax.nn.softmax(scores_BxHxTxS, axis=-1)
  probs = einops.rearrange(probs_BxHxTxS.astype(v_BxSxGxK.dtype), "b (g r) t s -> b g r t s", g=G)
  out = jnp.einsum("bgrts,bsgk->btgrk", probs, v_BxSxGxK)
  return einops.rearrange(out, "b t g r k -> b t (g r) k"), probs_BxHxTxS


def _splash_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK):
  """Causal grouped-query attention with the Pallas splash kernel: ``out [B, T, H, K]``.

  The kernel's multi-query form (one key/value head shared by ``H / G`` query heads) is vmapped
  over batch and key/value groups, so key/value heads are never copied. On TPU it runs compiled,
  elsewhere in Pallas interpret mode (slow: for numerics checks). Blocks are ``min(T, 512)``
  tokens; ``T`` must be a multiple of 128 (the kernel's lane width). Under a ``tensor``-split
  mesh the kernel is a custom call XLA does not partition: wrap it in a shard_map over heads
  before using it at scale (not done here).
  """
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=g-import-not-at-top

  B, T, H, K = q_BxTxHxK.shape
  G = k_BxTxGxK.shape[2]
  if T % 128:
    raise ValueError(
        f"ModelConfig.attention='splash' needs a sequence length that is a multiple of 128, got {T}; "
        "pad the sequence or use attention='xla'"
    )
  block = math.gcd(T, 512)
  sizes = splash.BlockSizes(
      block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
      block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
  )
  mask = splash.MultiHeadMask([splash.CausalMask((T, T)) for _ in range(H // G)])
  kernel = splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=jax.default_backend() != "tpu")
  q_BxGxRxTxK = einops.rearrange(q_BxTxHxK, "b t (g r) k -> b g r t k", g=G) / jnp.sqrt(K).astype(q_BxTxHxK.dtype)
  k_BxGxTxK, v_BxGxTxK = (einops.rearrange(a, "b t g k -> b g t k") for a in (k_BxTxGxK, v_BxTxGxK))
  out = jax.vmap(jax.vmap(kernel))(q_BxGxRxTxK, k_BxGxTxK, v_BxGxTxK)
  return einops.rearrange(out, "b g r t k -> b t (g r) k").astype(v_BxTxGxK.dtype)
