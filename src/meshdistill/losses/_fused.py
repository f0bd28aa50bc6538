"""The default distillation recipe's per-token loss and metrics in one pass over the vocabulary.

``loss = alpha * tau^2 * KL(p_t,tau || p_s,tau) + (1 - alpha) * CE(student, targets)`` with the metrics
``kl``, ``ce``, ``teacher_ce`` (`cross_entropy`), ``corr`` (`pearson`) and ``agree`` (`top1_agreement`),
the same values as those functions give one by one.

Why: with the vocabulary split over the mesh axis ``tensor``, every reduction over V is an all-reduce
(over ``tensor``), and inside the chunked loss (`chunked_token_sums`) each one runs once per chunk. Written
term by term, the recipe reduces over V for each log-softmax (student and teacher, at tau and at 1: a max
and a sum each), for the KL, the target picks, the correlation's means and sums and the agreement's maxima,
and again in the backward pass of every log-softmax: even after XLA's all-reduce combiner has merged the
independent ones, the compiled 2x4 chunked step keeps 7 all-reduces per chunk for the loss (plus the one
of the hidden-state gradient). Per token, everything follows from the maxima ``m_s = max s`` and
``m_t = max t`` (``max(s / tau) = m_s / tau`` exactly for tau > 0) and sums of elementwise terms, so here
(where V may be split over ``tensor``; see below for elsewhere):

* ONE max-reduction over V, of the stacked ``[s, t]``;
* ONE sum-reduction of the stacked terms the loss needs (``Z_s`` and ``Z_t`` at tau, the KL numerator
  ``sum_v e_t (b - a)`` with ``a, b`` the shifted logits at tau and ``e_t = exp(b)``, ``Z_s`` at 1, the
  student's shifted target logit), and beside it one of the terms only the metrics need (``Z_t`` at 1,
  the teacher's target logit, the logit sums for the correlation's means, the count of tokens that are
  the arg-max of both). The two are independent, so the combiner sends them as ONE all-reduce, and the
  metrics-light step, which drops the metrics, drops the second stack's work entirely;
* the correlation's three sums around the means (``pearson``'s two passes: raw moments would cancel for
  logits far from 0), a third sum-reduction that only the metrics need; it is independent of the
  hidden-state gradient's all-reduce, and the combiner sends the two together;
* a `jax.custom_vjp` whose backward pass is the analytic gradient with respect to the student logits,
  ``(g_loss alpha tau^2 + g_kl) / tau (p_s,tau - p_t,tau) + (g_loss (1 - alpha) + g_ce) (p_s - onehot)``,
  from the logits and the per-token maxima and normalisers saved by the forward pass: no reduction over V.

So a chunk of the 2x4 chunked step has 3 all-reduces (max; sums; correlation + hidden-state gradient)
instead of 8. The forward pass makes 4 exponentials per logit pair instead of 5; the backward pass
recomputes 3 from the logits rather than keeping ``[T, V]`` softmaxes as residuals.

Stacked reductions only where they save collectives: when the program being traced has ``tensor`` as a
compiler-managed (auto) mesh axis of more than one device, so that V may be split over it. There, separate
reductions leave the grouping to the combiner, which (measured) grouped the loss's sums with the
correlation's and kept 4 all-reduces per chunk. Everywhere else (one device; the student over the batch,
where ``tensor`` is manual and every device holds all of V) the reductions stay separate: each reads its
elementwise input as XLA fuses it in, while XLA:CPU writes a stack out before reducing it, for full
``[B, T, V]`` logits several times their size (on one device the separate reductions were the cheapest of the
three forms: stacked, separate, term by term). There the correlation's means come from plain sums of the
logits, which depend on nothing else, so XLA reduces them in the pass that forms the logits and their maxima; sums
after the shift by the maximum waited for it, a pass of their own over both chunks' logits (what that pass cost on a
TPU: `benchmarks/results/tpu_step.md`, "Changes to the code").

What the unfused functions guarantee holds: float32 (float64 for float64 logits; bfloat16 is widened),
masked tokens exactly 0 (values and gradients), only max and sum reductions over V (a vocabulary split over
``tensor``, also unevenly, is never gathered), teacher terms with ``e_t == 0`` (``-inf`` logits) count 0.

Gradients flow only to the student logits and only from ``loss``, ``kl`` and ``ce``; ``teacher_ce`` and
``agree`` have none to give, and ``corr`` (a monitoring metric) is treated as a constant, as are the
teacher, the temperature and alpha.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshdistill.losses._logits import as_float
from meshdistill.parallel.mesh import auto_tensor_size


def _reduce(op, arrays, stacked: bool):
  """``op(x, axis=-1)`` of each of ``arrays`` (one shape): as ONE reduction of their stack (one all-reduce where V
  is split over ``tensor``) if ``stacked``, else one by one (no stack written; see the module docstring)."""
  if stacked:
    return tuple(op(jnp.stack(arrays), axis=-1))
  return tuple(op(x, axis=-1) for x in arrays)


def _dtype(student_TxV, teacher_TxV):
  return jnp.promote_types(as_float(student_TxV).dtype, as_float(teacher_TxV).dtype)


def _shifted(s, t, tau, m_s, m_t):
  """``(s / tau - m_s / tau, t / tau - m_t / tau)``: what `jax.nn.log_softmax` subtracts its log-normaliser from
  (``max(s / tau) == m_s / tau`` exactly, division by tau > 0 being monotone)."""
  return s / tau - (m_s / tau)[..., None], t / tau - (m_t / tau)[..., None]


def _is_target(targets_T, vocab: int):
  """``[..., V]`` bool, True at each token's target id (all False for an id outside V, like `jax.nn.one_hot`)."""
  return jax.nn.one_hot(targets_T, vocab, dtype=jnp.bool_)


def _forward(s, t, targets_T, keep_T, tau, alpha):
  """The per-token values (unmasked) and the residuals of the backward pass."""
  vocab = s.shape[-1]
  stacked = auto_tensor_size() > 1  # V may be split over `tensor`: every reduction over V is an all-reduce
  m_s, m_t = _reduce(jnp.max, [s, t], stacked)  # the one max-reduction over V
  a_tau, b_tau = _shifted(s, t, tau, m_s, m_t)
  a_1, b_1 = s - m_s[..., None], t - m_t[..., None]
  e_t_tau = jnp.exp(b_tau)
  is_target = _is_target(targets_T, vocab)
  zero = jnp.zeros((), s.dtype)
  # terms with e_t == 0 (teacher logit -inf, or underflow) count 0, as in `kl_logprobs`
  kl_terms = jnp.where(e_t_tau > 0, e_t_tau * (b_tau - a_tau), zero)
  z_s_tau, z_t_tau, kl_num, z_s_1, s_target = _reduce(
      jnp.sum, [jnp.exp(a_tau), e_t_tau, kl_terms, jnp.exp(a_1), jnp.where(is_target, a_1, zero)], stacked
  )
  # metrics only: a stack of its own (independent of the loss's, so one combined all-reduce; dead when unused)
  both_top = jnp.logical_and(s >= m_s[..., None], t >= m_t[..., None]).astype(s.dtype)
  if stacked:
    z_t_1, t_target, sum_a, sum_b, n_top = _reduce(
        jnp.sum, [jnp.exp(b_1), jnp.where(is_target, b_1, zero), a_1, b_1, both_top], stacked
    )
    mean_s, mean_t = m_s + sum_a / vocab, m_t + sum_b / vocab
  else:
    # the logit sums depend on nothing else: XLA reduces them in the pass that forms the logits and their maxima
    # (summed after the shift by the maximum, they would need a pass over both chunks of their own)
    z_t_1, t_target, n_top = _reduce(jnp.sum, [jnp.exp(b_1), jnp.where(is_target, b_1, zero), both_top], stacked)
    mean_s, mean_t = jnp.sum(s, axis=-1) / vocab, jnp.sum(t, axis=-1) / vocab
  # the correlation's sums around the means, as `pearson` forms them (raw moments would cancel): a third
  # reduction, independent of the backward pass's (which the combiner then sends with it)
  a_c, b_c = s - mean_s[..., None], t - mean_t[..., None]
  cov, var_a, var_b = _reduce(jnp.sum, [a_c * b_c, a_c * a_c, b_c * b_c], stacked)
  log_z_s_tau, log_z_t_tau, log_z_s_1 = jnp.log(z_s_tau), jnp.log(z_t_tau), jnp.log(z_s_1)
  in_vocab = jnp.logical_and(targets_T >= 0, targets_T < vocab)  # `one_hot` of an id outside V is all zeros
  kl = kl_num / z_t_tau + (log_z_s_tau - log_z_t_tau)
  ce = jnp.where(in_vocab, log_z_s_1 - s_target, zero)
  teacher_ce = jnp.where(in_vocab, jnp.log(z_t_1) - t_target, zero)
  corr = cov / jnp.maximum(jnp.sqrt(var_a * var_b), 1e-12)
  out = {
      "kl": kl,
      "ce": ce,
      "teacher_ce": teacher_ce,
      "corr": corr,
      "agree": (n_top > 0).astype(s.dtype),
      "loss": alpha * tau**2 * kl + (1.0 - alpha) * ce,
  }
  out = {k: jnp.where(keep_T, v, zero) for k, v in out.items()}
  return out, (s, t, targets_T, keep_T, tau, alpha, m_s, m_t, 1.0 / z_s_tau, 1.0 / z_t_tau, 1.0 / z_s_1)


@jax.custom_vjp
def _terms(s, t, targets_T, keep_T, tau, alpha):
  return _forward(s, t, targets_T, keep_T, tau, alpha)[0]


def _terms_bwd(res, g):
  s, t, targets_T, keep_T, tau, alpha, m_s, m_t, inv_z_s_tau, inv_z_t_tau, inv_z_s_1 = res
  zero = jnp.zeros((), s.dtype)
  # per-token weights of the two softmax differences (masked tokens: exactly 0, whatever their logits)
  w_tau = jnp.where(keep_T, (g["loss"] * alpha * tau**2 + g["kl"]) / tau, zero)[..., None]
  w_1 = jnp.where(keep_T, g["loss"] * (1.0 - alpha) + g["ce"], zero)[..., None]
  a_tau, b_tau = _shifted(s, t, tau, m_s, m_t)
  # exp(x - m) / Z (as a softmax forms it): more accurate than exp(x - m - log Z)
  p_s_tau = jnp.exp(a_tau) * inv_z_s_tau[..., None]
  p_t_tau = jnp.exp(b_tau) * inv_z_t_tau[..., None]
  p_s_1 = jnp.exp(s - m_s[..., None]) * inv_z_s_1[..., None]
  is_target = _is_target(targets_T, s.shape[-1])
  d_s = w_tau * (p_s_tau - p_t_tau) + w_1 * (p_s_1 - is_target.astype(s.dtype))
  d_s = jnp.where(keep_T[..., None], d_s, zero)
  zeros = lambda x: jnp.zeros(x.shape, x.dtype)  # noqa: E731
  d_targets = jnp.zeros(targets_T.shape, jax.dtypes.float0)
  return d_s, zeros(t), d_targets, jnp.zeros(keep_T.shape, jax.dtypes.float0), zeros(tau), zeros(alpha)


_terms.defvjp(_forward, _terms_bwd)  # the forward pass returns its residuals too


def forward_kl_terms(
    student_TxV: jax.Array,
    teacher_TxV: jax.Array,
    targets_T: jax.Array,
    mask_T: jax.Array | None,
    temperature: float | jax.Array,
    alpha: float | jax.Array,
) -> dict[str, jax.Array]:
  """Per-token ``kl``, ``ce``, ``teacher_ce``, ``corr``, ``agree`` and ``loss`` of the forward-KL recipe, fused.

  The same values as ``forward_kl(s, t, mask, tau)``, ``cross_entropy(s, targets, mask)``,
  ``cross_entropy(t, targets, mask)``, ``pearson(s, t, mask)``, ``top1_agreement(s, t, mask)`` and
  ``alpha * tau^2 * kl + (1 - alpha) * ce`` (up to float rounding), from one max over V, one sum for the loss
  and two for the metrics only (stacked where V may be split over ``tensor``), and no reduction over V in the
  backward pass (see the module docstring). Gradients: to the student logits, from ``loss``, ``kl`` and ``ce``
  only.

  Args:
    student_TxV, teacher_TxV: logits ``[..., V]`` (V may be split over ``tensor``).
    targets_T: int target ids ``[...]``; mask_T: ``[...]``, tokens with 0 give exactly 0 (None: all count).
    temperature: tau > 0; alpha: the KL's weight (numbers or traced scalars; no gradient flows to them).

  Returns:
    ``{name: [...]}`` in float32 (float64 for float64 logits).
  """
  dtype = _dtype(student_TxV, teacher_TxV)
  s = student_TxV.astype(dtype)  # the cast's transpose hands the gradient back in the student's dtype
  t = jax.lax.stop_gradient(teacher_TxV).astype(dtype)
  keep_T = jnp.ones(targets_T.shape, bool) if mask_T is None else jnp.asarray(mask_T).astype(bool)
  tau = jax.lax.stop_gradient(jnp.asarray(temperature, dtype))
  alpha = jax.lax.stop_gradient(jnp.asarray(alpha, dtype))
  return _terms(s, t, targets_T, keep_T, tau, alpha)


__all__ = ["forward_kl_terms"]
