"""Per-sequence losses on logits: divergences, cross-entropy and logit metrics.

All functions take ONE sequence (``[T, V]`` logits, ``[T]`` mask) and return per-token
values ``[T]`` with masked tokens exactly 0; `jax.vmap` lifts them over a batch.

Divergences (`DIVERGENCES`, `get_divergence`): ``forward_kl``, ``reverse_kl``, ``jsd``
(generalised, ``beta``), ``skew_kl`` / ``skew_reverse_kl`` (``skew``), ``tvd``, ``mse``
(centred logits). `forward_kl_terms`: the default recipe's loss and metrics fused (one pass over V);
`kl_value_and_grad`: the same values and their loss's logits gradient in one Pallas kernel (`LOSS_KERNELS`,
`kl_kernel_applies`: `ChunkedLogitKD.loss_kernel`, the default on a TPU; `LOSS_NAMES`: its metrics-light form's). Top-k teachers: `teacher_topk`, `topk_tail`, `topk_divergence`;
`TopK` (a teacher given by its
top-k, e.g. an offline cache) and `narrow_topk`. A teacher of another tokenizer (`Aligned`): `span_logprobs` (merged
``bayesian`` or ``observed``, `observed_spans`), `uld`, `matched_divergence` (GOLD's ``beta``), `matched_kl`,
`hybrid_uld` on the spans both tokenizations agree on (per span ``[S]`` instead of per token); on the next byte of
the text (`ByteTables`, `byte_tables`, `byte_offsets`, `next_byte_logprobs`, `first_byte_logprobs`, `byte_kl`: both
sides' next-token distributions projected onto bytes); `topk_logprobs` (a cached top-k teacher of another tokenizer
as log-probabilities over its vocabulary, for all of these).
Several top-k teachers as one target: `route_topk` (a teacher per row), `mix_topk` (a weighted mixture over the union
of their ids, with the tail bin); `teacher_terms` (one teacher's KL and agreement, per token).
"""

from meshdistill.losses._chunked import (
    TokenFn,
    chunked_token_sums,
    cross_entropy_token_fn,
    divergence_token_fn,
    head_logits,
)
from meshdistill.losses._cross_tokenizer import (
    MERGES,
    Aligned,
    hybrid_uld,
    matched_divergence,
    matched_kl,
    observed_spans,
    span_logprobs,
    span_nll,
    target_logprobs,
    topk_logprobs,
    uld,
)
from meshdistill.losses._divergences import (
    DISTRIBUTION_DIVERGENCES,
    DIVERGENCES,
    HYPERPARAMETERS,
    forward_kl,
    get_distribution_divergence,
    get_divergence,
    jsd,
    kl_logprobs,
    logit_mse,
    reverse_kl,
    skew_kl,
    skew_reverse_kl,
    tvd,
)
from meshdistill.losses._fused import forward_kl_terms
from meshdistill.losses._kl_kernel import (LOSS_KERNELS, LOSS_NAMES, kl_kernel_applies, kl_kernel_usable,
                                          kl_token_value_and_grad, kl_value_and_grad)
from meshdistill.losses._next_byte import (
    ByteTables,
    byte_kl,
    byte_offsets,
    byte_tables,
    first_byte_logprobs,
    next_byte_logprobs,
)
from meshdistill.losses._logits import cross_entropy, log_softmax, pearson, top1_agreement
from meshdistill.losses._multi_teacher import mix_topk, route_topk, teacher_terms
from meshdistill.losses._topk import (
    TopK,
    narrow_topk,
    teacher_topk,
    topk_bins,
    topk_divergence,
    topk_tail,
    vocab_topk,
)

__all__ = [
    "mix_topk",
    "route_topk",
    "teacher_terms",
    "Aligned",
    "MERGES",
    "topk_logprobs",
    "ByteTables",
    "byte_kl",
    "byte_offsets",
    "byte_tables",
    "first_byte_logprobs",
    "next_byte_logprobs",
    "hybrid_uld",
    "matched_divergence",
    "matched_kl",
    "observed_spans",
    "span_logprobs",
    "span_nll",
    "target_logprobs",
    "uld",
    "vocab_topk",
    "DISTRIBUTION_DIVERGENCES",
    "DIVERGENCES",
    "HYPERPARAMETERS",
    "TokenFn",
    "chunked_token_sums",
    "cross_entropy_token_fn",
    "divergence_token_fn",
    "head_logits",
    "cross_entropy",
    "forward_kl",
    "forward_kl_terms",
    "LOSS_KERNELS",
    "LOSS_NAMES",
    "kl_kernel_applies",
    "kl_kernel_usable",
    "kl_token_value_and_grad",
    "kl_value_and_grad",
    "get_distribution_divergence",
    "get_divergence",
    "jsd",
    "kl_logprobs",
    "log_softmax",
    "logit_mse",
    "pearson",
    "reverse_kl",
    "skew_kl",
    "skew_reverse_kl",
    "TopK",
    "narrow_topk",
    "teacher_topk",
    "top1_agreement",
    "topk_bins",
    "topk_divergence",
    "topk_tail",
    "tvd",
]
