"""The teacher's part of the step (`meshdistill.train.step.per_device_gradients`) on the rows it is given: what the
strategy reads of the teacher -- the teacher run under ``stop_gradient`` on the student's tokens or on its own, or
its top-k read from the batch -- and the helpers both models' parts share (packed documents' keywords, the shared
vocabulary's slice, rows pinned whole). The step calls it once per step, or once per micro-batch
(`meshdistill.train.accumulate`)."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshdistill import losses
from meshdistill.core.batch import SEGMENT_KEYS, TARGET_LOGPROB_KEY, TOPK_KEYS
from meshdistill.strategies import Strategy
from meshdistill.train.teacher import MODEL, TeacherOutput


def teacher_outputs(source: TeacherOutput, teacher_def, teacher_params, strategy: Strategy, batch: dict, *,
                    vocab: int | None, topk_vocab: int | None, temperature: float, student_axis: str | None):
  """``(teacher_out, teacher_head, teacher_softcap, teacher_tied)`` for the rows of ``batch``: what the strategy reads
  of the teacher (a ModelOutput, a losses.TopK or a losses.Aligned; None without a teacher), the teacher's LM head for
  a strategy that forms logits from the heads, its final logit soft-cap, and whether that head is its embedding table
  transposed (``cfg.tie_embeddings``: a layout hint for a strategy that `reads_tied_heads`)."""
  capture = tuple(strategy.capture)
  # A strategy with `needs_head` forms logits itself from the final hidden states and the
  # LM heads (e.g. chunked over tokens); the models then skip their heads (`needs_logits`).
  with_logits, with_head = strategy.needs_logits, strategy.needs_head
  reads_topk = source.reads_topk(batch)
  if reads_topk and source.own_tokenizer:  # a cross-tokenizer cache
    return _aligned_topk(batch, topk_vocab, temperature), None, None, False
  if reads_topk:  # a teacher given by its top-k (offline cache, or a teacher on other devices)
    return losses.TopK(*(jax.lax.stop_gradient(batch[k]) for k in TOPK_KEYS)), None, None, False
  if source.kind is MODEL and source.own_tokenizer:  # a teacher of another tokenizer
    return _aligned_teacher(nnx.merge(teacher_def, teacher_params), batch, student_axis), None, None, False
  if source.kind is not MODEL:
    return None, None, None, False
  teacher = nnx.merge(teacher_def, teacher_params)
  inputs_BxT, segs = batch["inputs"], segments(batch)
  if student_axis is not None:
    inputs_BxT, segs = rows_whole((inputs_BxT, segs))
  teacher_out = vocab_slice(
      jax.lax.stop_gradient(teacher(inputs_BxT, capture=capture, logits=with_logits, **segs)), vocab)
  teacher_head = jax.lax.stop_gradient(teacher.head_weight()[:, :vocab]) if with_head else None
  return (teacher_out, teacher_head, getattr(teacher.cfg, "final_softcap", None),
          bool(getattr(teacher.cfg, "tie_embeddings", False)))


def segments(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The model keywords of rows packed from several documents (`SEGMENT_KEYS`); ``{}`` for rows of one stream."""
  return {k: batch[k] for k in SEGMENT_KEYS if k in batch}


def _aligned_teacher(teacher, batch: dict[str, jax.Array], student_axis: str | None) -> losses.Aligned:
  """The teacher run on its own tokens (``teacher_inputs`` [b, Tt], under ``stop_gradient``) with the row alignment
  of `CROSS_KEYS`, for a strategy with ``cross_tokenizer``."""
  inputs_BxT = batch["teacher_inputs"] if student_axis is None else rows_whole(batch["teacher_inputs"])
  logits = jax.lax.stop_gradient(teacher(inputs_BxT).logits)
  return losses.Aligned(logits, *(batch[k] for k in (
      "teacher_targets", "teacher_span", "student_span", "teacher_last", "student_last", "span_bytes")))


def _aligned_topk(batch: dict[str, jax.Array], vocab: int | None, temperature: float) -> losses.Aligned:
  """A cached teacher of another tokenizer (`TOPK_KEYS` and `TARGET_LOGPROB_KEY` per teacher token) with the row
  alignment of `CROSS_KEYS`: its top-k spread over its vocabulary as logits (log-probabilities times the cache's
  temperature: equal to the live teacher's logits up to a constant per position when the top-k is the whole
  vocabulary)."""
  if vocab is None:
    raise ValueError("a top-k teacher of another tokenizer needs its vocabulary size (the step's topk_vocab)")
  topk = [jax.lax.stop_gradient(batch[k]) for k in TOPK_KEYS]
  own = batch.get(TARGET_LOGPROB_KEY)
  targets = batch["teacher_targets"] if own is not None else None
  spread = lambda i, lp, tail, tgt, tgt_lp: losses.topk_logprobs(i, lp, tail, vocab, tgt, tgt_lp)  # noqa: E731
  dense = jax.vmap(spread)(*topk, targets, own)
  return losses.Aligned(jax.lax.stop_gradient(dense * temperature), *(batch[k] for k in (
      "teacher_targets", "teacher_span", "student_span", "teacher_last", "student_last", "span_bytes")))


def rows_whole(tree: Any) -> Any:
  """``tree``'s arrays pinned whole along their first (row) axis, their other axes left to the compiler.

  The teacher's inputs and outputs under ``student_axis``. Unpinned, the compiler sees them consumed split over
  rows (the student's nested ``shard_map``) and carries that split back into the teacher, whose weights are split
  over the same axis: on the 2x4 benchmark step it gathered every layer's attention weights and gathered the
  activations back before each MLP (a planned Qwen3-1.7B teacher on 2x4: 198 all-gathers, its whole bfloat16
  weights, 3.44 GB per device, every step). Pinned, the teacher runs split over ``tensor`` as in the default
  split, and its outputs reach the student's rows once (an all-to-all of the logits)."""
  def pin(x):
    if not isinstance(x, jax.Array) or x.ndim == 0:
      return x
    return jax.lax.with_sharding_constraint(x, P(None, *([P.UNCONSTRAINED] * (x.ndim - 1))))

  return jax.tree.map(pin, tree)


def vocab_slice(out, vocab: int | None):
  """``out`` with logits [B, T, V] cut to [B, T, vocab] (still split over ``tensor``); ``vocab=None`` keeps all."""
  if vocab is None or out.logits is None or out.logits.shape[-1] == vocab:
    return out
  return out._replace(logits=out.logits[..., :vocab])
