"""Several top-k teachers as one target: routing, mixing, and each teacher's own metrics.

Every teacher is given by its top-k per token (`TopK`: ids, log-probabilities, the tail bin). Two ways to combine
``N`` of them (all with the same ``K``; `narrow_topk` first):

* `route_topk`: each row takes one teacher's top-k (``teacher_B``: that teacher's index) -- the row is distilled
  from that teacher exactly as from it alone;
* `mix_topk`: per token, the weighted mixture ``q = sum_n w_n p_n`` of the teachers' (K+1)-bin distributions
  (each renormalised over its bins, the weights over the teachers). Over the union of their ids, a teacher that
  did not keep an id gives it 0 there (its mass for that id is inside its tail bin); the result keeps the ``K``
  most likely ids of the union, and every other token's mass -- the other union ids and the teachers' tails,
  weighted -- is its tail bin. So the bins of the result sum to 1 and the target is a ``TopK`` like any other.

`teacher_terms` gives, per teacher, the forward KL on its own K+1 bins and the top-1 agreement, token sums over
the rows that teacher serves (the step's ``kl/<name>`` and ``agreement/<name>`` metrics).

Shapes: ``B`` rows, ``T`` tokens, ``K`` ids per token, ``N`` teachers, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from meshdistill.losses._topk import TopK, topk_divergence


def _normalised(topk: TopK) -> tuple[jax.Array, jax.Array]:
  """``(logprobs [..., K], tail [...])`` renormalised over the K+1 bins (a float16 cache rounds off 1)."""
  logp = topk.logprobs.astype(jnp.float32)
  tail = topk.tail.astype(jnp.float32)
  log_z = jax.nn.logsumexp(jnp.concatenate([logp, tail[..., None]], axis=-1), axis=-1)
  return logp - log_z[..., None], tail - log_z


def route_topk(topks: Sequence[TopK], teacher_B: jax.Array) -> TopK:
  """Row ``b`` of the result is row ``b`` of ``topks[teacher_B[b]]`` (each ``[B, T, K]`` / ``[B, T]``)."""
  stacked = TopK(*(jnp.stack([getattr(t, f) for t in topks]) for f in TopK._fields))  # [N, B, ...]
  rows = jnp.arange(teacher_B.shape[0])
  return TopK(*(x[teacher_B, rows] for x in stacked))


def mix_topk(topks: Sequence[TopK], weights: Sequence[float]) -> TopK:
  """The weighted mixture of ``topks`` (``[..., T, K]`` each) as one top-K target (see the module docstring).

  ``weights``: one positive number per teacher (normalised here). Ties between union ids of equal mixture
  probability keep the earlier teacher's slot first."""
  if len(topks) != len(weights):
    raise ValueError(f"mix_topk: {len(topks)} teachers but {len(weights)} weights")
  w_N = jnp.asarray(weights, jnp.float32)
  w_N = w_N / jnp.sum(w_N)
  K = topks[0].indices.shape[-1]
  parts = [_normalised(t) for t in topks]
  ids_J = jnp.concatenate([t.indices.astype(jnp.int32) for t in topks], axis=-1)  # [..., J = N K] the union slots
  logw_J = jnp.repeat(jnp.log(w_N), K)  # each slot's teacher weight
  p_J = jnp.exp(jnp.concatenate([lp for lp, _ in parts], axis=-1) + logw_J)  # w_n p_n(id) of each slot
  same_JxJ = ids_J[..., :, None] == ids_J[..., None, :]
  q_J = jnp.sum(jnp.where(same_JxJ, p_J[..., None, :], 0.0), axis=-1)  # the mixture at each slot's id
  J = ids_J.shape[-1]
  earlier_JxJ = jnp.tril(jnp.ones((J, J), bool), k=-1)
  repeat_J = jnp.any(same_JxJ & earlier_JxJ, axis=-1)  # an id a slot before already holds
  logq_J = jnp.where(repeat_J, -jnp.inf, jnp.log(q_J))
  top_logq_K, pos_K = jax.lax.top_k(logq_J, K)
  chosen_J = jnp.any(pos_K[..., :, None] == jnp.arange(J), axis=-2)
  tail_N = jnp.stack([tail for _, tail in parts], axis=-1) + jnp.log(w_N)  # each teacher's weighted tail
  rest = jnp.concatenate([jnp.where(chosen_J, -jnp.inf, logq_J), tail_N], axis=-1)
  return TopK(jnp.take_along_axis(ids_J, pos_K, axis=-1), top_logq_K, jax.nn.logsumexp(rest, axis=-1))


def teacher_terms(student_TxV: jax.Array, topk: TopK, mask_T: jax.Array, temperature) -> dict[str, jax.Array]:
  """One teacher's per-token metrics of one sequence (``[T]``, 0 where ``mask_T`` is 0): ``kl``, the forward KL
  from the teacher's K+1 bins to the student's at ``temperature``, and ``agreement``, 1 where the student's most
  likely token is the teacher's first id."""
  kl_T = topk_divergence(student_TxV, topk.indices, topk.logprobs, mask_T, temperature, "forward_kl", topk.tail)
  at_top_T = jnp.take_along_axis(student_TxV, topk.indices[:, :1], axis=-1)[:, 0]
  agree_T = (at_top_T >= jnp.max(student_TxV, axis=-1)).astype(jnp.float32) * mask_T
  return {"kl": kl_T, "agreement": agree_T}
