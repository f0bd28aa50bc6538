"""A plain hand-written distillation step: the practical limit `tpu_step.py` holds meshdistill's step against.

One ``jax.jit`` function, written the way a JAX user would write it for one device: the teacher's forward (its
final hidden states, under ``stop_gradient``), the student's forward and backward, the same loss as
``ChunkedLogitKD`` (``alpha * tau^2 * KL(teacher_tau || student_tau) + (1 - alpha) * CE``, token means over the
mask) and the same optimizer (`meshdistill.default_optimizer`: clipping, AdamW, the non-finite skip), with the
optimizer state donated. The models are meshdistill's own decoders (the same weights, dtypes, scan and remat), so
the difference measured is the step around them. The vocabulary-wide logits are formed ``chunk`` tokens at a time
in a ``lax.scan`` whose body is ``jax.checkpoint``-ed (the usual way to keep ``[B, T, V]`` float32 logits out of
memory: the backward pass forms each chunk's logits again).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def make_plain_step(teacher, student, optimizer: optax.GradientTransformation, *, temperature: float, alpha: float,
                    chunk: int):
  """``(step, params, opt_state, teacher_params)``; ``step(params, opt_state, teacher_params, batch) -> (params,
  opt_state, loss)``, its first two arguments donated."""
  t_def, t_params = nnx.split(teacher)
  s_def, s_params = nnx.split(student)
  opt_state = optimizer.init(s_params)
  tau = float(temperature)

  def chunk_loss(s_CxD, t_CxE, s_head, t_head, targets_C, mask_C):
    s_CxV = jnp.dot(s_CxD, s_head.astype(s_CxD.dtype), preferred_element_type=jnp.float32)
    t_CxV = jnp.dot(t_CxE, t_head.astype(t_CxE.dtype), preferred_element_type=jnp.float32)
    t_logp = jax.nn.log_softmax(t_CxV / tau, axis=-1)
    s_logp_tau = jax.nn.log_softmax(s_CxV / tau, axis=-1)
    kl = jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp_tau), axis=-1)
    s_logp = jax.nn.log_softmax(s_CxV, axis=-1)
    ce = -jnp.take_along_axis(s_logp, targets_C[:, None], axis=-1)[:, 0]
    per_token = alpha * tau * tau * kl + (1.0 - alpha) * ce
    return jnp.sum(per_token * mask_C)

  def teacher_fn(t_params, batch):
    t_model = nnx.merge(t_def, t_params)
    t_out = t_model(batch["inputs"], capture=("final",), logits=False)
    return t_out.final.reshape(-1, t_out.final.shape[-1]), t_model.head_weight()

  def loss_fn(s_params, t_NxE, t_head, batch):
    s_model = nnx.merge(s_def, s_params)
    s_out = s_model(batch["inputs"], capture=("final",), logits=False)
    s_NxD = s_out.final.reshape(-1, s_out.final.shape[-1])
    s_head = s_model.head_weight()
    n = s_NxD.shape[0]
    c = min(chunk, n)
    split = lambda x: x.reshape(n // c, c, *x.shape[1:])  # noqa: E731
    xs = (split(s_NxD), split(t_NxE), split(batch["targets"].reshape(-1)), split(batch["mask"].reshape(-1)))
    body = jax.checkpoint(lambda acc, x: (acc + chunk_loss(x[0], x[1], s_head, t_head, x[2], x[3]), None))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
    return total / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

  def _step(params, opt_state, t_params, batch):
    t_NxE, t_head = jax.lax.stop_gradient(teacher_fn(t_params, batch))  # no gradient reaches the teacher
    loss, grads = jax.value_and_grad(loss_fn)(params, t_NxE, t_head, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(_step, donate_argnums=(0, 1))
  return step, s_params, opt_state, t_params
