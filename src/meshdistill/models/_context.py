"""Context parallelism in the attention (``mesh.axes: {context: n}``): `ContextShard`, a device's slice of the
sequence, the keys and values it gathers over ``context`` and the masks on global token indices. The decoder's
attention (`meshdistill.models.decoder.Attention`) and the splash kernel's placement
(`meshdistill.models._attention.splash_attention`) use it; the step's layout splits the rows
(`meshdistill.parallel.backends.ShardMapLayout`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# A device's slice and its gathers are collectives over named mesh axes (`context`, per `tensor` block).
from meshdistill.parallel.mesh import CONTEXT, TENSOR, context_ways
from meshdistill.models._variants import band


def _free_tensor() -> int:
  """The size of the mesh's ``tensor`` axis where it is compiler-managed in the program being traced (else 1)."""
  mesh = jax.sharding.get_abstract_mesh()
  if TENSOR not in getattr(mesh, "axis_names", ()) or TENSOR in set(getattr(mesh, "manual_axes", ())):
    return 1
  return int(mesh.shape[TENSOR])


class ContextShard(NamedTuple):
  """This device's slice of every row where the step splits the sequence over the mesh's ``context`` axis (context
  parallelism, ``mesh.axes: {context: n}``; `meshdistill.parallel.mesh.context_ways`): ``ways`` slices of
  ``tokens`` tokens, this device's first token at global index ``offset``.

  Queries stay on their device; keys and values are all-gathered over ``context`` before attention (`gather`,
  ``[B, T, G, K] -> [B, ways * T, G, K]``), so each query reads the keys of the whole row, and the causal mask, the
  sliding window and packed documents' segment ids compare global token indices (`visible`); RoPE takes each token's
  global position (`positions`; packed rows bring their own). The transpose of the gather is a reduce-scatter: a
  device's keys and values receive the gradient of every query that read them, on whichever device it is. The
  ``xla`` kernel runs the device's queries in blocks (`attend`) and ``explicit`` whole, each with the mask as it is
  (dense scores: every device does the same work, the causal part of it masked); the splash kernel takes a causal mask
  shifted by the device's offset (its masks are static block patterns, so one kernel per position on the axis, the
  device's chosen by ``lax.switch``, `splash_attention`), and skips the blocks it masks whole: the last device of the
  axis computes the most (contiguous slices are not load-balanced).

  Why an all-gather first and not a ring (ring attention: key/value blocks passed round the axis by
  ``ppermute``, a running softmax per block): the gather is one collective per layer that the compiler can issue
  as soon as the keys exist and overlap with the query projection; it is exact with any kernel that takes a mask and
  its backward pass is the gather's transpose. With grouped-query attention the gathered keys and values are small
  beside the rest of a layer (``2 x G x K`` values a token: Qwen3-1.7B at 32k tokens, 8 key/value heads of 128, is
  128 MiB a row in bfloat16, per layer, freed after it). A ring keeps one block in flight instead of the whole row
  and hides each transfer behind a block's scores; it pays once the gathered keys and values of a layer no longer
  fit beside the activations (hundreds of thousands of tokens, or many key/value heads) and needs a kernel that
  accumulates a softmax over key blocks, which the ``xla`` kernel does not expose. MaxText too gathers first.
  """

  ways: int
  tokens: int  # T: the tokens of a row this device holds
  offset: jax.Array  # int32 scalar: the global index of this device's first token

  @classmethod
  def here(cls, T: int) -> "ContextShard | None":
    """The slice of ``T`` tokens this device holds in the program being traced (None: rows are whole here)."""
    ways = context_ways()
    if ways == 1:
      return None
    return cls(ways, T, (jax.lax.axis_index(CONTEXT) * T).astype(jnp.int32))

  def gather(self, x: jax.Array, axis: int) -> jax.Array:
    """``x``'s slices of every device along token axis ``axis``, in order: the whole row. Keys and values
    ``[B, T, G, K]`` whose heads the compiler-managed ``tensor`` axis divides are gathered per ``tensor`` block (a
    nested ``shard_map`` manual over it, as `splash_attention` reads them): left to the compiler, a collective in a
    region manual over ``context`` first gathered its operand's heads over ``tensor``, every device then holding
    all the row's key/value heads."""
    gather = functools.partial(jax.lax.all_gather, axis_name=CONTEXT, axis=axis, tiled=True)
    t = _free_tensor()
    heads = 2 if axis == 1 else 1  # [B, T, G, K], or head-major [B, G, T, K] (the splash path)
    if x.ndim != 4 or t == 1 or x.shape[heads] % t:
      return gather(x)
    spec = P(*(TENSOR if i == heads else None for i in range(heads + 1)))
    return jax.shard_map(gather, in_specs=spec, out_specs=spec, axis_names={TENSOR}, check_vma=False)(x)

  def positions(self, T: int) -> jax.Array:
    """``[1, T]`` int32: the global positions of this device's tokens (rows of one stream)."""
    return (self.offset + jnp.arange(T, dtype=jnp.int32))[None]

  def visible(self, T: int, window: int | None = None, segment_ids_BxT: jax.Array | None = None, *,
              start=0, keys_BxS: jax.Array | None = None) -> jax.Array:
    """``[B | 1, 1, T, S]`` bool (``S``: the row's tokens): this device's queries ``start .. start + T`` (global
    ``offset + start + t``) see the row's keys at or before them (within the sliding ``window``, and of their own
    document with ``segment_ids_BxT``, their ids; ``keys_BxS``: the row's, gathered when not given)."""
    S = self.tokens * self.ways
    rows_Tx1, cols_1xS = self.offset + start + jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    visible = ((cols_1xS <= rows_Tx1) & band(rows_Tx1, cols_1xS, window))[None, None]
    if segment_ids_BxT is not None:
      keys = self.gather(segment_ids_BxT, axis=1) if keys_BxS is None else keys_BxS
      visible = visible & (segment_ids_BxT[:, :, None] == keys[:, None, :])[:, None]
    return visible

  def attend(self, attend, q_BxTxHxK: jax.Array, window: int | None = None,
             segment_ids_BxT: jax.Array | None = None, block: int | None = None) -> jax.Array:
    """``attend(q_block, visible_block) -> out_block`` over this device's queries ``[B, T, H, K]`` (the keys and
    values of the whole row closed over by ``attend``), ``block`` queries at a time (default `QUERY_BLOCK`) under
    `jax.checkpoint`: one block's ``[B, H, block, S]`` scores and mask exist at a time, forward and backward (a
    kernel that forms the scores whole, ``xla``, would hold ``T x S`` of them per head: at 32k tokens split in two,
    8 GiB a layer for 4 heads in float32). Each query's softmax is over its own keys, so blocks change nothing of
    the values. A slice of at most ``block`` tokens, or one ``block`` does not divide, runs whole."""
    block = QUERY_BLOCK if block is None else block
    T = q_BxTxHxK.shape[1]
    keys_BxS = None if segment_ids_BxT is None else self.gather(segment_ids_BxT, axis=1)
    if T <= block or T % block:
      return attend(q_BxTxHxK, self.visible(T, window, segment_ids_BxT, keys_BxS=keys_BxS))
    q_NxBxCxHxK = einops.rearrange(q_BxTxHxK, "b (n c) h k -> n b c h k", c=block)
    ids_NxBxC = None if segment_ids_BxT is None else einops.rearrange(segment_ids_BxT, "b (n c) -> n b c", c=block)

    @jax.checkpoint
    def one(args):
      i, q_BxCxHxK, ids_BxC = args
      return attend(q_BxCxHxK, self.visible(block, window, ids_BxC, start=i * block, keys_BxS=keys_BxS))

    out_NxBxCxHxK = jax.lax.map(one, (jnp.arange(T // block), q_NxBxCxHxK, ids_NxBxC))
    return einops.rearrange(out_NxBxCxHxK, "n b c h k -> b (n c) h k")


# Queries per block of `ContextShard.attend` (the xla kernel under context parallelism).
QUERY_BLOCK = 512
