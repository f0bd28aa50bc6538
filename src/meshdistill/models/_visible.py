"""What a query may attend to besides causality: the slots of a decoding key/value cache (`KVCache`) and the
documents packed into one row (`Segments`, `segment_mask`); the attention kernels (`meshdistill.models._attention`)
take both."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshdistill.models._context import ContextShard
from meshdistill.models._variants import band


class KVCache(NamedTuple):
  """One attention layer's key/value cache for decoding (`meshdistill.models.generate`).

  ``k`` / ``v``: keys (after RoPE) and values of ``S`` slots, ``[B, G, S, K]`` (G = n_kv_heads, split over
  ``tensor`` like the k/v projections; each row and head's slots contiguous, as a TPU lays them out and as
  `meshdistill.models._decode_attention` reads them), one pair per layer (scanned blocks too:
  `Decoder.decode_step`); ``valid_BxS``: slots holding a real token (left padding is never attended), over the first
  ``S`` slots of the cache, the ones this call attends to (`attended`): the cache may hold more, not yet written,
  that it never reads; ``index``: the slot of the first token of this call; ``positions_BxT``: the RoPE positions of
  this call's tokens, per row; ``kernel``: a one-token call may write and attend in one Pallas kernel (the caches are
  placed per device: whole on one, or rows over ``data`` and heads over ``tensor``; `Decoder.decode_step`).
  """

  k: jax.Array
  v: jax.Array
  valid_BxS: jax.Array
  index: jax.Array
  positions_BxT: jax.Array
  kernel: bool = False

  def write(self, k_BxTxGxK: jax.Array, v_BxTxGxK: jax.Array) -> "KVCache":
    """The cache with this call's keys and values (``[B, T, G, K]``) in slots ``index ..``."""
    at = (0, 0, self.index, 0)

    def put(cache, new_BxTxGxK):
      return jax.lax.dynamic_update_slice(cache, jnp.swapaxes(new_BxTxGxK, 1, 2).astype(cache.dtype), at)

    return self._replace(k=put(self.k, k_BxTxGxK), v=put(self.v, v_BxTxGxK))

  def attended(self) -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` ``[B, S, G, K]`` of the slots ``valid_BxS`` covers (a static prefix of the cache, read in place
    by the attention's fusions: the swap of axes is a view of the cache's own layout on a TPU)."""
    S = self.valid_BxS.shape[1]
    if S > self.k.shape[2]:
      raise ValueError(f"KVCache.valid_BxS covers {S} slots but the cache holds {self.k.shape[2]}: the mask marks the "
                       f"slots to attend to, at most the cache's (Decoder.empty_cache(batch, slots))")
    k, v = (self.k, self.v) if S == self.k.shape[2] else (self.k[:, :, :S], self.v[:, :, :S])
    return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

  def visible(self, T: int, window: int | None = None) -> jax.Array:
    """``[B, 1, T, S]``: query ``t`` (slot ``index + t``) sees valid slots ``<= index + t`` (with a sliding
    ``window``: the last ``window`` of them; a row's slots and positions differ by its left padding only, so the
    band on slots is the band on positions)."""
    S = self.valid_BxS.shape[1]
    rows_Tx1, cols_1xS = self.index + jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    causal_TxS = (cols_1xS <= rows_Tx1) & band(rows_Tx1, cols_1xS, window)
    return causal_TxS[None, None] & self.valid_BxS[:, None, None, :]


class Segments(NamedTuple):
  """Rows packed from several documents (``data.packing: documents``): ``ids_BxT`` each token's document within its
  row (1, 2, ...; 0 on padding), ``positions_BxT`` its RoPE position within that document (restarting at 0 where
  the document starts). A query attends only to keys of its own document (`segment_mask`; the splash kernel's own
  segment ids), so a packed row computes what its documents compute one by one."""

  ids_BxT: jax.Array
  positions_BxT: jax.Array

  @classmethod
  def of(cls, tokens_BxT: jax.Array, segment_ids_BxT=None, positions_BxT=None) -> "Segments | None":
    """The segments of a forward pass over ``tokens_BxT`` (None without ``segment_ids_BxT``), shapes checked;
    positions derived from the ids when not given (`segment_positions`)."""
    if segment_ids_BxT is None:
      if positions_BxT is not None:
        raise ValueError("positions were given without segment_ids: positions restart per packed document, so pass "
                         "both (the batch keys of data.packing: documents), or neither")
      return None
    for name, a in (("segment_ids", segment_ids_BxT), ("positions", positions_BxT)):
      if a is not None and tuple(a.shape) != tuple(tokens_BxT.shape):
        raise ValueError(f"{name} must be [batch, seq] like the tokens {tuple(tokens_BxT.shape)}, got "
                         f"{tuple(a.shape)}")
    ids_BxT = jnp.asarray(segment_ids_BxT, jnp.int32)
    if positions_BxT is not None:
      return cls(ids_BxT, jnp.asarray(positions_BxT, jnp.int32))
    shard = ContextShard.here(ids_BxT.shape[1])
    if shard is None:
      return cls(ids_BxT, segment_positions(ids_BxT))
    # a slice of the row (context parallelism): a document may start on another device, so count on the whole row
    whole_BxS = segment_positions(shard.gather(ids_BxT, axis=1))
    return cls(ids_BxT, jax.lax.dynamic_slice_in_dim(whole_BxS, shard.offset, ids_BxT.shape[1], axis=1))


def segment_positions(segment_ids_BxT: jax.Array) -> jax.Array:
  """``[B, T]`` int32: each token's index since the start of its segment (a token whose id differs from the one
  before it, and the row's first token, start one): the positions `meshdistill.data._packing` writes for a
  document's tokens."""
  T = segment_ids_BxT.shape[1]
  t_T = jnp.arange(T, dtype=jnp.int32)
  starts_BxT = jnp.concatenate([jnp.ones_like(segment_ids_BxT[:, :1], bool),
                                segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
  return t_T - jax.lax.cummax(jnp.where(starts_BxT, t_T, 0), axis=1)


def segment_mask(segment_ids_BxT: jax.Array) -> jax.Array:
  """``[B, 1, T, T]`` bool: query ``t`` and key ``s`` belong to one segment (the causal and window masks are the
  kernels' own)."""
  return (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])[:, None]
