"""Logit distillation without ``[B, T, V]`` logits: chunked over tokens, parallel over the vocabulary."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from meshdistill.losses import (LOSS_KERNELS, LOSS_NAMES, chunked_token_sums, kl_kernel_applies,
                               kl_token_value_and_grad)
from meshdistill.models import ModelOutput
from meshdistill.models import softcap
from meshdistill.losses.schedules import check_integer
from meshdistill.strategies._base import BatchStrategy, register
from meshdistill.strategies._logit import LogitKD, LogitRecipe


@register("chunked_logit_kd")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedLogitKD(LogitRecipe, BatchStrategy):
  """`LogitKD` computed from final hidden states and LM-head weights, ``chunk_size`` tokens at a time.

  The recipe, its checks, the per-token loss and the metrics are `LogitRecipe`'s, shared
  with `LogitKD`: the same settings give the same numbers.

  The models run without their LM heads (``needs_logits = False``); the step hands over the
  heads (``needs_head = True``) and calls `per_batch` on all local rows at once. Their tokens
  are flattened and cut into chunks of ``chunk_size`` (`meshdistill.losses.chunked_token_sums`):
  per device at most ``chunk_size x V / tensor`` logits of each model exist at a time, the
  vocabulary is never gathered, and the backward pass recomputes nothing.

  Args (besides `LogitRecipe`'s):
    chunk_size: tokens per chunk over this device's rows (``b * T`` tokens); ``0`` forms the full
      logits at once (the naive loss, same numbers). Memory per device scales with
      ``chunk_size * V / tensor`` instead of ``b * T * V / tensor``.
    capture: must include ``"final"`` (the LM-head input).
    loss_kernel: how the default recipe (the full forward KL, no logit soft-caps) forms a chunk's values and
      logits gradient: ``"auto"`` (default) in one Pallas kernel that reads both chunks' logits once
      (`meshdistill.losses.kl_value_and_grad`) where the step is compiled for a TPU and the kernel applies (nothing
      split over a compiler-managed mesh axis, a vocabulary of whole 128-column tiles:
      `meshdistill.losses.kl_kernel_applies`), else in XLA; ``"xla"``: always in two XLA passes over them;
      ``"pallas"``: the kernel wherever it applies (interpreted off a TPU: slow, for numerics checks). The same
      values either way, within float32 rounding.

  No top-k variant: that needs a vocabulary-wide top-k per token (use `LogitKD(top_k=...)`).
  """

  chunk_size: int = 1024
  capture: tuple[str, ...] = ("final",)
  loss_kernel: str = "auto"
  reads_tied_heads: ClassVar[bool] = True  # the chunk loop reads a tied head's table as stored
  drops_metrics: ClassVar[bool] = True  # a metrics-light step's loss kernel forms the loss's sums only

  def __post_init__(self):
    super().__post_init__()
    check_integer(
        "ChunkedLogitKD.chunk_size", self.chunk_size, 0, meaning=": tokens per chunk (e.g. 1024), or 0 for the unchunked loss"
    )
    if self.loss_kernel not in LOSS_KERNELS:
      raise ValueError(f"ChunkedLogitKD.loss_kernel={self.loss_kernel!r}; choose one of {LOSS_KERNELS} "
                       "(auto: the one-read kernel on a TPU where it applies; pallas: wherever it applies; xla: never)")
    if "final" not in self.capture:
      raise ValueError(f"ChunkedLogitKD.capture={self.capture!r} must include 'final' (the LM-head input)")

  def per_batch(
      self, params, student: ModelOutput, teacher: ModelOutput, heads, targets_BxT, mask_BxT, step,
      softcaps=(None, None), tied_heads=(False, False), metrics: bool = True,
  ) -> dict[str, jax.Array]:
    """Token sums over this device's rows.

    ``student.final``: [b, T, D], ``teacher.final``: [b, T, E]; ``heads = (student_DxV,
    teacher_ExV)`` with V split over ``tensor``; ``targets_BxT``, ``mask_BxT``: [b, T]; ``softcaps``: the
    models' final logit soft-caps, applied to each chunk's logits (elementwise, on each vocabulary shard) before
    the loss reduces anything; ``tied_heads``: which head is its model's embedding table transposed
    (`chunked_token_sums` reads those tables as stored); ``metrics``: False (a metrics-light step) sums only the
    loss's own terms (``loss``, ``kl``, ``ce``: `meshdistill.losses.LOSS_NAMES`), and the loss kernel skips the
    metrics' work.
    """
    del params
    student_head_DxV, teacher_head_ExV = heads
    s_final, t_final = student.final, teacher.final
    token_fn = self.token_terms
    fused = None
    if any(c is not None for c in softcaps):
      token_fn = functools.partial(_capped, self.token_terms, *softcaps)
    elif self.term_name == "kl" and kl_kernel_applies(student_head_DxV.shape[1], self.loss_kernel,
                                                       head_dtype=student_head_DxV.dtype):
      # the default recipe's values and logits gradient in one read
      fused = functools.partial(kl_token_value_and_grad, metrics=metrics)
    if not metrics:
      token_fn = functools.partial(_only, token_fn, LOSS_NAMES)
    return chunked_token_sums(
        token_fn,
        self.scalars(step),
        s_final.reshape(-1, s_final.shape[-1]),
        student_head_DxV,
        t_final.reshape(-1, t_final.shape[-1]),
        teacher_head_ExV,
        targets_BxT.reshape(-1),
        jnp.asarray(mask_BxT, jnp.float32).reshape(-1),
        chunk_size=self.chunk_size,
        tied_heads=tied_heads,
        value_and_grad=fused,
    )


def _only(token_fn, names, params, student_CxV, teacher_CxV, targets_C, mask_C):
  """``token_fn``'s values of ``names`` (those it has)."""
  out = token_fn(params, student_CxV, teacher_CxV, targets_C, mask_C)
  return {k: v for k, v in out.items() if k in names}


def _capped(token_fn, student_cap, teacher_cap, params, student_CxV, teacher_CxV, targets_C, mask_C):
  """``token_fn`` on soft-capped logits (`meshdistill.models._variants.softcap`; None leaves a model's as they are)."""
  return token_fn(params, softcap(student_CxV, student_cap), softcap(teacher_CxV, teacher_cap), targets_C, mask_C)


# `default_recipe`: from this vocabulary size on, the recipe's default is the chunked form. At 32k tokens a
# [B, T, V] float32 logit tensor is 128 KiB per token per model (with its gradient and the softmaxes several times
# that); below it (the main job's 264 bytes) the full logits are small and the step keeps `LogitKD`.
CHUNKED_FROM_VOCAB = 32768
DEFAULT_CHUNK = 1024  # tokens per chunk (the planner's and the measured chip steps' choice)


def default_recipe(recipe: LogitRecipe, vocab: int, model_teacher: bool) -> LogitRecipe:
  """``recipe`` as the step should run it when the user named no loss form: a full-vocabulary `LogitKD` (no
  top-k, no captured outputs) becomes the `ChunkedLogitKD` of the same settings (the same numbers, without
  ``[B, T, V]`` logits) where the vocabulary has at least `CHUNKED_FROM_VOCAB` tokens and the teacher is a model
  the step runs (``model_teacher``; a top-k teacher gives no LM head); anything else is returned as it is."""
  if type(recipe) is not LogitKD or recipe.top_k is not None or recipe.capture or not model_teacher:
    return recipe
  if vocab < CHUNKED_FROM_VOCAB:
    return recipe
  fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(LogitRecipe) if f.init}
  return ChunkedLogitKD(**fields, chunk_size=DEFAULT_CHUNK)
