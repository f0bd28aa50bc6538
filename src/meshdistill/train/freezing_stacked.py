"""Progressive freezing of stacked blocks (``ModelConfig.scan_layers``): the block groups of
`meshdistill.train.freezing.progressive_freeze` when every block weight is ONE ``[L, ...]`` leaf.

A scanned decoder holds block ``i``'s weights as slice ``[i]`` of each ``blocks/<name>`` leaf (the
layer axis is axis 0 and never split over a mesh axis: `meshdistill.models._scan`), so a block
group is a slice, not a set of leaves. The semantics are those of per-layer blocks, slice by slice:

* the inner optimizer is traced ONCE for all stacked leaves and run over the layer axis with
  ``jax.lax.map``: each slice sees its own gradient, moments and params, and its block's own step
  count (the ``[G]`` stacked non-parameter state keeps one entry per block group, entries ``0..L-1``
  as with per-layer blocks, so the state has the same counts either way). ``lax.map`` rather than
  ``vmap``: each iteration is the per-layer computation itself, so the updates equal those of
  per-layer blocks bit for bit (the batched form of Adam's bias correction differed in the last bit,
  which a thawed block's first steps amplify); the program still holds one copy of the optimizer;
* the clip norm is summed in the per-layer order (`clip_layer_major`), for the same reason;
* a frozen block's gradient slice is zeroed before clipping, its update slice is exactly ``-0.0``
  (no weight decay), and its moment slices and step count are held bit for bit.

The moments keep the stacked layout of their params (``[L, ...]``, sharded like them).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import optax

# Group id of a stacked block leaf (all blocks at once); per-layer groups are >= 0.
STACKED = -1


def is_stacked_block(keys: list, block_key: str) -> bool:
  """Whether the path ``keys`` (below ``student``) names a stacked block weight: ``blocks/<name>/...``."""
  if block_key not in keys[:-1]:
    return False
  i = keys[keys.index(block_key) + 1]
  return isinstance(i, str) and not i.isdigit()


def check_stacked(tree, gids, n_layers: int, block_key: str) -> bool:
  """Whether ``tree`` has stacked block leaves; raises for a layer axis of another length or for
  stacked and per-layer blocks mixed in one tree."""
  pairs = list(zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(gids)))
  stacked = [(p, x) for (p, x), g in pairs if g == STACKED]
  if not stacked:
    return False
  for path, x in stacked:
    if jnp.ndim(x) < 1 or jnp.shape(x)[0] != n_layers:
      raise ValueError(
          f"progressive freezing reads {jax.tree_util.keystr(path)} (shape {jnp.shape(x)}) as {block_key} stacked "
          f"[n_layers, ...] (scan_layers=true), but n_layers={n_layers}; pass the student's n_layers to "
          "progressive_freeze"
      )
  if any(0 <= g < n_layers for _, g in pairs):
    raise ValueError(
        f"progressive freezing found both stacked {block_key}/<name> weights and per-layer {block_key}/<i> weights; "
        "give it one decoder layout (scan_layers=true or false for the whole student)"
    )
  return True


def layer_flags(row_L: jax.Array, like: jax.Array) -> jax.Array:
  """``row_L`` ([L] booleans) shaped to broadcast against ``like`` ([L, ...])."""
  return row_L.reshape((row_L.shape[0],) + (1,) * (jnp.ndim(like) - 1))


def gate_gradient(g: jax.Array, row_L: jax.Array) -> jax.Array:
  """A stacked gradient with the slices of frozen blocks zeroed."""
  return jnp.where(layer_flags(row_L, g), g, jnp.zeros_like(g))


def clip_layer_major(grads, gids, clip: float, n_layers: int):
  """``optax.clip_by_global_norm(clip)`` of ``grads`` with the squared norm summed in per-layer order.

  The stacked leaves (contiguous in the tree, as ``blocks/<i>/...`` are) contribute their per-layer sums
  block by block, so the sum runs in the order of the per-layer tree and the clipped gradients equal
  those of unrolled blocks bit for bit (a summation in another order differs in the last bit, which
  Adam's first steps after a thaw amplify on near-zero gradients).
  """
  terms, done = [], False
  for x, g in zip(jax.tree.leaves(grads), jax.tree.leaves(gids)):
    if g != STACKED:
      terms.append(jnp.sum(jnp.square(x)))
    elif not done:
      stacked = [y for y, h in zip(jax.tree.leaves(grads), jax.tree.leaves(gids)) if h == STACKED]
      terms += [jnp.sum(jnp.square(y[i])) for i in range(n_layers) for y in stacked]
      done = True
  norm = jnp.sqrt(functools.reduce(operator.add, terms, 0))
  keep = norm < clip
  return jax.tree.map(lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * clip), grads)


def stacked_update(inner: optax.GradientTransformation, grads, full, params, gids, row_L, lr, n_layers: int):
  """The stacked leaves' updates (``MaskedNode`` elsewhere) and ``full`` with their new inner state.

  ``grads`` are already gated and clipped; ``full`` is the whole `progressive_freeze` inner state
  (non-parameter leaves ``[G, ...]``, entries ``0..L-1`` the blocks); ``row_L`` the stage's block flags.
  """
  masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  pick = lambda t: jax.tree.map(lambda x, g: x if g == STACKED else optax.MaskedNode(), t, gids)  # noqa: E731
  sub_state = optax.tree_utils.tree_map_params(
      inner,
      lambda x, g: x if masked(x) or g == STACKED else optax.MaskedNode(),
      full,
      gids,
      transform_non_params=lambda v: v[:n_layers],
      is_leaf=masked,
  )
  sub_params = None if params is None else pick(params)
  upd, new = jax.lax.map(lambda a: inner.update(*a), (pick(grads), sub_state, sub_params))
  kinds = optax.tree_utils.tree_map_params(inner, lambda _: True, full, transform_non_params=lambda _: False)

  def put(n, f, is_param: bool):
    if masked(n):
      return f
    if is_param:  # a stacked moment: [L, ...] like its param
      return jnp.where(layer_flags(row_L, n), n, f)
    return f.at[:n_layers].set(jnp.where(layer_flags(row_L, n), n, f[:n_layers]))  # the blocks' step counts etc.

  full = jax.tree.map(put, new, full, kinds, is_leaf=masked)
  gated = lambda u: jnp.where(layer_flags(row_L, u), (lr * u).astype(u.dtype), jnp.asarray(-0.0, u.dtype))  # noqa: E731
  out = jax.tree.map(lambda u: u if masked(u) else gated(u), upd, is_leaf=masked)
  return out, full


def stacked_mask(row, n_layers: int) -> tuple[bool, ...]:
  """Host-side per-block flags of a stacked leaf (``[L]`` booleans, block ``i`` at ``[i]``)."""
  return tuple(bool(b) for b in row[:n_layers])
