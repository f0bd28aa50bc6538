"""Scanned blocks (``ModelConfig.scan_layers``): the decoder's blocks built once with a leading layer axis
and run under ``nnx.scan``, so XLA compiles one block body instead of ``n_layers`` copies.

* `stacked_blocks` creates ``n_layers`` blocks under ``nnx.vmap`` (one RNG stream split per layer): every
  weight becomes ``[L, ...]`` and its partitioning ``("layers", *per-layer)``: no rules table splits the layer axis.
* `scan_blocks` runs them with the same ``run_block(block, x, want_probs) -> BlockOutput`` as the unrolled loop
  (so the per-block rematerialisation, and any per-block step inside it, is unchanged); the per-layer hidden
  states, attention probabilities and routing come out of the scan stacked and are returned as the unrolled
  model's tuples.
* `layer_blocks` is the decoding form (`Decoder.decode_step`, which `meshdistill.models.generate` runs): not
  scanned but one block per layer on static slices of the stacked weights, each with its own key/value cache.
* Layers that attend differently (``ModelConfig.scan_period`` ``P > 1``: Gemma 2's local / global pairs, Gemma
  3's five local and one global) share the weights' structure, so they stay stacked ``[L, ...]`` as above; only
  the run differs: the first ``G * P`` layers are viewed as ``[G, P, ...]`` (a reshape) and scanned ``G`` times
  over a body of ``P`` blocks, block ``j`` of a group attending as layer ``j`` (``place(block, j)`` sets its
  window and RoPE, static values); the ``R = L - G * P`` last layers run after the loop as one more group of
  ``R``. The compiled program holds ``P + R`` blocks (Gemma 3 1B: 6 + 2, against 26 unrolled).

Conversions between stacked and per-layer weights live in `meshdistill.models.stacking`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from meshdistill.models._output import BlockOutput


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
                want_router: bool = False, period: int = 1, place=None):
  """``(x after the last block, hidden L x [B, T, D] or (), attn L x [B, H, T, T] or (), router L x Routing or
  ())``.

  ``run_block(block, x, want_probs) -> BlockOutput`` runs one (sliced) block, as in the unrolled loop; a dense
  block's routing (None) is not in ``router``.
  ``period`` > 1: groups of that many layers per iteration, ``place(block, j)`` making a block attend as the
  group's ``j``-th layer (see the module docstring).
  """
  if period > 1:
    return _scan_groups(blocks, x_BxTxD, run_block, (want_hidden, want_attn, want_router), period, place)

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=LAYER_AXIS)
  def body(x, block):
    out = run_block(block, x, want_attn)
    return out.x, _kept(out, want_hidden, want_router)

  x_BxTxD, (hidden_LxBxTxD, attn_LxBxHxTxT, router_L) = body(x_BxTxD, blocks)
  return x_BxTxD, _layers(hidden_LxBxTxD), _layers(attn_LxBxHxTxT), _layers(router_L)


def _kept(out: BlockOutput, want_hidden: bool, want_router: bool) -> tuple:
  """What a scan stacks of one block's `BlockOutput`: ``(hidden, probs, routing)``, None where not asked for (the
  probabilities are None unless asked for already)."""
  return out.x if want_hidden else None, out.probs, out.aux if want_router else None


def _view(state, start: int, groups: int, size: int):
  """Layers ``start .. start + groups * size`` of stacked ``[L, ...]`` leaves as ``[groups, size, ...]``."""
  return jax.tree.map(lambda a: a[start:start + groups * size].reshape(groups, size, *a.shape[1:]), state)


def _scan_groups(blocks: nnx.Module, x_BxTxD: jax.Array, run_block, wants, period: int, place):
  """`scan_blocks` over groups of ``period`` layers (and the remainder as one more group)."""
  want_hidden, want_attn, want_router = wants
  graphdef, state = nnx.split(blocks)
  n_layers = jax.tree.leaves(state)[0].shape[0]
  groups, rest = divmod(n_layers, period)

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=LAYER_AXIS)
  def body(x, group):
    group_def, group_state = nnx.split(group)
    outs = []
    for j in range(jax.tree.leaves(group_state)[0].shape[0]):
      block = nnx.merge(group_def, jax.tree.map(lambda a, j=j: a[j], group_state))
      place(block, j)
      out = run_block(block, x, want_attn)
      x = out.x
      outs.append(_kept(out, want_hidden, want_router))
    return x, tuple(outs)

  runs = [(0, groups, period)] + ([(groups * period, 1, rest)] if rest else [])
  hidden, attn, router = [], [], []
  for start, count, size in runs:
    x_BxTxD, outs = body(x_BxTxD, nnx.merge(graphdef, _view(state, start, count, size)))
    for g in range(count):  # [count] x size entries -> layer order
      for j in range(size):
        h, p, r = jax.tree.map(lambda a, g=g: a[g], outs[j])
        hidden += [h] if want_hidden else []
        attn += [p] if want_attn else []
        router += [r] if r is not None else []  # a dense block reports no routing
  return x_BxTxD, tuple(hidden), tuple(attn), tuple(router)


def _layers(stacked) -> tuple:
  """The per-layer entries of a scan's stacked output (an array or a pytree of arrays [L, ...]), or ()."""
  if stacked is None:
    return ()
  n = jax.tree.leaves(stacked)[0].shape[0]
  return tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n))


def layer_blocks(blocks: nnx.Module, place) -> list[nnx.Module]:
  """Stacked blocks as one block per layer, each on a static slice ``[l]`` of the stacked weights and attending as
  layer ``l`` (``place(block, l)``, as in `scan_blocks`): the decoding form (`Decoder.decode_step`).

  Decoding reads every weight and cache once per token, so it is bound by memory, not by the size of the program:
  traced, each slice is read in place and each layer attends to its own caches. Scanned with the weights, the caches
  were stacked ``[L, ...]`` and each layer staged its whole slice of them (every preallocated slot) before
  attending, traffic the unrolled form does not have (what it cost on a TPU v5e: `benchmarks/results/tpu_step.md`,
  "Changes to the code").
  """
  graphdef, state = nnx.split(blocks)
  out = [nnx.merge(graphdef, layer_state) for layer_state in _layers(state)]
  for layer, block in enumerate(out):
    place(block, layer)
  return out
