"""Preference optimisation with the teacher slot as the frozen reference model: DPO, IPO and DPO + KL.

A preference batch holds PAIRS of rows: row ``2i`` is prompt + chosen completion, row ``2i + 1``
the same prompt + rejected completion (the data package builds it: `meshdistill.data.preference_batch` from
`meshdistill.data.read_preferences` rows, `meshdistill.data.PreferencePairs` for a run); this module is the loss alone.
The mask covers the completion's target tokens only, so prompt tokens never count. For each row
the policy (student) and the reference (teacher, under ``stop_gradient`` in the step) give the
completion log-probability ``log pi(y | x) = sum_t mask_t log p(y_t | y_<t, x)``, and

  margin = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))

* ``loss="sigmoid"`` (DPO): ``-log sigmoid(beta * margin)``;
* ``loss="ipo"`` (IPO): ``(margin - 1 / (2 beta))^2``;
* ``loss="sigmoid_kl"``: DPO plus ``kl_weight`` times the token-summed KL(policy || reference) over
  the completion tokens of both rows, an explicit pull towards the reference.

The per-pair values are summed over the local pairs; `PreferenceLoss.count` tells the step to
divide by the global number of pairs (not tokens), so the loss is the mean over pairs of the
global batch on every layout. Metrics (means over pairs): ``reward_margin`` (``beta * margin``),
``accuracy`` (1 where the margin is > 0), ``logp_chosen`` / ``logp_rejected`` (policy completion
log-probabilities), ``reward_chosen`` / ``reward_rejected``.

This is a per-batch strategy (``needs_head = True``): it pairs rows, so it cannot be vmapped over
single sequences. Rows of one pair must sit on one ``data`` shard: the local batch must be even.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from meshdistill.losses import cross_entropy
from meshdistill.models import softcap
from meshdistill.strategies._base import BatchStrategy, register

LOSSES = ("sigmoid", "ipo", "sigmoid_kl")


def pair_loss(margin_P: jax.Array, beta: float, loss: str = "sigmoid") -> jax.Array:
  """Per-pair preference loss from the log-ratio margins ``[P]`` (see the module docstring)."""
  if loss in ("sigmoid", "sigmoid_kl"):
    return -jax.nn.log_sigmoid(beta * margin_P)
  if loss == "ipo":
    return (margin_P - 1.0 / (2.0 * beta)) ** 2
  raise ValueError(f"preference loss={loss!r}; choose one of {LOSSES}")


@register("preference")
@dataclasses.dataclass(frozen=True)
class PreferenceLoss(BatchStrategy):
  """DPO-family loss on (chosen, rejected) row pairs, the teacher as the reference model.

  Args:
    beta: inverse temperature of the implicit reward (> 0; DPO's usual 0.1).
    loss: one of `LOSSES`.
    kl_weight: weight of the KL(policy || reference) term of ``loss="sigmoid_kl"`` (>= 0).
  """

  beta: float = 0.1
  loss: str = "sigmoid"
  kl_weight: float = 0.1
  needs_pairs: ClassVar[bool] = True  # the jobs read its batches as (chosen, rejected) row pairs

  # The models skip their heads; logits are formed here from the final hidden states and the LM
  # heads (V split over `tensor`), the same product the models' heads compute.
  capture: tuple[str, ...] = dataclasses.field(default=("final",), init=False)

  def __post_init__(self):
    if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not self.beta > 0:
      raise ValueError(f"PreferenceLoss.beta={self.beta!r} must be a number > 0, e.g. 0.1")
    if self.loss not in LOSSES:
      raise ValueError(f"PreferenceLoss.loss={self.loss!r}; choose one of {LOSSES}")
    if isinstance(self.kl_weight, bool) or not isinstance(self.kl_weight, (int, float)) or self.kl_weight < 0:
      raise ValueError(f"PreferenceLoss.kl_weight={self.kl_weight!r} must be a number >= 0")

  def count(self, mask_BxT: jax.Array) -> jax.Array:
    """The local number of pairs: the step's denominator (summed over ``data``)."""
    B = mask_BxT.shape[0]
    if B % 2:
      raise ValueError(
          f"a preference batch pairs rows (chosen, rejected); this device's share of the batch holds {B} rows: use a "
          "batch size that is an even multiple of mesh.data (of mesh.data x mesh.tensor with "
          "mesh.student_split='batch')"
      )
    return jnp.asarray(B // 2, jnp.float32)

  def per_batch(self, params, student, teacher, heads, targets_BxT, mask_BxT, step, softcaps=(None, None)
                ) -> dict[str, jax.Array]:
    del params, step
    self.count(mask_BxT)
    s_logits, t_logits = (softcap(_logits(out, head), cap) if head is not None else _logits(out, head)
                          for out, head, cap in zip((student, teacher), heads or (None, None), softcaps))
    ce = jax.vmap(cross_entropy)
    logp_B = -jnp.sum(ce(s_logits, targets_BxT, mask_BxT), axis=-1)
    ref_B = -jnp.sum(ce(t_logits, targets_BxT, mask_BxT), axis=-1)
    logp_c, logp_r = logp_B[0::2], logp_B[1::2]
    ratio_c, ratio_r = logp_c - ref_B[0::2], logp_r - ref_B[1::2]
    margin_P = ratio_c - ratio_r
    loss_P = pair_loss(margin_P, self.beta, self.loss)
    sums = {
        "preference_loss": jnp.sum(loss_P),
        "reward_margin": jnp.sum(self.beta * margin_P),
        "accuracy": jnp.sum((margin_P > 0).astype(jnp.float32)),
        "logp_chosen": jnp.sum(logp_c),
        "logp_rejected": jnp.sum(logp_r),
        "reward_chosen": jnp.sum(self.beta * ratio_c),
        "reward_rejected": jnp.sum(self.beta * ratio_r),
    }
    total = sums["preference_loss"]
    if self.loss == "sigmoid_kl":
      kl_BxT = jax.vmap(_reverse_kl)(s_logits, t_logits, mask_BxT)
      kl = jnp.sum(kl_BxT) / 2.0  # per pair: both rows' completion tokens
      sums["kl"] = kl
      total = total + self.kl_weight * kl
    sums["loss"] = total
    return sums


def _logits(out, head_DxV):
  """``[B, T, V]`` float32 logits of a model output: its own, or its final hidden states times its LM head."""
  if out.logits is not None:
    return out.logits
  return jnp.einsum("btd,dv->btv", out.final, head_DxV.astype(out.final.dtype)).astype(jnp.float32)


def _reverse_kl(student_TxV, teacher_TxV, mask_T):
  """KL(policy || reference) per token, masked tokens exactly 0 (vocabulary sums only)."""
  lp = jax.nn.log_softmax(student_TxV.astype(jnp.float32), axis=-1)
  lq = jax.nn.log_softmax(teacher_TxV.astype(jnp.float32), axis=-1)
  return jnp.where(mask_T > 0, jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1), 0.0)
