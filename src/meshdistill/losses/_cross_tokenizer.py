"""Losses between a teacher and a student that do not share a tokenizer, on aligned spans of one sequence.

The two models predict different tokens, so their distributions are compared span by span
(`meshdistill.data.alignment`: a span is a maximal group of student tokens and of teacher tokens that
cover the same bytes). Inputs for one sequence: each side's logits ``[T, V]``, its targets ``[T]``, the
span of each target ``[T]`` (-1: none) and the position of each span's last target ``[S]``.

Span log-probabilities (`span_logprobs`) merge a span's tokens into one distribution, as TRL's
``uld_token_merge_strategy`` does (``merge``):

* ``"bayesian"`` (the chain rule; meshdistill's default): a span of targets ``x_1 .. x_n`` gets the distribution
  at its LAST position, ``log p(v | x_<n)``, plus the log-probabilities of the actual earlier tokens,
  ``sum_{j<n} log p(x_j | x_<j)``: the joint log-probability of the span ending in ``v``; at ``v = x_n`` it is
  the span's log-probability, the sum of its tokens' log-probabilities. The result is not normalised (it sums to
  ``p(x_1 .. x_{n-1})``).
* ``"observed"`` (TRL's default), as TRL computes it: TRL reads this strategy's logits at the answer positions
  unshifted, so every distribution is the one a position LATER than the target it is merged with: the
  distribution after the span's first target (``log p(v | x_<=1)``, a prediction of the text that follows that
  token) plus, for each later target ``x_j``, the log-probability the position after it gives the token ``x_j``
  itself. A span whose last target is the row's last position has no position after it: `observed_spans` says
  which spans can be read this way.

* `uld` (Universal Logit Distillation, Boizard et al. 2024): the L1 distance between the two sides' span
  probabilities sorted in decreasing order, the shorter vocabulary padded with zeros (the Wasserstein-1
  distance of the sorted vectors). With ``top_k``, each side keeps its ``k`` largest (the vocabulary-parallel
  top-k of `meshdistill.losses.teacher_topk` when the vocabulary is split over ``tensor``); ``top_k=None``
  sorts the whole vocabulary (exact; a vocabulary split over ``tensor`` is then gathered).
* `hybrid_uld` (GOLD's hybrid loss): tokens whose bytes exist in both vocabularies (the matched vocabulary,
  pairs of ids ``(teacher_ids [M], student_ids [M])``) are compared token by token with GOLD's generalised JSD
  (`matched_divergence`) on the span probabilities at those ids (as TRL: probabilities clamped at 1e-8, no
  renormalisation): ``beta = 0`` KL(teacher || student), ``beta = 1`` KL(student || teacher), in between
  ``beta KL(t || m) + (1 - beta) KL(s || m)`` with ``m = beta t + (1 - beta) s`` (TRL's ``beta``, whose
  default is 0.5; here 0); the rest of each vocabulary falls to `uld`;
  ``matched_weight * matched + (1 - matched_weight) * uld``, with the default weight ``M / W`` (the matched
  share of the teacher's vocabulary, as TRL).

All return per-span values ``[S]``, exactly 0 where ``span_mask`` is 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshdistill.losses._divergences import jsd_logprobs, kl_logprobs
from meshdistill.losses._logits import log_softmax
from meshdistill.losses._topk import vocab_topk

CLAMP = 1e-8  # TRL clamps probabilities at this before taking logs in the matched KL
MERGES = ("bayesian", "observed")  # how a span's tokens merge into one distribution (TRL's uld_token_merge_strategy)
DENSE_FLOOR = -1e4  # `topk_logprobs` of ids with no mass: exp() is 0 in float32, products with 0 stay finite


class Aligned(NamedTuple):
  """A teacher of another tokenizer, for the step's strategy: its logits on its own tokens ``[..., Tt, W]`` and
  targets ``[..., Tt]``, and the alignment of the row (`meshdistill.data.alignment.RowAlignment`): span ids
  ``teacher_span [..., Tt]`` / ``student_span [..., Ts]``, last positions ``teacher_last`` / ``student_last
  [..., S]`` and ``span_bytes [..., S]`` (0: the span does not count)."""

  logits: jax.Array
  targets: jax.Array
  teacher_span: jax.Array
  student_span: jax.Array
  teacher_last: jax.Array
  student_last: jax.Array
  span_bytes: jax.Array


def topk_logprobs(
    indices_TxK: jax.Array, logprobs_TxK: jax.Array, tail_T: jax.Array, vocab: int,
    targets_T: jax.Array | None = None, target_logprobs_T: jax.Array | None = None,
) -> jax.Array:
  """A top-k teacher (an offline cache) as log-probabilities over its whole vocabulary ``[T, vocab]``.

  The ``K`` kept ids get their log-probabilities; with ``targets_T`` / ``target_logprobs_T`` (the log-probability
  of each position's actual next token, which a cross-tokenizer cache stores) the target id gets its own too;
  the tail mass ``exp(tail_T)`` (the rest, `meshdistill.losses.topk_tail`) is spread evenly over the other ids. At
  ``K = vocab`` nothing is spread and the result is the teacher's log-softmax itself, so every cross-tokenizer loss
  reads a cached teacher as the live one; below it the kept ids, the span merge's earlier tokens and the tail's
  total are exact and only how the tail splits among the other ids is assumed. Ids of no mass get a finite floor
  (`DENSE_FLOOR`, probability 0 in float32) so that products with one-hot vectors stay finite.
  """
  T, K = indices_TxK.shape
  rows = jnp.arange(T)[:, None]
  dense = jnp.full((T, vocab), -jnp.inf, jnp.float32).at[rows, indices_TxK].set(logprobs_TxK.astype(jnp.float32))
  known = jnp.zeros((T, vocab), bool).at[rows, indices_TxK].set(True)
  tail = tail_T.astype(jnp.float32)
  if targets_T is not None:
    listed = jnp.any(indices_TxK == targets_T[:, None], axis=-1)
    own = target_logprobs_T.astype(jnp.float32)
    # the target's mass leaves the tail when it was not among the kept ids: log(exp(tail) - exp(own))
    rest = tail + jnp.log1p(-jnp.minimum(jnp.exp(own - jnp.maximum(tail, -1e30)), 1.0))
    tail = jnp.where(listed, tail, rest)
    dense = dense.at[jnp.arange(T), targets_T].set(jnp.where(listed, dense[jnp.arange(T), targets_T], own))
    known = known.at[jnp.arange(T), targets_T].set(True)
  others = vocab - jnp.sum(known, axis=-1)
  spread = tail - jnp.log(jnp.maximum(others, 1).astype(jnp.float32))
  return jnp.maximum(jnp.where(known, dense, spread[:, None]), DENSE_FLOOR)


def target_logprobs(logp_TxV: jax.Array, targets_T: jax.Array) -> jax.Array:
  """``logp[t, targets[t]]`` ``[T]`` with a one-hot product (a sum over V, never a gather of the vocabulary)."""
  onehot = jax.nn.one_hot(targets_T, logp_TxV.shape[-1], dtype=logp_TxV.dtype)
  return jnp.sum(onehot * logp_TxV, axis=-1)


def span_logprobs(
    logits_TxV: jax.Array, targets_T: jax.Array, span_T: jax.Array, last_S: jax.Array, temperature=1.0,
    merge: str = "bayesian",
) -> jax.Array:
  """``[S, V]`` span log-probabilities (see the module docstring) at ``temperature``, merged by ``merge``."""
  if merge not in MERGES:
    raise ValueError(f"merge={merge!r} is not a span merge; choose one of {list(MERGES)}")
  logp_TxV = log_softmax(logits_TxV, temperature)
  T, S = logp_TxV.shape[0], last_S.shape[0]
  if merge == "observed":  # each target read at the next position, as TRL's unshifted slice (the last: unusable)
    logp_TxV = jnp.concatenate([logp_TxV[1:], logp_TxV[-1:]], axis=0)
  actual_T = jnp.maximum(target_logprobs(logp_TxV, targets_T), jnp.log(jnp.asarray(CLAMP, logp_TxV.dtype)))
  counted_T = span_T >= 0
  segment_T = jnp.where(counted_T, span_T, S)
  sums_S = jax.ops.segment_sum(jnp.where(counted_T, actual_T, 0.0), segment_T, S + 1)[:S]
  if merge == "bayesian":
    base_S = last_S  # each earlier token's probability clamped at 1e-8, as TRL
  else:
    base_S = jnp.minimum(jax.ops.segment_min(jnp.arange(T), segment_T, S + 1)[:S], T - 1)  # each span's first
  return logp_TxV[base_S] + (sums_S - actual_T[base_S])[:, None]


def observed_spans(last_S: jax.Array, length: int) -> jax.Array:
  """``[S]`` bool: the spans the ``observed`` merge can read in a row of ``length`` targets (a position after their
  last target exists)."""
  return last_S < length - 1


def span_nll(logits_TxV: jax.Array, targets_T: jax.Array, span_T: jax.Array, span_bytes_S: jax.Array) -> jax.Array:
  """Negative log-likelihood (nats, a scalar) of the targets in counted spans (``span_bytes > 0``) of one sequence:
  over the bytes of those spans, a model's bits per byte on text both tokenizations cover alike."""
  counted_T = (span_T >= 0) & (span_bytes_S[jnp.maximum(span_T, 0)] > 0)
  return -jnp.sum(jnp.where(counted_T, target_logprobs(log_softmax(logits_TxV), targets_T), 0.0))


def _sorted_probs(logp_SxV: jax.Array, k: int) -> jax.Array:
  """The ``k`` largest probabilities per row, decreasing, zero-padded past the vocabulary."""
  V = logp_SxV.shape[-1]
  _, top_SxK = vocab_topk(logp_SxV, min(k, V))
  probs = jnp.exp(top_SxK)
  return jnp.pad(probs, ((0, 0), (0, k - probs.shape[-1])))


def uld(student_SxV: jax.Array, teacher_SxW: jax.Array, span_mask_S: jax.Array, top_k: int | None = None) -> jax.Array:
  """``sum_j |sort(p_s)_j - sort(p_t)_j|`` per span ``[S]`` on span log-probabilities (see the module docstring)."""
  k = max(student_SxV.shape[-1], teacher_SxW.shape[-1]) if top_k is None else top_k
  dist_S = jnp.sum(jnp.abs(_sorted_probs(student_SxV, k) - _sorted_probs(teacher_SxW, k)), axis=-1)
  return jnp.where(span_mask_S > 0, dist_S, 0.0)


def matched_divergence(
    student_SxV: jax.Array, teacher_SxW: jax.Array, student_ids_M, teacher_ids_M, span_mask_S: jax.Array,
    beta: float = 0.0,
) -> jax.Array:
  """GOLD's generalised JSD over the matched ids per span ``[S]`` on ``q = max(p_t[teacher_ids], 1e-8)`` and
  ``p = max(p_s[student_ids], 1e-8)`` (M values per span are picked, not renormalised): ``beta = 0``:
  KL(q || p); ``beta = 1``: KL(p || q); else ``beta KL(q || m) + (1 - beta) KL(p || m)``,
  ``m = beta q + (1 - beta) p``. The ends are the KLs, as TRL switches to them there (the JSD itself goes to 0)."""
  floor = jnp.log(jnp.asarray(CLAMP, student_SxV.dtype))
  log_p = jnp.maximum(student_SxV[:, jnp.asarray(student_ids_M)], floor)
  log_q = jnp.maximum(teacher_SxW[:, jnp.asarray(teacher_ids_M)], floor)
  if beta == 0:
    d_S = kl_logprobs(log_q, log_p)
  elif beta == 1:
    d_S = kl_logprobs(log_p, log_q)
  else:
    d_S = jsd_logprobs(log_p, log_q, beta)
  return jnp.where(span_mask_S > 0, d_S, 0.0)


def matched_kl(
    student_SxV: jax.Array, teacher_SxW: jax.Array, student_ids_M, teacher_ids_M, span_mask_S: jax.Array
) -> jax.Array:
  """KL(teacher || student) over the matched ids per span ``[S]``: ``sum_m q_m (log q_m - log p_m)`` with
  ``q = max(p_t[teacher_ids], 1e-8)``, ``p = max(p_s[student_ids], 1e-8)`` (`matched_divergence` at ``beta=0``)."""
  return matched_divergence(student_SxV, teacher_SxW, student_ids_M, teacher_ids_M, span_mask_S, 0.0)


def unmatched_mask(size: int, ids_M) -> np.ndarray:
  """``[size]`` bool: True at the ids of the matched vocabulary (a constant of the program)."""
  out = np.zeros(size, bool)
  out[np.asarray(ids_M, np.int64)] = True
  return out


def hybrid_uld(
    student_SxV: jax.Array,
    teacher_SxW: jax.Array,
    student_ids_M,
    teacher_ids_M,
    span_mask_S: jax.Array,
    matched_weight: float | None = None,
    top_k: int | None = None,
    beta: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """GOLD's hybrid loss per span: ``(loss [S], matched divergence [S], unmatched ULD [S])`` (see the module
  docstring; the matched term is `matched_divergence` at ``beta``)."""
  M = len(student_ids_M)
  weight = M / teacher_SxW.shape[-1] if matched_weight is None else matched_weight
  kl_S = matched_divergence(student_SxV, teacher_SxW, student_ids_M, teacher_ids_M, span_mask_S, beta)
  drop_s = unmatched_mask(student_SxV.shape[-1], student_ids_M)
  drop_t = unmatched_mask(teacher_SxW.shape[-1], teacher_ids_M)
  rest_s = jnp.where(drop_s, -jnp.inf, student_SxV)
  rest_t = jnp.where(drop_t, -jnp.inf, teacher_SxW)
  if top_k is None:  # exact: each side's unmatched ids, sorted, the shorter padded with zeros
    top_k = max(student_SxV.shape[-1] - M, teacher_SxW.shape[-1] - M)
  uld_S = uld(rest_s, rest_t, span_mask_S, top_k)
  return weight * kl_S + (1.0 - weight) * uld_S, kl_S, uld_S
