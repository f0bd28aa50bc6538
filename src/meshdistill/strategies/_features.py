"""Feature distillation: match the student's per-layer hidden states to the teacher's.

Hidden states are ``ModelOutput.hidden``: ``n_layers + 1`` entries of ``[T, D]`` for one
sequence (entry 0 = embeddings, entry i = output of block i). ``D`` is replicated over
the mesh. Two ways to bridge the width gap between teacher (``D_t``) and student (``D_s``):

* `FeaturePooling` -- no parameters: the teacher's features are average-pooled in
  consecutive groups of ``D_t / D_s`` down to the student's width;
* `FeatureProjection` -- a learned linear map ``[D_s, D_t]`` per mapped layer lifts the
  student's features to the teacher's width. Its weights live in
  ``state.params["strategy"]``, are trained with the student, and do not depend on
  batch size or sequence length (the same map is applied to every token).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from meshdistill.models import ModelOutput
from meshdistill.strategies._base import SequenceStrategy, register
from meshdistill.strategies._layer_map import LayerMap, check_layer_map_shape, mean_groups, resolve_layer_map

FEATURE_LOSSES = ("cosine", "mse")
_EPS = 1e-12


def pool_features(x_TxD: jax.Array, width: int, owner: str = "FeaturePooling") -> jax.Array:
  """Average-pools ``[T, D]`` to ``[T, width]`` over consecutive groups of ``D / width`` features."""
  return mean_groups(
      x_TxD,
      width,
      -1,
      f"{owner}: teacher d_model={{N}} is not a multiple of student d_model={{n}}; pooling averages groups "
      "of teacher_d / student_d features. Choose widths that divide, or use FeatureProjection (a learned map)",
  )


def feature_loss(student_TxD: jax.Array, teacher_TxD: jax.Array, mask_T: jax.Array, loss: str = "cosine") -> jax.Array:
  """Per-token distance between two feature sequences of the same width.

  ``"cosine"``: ``1 - cos(student, teacher)``; ``"mse"``: mean over features of the
  squared difference. Returns ``[T]``, exactly 0 where ``mask_T == 0``.
  """
  s = student_TxD.astype(jnp.float32)
  t = teacher_TxD.astype(jnp.float32)
  if loss == "cosine":
    # max() on the squared norm keeps the gradient finite at a zero vector.
    norm_s = jnp.sqrt(jnp.maximum(jnp.sum(s * s, axis=-1), _EPS))
    norm_t = jnp.sqrt(jnp.maximum(jnp.sum(t * t, axis=-1), _EPS))
    per_T = 1.0 - jnp.sum(s * t, axis=-1) / (norm_s * norm_t)
  elif loss == "mse":
    per_T = jnp.mean(jnp.square(s - t), axis=-1)
  else:
    raise ValueError(f"feature loss={loss!r}; choose one of {FEATURE_LOSSES}")
  return jnp.where(mask_T > 0, per_T, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FeatureMatch(SequenceStrategy):
  """What `FeaturePooling` and `FeatureProjection` share: a layer map over hidden states and a loss."""

  layer_map: LayerMap | None = None
  loss: str = "cosine"
  capture: ClassVar[tuple[str, ...]] = ("hidden",)

  def __post_init__(self):
    owner = type(self).__name__
    if self.loss not in FEATURE_LOSSES:
      raise ValueError(f"{owner}.loss={self.loss!r}; choose one of {FEATURE_LOSSES}")
    object.__setattr__(self, "layer_map", check_layer_map_shape(owner, self.layer_map))

  def pairs_for_models(self, student_cfg, teacher_cfg) -> LayerMap:
    """The layer pairs for these model sizes (checks the layer map against them)."""
    n_s, n_t = student_cfg.n_layers + 1, teacher_cfg.n_layers + 1
    return resolve_layer_map(type(self).__name__, self.layer_map, n_s, n_t, "hidden state", 1)

  def pairs(self, student: ModelOutput, teacher: ModelOutput) -> LayerMap:
    """The layer pairs for these captured hidden states."""
    owner = type(self).__name__
    if not student.hidden or not teacher.hidden:
      raise ValueError(f"{owner} needs hidden states: the models must be called with capture=('hidden',)")
    return resolve_layer_map(owner, self.layer_map, len(student.hidden), len(teacher.hidden), "hidden state", 1)


@register("feature_pooling")
@dataclasses.dataclass(frozen=True, kw_only=True)
class FeaturePooling(_FeatureMatch):
  """Hidden-state distillation with the teacher's width average-pooled to the student's.

  ``loss`` per sequence = sum over unmasked tokens of the per-token distance, averaged
  over mapped layer pairs.

  Attributes:
    layer_map: ``((student_hidden, teacher_hidden), ...)`` over hidden-state entries
      ``0 .. n_layers`` (0 = embeddings); ``None`` pairs block outputs evenly
      (student entry ``i`` with teacher entry ``round(i * Lt / Ls)``).
    loss: ``"cosine"`` (1 - cosine similarity) or ``"mse"``.
  """

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    """Checks the layer map and widths against the models; no parameters."""
    del key
    self.pairs_for_models(student_cfg, teacher_cfg)
    if teacher_cfg.d_model % student_cfg.d_model:
      pool_features(jnp.zeros((1, teacher_cfg.d_model)), student_cfg.d_model)
    return {}

  def per_sequence(self, params, student: ModelOutput, teacher: ModelOutput, targets_T, mask_T, step):
    del params, targets_T, step
    pairs = self.pairs(student, teacher)
    total_T = 0.0
    for s_idx, t_idx in pairs:
      s = student.hidden[s_idx]
      t = pool_features(teacher.hidden[t_idx], s.shape[-1])
      total_T = total_T + feature_loss(s, t, mask_T, self.loss)
    return {"loss": jnp.sum(total_T) / len(pairs)}


def projection_name(student_layer: int, teacher_layer: int) -> str:
  """Key of the projection for one layer pair in `FeatureProjection` parameters."""
  return f"s{student_layer}_t{teacher_layer}"


@register("feature_projection")
@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureProjection(_FeatureMatch):
  """Hidden-state distillation through a learned per-token linear map ``D_s -> D_t``.

  Parameters (from `init_params`): ``{projection_name(s, t): {"kernel": [D_s, D_t]}}``,
  one per mapped layer pair, LeCun-normal initialised, replicated over the mesh and
  trained with the student. ``loss`` per sequence = sum over unmasked tokens of the
  distance between ``student_hidden @ kernel`` and the teacher's hidden state, averaged
  over mapped pairs.

  Attributes:
    layer_map: as in `FeaturePooling`.
    loss: ``"cosine"`` or ``"mse"``.
  """

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    """One ``[D_s, D_t]`` kernel per mapped layer pair (checks the layer map first)."""
    pairs = self.pairs_for_models(student_cfg, teacher_cfg)
    init = jax.nn.initializers.lecun_normal()
    shape = (student_cfg.d_model, teacher_cfg.d_model)
    return {
        projection_name(s, t): {"kernel": init(jax.random.fold_in(key, i), shape, jnp.float32)}
        for i, (s, t) in enumerate(pairs)
    }

  def per_sequence(self, params, student: ModelOutput, teacher: ModelOutput, targets_T, mask_T, step):
    del targets_T, step
    pairs = self.pairs(student, teacher)
    total_T = 0.0
    for s_idx, t_idx in pairs:
      name = projection_name(s_idx, t_idx)
      if name not in params:
        raise ValueError(
            f"FeatureProjection has no projection {name!r} (has {sorted(params)}); "
            "build the train state with this strategy's init_params (Distiller.init_state)"
        )
      kernel_DsxDt = params[name]["kernel"]
      s = jnp.einsum("td,de->te", student.hidden[s_idx].astype(jnp.float32), kernel_DsxDt)
      total_T = total_T + feature_loss(s, teacher.hidden[t_idx], mask_T, self.loss)
    return {"loss": jnp.sum(total_T) / len(pairs)}
