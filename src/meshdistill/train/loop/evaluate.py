"""Validation metrics: loss and perplexity of a model, and its agreement with a teacher.

Every number is a token mean over the UNMASKED tokens of all validation batches (sums
accumulated over batches, divided once at the end), so padding never counts and the
result does not depend on how the rows are batched:

* ``loss`` -- cross-entropy of the model on the next token; ``ppl = exp(loss)``;
* with a teacher: ``teacher_loss`` / ``teacher_ppl``, ``kl`` = KL(teacher || model) at
  temperature 1, ``agree`` = share of tokens whose arg-max matches the teacher's, ``corr`` =
  Pearson correlation of the two logit vectors;
* with batches of two tokenizations (``data.teacher_tokenizer``): ``bpb``, the model's bits per byte on the
  counted spans (text both tokenizations cover alike, `meshdistill.losses.span_nll`), and ``teacher_bpb``, the
  teacher's on the same bytes, run on its own tokens: models of different vocabularies compare;
* against teachers given by their top-k (`Evaluator.against_topk`: several teachers' own top-k, `MULTI_KEYS`, and
  their combined target, `TOPK_KEYS`): per teacher ``kl`` (forward KL from its K+1 bins to the model's at the
  given temperature, `meshdistill.losses.teacher_terms`, the step's ``kl/<name>``) and ``agreement`` (the model's
  arg-max is the teacher's first id) over the rows that teacher serves, and the same against the combined target
  over every row.

The forward passes run as one jitted program per batch on the layout the parameters
live on (batch split over ``data``; weights split over ``tensor``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshdistill import losses
from meshdistill.parallel.mesh import host_to_global
from meshdistill.core.batch import BATCH_KEYS, CROSS_KEYS, MULTI_KEYS, SEGMENT_KEYS, TOPK_KEYS
from meshdistill.train.teacher import TeacherKind


@functools.partial(jax.jit, static_argnames=("model_def", "teacher_def"))
def _sums(params, teacher_params, batch, *, model_def, teacher_def):
  mask_BxT = batch["mask"].astype(jnp.float32)
  targets_BxT = batch["targets"]
  segments = {k: batch[k] for k in SEGMENT_KEYS if k in batch}  # packed documents: each attended on its own
  logits = nnx.merge(model_def, params)(batch["inputs"], **segments).logits
  per_seq = lambda f: jax.vmap(lambda *a: jnp.sum(f(*a)))
  out = {"tokens": jnp.sum(mask_BxT), "ce": jnp.sum(per_seq(losses.cross_entropy)(logits, targets_BxT, mask_BxT))}
  if teacher_def is not None:
    t_logits = nnx.merge(teacher_def, teacher_params)(batch["inputs"], **segments).logits
    out["teacher_ce"] = jnp.sum(per_seq(losses.cross_entropy)(t_logits, targets_BxT, mask_BxT))
    out["kl"] = jnp.sum(per_seq(losses.forward_kl)(logits, t_logits, mask_BxT))
    out["agree"] = jnp.sum(per_seq(losses.top1_agreement)(logits, t_logits, mask_BxT))
    out["corr"] = jnp.sum(per_seq(losses.pearson)(logits, t_logits, mask_BxT))
  return out


@functools.partial(jax.jit, static_argnames=("model_def", "teacher_def"))
def _cross_sums(params, teacher_params, batch, *, model_def, teacher_def):
  """Token sums of a batch of two tokenizations: the model's CE on its tokens, both models' span NLL and bytes."""
  mask_BxT = batch["mask"].astype(jnp.float32)
  logits = nnx.merge(model_def, params)(batch["inputs"]).logits
  per_seq = lambda f: jax.vmap(lambda *a: jnp.sum(f(*a)))  # noqa: E731
  out = {
      "tokens": jnp.sum(mask_BxT), "ce": jnp.sum(per_seq(losses.cross_entropy)(logits, batch["targets"], mask_BxT)),
      "bytes": jnp.sum(batch["span_bytes"].astype(jnp.float32)),
      "span_nll": jnp.sum(jax.vmap(losses.span_nll)(logits, batch["targets"], batch["student_span"],
                                                    batch["span_bytes"])),
  }
  if teacher_def is not None:
    t_logits = nnx.merge(teacher_def, teacher_params)(batch["teacher_inputs"]).logits
    out["teacher_span_nll"] = jnp.sum(jax.vmap(losses.span_nll)(
        t_logits, batch["teacher_targets"], batch["teacher_span"], batch["span_bytes"]))
  return out


@functools.partial(jax.jit, static_argnames=("model_def", "temperature"))
def _topk_sums(params, batch, *, model_def, temperature):
  """Token sums of the model against top-k teachers: ``kl/<n>``, ``agreement/<n>``, ``tokens/<n>`` per teacher ``n``
  (`MULTI_KEYS`, over the rows it serves) and ``kl``, ``agreement``, ``tokens`` against the target (`TOPK_KEYS`)."""
  mask_BxT = batch["mask"].astype(jnp.float32)
  segments = {k: batch[k] for k in SEGMENT_KEYS if k in batch}
  logits = nnx.merge(model_def, params)(batch["inputs"], **segments).logits
  terms = jax.vmap(losses.teacher_terms, in_axes=(0, 0, 0, None))
  out = {}
  if MULTI_KEYS[0] in batch:
    for n in range(batch[MULTI_KEYS[0]].shape[1]):
      mask_n = mask_BxT * batch["teachers_rows"][:, n, None].astype(jnp.float32)
      got = terms(logits, losses.TopK(*(batch[k][:, n] for k in MULTI_KEYS[:3])), mask_n, temperature)
      out |= {f"{k}/{n}": jnp.sum(v) for k, v in got.items()} | {f"tokens/{n}": jnp.sum(mask_n)}
  if TOPK_KEYS[0] in batch:
    got = terms(logits, losses.TopK(*(batch[k] for k in TOPK_KEYS)), mask_BxT, temperature)
    out |= {k: jnp.sum(v) for k, v in got.items()} | {"tokens": jnp.sum(mask_BxT)}
  return out


def finish(sums: dict[str, float]) -> dict[str, float]:
  """Token means and perplexities from accumulated token sums."""
  n = max(sums["tokens"], 1.0)
  out = {"loss": sums["ce"] / n, "tokens": sums["tokens"]}
  out["ppl"] = math.exp(min(out["loss"], 700.0))
  if "teacher_ce" in sums:
    out["teacher_loss"] = sums["teacher_ce"] / n
    out["teacher_ppl"] = math.exp(min(out["teacher_loss"], 700.0))
    for k in ("kl", "agree", "corr"):
      out[k] = sums[k] / n
  if "bytes" in sums:  # two tokenizations: bits per byte of each model on the same bytes
    per_byte = max(sums["bytes"], 1.0) * math.log(2.0)
    out["bpb"] = sums["span_nll"] / per_byte
    if "teacher_span_nll" in sums:
      out["teacher_bpb"] = sums["teacher_span_nll"] / per_byte
  return out


class Evaluator:
  """Evaluates a model (optionally against a teacher) on fixed validation batches.

  Args:
    model_def: graph definition of the evaluated model (``trainer.student_def``).
    teacher_def, teacher_params: the teacher to compare with, or None.
    mesh: where batches go (split over ``data``); None places them on the default device.
  """

  def __init__(self, model_def: nnx.GraphDef, *, teacher_def=None, teacher_params=None, mesh: Mesh | None = None):
    self.mesh = mesh
    self.teacher_def, self.teacher_params = teacher_def, teacher_params
    # One compiled program per (graph definitions, shapes, layout), shared by every Evaluator.
    self._fn: Any = functools.partial(_sums, model_def=model_def, teacher_def=teacher_def)  # of a jitted function
    self._cross = functools.partial(_cross_sums, model_def=model_def, teacher_def=teacher_def)

  @classmethod
  def for_trainer(cls, trainer: Any, with_teacher: bool = True) -> Evaluator:
    """An evaluator of ``trainer``'s student (a `Distiller` or `HardLabelTrainer`) on its layout, against its teacher
    when ``with_teacher`` and the step runs a teacher model (``trainer.teacher_output.kind is TeacherKind.MODEL``)."""
    if not (with_teacher and trainer.teacher_output.kind is TeacherKind.MODEL):
      return cls(trainer.student_def, mesh=trainer.layout.eval_mesh)
    return cls(trainer.student_def, teacher_def=trainer.teacher_def,
               teacher_params=trainer.unreplicate(trainer.teacher_params), mesh=trainer.layout.eval_mesh)

  def _place(self, batch, keys=()):
    batch = {k: np.asarray(batch[k]) for k in BATCH_KEYS + CROSS_KEYS + SEGMENT_KEYS + tuple(keys) if k in batch}
    if self.mesh is None:
      return batch
    return host_to_global(batch, self.mesh)

  def _in_mesh(self):
    """The mesh in context: kernels XLA cannot partition (Pallas splash attention) place themselves on it."""
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def lower(self, params: Any, batch: dict):
    """The lowered program of one batch (already placed; abstract ``jax.ShapeDtypeStruct``s work)."""
    with self._in_mesh():
      return self._fn.func.lower(params, self.teacher_params, batch, **self._fn.keywords)

  def __call__(self, params: Any, batches: Sequence[dict]) -> dict[str, float]:
    """Metrics of the model with parameters ``params`` (an ``nnx.State``) over ``batches``."""
    if not batches:
      raise ValueError(
        "no validation batches: the corpus has no validation split; set data.val_fraction > 0 "
        "(e.g. 0.05) or use a larger corpus"
      )
    total: dict[str, float] = {}
    with self._in_mesh():
      for batch in batches:
        fn = self._cross if "span_bytes" in batch else self._fn
        sums = jax.device_get(fn(params, self.teacher_params, self._place(batch)))
        for k, v in sums.items():
          total[k] = total.get(k, 0.0) + float(v)
    return finish(total)

  def against_topk(self, params: Any, batches: Sequence[dict], temperature: float) -> dict:
    """The model against top-k teachers on ``batches`` carrying them (see the module docstring):
    ``{"teachers": [{"kl", "agreement", "tokens"} per teacher, in the batches' order], "target": {...} or None}``,
    token means; the student at ``temperature``."""
    total: dict[str, float] = {}
    with self._in_mesh():
      for batch in batches:
        placed = self._place(batch, MULTI_KEYS + TOPK_KEYS)
        sums = jax.device_get(_topk_sums(params, placed, model_def=self._fn.keywords["model_def"],
                                         temperature=float(temperature)))
        for k, v in sums.items():
          total[k] = total.get(k, 0.0) + float(v)

    def means(suffix=""):
      n = total[f"tokens{suffix}"]
      return {"kl": total[f"kl{suffix}"] / max(n, 1.0), "agreement": total[f"agreement{suffix}"] / max(n, 1.0),
              "tokens": n}

    count = sum(k.startswith("tokens/") for k in total)
    return {"teachers": [means(f"/{n}") for n in range(count)], "target": means() if "tokens" in total else None}
