"""Sampled-token on-policy distillation: the teacher's log-probability of the student's own tokens as a reward.

On a completion ``y`` the student sampled (`meshdistill.train.onpolicy.OnPolicyDistiller` with ``lambda=1``),
each token gets the reward ``r_t = log p_teacher(y_t) - log p_student(y_t)`` (both at temperature 1, under
`jax.lax.stop_gradient`: a number, not a path for gradients) and the advantage

  ``A_t = sum_{s >= t} discount^(s - t) r_s``    (over the completion's tokens; ``discount=0``: ``A_t = r_t``)

of a REINFORCE update: ``loss = -sum_t mask_t A_t log p_student(y_t)``, divided like every loss by the global
count of unmasked tokens. Its expected gradient is the gradient of the reverse KL of the student's sequence
distribution from the teacher's (per token with ``discount=0``, the form Thinking Machines and tinker-cookbook
use; MiniLLM's policy gradient with ``discount=1``).

The teacher enters through ONE number per token, its log-probability of the sampled token, so any teacher
that can give it works: a live teacher (its logits, vocabulary-parallel: a one-hot sum over V), a teacher on
its own devices or an offline cache (`meshdistill.losses.TopK`). A token outside a top-k teacher's ``k``
gets the tail bin's log-mass spread evenly over the ``V - k`` tokens it holds: ``tail - log(V - k)`` (exact
when the teacher's tail is flat, never more than the tail's whole mass). Every teacher log-probability is
clipped below at ``floor`` (default -20), so a token the teacher gives (numerically) no mass has a bounded
advantage instead of ``-inf``.

As its authors do it (tinker-cookbook's ``distillation/train_on_policy.py``: advantage ``-kl_penalty_coef (log p_s -
log p_t)`` per sampled token, ``kl_penalty_coef=1``, ``kl_discount_factor=0``): discount 0 by default, no baseline;
a live teacher's log-probability of the sampled token is exact (its whole vocabulary, vocabulary-parallel); the
samples come from the parameters of the step that trains on them (`meshdistill.train.onpolicy.OnPolicyDistiller`
samples just before the step, so the importance ratio ``p_theta / p_sampler`` of their loss is 1 and is left out);
there is no KL penalty towards a separate reference model (off: the teacher term is the only one). One difference:
the loss is divided by the global count of sampled tokens (every strategy's token mean), where tinker sums over
tokens; per batch that is a constant factor, taken up by the learning rate. `tests/test_onpolicy_identities.py`
pins these: a teacher equal to the student gives zero advantages, a hand-built teacher shows where each reward
lands, prompt and padding positions never count.

Metrics (token means): ``loss`` (the surrogate; its value is not a divergence), ``reverse_kl`` (the sample
estimate ``log p_student - log p_teacher`` on the sampled tokens), ``teacher_ce`` / ``ce`` (the teacher's /
student's NLL of them), ``advantage``, ``in_topk`` (a top-k teacher: the share of sampled tokens in its ``k``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from meshdistill import losses
from meshdistill.strategies._base import SequenceStrategy, register


def discounted_returns(rewards_T: jax.Array, mask_T: jax.Array, discount: float) -> jax.Array:
  """``A_t = sum_{s >= t} discount^(s - t) r_s`` over unmasked tokens ``[T]`` (masked: 0, and skipped)."""
  rewards_T = jnp.where(mask_T, rewards_T, 0.0)
  if discount == 0:
    return rewards_T

  def back(carry, x):
    r, m = x
    out = jnp.where(m, r + discount * carry, carry)
    return out, jnp.where(m, out, 0.0)

  _, returns_T = jax.lax.scan(back, jnp.zeros((), rewards_T.dtype), (rewards_T, mask_T), reverse=True)
  return returns_T


def sampled_token_logprob(teacher, targets_T: jax.Array, vocab: int, floor: float) -> tuple[jax.Array, jax.Array]:
  """The teacher's log-probability of each target ``[T]`` and whether the teacher knew it exactly (``[T]`` bool:
  always for a live teacher; for a `meshdistill.losses.TopK` teacher, whether it is among the ``k``)."""
  if isinstance(teacher, losses.TopK):
    hit_TxK = teacher.indices == targets_T[:, None]
    known_T = jnp.any(hit_TxK, axis=-1)
    k = teacher.indices.shape[-1]
    spread_T = teacher.tail.astype(jnp.float32) - jnp.log(float(max(vocab - k, 1)))
    picked_T = jnp.sum(jnp.where(hit_TxK, teacher.logprobs.astype(jnp.float32), 0.0), axis=-1)
    logp_T = jnp.where(known_T, picked_T, spread_T)
  else:
    logp_T = -losses.cross_entropy(teacher.logits, targets_T)
    known_T = jnp.ones(targets_T.shape, bool)
  return jnp.maximum(jax.lax.stop_gradient(logp_T), floor), known_T


@register("sampled_token")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SampledTokenKD(SequenceStrategy):
  """REINFORCE on the student's own tokens with advantage ``log p_teacher - log p_student`` (module docstring).

  Args:
    discount: in [0, 1]; 0 (default) scores each token by its own reward, 1 by the sum of the rewards from it on.
    floor: lower clip of the teacher's log-probability of a token (default -20).
  """

  accepts_topk: ClassVar[bool] = True  # the sampled token's log-probability: from the top-k, else the tail bin
  discount: float = 0.0
  floor: float = -20.0

  def __post_init__(self):
    if isinstance(self.discount, bool) or not isinstance(self.discount, (int, float)) or not 0 <= self.discount <= 1:
      raise ValueError(f"SampledTokenKD.discount={self.discount!r} must be a number in [0, 1] (0: each token's own "
                       "reward, e.g. 0.9 to add later tokens' rewards)")
    if isinstance(self.floor, bool) or not isinstance(self.floor, (int, float)) or not self.floor < 0:
      raise ValueError(f"SampledTokenKD.floor={self.floor!r} must be a negative number (a log-probability), e.g. -20")

  def check_topk_teacher(self, teacher) -> None:
    """A top-k teacher (`meshdistill.teachers.cache.TopKTeacher`) serves when its log-probabilities are at
    temperature 1 (the teacher's own distribution, whose log-probability the reward is)."""
    if float(teacher.temperature) != 1.0:
      raise ValueError(f"{teacher.source} holds log-probabilities at temperature {teacher.temperature}, but "
                       "distill.kind=sampled_token rewards the teacher's own log-probability (temperature 1); write "
                       "the cache with teacher.cache_temperature=1")

  def per_sequence(self, params, student, teacher, targets_T, mask_T, step):
    del params, step
    keep_T = mask_T.astype(bool)
    mask_f = keep_T.astype(jnp.float32)
    logp_s_T = -losses.cross_entropy(student.logits, targets_T)
    logp_t_T, known_T = sampled_token_logprob(teacher, targets_T, student.logits.shape[-1], self.floor)
    rewards_T = logp_t_T - jax.lax.stop_gradient(logp_s_T)
    advantage_T = discounted_returns(rewards_T, keep_T, float(self.discount))
    return {
        "loss": -jnp.sum(mask_f * advantage_T * logp_s_T),
        "reverse_kl": -jnp.sum(mask_f * rewards_T),
        "teacher_ce": -jnp.sum(mask_f * logp_t_T),
        "ce": -jnp.sum(mask_f * jax.lax.stop_gradient(logp_s_T)),
        "advantage": jnp.sum(mask_f * advantage_T),
        "in_topk": jnp.sum(mask_f * known_T),
    }
