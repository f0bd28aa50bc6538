"""What to distil: strategies turn one sequence's student and teacher outputs into loss terms.

A strategy is any object with

* ``capture``: the extra model outputs it needs (subset of ``("hidden", "attn", "final")``);
* ``init_params(student_cfg, teacher_cfg, key)``: extra trainable parameters (e.g. a
  feature projection), trained with the student, replicated over the mesh; ``{}`` when
  none. It is also where a strategy checks its settings against the model sizes
  (`Distiller.init_state` calls it), raising ``ValueError`` for a bad setting;
* ``per_sequence(params, student, teacher, targets_T, mask_T, step)``: a dict of
  token SUMS for one sequence. ``"loss"`` is required; every other entry is reported as
  a metric. The train step vmaps it over the local batch, sums over the global batch and
  divides by the global count of unmasked tokens, so every value is a token mean.

``student`` / ``teacher`` are `ModelOutput` of one sequence: logits ``[T, V]``,
hidden states ``(L+1) x [T, D]`` and attention maps ``L x [H, T, T]``.

A strategy that sets ``needs_head = True`` instead receives all local rows at once in
``per_batch`` together with the LM heads, and the models skip their own heads
(``needs_logits = False``; see `ChunkedLogitKD` and `meshdistill.step`).

Built in:

====================  ==========================================================================
`LogitKD`             a divergence (KL, reverse KL, JSD, ...) between temperature-softened
                      logits, mixed with hard-label CE
`ChunkedLogitKD`      logit KD without ``[B, T, V]`` logits (token chunks, vocabulary-parallel)
`HardLabelCE`         cross-entropy on the targets only
`AttentionTransfer`   KL / MSE between attention probability maps of mapped layers
`FeaturePooling`      cosine / MSE to the teacher's width-pooled hidden states
`FeatureProjection`   cosine / MSE through a learned ``[D_s, D_t]`` map per mapped layer
`Composite`           a weighted sum of per-sequence strategies (all above but `ChunkedLogitKD`);
                      weights may be schedules
====================  ==========================================================================

Layer maps (`default_layer_map`) pair student with teacher layers; weights and other
scalars may be schedules, evaluated with `value_at`.
"""

from meshdistill.strategies._attention import AttentionTransfer, attention_map_loss, group_heads
from meshdistill.strategies._chunked import ChunkedLogitKD
from meshdistill.strategies._composite import Composite, HardLabelCE
from meshdistill.strategies._features import FeaturePooling, FeatureProjection, feature_loss, pool_features
from meshdistill.strategies._layer_map import default_layer_map
from meshdistill.strategies._logit import LogitKD, Scalar, logit_metrics, value_at
from meshdistill.strategies._wrappers import LogitMSE, ScaledLoss, fallback_strategy

__all__ = [
    "AttentionTransfer",
    "ChunkedLogitKD",
    "Composite",
    "FeaturePooling",
    "FeatureProjection",
    "HardLabelCE",
    "LogitKD",
    "Scalar",
    "attention_map_loss",
    "default_layer_map",
    "feature_loss",
    "group_heads",
    "logit_metrics",
    "pool_features",
    "value_at",
]
