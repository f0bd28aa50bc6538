"""Divergences between a student's and a teacher's next-token distributions, per token.

Each divergence exists at two levels:

* **distribution level** -- ``fn(logp_s_TxN, logp_t_TxN, **hyper) -> [T]`` on normalised
  log-probabilities over N bins (the vocabulary, or the k+1 bins of a top-k teacher, see
  `meshdistill.losses.topk_divergence`). Listed in `DISTRIBUTION_DIVERGENCES`.
* **logit level** -- ``fn(student_TxV, teacher_TxV, mask_T=None, temperature=1.0, **hyper) -> [T]``
  on the logits of ONE sequence: both sides are divided by ``temperature`` and
  log-softmaxed, the distribution-level divergence is applied, and masked tokens
  (``mask_T == 0``) are exactly 0 (with zero gradient). Listed in `DIVERGENCES`.

``p_s`` / ``p_t`` are the student / teacher distributions at the temperature. Everything
runs in float32 (float64 for float64 inputs), bfloat16 logits are widened first; mixtures
are formed in log space (``logaddexp``), so logits of +-1e4 stay finite.

The vocabulary axis V may be split over the mesh axis ``tensor``: every function reduces
over V with sums and maxima only (no arg-max, sort or gather over V).

A term ``p * (log p - log q)`` with ``p == 0`` counts as 0 (also for ``log p = -inf``,
e.g. a vocabulary padded with ``-inf`` logits). Rounding can leave a divergence of two
nearly equal distributions a few ulps below 0.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from meshdistill.losses._logits import _masked, as_float, log_softmax

Scalar = float | jax.Array


# ------------------------------------------------------------------ distribution level
def kl_logprobs(logp_TxN: jax.Array, logq_TxN: jax.Array) -> jax.Array:
  """``KL(p || q) = sum_n p(n) (log p(n) - log q(n))`` per row, from log-probabilities.

  Bins with ``p(n) == 0`` contribute 0 (their log-difference is replaced before the
  product, so neither the value nor the gradient turns into NaN).
  """
  p = jnp.exp(logp_TxN)
  diff = jnp.where(p > 0, logp_TxN - logq_TxN, jnp.zeros_like(logp_TxN))
  return jnp.sum(p * diff, axis=-1)


def _log_mix(w: Scalar, logp_TxN: jax.Array, logq_TxN: jax.Array) -> jax.Array:
  """``log(w p + (1 - w) q)`` in log space, for ``0 <= w <= 1``."""
  w = jnp.asarray(w, logp_TxN.dtype)
  return jnp.logaddexp(jnp.log(w) + logp_TxN, jnp.log1p(-w) + logq_TxN)


def forward_kl_logprobs(logp_s_TxN, logp_t_TxN):
  """``KL(p_t || p_s)``: mass-covering; the classic distillation loss."""
  return kl_logprobs(logp_t_TxN, logp_s_TxN)


def reverse_kl_logprobs(logp_s_TxN, logp_t_TxN):
  """``KL(p_s || p_t)``: mode-seeking (MiniLLM)."""
  return kl_logprobs(logp_s_TxN, logp_t_TxN)


def jsd_logprobs(logp_s_TxN, logp_t_TxN, beta: Scalar = 0.5):
  """Generalised Jensen-Shannon divergence, TRL GKD's convention.

  ``JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)``, ``m = beta p_t + (1 - beta) p_s``.
  """
  log_m = _log_mix(beta, logp_t_TxN, logp_s_TxN)
  beta = jnp.asarray(beta, logp_s_TxN.dtype)
  return beta * kl_logprobs(logp_t_TxN, log_m) + (1.0 - beta) * kl_logprobs(logp_s_TxN, log_m)


def skew_kl_logprobs(logp_s_TxN, logp_t_TxN, skew: Scalar = 0.1):
  """Skew KL (DistiLLM): ``KL(p_t || skew p_t + (1 - skew) p_s)``."""
  return kl_logprobs(logp_t_TxN, _log_mix(skew, logp_t_TxN, logp_s_TxN))


def skew_reverse_kl_logprobs(logp_s_TxN, logp_t_TxN, skew: Scalar = 0.1):
  """Skew reverse KL (DistiLLM): ``KL(p_s || skew p_s + (1 - skew) p_t)``."""
  return kl_logprobs(logp_s_TxN, _log_mix(skew, logp_s_TxN, logp_t_TxN))


def tvd_logprobs(logp_s_TxN, logp_t_TxN):
  """Total variation distance ``0.5 sum_n |p_s(n) - p_t(n)|`` (in [0, 1])."""
  return 0.5 * jnp.sum(jnp.abs(jnp.exp(logp_s_TxN) - jnp.exp(logp_t_TxN)), axis=-1)


# ------------------------------------------------------------------------- logit level
def _on_logits(fn, student_TxV, teacher_TxV, mask_T, temperature, **hyper) -> jax.Array:
  per_token_T = fn(log_softmax(student_TxV, temperature), log_softmax(teacher_TxV, temperature), **hyper)
  return _masked(per_token_T, mask_T)


def forward_kl(student_TxV, teacher_TxV, mask_T=None, temperature: Scalar = 1.0) -> jax.Array:
  """``KL(p_t || p_s) = sum_v p_t(v) (log p_t(v) - log p_s(v))`` per token, both at ``temperature``."""
  return _on_logits(forward_kl_logprobs, student_TxV, teacher_TxV, mask_T, temperature)


def reverse_kl(student_TxV, teacher_TxV, mask_T=None, temperature: Scalar = 1.0) -> jax.Array:
  """``KL(p_s || p_t) = sum_v p_s(v) (log p_s(v) - log p_t(v))`` per token (MiniLLM's objective)."""
  return _on_logits(reverse_kl_logprobs, student_TxV, teacher_TxV, mask_T, temperature)


def jsd(student_TxV, teacher_TxV, mask_T=None, temperature: Scalar = 1.0, beta: Scalar = 0.5) -> jax.Array:
  """Generalised Jensen-Shannon divergence per token, with TRL GKD's ``beta`` convention.

  ``JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with the mixture
  ``m = beta p_t + (1 - beta) p_s`` (formed in log space with ``logaddexp``).
  ``beta = 0.5`` is the ordinary Jensen-Shannon divergence; ``JSD_beta(s, t) = JSD_{1-beta}(t, s)``.

  The ends: ``JSD_beta`` is continuous in ``beta`` and exactly 0 at ``beta = 0`` and
  ``beta = 1`` (the mixture collapses onto one side). What tends to the KLs is the
  scaled value: ``JSD_beta / beta -> KL(p_t || p_s)`` (forward KL) as ``beta -> 0`` and
  ``JSD_beta / (1 - beta) -> KL(p_s || p_t)`` (reverse KL) as ``beta -> 1``, each with an
  error of order ``beta`` (resp. ``1 - beta``). TRL switches to the two KLs at exactly
  ``beta = 0 / 1``; here use ``forward_kl`` / ``reverse_kl`` for that
  (`meshdistill.strategies.LogitKD` rejects ``divergence="jsd"`` with a constant beta of 0 or 1).
  """
  return _on_logits(jsd_logprobs, student_TxV, teacher_TxV, mask_T, temperature, beta=beta)


def skew_kl(student_TxV, teacher_TxV, mask_T=None, temperature: Scalar = 1.0, skew: Scalar = 0.1) -> jax.Array:
  """Skew KL per token (DistiLLM): ``KL(p_t || skew p_t + (1 - skew) p_s)``, ``skew`` in [0, 1).

  ``skew = 0`` is the forward KL; a larger ``skew`` bounds the loss where the student
  puts little mass on the teacher's tokens (``<= -log skew``).
  """
  return _on_logits(skew_kl_logprobs, student_TxV, teacher_TxV, mask_T, temperature, skew=skew)


def skew_reverse_kl(
    student_TxV, teacher_TxV, mask_T=None, temperature: Scalar = 1.0, skew: Scalar = 0.1
) -> jax.Array:
  """Skew reverse KL per token (DistiLLM): ``KL(p_s || skew p_s + (1 - skew) p_t)``, ``skew`` in [0, 1).

  ``skew = 0`` is the reverse KL.
  """
  return _on_logits(skew_reverse_kl_logprobs, student_TxV, teacher_TxV, mask_T, temperature, skew=skew)


def tvd(student_TxV, teacher_TxV, mask_T=None, temperature: Scalar = 1.0) -> jax.Array:
  """Total variation distance per token: ``0.5 sum_v |p_s(v) - p_t(v)|``, in [0, 1]."""
  return _on_logits(tvd_logprobs, student_TxV, teacher_TxV, mask_T, temperature)


def logit_mse(student_TxV, teacher_TxV, mask_T=None, temperature: Scalar = 1.0) -> jax.Array:
  """Mean squared error of centred logits per token: ``mean_v (c(z_s)(v) - c(z_t)(v))^2``.

  ``z = logits / temperature`` and ``c(z) = z - mean_v z``. Softmax ignores a constant
  added to all of a token's logits, so the teacher's offset carries no information;
  centring removes it (raw-logit MSE would make the student copy it). The mean runs over
  V, so the scale does not grow with the vocabulary. Not a divergence of distributions:
  it has no top-k form.
  """
  s = as_float(student_TxV)
  t = as_float(teacher_TxV)
  tau = jnp.asarray(temperature, s.dtype)
  s = s / tau
  t = t / tau
  d = (s - jnp.mean(s, axis=-1, keepdims=True)) - (t - jnp.mean(t, axis=-1, keepdims=True))
  return _masked(jnp.mean(d * d, axis=-1), mask_T)


# ---------------------------------------------------------------------------- registry
DIVERGENCES: dict[str, Callable[..., jax.Array]] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "jsd": jsd,
    "skew_kl": skew_kl,
    "skew_reverse_kl": skew_reverse_kl,
    "tvd": tvd,
    "mse": logit_mse,
}
"""Logit-level divergences by name: ``fn(student_TxV, teacher_TxV, mask_T=None, temperature=1.0, **hyper)``."""

DISTRIBUTION_DIVERGENCES: dict[str, Callable[..., jax.Array]] = {
    "forward_kl": forward_kl_logprobs,
    "reverse_kl": reverse_kl_logprobs,
    "jsd": jsd_logprobs,
    "skew_kl": skew_kl_logprobs,
    "skew_reverse_kl": skew_reverse_kl_logprobs,
    "tvd": tvd_logprobs,
}
"""Distribution-level divergences by name: ``fn(logp_s_TxN, logp_t_TxN, **hyper)`` (all but ``mse``)."""

HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    name: {"jsd": ("beta",), "skew_kl": ("skew",), "skew_reverse_kl": ("skew",)}.get(name, ())
    for name in DIVERGENCES
}
"""The keyword hyper-parameters each divergence takes (``beta`` for jsd, ``skew`` for the skew KLs); a divergence
with none needs no entry."""


def _check_name(name: str, table: dict, what: str) -> None:
  if name not in table:
    raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}")


def get_divergence(name: str) -> Callable[..., jax.Array]:
  """The logit-level divergence called ``name`` (see `DIVERGENCES`).

  Raises:
    ValueError: unknown name; the message lists the registered names.
  """
  _check_name(name, DIVERGENCES, "divergence")
  return DIVERGENCES[name]


def get_distribution_divergence(name: str) -> Callable[..., jax.Array]:
  """The distribution-level divergence called ``name`` (see `DISTRIBUTION_DIVERGENCES`)."""
  _check_name(name, DISTRIBUTION_DIVERGENCES, "distribution divergence (usable with top-k)")
  return DISTRIBUTION_DIVERGENCES[name]
