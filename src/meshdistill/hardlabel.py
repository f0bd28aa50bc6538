"""Training one model on hard labels (next-token cross-entropy), with no teacher.

Used to pretrain a teacher from scratch and to train the "scratch student" baseline of the
quality benchmark. Why a separate step rather than `Distiller` with ``alpha=0``: the
distillation step always runs a teacher forward pass, and with the model itself (or any
stand-in) as the teacher that forward would be pure waste -- a third of the compute of a
pretraining step. This step is the distillation step minus the teacher: the same
`TrainState`, the same layouts (`meshdistill.step.wrap_step`: ``single`` / ``shard_map`` /
``pmap``), the same token-mean over unmasked tokens of the GLOBAL batch, the same
per-sequence loss `jax.vmap`-ed over the local rows. States are interchangeable with the
distiller's (``params = {"student": ..., "strategy": {}}``), so checkpoints, evaluation and the
trainer loop serve both.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from meshdistill import losses
from meshdistill.distiller import BATCH_KEYS, default_optimizer, place_batch, stack_replicas
from meshdistill.mesh import TENSOR, check_batch, param_shardings
from meshdistill.models import Decoder
from meshdistill.step import StepVariants, TrainState, resolve_backend


def per_device_ce_step(
  state: TrainState,
  unused_teacher_params: Any,
  batch: dict[str, jax.Array],
  *,
  model_def: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  data_axis: str | None,
):
  """One hard-label step on this device's rows ``batch = {inputs, targets, mask}: [b, T]`` (b split over ``data``).

  Returns ``(new_state, metrics)`` with ``loss`` = ``ce`` (token mean over the global batch),
  ``grad_norm`` and ``tokens``; the signature matches `meshdistill.step.per_device_step` so
  `wrap_step` compiles it for every layout.
  """
  del unused_teacher_params
  mask_BxT = batch["mask"].astype(jnp.float32)
  tokens = jnp.sum(mask_BxT) if data_axis is None else jax.lax.psum(jnp.sum(mask_BxT), data_axis)
  denom = jnp.maximum(tokens, 1.0)

  def loss_fn(params):
    model = nnx.merge(model_def, params["student"])
    logits_BxTxV = model(batch["inputs"]).logits
    ce_B = jax.vmap(lambda l, t, m: jnp.sum(losses.cross_entropy(l, t, m)))(logits_BxTxV, batch["targets"], mask_BxT)
    return jnp.sum(ce_B) / denom, jnp.sum(ce_B)

  (_, ce_sum), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  if data_axis is not None:
    grads, ce_sum = jax.lax.psum((grads, ce_sum), data_axis)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  ce = ce_sum / denom
  metrics = {"loss": ce, "ce": ce, "grad_norm": optax.global_norm(grads), "tokens": tokens}
  return TrainState(state.step + 1, params, opt_state), metrics


class HardLabelTrainer(StepVariants):
  """Trains ``model`` on next-token cross-entropy; the teacher-free twin of `Distiller`.

  Same interface as `Distiller` where the trainer loop needs it: `init_state`, `step`,
  `unreplicate`, `student`, ``student_def``, ``mesh``, ``backend``; ``teacher_def`` and
  ``teacher_params`` are None.
  """

  _MODEL_DEF = "model_def"
  teacher_def = None
  teacher_params = None
  teacher_cfg = None

  def __init__(
    self,
    model: Decoder,
    *,
    optimizer: optax.GradientTransformation | None = None,
    mesh: Mesh | None = None,
    backend: str | None = None,
  ):
    backend, mesh = resolve_backend(backend, mesh)
    if backend == "shard_map":
      model.cfg.check_tensor_split(mesh.shape[TENSOR])
    self.mesh, self.backend = mesh, backend
    self.optimizer = optimizer if optimizer is not None else default_optimizer()
    self.student_cfg = model.cfg
    self.max_len = model.cfg.max_len
    self.student_def, self._init = nnx.split(model)
    self._specs = nnx.get_partition_spec(self._init)
    self._step_fn = functools.partial(per_device_ce_step, model_def=self.student_def, optimizer=self.optimizer)
    self._compiled = None

  def init_state(self) -> TrainState:
    """A fresh train state from the model given at construction."""
    params = {"student": self._init, "strategy": {}}
    fresh = jax.jit(lambda p: TrainState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.copy, p), self.optimizer.init(p)))
    if self.backend == "single":
      return fresh(jax.device_put(params, jax.devices()[0]))
    if self.backend == "pmap":
      return stack_replicas(jax.device_get(fresh(jax.device_get(params))), self.mesh.size)
    shardings = {"student": param_shardings(self._specs, self.mesh), "strategy": {}}
    return fresh(jax.device_put(params, shardings))

  def check_batch(self, batch: dict) -> None:
    """Raises a clear error for a malformed batch (keys, length, divisibility)."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
      raise ValueError(f"batch is missing {missing}; a batch is a dict with {BATCH_KEYS}, each [batch, seq]")
    B, T = np.shape(batch["inputs"])
    if T > self.max_len:
      raise ValueError(f"sequence length {T} exceeds max_len={self.max_len}; use seq_len <= {self.max_len}")
    check_batch(B, self.mesh)

  def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict[str, jax.Array]]:
    """One step on a host batch ``{inputs, targets, mask}`` [B, T]; ``state`` is consumed (donated)."""
    self.check_batch(batch)
    new_state, metrics = self.compiled_step(state)(state, {}, place_batch(batch, self.backend, self.mesh))
    if self.backend == "pmap":
      metrics = jax.tree.map(lambda x: x[0], metrics)
    return new_state, metrics

  def lower(self, state: TrainState, batch: dict):
    """The lowered step for ``batch`` (for memory analysis and HLO inspection)."""
    self.check_batch(batch)
    return self.compiled_step(state).lower(state, {}, place_batch(batch, self.backend, self.mesh))

  def unreplicate(self, tree):
    """For ``pmap`` the first replica of a stacked tree; otherwise ``tree`` unchanged."""
    return jax.tree.map(lambda x: x[0], tree) if self.backend == "pmap" else tree

  def student(self, state: TrainState) -> Decoder:
    """The model holding the parameters of ``state``."""
    return nnx.merge(self.student_def, self.unreplicate(state.params)["student"])
