"""Progressive layer freezing as one optax transformation.

A schedule is a list of `Stage`s by step. Each stage freezes the bottom blocks of the
student (a fraction of them, or explicit block indices) and has its own learning rate.
The common recipe (`default_stages`) freezes the bottom 80% of blocks at lr 1e-4, then
the bottom 50% at lr 5e-5, then trains everything at lr 1e-5.

`progressive_freeze(stages, n_layers, inner)` wraps an optax transformation so that a
`Distiller` needs no change: ``Distiller(optimizer=progressive_freeze(...))``. ONE
compiled step serves every stage: the stage index, the trainable mask and the learning
rate are computed inside the transformation from its own update count with jnp ops.

Which parameter belongs to which block comes from its path in the params tree
``{"student": nnx.State, "strategy": ...}``, e.g. ``student/blocks/3/attn/q/kernel``:

* ``student/blocks/<i>/...``    -- block ``i``; with stacked blocks (``scan_layers``), ``student/blocks/<name>``
  ``[L, ...]``: slice ``[i]`` is block ``i``, with the same semantics (`meshdistill.train.freezing_stacked`);
* ``student/embed/...``         -- the embeddings: frozen when the stage's
  ``freeze_embeddings`` says so; by default (``None``) they follow block 0 (the layer
  below it). With tied embeddings the LM head IS the embedding table and follows this rule;
* ``student/final_norm``, ``student/head`` -- follow the TOP block: frozen only when
  block ``n_layers - 1`` is frozen (a bottom-up schedule never freezes them unless it
  freezes every block);
* ``strategy/...`` (projections etc.) and any other student parameter -- never frozen.

Frozen parameters do not move AT ALL while frozen, bit for bit: their gradients are
zeroed before clipping (so the clip norm is that of the trainable gradients), they get
no weight decay, and their optimizer state does not drift. The inner optimizer runs once
per parameter group (one block, the embeddings, the head, the rest) on that group's
leaves with that group's OWN step count; a group's moments and count are updated only
while it trains and held exactly while it is frozen. The moments keep the layout of the
params (so they shard like them); only scalar state such as the count is stacked per group.

Behaviour at thaw: a group resumes from its own last moments AND its own step count
(Adam's bias correction is per group). A group frozen from the start therefore begins
exactly like a fresh AdamW (zero moments, count 0: first steps of size ~lr). With a
global count instead, a group thawed at step 1000 would see bias corrections near 1 on
near-zero second moments and take steps several times larger than lr for hundreds of
steps -- a jolt to weights that were just released.

Learning rate: ``inner`` must be built with learning rate 1.0 (e.g.
``optax.adamw(1.0, weight_decay=0.1)``); the stage's ``lr`` multiplies its updates. For
AdamW this is exactly ``adamw(lr, weight_decay)``: the decay step scales with the
stage lr as usual. (A schedule inside ``inner`` then acts as a multiplier of the stage lr.)

The stage clock is the number of updates this transformation has applied. Wrapped in
`meshdistill.train.loop.safeguards.safeguarded`, steps skipped for non-finite gradients do not
advance it, so each stage gets its full number of real updates. `freeze_status` reads
the stage, learning rate and clock out of an optimizer state for logging.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshdistill.train.freezing_stacked import (
    STACKED, check_stacked, clip_layer_major, gate_gradient, is_stacked_block, stacked_mask, stacked_update)

log = logging.getLogger(__name__)

# Group ids besides block indices 0..n_layers-1 (offsets from n_layers).
_EMBED, _HEAD, _ALWAYS = 0, 1, 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
  """One stage of a freezing schedule, active from ``start_step`` until the next stage starts.

  Args:
    start_step: first update of the stage (the first stage must start at 0).
    freeze: fraction in [0, 1] of the bottom blocks to freeze (``floor(freeze * n_layers)``
      blocks), or explicit block indices (0 = bottom block).
    lr: learning rate of the stage (> 0).
    freeze_embeddings: freeze the embedding table; ``None`` (default) follows block 0.
  """

  start_step: int
  freeze: float | tuple[int, ...] = 0.0
  lr: float
  freeze_embeddings: bool | None = None

  def __post_init__(self):
    if isinstance(self.start_step, bool) or not isinstance(self.start_step, (int, np.integer)) or self.start_step < 0:
      raise ValueError(f"Stage.start_step={self.start_step!r} must be a non-negative integer step number")
    lr_ok = isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool) and math.isfinite(self.lr)
    if not (lr_ok and self.lr > 0):
      raise ValueError(f"Stage.lr={self.lr!r} must be a finite number > 0 (e.g. 1e-4)")
    f = self.freeze
    if isinstance(f, (int, float, np.integer, np.floating)) and not isinstance(f, bool):
      if not 0.0 <= float(f) <= 1.0:
        raise ValueError(
            f"Stage.freeze={f!r} is a fraction of blocks and must lie in [0, 1] "
            "(0.8 freezes the bottom 80%), or give explicit block indices such as (0, 1, 2)"
        )
    elif isinstance(f, (list, tuple)):
      idx = tuple(f)
      if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= 0 for i in idx):
        raise ValueError(f"Stage.freeze={f!r}: block indices must be non-negative integers (0 = bottom block)")
      if len(set(idx)) != len(idx):
        raise ValueError(f"Stage.freeze={f!r} repeats a block index")
      object.__setattr__(self, "freeze", tuple(sorted(int(i) for i in idx)))
    else:
      raise ValueError(f"Stage.freeze={f!r}: give a fraction in [0, 1] or a tuple of block indices")
    if self.freeze_embeddings not in (None, True, False):
      raise ValueError(f"Stage.freeze_embeddings={self.freeze_embeddings!r}; use True, False or None (follow block 0)")

  def frozen_blocks(self, n_layers: int) -> tuple[int, ...]:
    """Indices of the blocks this stage freezes in a model of ``n_layers`` blocks."""
    if isinstance(self.freeze, tuple):
      bad = [i for i in self.freeze if i >= n_layers]
      if bad:
        raise ValueError(
            f"Stage(start_step={self.start_step}).freeze={self.freeze!r} names block(s) {bad}, but the "
            f"student has n_layers={n_layers}; use indices in 0..{n_layers - 1}"
        )
      return self.freeze
    return tuple(range(math.floor(float(self.freeze) * n_layers + 1e-9)))


def default_stages(stage_steps: Sequence[int]) -> list[Stage]:
  """The three-stage recipe with stage lengths ``stage_steps = (n1, n2)`` (stage 3 runs to the end).

  Stage 1 freezes the bottom 80% of blocks at lr 1e-4, stage 2 the bottom 50% at lr 5e-5,
  stage 3 trains everything at lr 1e-5.
  """
  if len(stage_steps) != 2 or any(int(n) < 1 for n in stage_steps):
    raise ValueError(f"stage_steps={tuple(stage_steps)!r}: give the lengths of stages 1 and 2, e.g. (1000, 1000)")
  n1, n2 = (int(n) for n in stage_steps)
  return [
      Stage(start_step=0, freeze=0.8, lr=1e-4),
      Stage(start_step=n1, freeze=0.5, lr=5e-5),
      Stage(start_step=n1 + n2, freeze=0.0, lr=1e-5),
  ]


def check_stages(stages: Sequence[Stage], n_layers: int) -> None:
  """Raises ValueError for an empty or unordered schedule, or block indices out of range."""
  if not isinstance(n_layers, int) or n_layers < 1:
    raise ValueError(f"n_layers={n_layers!r} must be a positive integer (the student's number of blocks)")
  if not stages:
    raise ValueError("stages is empty; give at least Stage(start_step=0, lr=...)")
  if not all(isinstance(s, Stage) for s in stages):
    raise ValueError(f"stages must be meshdistill.train.freezing.Stage objects, got {[type(s).__name__ for s in stages]}")
  starts = [s.start_step for s in stages]
  if starts[0] != 0:
    raise ValueError(f"stages start at steps {starts}; the first stage must have start_step=0")
  if any(b <= a for a, b in zip(starts, starts[1:])):
    raise ValueError(f"stages start at steps {starts}; start_step must strictly increase from stage to stage")
  for s in stages:
    s.frozen_blocks(n_layers)


def trainable_table(stages: Sequence[Stage], n_layers: int) -> np.ndarray:
  """``[n_stages, n_layers + 3]`` booleans: columns are blocks 0..L-1, embeddings, head, rest."""
  check_stages(stages, n_layers)
  table = np.ones((len(stages), n_layers + 3), bool)
  for k, s in enumerate(stages):
    frozen = set(s.frozen_blocks(n_layers))
    for i in frozen:
      table[k, i] = False
    embed_frozen = (0 in frozen) if s.freeze_embeddings is None else s.freeze_embeddings
    table[k, n_layers + _EMBED] = not embed_frozen
    table[k, n_layers + _HEAD] = (n_layers - 1) not in frozen
  return table


def _key_name(k) -> Any:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return k


def param_group(path, n_layers: int, block_key: str = "blocks") -> int:
  """Group id at ``path``: its block index, `STACKED` (every block, stacked) or n_layers + (0 embed, 1 head, 2 rest)."""
  keys = [_key_name(k) for k in path]
  if keys and keys[0] == "strategy":
    return n_layers + _ALWAYS
  if keys and keys[0] == "student":
    keys = keys[1:]
  if block_key in keys[:-1]:
    if is_stacked_block(keys, block_key):  # blocks/attn/...: every block in one stacked [L, ...] weight
      return STACKED
    i = keys[keys.index(block_key) + 1]
    if not isinstance(i, (int, np.integer)) or not 0 <= int(i) < n_layers:
      raise ValueError(
          f"parameter {'/'.join(map(str, keys))} has block index {i!r} but n_layers={n_layers}; "
          "pass the student's n_layers to progressive_freeze"
      )
    return int(i)
  if keys and keys[0] == "embed":
    return n_layers + _EMBED
  if keys and keys[0] in ("final_norm", "head"):
    return n_layers + _HEAD
  return n_layers + _ALWAYS


def _groups(tree, n_layers: int, block_key: str):
  return jax.tree_util.tree_map_with_path(lambda p, _: param_group(p, n_layers, block_key), tree)


def trainable_mask(params, stage: Stage | Sequence[Stage], n_layers: int, index: int = 0, block_key: str = "blocks"):
  """Host-side tree of bools: which leaves of ``params`` train in ``stages[index]`` (stacked blocks: one per block)."""
  stages = [stage] if isinstance(stage, Stage) else list(stage)
  row = trainable_table(stages, n_layers)[index]
  return jax.tree.map(lambda g: stacked_mask(row, n_layers) if g == STACKED else bool(row[g]),
                      _groups(params, n_layers, block_key))


class ProgressiveFreezeState(NamedTuple):
  """State of `progressive_freeze`.

  ``count``: updates applied (the stage clock); ``stage`` / ``learning_rate``: those of the
  last update; ``next_stage``: the stage of the next update; ``inner``: the inner state,
  laid out like ``inner.init(params)`` (moments shaped like the params, so they shard like
  them) except that each non-parameter leaf (e.g. Adam's step count) is stacked ``[G, ...]``
  with one entry per parameter group present (groups in increasing id order).
  """

  count: jax.Array
  stage: jax.Array
  learning_rate: jax.Array
  next_stage: jax.Array
  inner: Any


def _is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def _select(tree, gids, g: int):
  """``tree`` with the leaves of groups other than ``g`` replaced by `optax.MaskedNode`."""
  return jax.tree.map(lambda x, gi: x if gi == g else optax.MaskedNode(), tree, gids)


def progressive_freeze(
    stages: Sequence[Stage],
    n_layers: int,
    inner: optax.GradientTransformation | None = None,
    *,
    clip: float | None = 1.0,
    block_key: str = "blocks",
) -> optax.GradientTransformation:
  """Wraps ``inner`` (built with learning rate 1.0) with a progressive freezing schedule.

  Args:
    stages: `Stage`s ordered by ``start_step`` (the first at 0).
    n_layers: the student's number of blocks.
    inner: optimizer with learning rate 1.0 (default ``optax.adamw(1.0, weight_decay=0.0)``);
      must be elementwise (Adam, AdamW, Lion, SGD with momentum, ...). It is run once per
      parameter group on that group's leaves, with that group's step count.
    clip: global-norm clipping of the trainable gradients (``None``: off).
    block_key: path component that precedes the block index (``"blocks"`` for `Decoder`).

  Returns:
    An optax transformation: frozen leaves get updates of exactly ``-0.0`` (``p + -0.0 == p``
    bit for bit) and keep their inner state; trainable leaves get ``lr * inner update``.
    Compatible with `optax.tree_utils.tree_map_params` (moments follow the params).
  """
  table_np = trainable_table(stages, n_layers)
  if clip is not None and not clip > 0:
    raise ValueError(f"progressive_freeze clip={clip!r} must be > 0 or None (no clipping)")
  inner = inner if inner is not None else optax.adamw(1.0, weight_decay=0.0)
  starts_np = np.asarray([s.start_step for s in stages], np.int32)
  lrs_np = np.asarray([s.lr for s in stages], np.float32)

  def present_groups(tree, gids) -> list[int]:
    """Group ids with state entries: the leaves' groups, every block for stacked blocks (`freezing_stacked`)."""
    blocks = range(n_layers) if check_stacked(tree, gids, n_layers, block_key) else ()
    return sorted((set(jax.tree.leaves(gids)) - {STACKED}) | set(blocks))

  def group_state(full, gids, g: int, k: int):
    """Group ``g``'s inner state: its leaves of each param-shaped tree, entry ``k`` of the rest."""
    return optax.tree_utils.tree_map_params(
        inner,
        lambda x, gi: x if _is_masked(x) or gi == g else optax.MaskedNode(),
        full,
        gids,
        transform_non_params=lambda v: v[k],
        is_leaf=_is_masked,
    )

  def merge(new_g, full, on, k: int):
    """Writes group ``k``'s new inner state into ``full`` where the group trains (``on``)."""

    def put(n, f):
      if _is_masked(n):
        return f
      if jnp.shape(n) == jnp.shape(f):  # a leaf of this group in a param-shaped tree
        return jnp.where(on, n, f)
      return f.at[k].set(jnp.where(on, n, f[k]))  # its entry of a stacked non-param leaf

    return jax.tree.map(put, new_g, full, is_leaf=_is_masked)

  def init(params):
    gids = _groups(params, n_layers, block_key)
    groups = present_groups(params, gids)
    if groups and not any(g < n_layers for g in groups):
      log.warning("progressive_freeze: no parameter path contains %r/<index>; nothing will be frozen", block_key)
    full = inner.init(params)
    stacked = optax.tree_utils.tree_map_params(
        inner,
        lambda x: x,
        full,
        transform_non_params=lambda v: jnp.broadcast_to(v, (len(groups), *jnp.shape(v))),
        is_leaf=_is_masked,
    )
    return ProgressiveFreezeState(
        count=jnp.zeros((), jnp.int32),
        stage=jnp.zeros((), jnp.int32),
        learning_rate=jnp.asarray(lrs_np[0]),
        next_stage=jnp.zeros((), jnp.int32),
        inner=stacked,
    )

  def update(updates, state, params=None):
    gids = _groups(updates, n_layers, block_key)
    groups = present_groups(updates, gids)
    stage_at = lambda n: jnp.sum(n >= jnp.asarray(starts_np)).astype(jnp.int32) - 1  # noqa: E731
    stage = stage_at(state.count)
    row = jnp.asarray(table_np)[stage]  # [n_layers + 3] trainable flags of this stage
    lr = jnp.asarray(lrs_np)[stage]
    grads = jax.tree.map(
        lambda g, gi: gate_gradient(g, row[:n_layers]) if gi == STACKED else jnp.where(row[gi], g, jnp.zeros_like(g)),
        updates, gids)
    if clip is not None and STACKED in jax.tree.leaves(gids):
      grads = clip_layer_major(grads, gids, clip, n_layers)
    elif clip is not None:
      grads, _ = optax.clip_by_global_norm(clip).update(grads, optax.EmptyState())

    flat_gids, treedef = jax.tree.flatten(gids)
    out = [None] * len(flat_gids)
    full = state.inner
    for k, g in enumerate(groups):
      if g not in flat_gids:  # a block of stacked leaves: updated below, all blocks at once
        continue
      sub_params = None if params is None else _select(params, gids, g)
      upd_g, new_g = inner.update(_select(grads, gids, g), group_state(state.inner, gids, g, k), sub_params)
      on = row[g]
      full = merge(new_g, full, on, k)
      positions = [i for i, gi in enumerate(flat_gids) if gi == g]
      for i, u in zip(positions, jax.tree.leaves(upd_g)):
        out[i] = jnp.where(on, (lr * u).astype(u.dtype), jnp.asarray(-0.0, u.dtype))
    if STACKED in flat_gids:
      upd_s, full = stacked_update(inner, grads, full, params, gids, row[:n_layers], lr, n_layers)
      for i, (u, gi) in enumerate(zip(jax.tree.leaves(upd_s, is_leaf=_is_masked), flat_gids)):
        out[i] = u if gi == STACKED else out[i]
    new_state = ProgressiveFreezeState(state.count + 1, stage, lr, stage_at(state.count + 1), full)
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformation(init, update)


def freeze_status(opt_state) -> dict[str, float] | None:
  """``{"stage", "lr", "next_stage", "count"}`` of the `progressive_freeze` in ``opt_state``, or None.

  ``stage`` (0-based) and ``lr`` are those of the last applied update, ``next_stage`` that
  of the next one; ``count`` is the stage clock. Host values; stacked (pmap) states are
  read from their first replica.
  """
  found = [
      x
      for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ProgressiveFreezeState))
      if isinstance(x, ProgressiveFreezeState)
  ]
  if not found:
    return None
  s = found[0]
  first = lambda x: np.asarray(jax.device_get(x)).reshape(-1)[0]  # noqa: E731
  return {
      "stage": int(first(s.stage)),
      "lr": float(first(s.learning_rate)),
      "next_stage": int(first(s.next_stage)),
      "count": int(first(s.count)),
  }


def describe_stages(stages: Sequence[Stage], n_layers: int) -> list[str]:
  """One readable line per stage (for logs): steps, lr, frozen blocks, embeddings (a tied head follows them), head."""
  table = trainable_table(stages, n_layers)
  lines = []
  for k, s in enumerate(stages):
    end = f"{stages[k + 1].start_step - 1}" if k + 1 < len(stages) else "end"
    frozen = [i for i in range(n_layers) if not table[k, i]]
    lines.append(
        f"stage {k + 1} (steps {s.start_step}..{end}): lr={s.lr:g}, frozen blocks {frozen}, "
        f"embeddings {'trainable' if table[k, n_layers + _EMBED] else 'frozen'}, "
        f"final norm and untied head {'trainable' if table[k, n_layers + _HEAD] else 'frozen'}"
    )
  return lines
