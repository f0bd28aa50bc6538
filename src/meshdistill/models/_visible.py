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

  ``k`` / ``v``: keys (after RoPE) and values of ``S`` slots, ``[B, S, G, K]`` (G = n_kv_heads, split over
  ``tensor`` like the k/v projections), one pair per layer (scanned blocks too: `Decoder.decode_step`);
  ``valid_BxS``: slots holding a real token (left padding is never attended), over the first ``S`` slots of the
  cache, the ones this call attends to (`attended`): the cache may hold more, not yet written, that it never reads;
  ``index``: the slot of the first token of this call; ``positions_BxT``: the RoPE positions of this call's tokens,
  per row; ``recent``: where this call's keys and values go instead of the cache (`RecentSlots`), None to write them
  into it.
  """

  k: jax.Array
  v: jax.Array
  valid_BxS: jax.Array
  index: jax.Array
  positions_BxT: jax.Array
  recent: "RecentSlots | None" = None

  def write(self, k_BxTxGxK: jax.Array, v_BxTxGxK: jax.Array) -> "KVCache":
    """The cache with this call's keys and values in slots ``index ..`` (of its `RecentSlots` when it has them)."""
    if self.recent is not None:
      return self._replace(recent=self.recent.write(k_BxTxGxK, v_BxTxGxK, self.index))
    at = (0, self.index, 0, 0)
    return self._replace(k=jax.lax.dynamic_update_slice(self.k, k_BxTxGxK.astype(self.k.dtype), at),
                         v=jax.lax.dynamic_update_slice(self.v, v_BxTxGxK.astype(self.v.dtype), at))

  def attended(self) -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` of the slots ``valid_BxS`` covers (a static prefix of the cache: read in place, not copied)."""
    S = self.valid_BxS.shape[1]
    if S > self.k.shape[1]:
      raise ValueError(f"KVCache.valid_BxS covers {S} slots but the cache holds {self.k.shape[1]}: the mask marks the "
                       f"slots to attend to, at most the cache's (Decoder.empty_cache(batch, slots))")
    return (self.k, self.v) if S == self.k.shape[1] else (self.k[:, :S], self.v[:, :S])

  def visible(self, T: int, window: int | None = None) -> jax.Array:
    """``[B, 1, T, S]``: query ``t`` (slot ``index + t``) sees valid slots ``<= index + t`` (with a sliding
    ``window``: the last ``window`` of them; a row's slots and positions differ by its left padding only, so the
    band on slots is the band on positions)."""
    S = self.valid_BxS.shape[1]
    rows_Tx1, cols_1xS = self.index + jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    causal_TxS = (cols_1xS <= rows_Tx1) & band(rows_Tx1, cols_1xS, window)
    if self.recent is not None:  # the slots from its base on are read from the recent ones
      causal_TxS = causal_TxS & (cols_1xS < self.recent.base)
    return causal_TxS[None, None] & self.valid_BxS[:, None, None, :]

  def recent_visible(self, T: int, window: int | None = None) -> jax.Array:
    """``[1, 1, T, W]``: query ``t`` sees the recent slots up to its own (`RecentSlots`: every one a decoded token),
    within the sliding ``window``."""
    W = self.recent.k.shape[0]
    rows_Tx1, cols_1xW = self.index + jnp.arange(T)[:, None], self.recent.base + jnp.arange(W)[None, :]
    return ((cols_1xW <= rows_Tx1) & band(rows_Tx1, cols_1xW, window))[None, None]


class RecentSlots(NamedTuple):
  """The keys and values of the slots ``base ..  base + W - 1`` of a layer's `KVCache`, held apart from it while
  they are decoded and written into it after (`settle`): ``k`` / ``v`` ``[W, B, G, K]``, slot-major, so that writing one
  token's slot writes whole tiles of it. The cache lays a row's slots out ``[G, S, K]`` in tiles of several slots (16
  in bfloat16 on a TPU), and a slot written there reads and writes back one tile per row and key/value head.
  Every recent slot up to the decoded token's holds a token (`KVCache.recent_visible`)."""

  k: jax.Array
  v: jax.Array
  base: jax.Array

  @classmethod
  def empty(cls, k_BxSxGxK: jax.Array, slots: int, base, sharding=None) -> "RecentSlots":
    """``slots`` zero recent slots of a cache like ``k_BxSxGxK``, the first of them its slot ``base``; placed with
    ``sharding`` (its rows are the second axis) when given."""
    B, _, G, K = k_BxSxGxK.shape
    z = jnp.zeros((slots, B, G, K), k_BxSxGxK.dtype)
    z = z if sharding is None else jax.lax.with_sharding_constraint(z, sharding)
    return cls(z, z, jnp.asarray(base, jnp.int32))

  def write(self, k_BxTxGxK: jax.Array, v_BxTxGxK: jax.Array, index) -> "RecentSlots":
    """These slots with a call's keys and values for the cache's slots ``index ..``."""
    at = (index - self.base, 0, 0, 0)
    put = lambda r, x: jax.lax.dynamic_update_slice(r, jnp.swapaxes(x, 0, 1).astype(r.dtype), at)  # noqa: E731
    return self._replace(k=put(self.k, k_BxTxGxK), v=put(self.v, v_BxTxGxK))

  def settle(self, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The cache's ``(k, v)`` with these slots written from ``base`` on: every one, those not decoded too (slots
    past the decoded ones, which no query sees until a later token's write); the cache must hold ``base + W``
    slots (a ``dynamic_update_slice`` past its end would move back and overwrite earlier ones)."""
    at = (0, self.base, 0, 0)
    put = lambda c, r: jax.lax.dynamic_update_slice(c, jnp.swapaxes(r, 0, 1), at)  # noqa: E731
    return put(k_BxSxGxK, self.k), put(v_BxSxGxK, self.v)


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
