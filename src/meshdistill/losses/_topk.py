"""Top-k teachers: the teacher's k most likely tokens plus one tail bin for the rest.

A top-k teacher is given per token by ``indices_TxK`` (token ids) and ``logprobs_TxK``
(their log-probabilities). The target is a distribution over k+1 bins: the k kept
tokens and a tail bin holding the remaining mass ``1 - sum_k p_t``. The student's
distribution is mapped onto the same bins: its probabilities at the k token ids and
its own remaining mass in the tail. Any distribution-level divergence
(`meshdistill.losses.DISTRIBUTION_DIVERGENCES`) then compares the two (k+1)-bin
distributions. Merging tokens into one bin never increases these divergences, so the
top-k value is a lower bound of the full-vocabulary one and equals it for
``k >= V - 1``.

Unlike a top-k that renormalises over the k tokens, the tail keeps the student
accountable for mass it puts outside the teacher's top-k. The ``(indices, logprobs)``
pair is all the teacher side needs, so an offline cache of teacher top-k can feed
`topk_divergence` directly; `teacher_topk` computes it from live teacher logits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from jax.sharding import PartitionSpec as P

from meshdistill.losses._divergences import Scalar, get_distribution_divergence
from meshdistill.losses._logits import _masked, as_float, log_softmax
from meshdistill.parallel.mesh import TENSOR, auto_tensor_size


def teacher_topk(teacher_TxV: jax.Array, k: int, temperature: Scalar = 1.0) -> tuple[jax.Array, jax.Array]:
  """The teacher's ``k`` most likely tokens per position at ``temperature``.

  Returns ``(indices_TxK int32, logprobs_TxK)``: token ids in decreasing probability and
  their log-probabilities ``log softmax(teacher / temperature)`` (ties: the lower id first).

  Inside a train step whose vocabulary is split over the mesh axis ``tensor`` (an automatic
  axis of the current mesh), the selection is vocabulary-parallel: each device takes the top
  ``k`` of its own vocabulary slice, the ``tensor * k`` candidates are all-gathered, and the
  top ``k`` of those are the global ones (exact: every global top-k token is in its slice's
  top k). Only ``[T, tensor * k]`` values move instead of the ``[T, V]`` log-probabilities a
  plain `jax.lax.top_k` would gather. Elsewhere (one device, ``V`` not divisible by
  ``tensor``, or ``k`` above a slice) it is `jax.lax.top_k` over V. An offline top-k cache
  avoids the selection in the train step altogether.
  """
  return vocab_topk(log_softmax(teacher_TxV, temperature), k)


def vocab_topk(values_TxV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``(indices_TxK int32, values_TxK)``: the ``k`` largest of ``values_TxV`` per row, decreasing; selected
  vocabulary-parallel when V is split over ``tensor`` (see `teacher_topk`)."""
  if _vocab_shards(values_TxV.shape[-1], k) > 1:
    return _sharded_topk(values_TxV, k)
  top_TxK, indices_TxK = jax.lax.top_k(values_TxV, k)
  return indices_TxK.astype(jnp.int32), top_TxK


def _vocab_shards(vocab: int, k: int) -> int:
  """Size of the automatic ``tensor`` axis of the mesh being traced, when a vocabulary of ``vocab``
  splits over it evenly with at least ``k`` tokens per slice; else 1."""
  n = auto_tensor_size()
  return n if n > 1 and vocab % n == 0 and vocab // n >= k else 1


def _sharded_topk(logp_TxV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`teacher_topk`'s selection with the vocabulary split over ``tensor`` (see there)."""

  def local(logp_TxVl):
    values_TxK, indices_TxK = jax.lax.top_k(logp_TxVl, k)
    indices_TxK = indices_TxK.astype(jnp.int32) + jax.lax.axis_index(TENSOR) * logp_TxVl.shape[-1]
    # candidates ordered by slice, then by rank: among equal values the lower id comes first
    values_TxSK = jax.lax.all_gather(values_TxK, TENSOR, axis=values_TxK.ndim - 1, tiled=True)
    indices_TxSK = jax.lax.all_gather(indices_TxK, TENSOR, axis=indices_TxK.ndim - 1, tiled=True)
    top_TxK, position_TxK = jax.lax.top_k(values_TxSK, k)
    return jnp.take_along_axis(indices_TxSK, position_TxK, axis=-1), top_TxK

  lead = (None,) * (logp_TxV.ndim - 1)
  return jax.shard_map(
    local, in_specs=P(*lead, TENSOR), out_specs=(P(), P()), axis_names={TENSOR}, check_vma=False
  )(logp_TxV)


def _log1mexp(x: jax.Array) -> jax.Array:
  """``log(1 - exp(x))`` for ``x <= 0`` (``x`` is clipped to 0; gives -inf there)."""
  x = jnp.minimum(x, 0.0)
  safe = jnp.where(x < 0, x, -1.0)  # keeps the unused branch's gradient finite
  return jnp.where(x < 0, jnp.log(-jnp.expm1(safe)), -jnp.inf)


def _tail(logp_TxV: jax.Array, indices_TxK: jax.Array) -> jax.Array:
  """``log sum_{v not in indices} p(v)`` per token: a masked log-sum-exp over V (-inf if K == V)."""
  T, V = logp_TxV.shape
  if indices_TxK.shape[-1] == V:
    return jnp.full((T,), -jnp.inf, logp_TxV.dtype)
  in_top_TxV = jnp.zeros((T, V), bool).at[jnp.arange(T)[:, None], indices_TxK].set(True)
  return jax.nn.logsumexp(jnp.where(in_top_TxV, -jnp.inf, logp_TxV), axis=-1)


def topk_tail(logits_TxV: jax.Array, indices_TxK: jax.Array, temperature: Scalar = 1.0) -> jax.Array:
  """Exact log-mass ``[T]`` of the tokens outside ``indices_TxK`` at ``temperature``.

  ``log(1 - sum_k p)`` from the top-k log-probabilities alone loses precision when the
  tail is small (float32 rounding of the sum is ~1e-7 absolute); with the logits at hand,
  this sums the tail directly. Worth storing next to an offline top-k cache.
  """
  return _tail(log_softmax(logits_TxV, temperature), indices_TxK)


def topk_bins(
    student_TxV: jax.Array,
    indices_TxK: jax.Array,
    logprobs_TxK: jax.Array,
    temperature: Scalar = 1.0,
    tail_T: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Student and teacher log-probabilities on the k+1 bins, ``([T, K+1], [T, K+1])``.

  Bin ``j < K`` is token ``indices_TxK[:, j]``; bin ``K`` is the tail (all other tokens).

  * teacher: ``logprobs_TxK`` and the tail log-mass ``tail_T`` (from `topk_tail`), or,
    when not given, ``log(1 - sum_k p_t)``; renormalised over the k+1 bins (so rounding
    in a cached, e.g. bfloat16, top-k cannot leave it off 1). ``logprobs_TxK`` must be
    log-probabilities at the same ``temperature`` the student is compared at (what
    `teacher_topk` returns).
  * student: ``log softmax(student / temperature)`` picked at the k ids (a gather of k
    values per token) and the exact log of its remaining mass, a log-sum-exp over the
    tokens outside the k (a masked reduction over V, no ``1 - sum`` cancellation).

  With ``K == V`` there is nothing left: the tail bin is empty on both sides.
  """
  V = student_TxV.shape[-1]
  K = indices_TxK.shape[-1]
  if K > V:
    raise ValueError(f"top-k teacher has k={K} tokens per position but the vocabulary has V={V}; use k <= {V}")
  logp_s_TxV = log_softmax(student_TxV, temperature)
  top_s_TxK = jnp.take_along_axis(logp_s_TxV, indices_TxK, axis=-1)
  top_t_TxK = as_float(logprobs_TxK).astype(logp_s_TxV.dtype)
  tail_s_T = _tail(logp_s_TxV, indices_TxK)
  if K == V:
    tail_t_T = tail_s_T
  elif tail_T is not None:
    tail_t_T = as_float(tail_T).astype(logp_s_TxV.dtype)
  else:
    tail_t_T = _log1mexp(jax.nn.logsumexp(top_t_TxK, axis=-1))
  bins_s = jnp.concatenate([top_s_TxK, tail_s_T[:, None]], axis=-1)
  bins_t = jax.nn.log_softmax(jnp.concatenate([top_t_TxK, tail_t_T[:, None]], axis=-1), axis=-1)
  return bins_s, bins_t


def topk_divergence(
    student_TxV: jax.Array,
    indices_TxK: jax.Array,
    logprobs_TxK: jax.Array,
    mask_T: jax.Array | None = None,
    temperature: Scalar = 1.0,
    divergence: str = "forward_kl",
    tail_T: jax.Array | None = None,
    **hyper,
) -> jax.Array:
  """A distribution-level divergence between the student and a top-k teacher on k+1 bins, per token.

  Args:
    student_TxV: student logits of one sequence.
    indices_TxK, logprobs_TxK: the teacher's top-k token ids and log-probabilities at
      ``temperature`` (from `teacher_topk` or an offline cache).
    mask_T: masked tokens (0) give exactly 0.
    temperature: the student's temperature.
    divergence: a name in `DISTRIBUTION_DIVERGENCES` (default forward KL).
    tail_T: optional exact teacher tail log-mass (`topk_tail`); default ``log(1 - sum_k p_t)``.
    **hyper: the divergence's hyper-parameters (``beta`` for jsd, ``skew`` for the skew KLs).

  Returns:
    ``[T]`` per-token divergence.
  """
  fn = get_distribution_divergence(divergence)
  bins_s, bins_t = topk_bins(student_TxV, indices_TxK, logprobs_TxK, temperature, tail_T)
  return _masked(fn(bins_s, bins_t, **hyper), mask_T)


class TopK(NamedTuple):
  """A teacher given by its top-k tokens rather than its weights (an offline cache, or a teacher on
  other devices): ``indices [..., T, K]`` int32 token ids in decreasing probability,
  ``logprobs [..., T, K]`` their log-probabilities at the distillation temperature and ``tail [..., T]``
  the log-mass of all other tokens (`topk_tail`). The train step hands one sequence's ``[T, ...]``
  slices to the strategy in place of the teacher's `ModelOutput`."""

  indices: jax.Array
  logprobs: jax.Array
  tail: jax.Array


def narrow_topk(topk: TopK, k: int) -> TopK:
  """The first ``k`` of ``K >= k`` kept tokens; the other ``K - k`` join the tail bin (exact).

  Host arrays (numpy: the teacher server narrowing an answer to the ``prompt_logprobs`` asked) are narrowed on the
  host with numpy and scipy, no JAX program per shape; anything else (traced, device arrays) with jax.numpy."""
  K = topk.indices.shape[-1]
  if k == K:
    return topk
  if k > K:
    raise ValueError(f"a top-k teacher with k={K} cannot give its top {k}; use top_k <= {K}")
  host = all(isinstance(x, np.ndarray) for x in topk)
  xp, logsumexp = (np, scipy.special.logsumexp) if host else (jnp, jax.nn.logsumexp)
  rest = xp.concatenate([topk.logprobs[..., k:].astype(xp.float32), topk.tail[..., None].astype(xp.float32)], -1)
  return TopK(topk.indices[..., :k], topk.logprobs[..., :k], logsumexp(rest, axis=-1))
