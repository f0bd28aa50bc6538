"""Attention transfer: match the student's attention probability maps to the teacher's.

This compares the attention *probabilities* ``softmax(q k^T / sqrt(d))`` of mapped
layers (``ModelOutput.attn``, ``[H, T, T]`` per layer for one sequence: heads, queries,
keys), not the attention modules' outputs. The head axis H may be split over
``tensor``; only reductions over heads and keys are used, so nothing is gathered.

Masking. A query row whose token has ``mask == 0`` contributes nothing. Keys whose
token has ``mask == 0`` are dropped and every row is renormalised over the remaining
keys (``mask_keys=True``), so both maps are distributions over the same unmasked keys
and the loss does not depend on attention paid to padding. With ``mask_keys=False``
rows are compared over all keys (useful when the mask hides a prompt that is still real
context). Keys after the query are already 0 in both maps (causal attention).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from meshdistill.models import ModelOutput
from meshdistill.strategies._base import SequenceStrategy, register
from meshdistill.strategies._layer_map import LayerMap, check_layer_map_shape, mean_groups, resolve_layer_map

ATTENTION_LOSSES = ("kl", "mse")
HEAD_MODES = ("group", "mean")
_EPS = 1e-12


def group_heads(attn_HxTxS: jax.Array, n_heads: int, owner: str = "AttentionTransfer") -> jax.Array:
  """Averages ``H`` heads into ``n_heads`` groups of ``H / n_heads`` consecutive heads.

  ``[H, T, S] -> [n_heads, T, S]``; identity when ``H == n_heads``. The mean of
  probability rows is a probability row, so KL stays well defined.
  """
  return mean_groups(
      attn_HxTxS,
      n_heads,
      0,
      f"{owner}: teacher has {{N}} attention heads, which cannot be averaged into the student's {{n}} "
      "(groups of teacher_heads / student_heads heads need {N} % {n} == 0); "
      "use heads='mean' to compare head-averaged maps instead",
  )


def _drop_keys(p_HxTxS: jax.Array, mask_S: jax.Array) -> jax.Array:
  p = p_HxTxS * mask_S[None, None, :]
  return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), _EPS)


def attention_map_loss(
    student_HxTxS: jax.Array,
    teacher_HxTxS: jax.Array,
    mask_T: jax.Array,
    loss: str = "kl",
    mask_keys: bool = True,
) -> jax.Array:
  """Per-query loss between two attention maps of one sequence, averaged over heads.

  Args:
    student_HxTxS, teacher_HxTxS: attention probabilities ``[H, T, T]`` (same H).
    mask_T: 1 for real tokens, 0 for ignored ones (queries and, with ``mask_keys``, keys).
    loss: ``"kl"`` -- row-wise ``KL(teacher || student)``; ``"mse"`` -- squared L2
      distance between rows (summed over keys, so its size does not grow with T).
    mask_keys: drop keys with ``mask == 0`` and renormalise rows (see module docstring).

  Returns:
    ``[T]`` per-query values; exactly 0 where ``mask_T == 0``.
  """
  m = mask_T.astype(jnp.float32)
  s = student_HxTxS.astype(jnp.float32)
  t = teacher_HxTxS.astype(jnp.float32)
  if mask_keys:
    s, t = _drop_keys(s, m), _drop_keys(t, m)
  if loss == "kl":
    # 0 * log 0 = 0; a floor on the logs keeps underflowed student entries finite.
    terms = jnp.where(t > 0, t * (jnp.log(jnp.maximum(t, _EPS)) - jnp.log(jnp.maximum(s, _EPS))), 0.0)
  elif loss == "mse":
    terms = jnp.square(s - t)
  else:
    raise ValueError(f"attention loss={loss!r}; choose one of {ATTENTION_LOSSES}")
  per_T = jnp.mean(jnp.sum(terms, axis=-1), axis=0)
  return jnp.where(m > 0, per_T, 0.0)


@register("attention_transfer")
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionTransfer(SequenceStrategy):
  """Distils attention probability maps of mapped layers.

  ``loss`` per sequence = sum over unmasked queries of the per-row loss, averaged over
  heads and over mapped layer pairs (the step turns the sum into a token mean).

  Attributes:
    layer_map: ``((student_layer, teacher_layer), ...)`` over blocks ``0 .. n_layers-1``;
      ``None`` spreads the student's blocks evenly over the teacher's
      (see `default_layer_map`).
    loss: ``"kl"`` (row-wise KL(teacher || student)) or ``"mse"``.
    heads: ``"group"`` averages the teacher's heads in consecutive groups of
      ``teacher_heads / student_heads`` (must divide); ``"mean"`` averages all heads
      of both models into one map (any head counts).
    mask_keys: drop masked keys and renormalise rows (``True``) or keep all keys.
  """

  layer_map: LayerMap | None = None
  loss: str = "kl"
  heads: str = "group"
  mask_keys: bool = True
  capture: ClassVar[tuple[str, ...]] = ("attn",)

  def __post_init__(self):
    object.__setattr__(self, "layer_map", check_layer_map_shape("AttentionTransfer", self.layer_map))
    if self.loss not in ATTENTION_LOSSES:
      raise ValueError(f"AttentionTransfer.loss={self.loss!r}; choose one of {ATTENTION_LOSSES}")
    if self.heads not in HEAD_MODES:
      raise ValueError(f"AttentionTransfer.heads={self.heads!r}; choose one of {HEAD_MODES}")

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    """Checks the layer map and head counts against the models; no parameters."""
    del key
    resolve_layer_map("AttentionTransfer", self.layer_map, student_cfg.n_layers, teacher_cfg.n_layers, "layer", 0)
    if self.heads == "group" and teacher_cfg.n_heads % student_cfg.n_heads:
      group_heads(jnp.zeros((teacher_cfg.n_heads, 1, 1)), student_cfg.n_heads)
    return {}

  def per_sequence(self, params, student: ModelOutput, teacher: ModelOutput, targets_T, mask_T, step):
    del params, targets_T, step
    if not student.attn or not teacher.attn:
      raise ValueError("AttentionTransfer needs attention maps: the models must be called with capture=('attn',)")
    pairs = resolve_layer_map("AttentionTransfer", self.layer_map, len(student.attn), len(teacher.attn), "layer", 0)
    total_T = 0.0
    for s_idx, t_idx in pairs:
      s, t = student.attn[s_idx], teacher.attn[t_idx]
      if self.heads == "mean":
        s, t = jnp.mean(s, axis=0, keepdims=True), jnp.mean(t, axis=0, keepdims=True)
      else:
        t = group_heads(t, s.shape[0])
      total_T = total_T + attention_map_loss(s, t, mask_T, self.loss, self.mask_keys)
    return {"loss": jnp.sum(total_T) / len(pairs)}
