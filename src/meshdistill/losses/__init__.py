"""Per-sequence losses on logits: divergences, cross-entropy and logit metrics.

All functions take ONE sequence (``[T, V]`` logits, ``[T]`` mask) and return per-token
values ``[T]`` with masked tokens exactly 0; `jax.vmap` lifts them over a batch.
"""

from meshdistill.losses._logits import cross_entropy, forward_kl, log_softmax, pearson, top1_agreement

__all__ = ["cross_entropy", "forward_kl", "log_softmax", "pearson", "top1_agreement"]
