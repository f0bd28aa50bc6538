"""What to distil: strategies turn one sequence's student and teacher outputs into loss terms.

A strategy is any object with

* ``capture``: the extra model outputs it needs (subset of ``("hidden", "attn")``);
* ``init_params(student_cfg, teacher_cfg, key)``: extra trainable parameters (e.g. a
  feature projection), trained with the student; ``{}`` when none;
* ``per_sequence(params, student, teacher, targets_T, mask_T, step)``: a dict of
  token SUMS for one sequence. ``"loss"`` is required; every other entry is reported as
  a metric. The train step vmaps it over the local batch, sums over the global batch and
  divides by the global count of unmasked tokens, so every value is a token mean.

``student`` / ``teacher`` are `ModelOutput` of one sequence: logits ``[T, V]``,
hidden states ``[T, D]`` and attention maps ``[H, T, T]``.
"""

from meshdistill.strategies._logit import LogitKD, Scalar, logit_metrics, value_at

__all__ = ["LogitKD", "Scalar", "logit_metrics", "value_at"]
