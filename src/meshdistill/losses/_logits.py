"""Per-token losses and metrics on one sequence's logits.

Every function here takes logits of ONE sequence, ``[T, V]``, and returns a per-token
vector ``[T]``; masked positions (``mask == 0``) are exactly 0 in the result. Callers
reduce with a sum and divide by the token count of the global batch
(see `meshdistill.train.step`). The vocabulary axis V may be split over the mesh axis
``tensor``: only max- and sum-reductions over V are used (log-sum-exp subtracts a
stop-gradient max), so the compiler reduces partial results across ``tensor``
instead of gathering the vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _masked(values_T: jax.Array, mask_T: jax.Array | None) -> jax.Array:
  if mask_T is None:
    return values_T
  return jnp.where(mask_T.astype(bool), values_T, jnp.zeros_like(values_T))


def as_float(x: jax.Array) -> jax.Array:
  """``x`` in at least float32: bfloat16/float16 are widened, float64 (under x64) is kept."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def log_softmax(logits_TxV: jax.Array, temperature: float | jax.Array = 1.0) -> jax.Array:
  """``log softmax(logits / temperature)`` in float32 (float64 for float64 inputs)."""
  x = as_float(logits_TxV)
  return jax.nn.log_softmax(x / jnp.asarray(temperature, x.dtype), axis=-1)


def cross_entropy(logits_TxV: jax.Array, targets_T: jax.Array, mask_T: jax.Array | None = None) -> jax.Array:
  """``-log softmax(logits)[target]`` per token.

  The target's log-probability is picked with a one-hot product (a sum over V),
  so a vocabulary split over ``tensor`` is never gathered.
  """
  logp = log_softmax(logits_TxV)
  onehot = jax.nn.one_hot(targets_T, logits_TxV.shape[-1], dtype=logp.dtype)
  return _masked(-jnp.sum(onehot * logp, axis=-1), mask_T)


def pearson(a_TxV: jax.Array, b_TxV: jax.Array, mask_T: jax.Array | None = None) -> jax.Array:
  """Pearson correlation over the vocabulary between two logit vectors, per token."""
  a = a_TxV.astype(jnp.float32)
  b = b_TxV.astype(jnp.float32)
  a = a - jnp.mean(a, axis=-1, keepdims=True)
  b = b - jnp.mean(b, axis=-1, keepdims=True)
  cov = jnp.sum(a * b, axis=-1)
  denom = jnp.sqrt(jnp.sum(a * a, axis=-1) * jnp.sum(b * b, axis=-1))
  return _masked(cov / jnp.maximum(denom, 1e-12), mask_T)


def top1_agreement(a_TxV: jax.Array, b_TxV: jax.Array, mask_T: jax.Array | None = None) -> jax.Array:
  """1.0 where both logit vectors share an arg-max token, else 0.0, per token.

  Written with max-reductions only (no arg-max), so it stays vocabulary-parallel.
  """
  top_a = a_TxV >= jnp.max(a_TxV, axis=-1, keepdims=True)
  top_b = b_TxV >= jnp.max(b_TxV, axis=-1, keepdims=True)
  agree_T = jnp.max(jnp.logical_and(top_a, top_b).astype(jnp.float32), axis=-1)
  return _masked(agree_T, mask_T)
