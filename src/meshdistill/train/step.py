"""The one distillation train step, and the three ways it is run.

`per_device_step` is written once, for the rows of the batch that one ``data`` shard
holds. It runs, in ONE compiled program:

1. the teacher forward pass (under `jax.lax.stop_gradient`; the teacher has no
   optimizer state and receives no gradient);
2. the student forward and backward pass, with the strategy's per-sequence loss
   `jax.vmap`-ed over the local rows;
3. the gradient sum over ``data`` and the optimizer update.

It is written as two halves, `per_device_gradients` (steps 1-2 and the sums over ``data``) and
`apply_gradients` (the update). The single and pmap layouts run both per device; the
shard_map layout runs the first under its ``shard_map`` and the second on the global arrays
(see `meshdistill.parallel.fsdp`: weights may be split over ``data``).

The loss is the token mean over unmasked tokens of the GLOBAL batch: numerator and
denominator are summed over ``data`` (``psum``), so every layout computes the same
number as one device. Under context parallelism (``mesh.axes: {context: n}``) each device holds a slice of its rows'
tokens: both models run on the slice (attention gathers keys and values over ``context``,
`meshdistill.models._context.ContextShard`), the loss (chunked or not) and the teacher's logits are those of the
slice, and ``data_axis`` names ``data`` and ``context``: gradients and token sums are summed over both.

With no teacher (``teacher_def=None``) step 1 is skipped and the strategy sees
``teacher=None``: teacher pretraining and hard-label baselines run this same step.

How the step is compiled and where its inputs live -- single device, ``shard_map`` over
a ``(data, tensor)`` mesh, or ``pmap`` -- is `meshdistill.parallel.layout`'s business.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import PartitionSpec as P

from meshdistill import losses
from meshdistill.core.batch import (  # noqa: F401 -- the step's batch keys, read here
    BATCH_KEYS, CROSS_KEYS, MULTI_KEYS, SEGMENT_KEYS, TARGET_LOGPROB_KEY, TOPK_KEYS,
)
from meshdistill.core.state import SplitStep, TrainState, join_trainable, split_trainable  # noqa: F401
from meshdistill.parallel import fsdp
from meshdistill.parallel.collectives import psum_bundled
from meshdistill.parallel.mesh import DATA, context_ways
from meshdistill.strategies import Strategy
from meshdistill.train import router_losses
from meshdistill.train.accumulate import SETTING as MICRO_BATCH_SETTING
from meshdistill.train.accumulate import accumulate, micro_batches, split_rows
from meshdistill.train.teacher import MODEL, NONE, TeacherOutput
from meshdistill.train.teacher_part import rows_whole, segments, teacher_outputs, vocab_slice

# One step on this device's rows ``batch = {inputs, targets, mask}: [b, T]``: `per_device_gradients` then
# `apply_gradients` (see them for the keywords), defined below as the `SplitStep` of the two. Returns
# ``(new_state, metrics)``; metrics are token means over the global batch (plus ``grad_norm`` and ``tokens``),
# identical on every device.


def per_device_gradients(
    state: TrainState,
    teacher_params: Any,
    batch: dict[str, jax.Array],
    *,
    student_def: nnx.GraphDef,
    teacher_def: nnx.GraphDef | None,
    strategy: Strategy,
    data_axis: str | None,
    vocab: int | None = None,
    trainable: Any = None,
    light: bool = False,
    student_axis: str | None = None,
    teacher_names: tuple[str, ...] = (),
    teacher_temperature: float = 1.0,
    loss_scale: float | None = None,
    topk_vocab: int | None = None,
    teacher_output: TeacherOutput | None = None,
    micro_batch: int | None = None,
):
  """The gradient half of the step on this device's rows: ``(grads summed over data, metrics without grad_norm)``.

  ``teacher_output``: what the teacher gives (`meshdistill.train.teacher.TeacherOutput`, decided when the `Distiller`
  is built); the step reads it, and nothing else, to choose the teacher's part. A top-k teacher (an offline cache,
  `meshdistill.teachers.cache`, or a teacher on its own devices, `meshdistill.teachers.mesh`) is not run: its top-k
  from the batch (`TOPK_KEYS`) is handed to the strategy as a `meshdistill.losses.TopK`. A teacher of its own
  tokenizer runs on its own tokens and its output is aligned on spans (`meshdistill.losses.Aligned`). ``None``: the
  teacher's weights when ``teacher_def`` is given (else no teacher), on the student's tokens.

  ``trainable``: an nnx filter of the student parameters that train (e.g. ``nnx.LoRAParam``); the
  others are inputs of the step only: no gradient, no optimizer state, never moved (`split_trainable`).
  ``None``: the whole student trains.

  ``vocab``: when teacher and student vocabularies differ only by padding rows, the shared
  range ``[0, vocab)``; both models' logits (and LM heads) are sliced to it before the loss.

  ``light``: the metrics-light step: the same update (same parameters, same loss), but its metrics
  are only ``loss``, ``grad_norm`` and ``tokens`` (what the divergence guard and the progress line
  read); the strategy's other metrics are not returned, so the compiler drops their work (their
  vocabulary-wide passes and reductions). The loop runs it on the steps it does not log.

  Rows packed from several documents (``data.packing: documents``) carry `SEGMENT_KEYS`: both models get them
  (``segment_ids``, ``positions``), so each attends within a document and RoPE restarts at each.

  ``teacher_names``: with several teachers (`MULTI_KEYS` in ``batch``), their names, in the batch's order: the
  metrics then hold ``kl/<name>`` and ``agreement/<name>`` (token means over the rows each teacher serves, the
  student at ``teacher_temperature``) and ``tokens/<name>``; the loss reads only the combined top-k.

  ``topk_vocab``: a top-k teacher of another tokenizer (a cross-tokenizer cache, read by a ``cross_tokenizer``
  strategy): its vocabulary size; its top-k, spread over that vocabulary (`meshdistill.losses.topk_logprobs`), is
  handed to the strategy as the `meshdistill.losses.Aligned` teacher's logits, at ``teacher_temperature`` (the
  cache's: the strategy's own temperature then applies as to live logits).

  ``loss_scale``: static loss scaling (`scale_gradient`): the loss gradient multiplied by it, the loss value and
  every metric unchanged; pair it with ``meshdistill.train.optimizers.safeguarded(..., loss_scale=S)``, which divides
  the gradients by it first. ``None``: off.

  ``student_axis``: a compiler-managed mesh axis (``tensor``) over which the student is replicated and its rows
  split (`meshdistill.parallel.backends.ShardMapLayout` with ``student_split="batch"``): the teacher runs as usual on
  this device's rows (its inputs and outputs pinned whole over rows, `rows_whole`), the student's part
  (`student_gradients`) in a nested ``shard_map`` manual over that axis on its slice of them, and the sums cover
  ``data`` and that axis. Same numbers as one device.

  ``micro_batch``: rows per forward and backward pass (gradient accumulation, `meshdistill.train.accumulate`): this
  device's rows run as ``rows / micro_batch`` micro-batches in a ``lax.scan``, each the teacher's forward and the
  student's gradient, added in float32 over the whole batch's denominator (computed and summed over ``data`` first)
  and summed over ``data`` once after the loop: the same loss, gradients and metrics as the whole batch at once.
  ``None``: the whole batch at once. A size that does not divide the rows is an error naming ``train.micro_batch``.

  Only ``state.step`` and ``state.params`` are read. Weights split over ``data`` (`meshdistill.parallel.fsdp`) arrive as
  shards and their gradients leave as shards, already summed over ``data``. The whole step's keywords reach each
  half as its signature names them (`meshdistill.core.state.SplitStep.split_keywords`); any other is an error.
  """
  rows = batch["inputs"].shape[0]
  multiple, why = 2 if strategy.needs_pairs else 1, " (the strategy pairs rows: chosen, rejected)"
  if student_axis is not None:  # each micro-batch's rows split over `student_axis` as well
    multiple, why = multiple * _axis_size(student_axis), f" (rows split over {student_axis} too: mesh.student_split)"
  k = micro_batches(rows, micro_batch, multiple, why)
  source = teacher_output if teacher_output is not None else TeacherOutput(NONE if teacher_def is None else MODEL)
  teacher_part = functools.partial(teacher_outputs, source, teacher_def, vocab=vocab, topk_vocab=topk_vocab,
                                   temperature=teacher_temperature, student_axis=student_axis)
  student_part = functools.partial(
      _student_local, state.step, student_def=student_def, strategy=strategy, vocab=vocab, trainable=trainable,
      light=light, teachers=(tuple(teacher_names), teacher_temperature), loss_scale=loss_scale, micro_batches=k,
  )
  keys = ("inputs", "targets", "mask", *SEGMENT_KEYS, *(MULTI_KEYS if teacher_names else ()))
  if student_axis is None:
    tokens, denom = _denominators(strategy, batch["mask"], data_axis)
  else:  # summed where the student's rows are split: over `data` and `student_axis` at once
    tokens, denom = jax.shard_map(
        functools.partial(_denominators, strategy, axes=student_axis if data_axis is None else (data_axis,
                                                                                                  student_axis)),
        in_specs=P(student_axis), out_specs=P(), axis_names={student_axis}, check_vma=False)(batch["mask"])

  # Under `student_axis` the student's part sums over that axis inside its nested `shard_map` (its outputs leave
  # whole): over `data` too when the rows run at once, only over it per micro-batch (`data` once, after the loop).
  inner = (student_axis if data_axis is None or k > 1 else (data_axis, student_axis)) if student_axis else None

  def gradients(part: dict, weights: tuple) -> tuple[Any, dict, dict]:
    """The gradients and token sums of the rows ``part`` (the whole local batch, or one micro-batch) over the whole
    batch's ``denom``, summed over no axis but ``inner``; ``weights``: (the student's, the teacher's), as the loop
    running this hands them in."""
    params, t_params = weights
    teacher_out, teacher_head, teacher_cap, teacher_tied = teacher_part(t_params, strategy, part)
    rows_in = {key: part[key] for key in keys if key in part}
    run = functools.partial(student_part, teacher_softcap=teacher_cap, teacher_tied=teacher_tied)
    if student_axis is None:
      return run(params, rows_in, teacher_out, teacher_head, axes=data_axis, denom=denom)
    # The student on its rows: they (and the teacher's outputs, moved to rows) split over `student_axis`, its
    # weights, the teacher's LM head and the denominator whole; gradients and sums over that axis inside, so they
    # leave replicated.
    axes = student_axis if data_axis is None else (data_axis, student_axis)

    def on_rows(params, rows_in, teacher_out, teacher_head, denom):
      grads, sums, usage = run(params, rows_in, teacher_out, teacher_head, axes=axes, denom=denom)
      return (*sum_over_data((grads, sums), inner), usage)

    split = jax.shard_map(on_rows, in_specs=(P(), P(student_axis), P(student_axis), P(), P()), out_specs=P(),
                          axis_names={student_axis}, check_vma=False)
    return split(params, rows_in, rows_whole(teacher_out), teacher_head, denom)

  if k == 1:
    grads, sums, usage = gradients(batch, (state.params, teacher_params))
  else:  # micro-batches one after another, their gradients and token sums added in float32 (`accumulate`); the
    # weights enter the loop as its operands (a model merged inside it from weights it closes over holds values of
    # the enclosing trace, which a scanned model's own `nnx.scan` refuses)
    grads, sums = accumulate(lambda part, weights: gradients(part, weights)[:2], split_rows(batch, k),
                             (state.params, teacher_params))
    usage = {}
  outer = None if student_axis is not None and k == 1 else data_axis  # what `inner` left to sum
  return _summed_metrics(grads, sums, usage, tokens, denom, outer, teacher_names)


def _axis_size(axis: str) -> int:
  """The size of mesh axis ``axis`` of the mesh being traced under."""
  return int(dict(jax.sharding.get_abstract_mesh().shape).get(axis, 1))


def student_gradients(
    step: jax.Array,
    params: Any,
    batch: dict[str, jax.Array],
    teacher_out: Any,
    teacher_head: jax.Array | None,
    *,
    axes: Any,
    student_def: nnx.GraphDef,
    strategy: Strategy,
    vocab: int | None,
    trainable: Any,
    light: bool,
    teacher_softcap: float | None = None,
    teachers: tuple[tuple[str, ...], float] = ((), 1.0),
    loss_scale: float | None = None,
    teacher_tied: bool = False,
):
  """The student's part of `per_device_gradients` on the rows given, with the teacher's outputs for them:
  ``(grads, metrics)`` with gradients and token sums summed over the mesh axes ``axes`` (``None``: none).
  ``teacher_softcap``: the teacher's final logit soft-cap, for a strategy that forms logits from the heads.
  ``teachers``: ``(names, temperature)`` of several teachers whose own top-k the batch carries (`MULTI_KEYS`).
  ``loss_scale``: the factor on the loss gradient (`scale_gradient`). ``teacher_tied``: the teacher's LM head is its
  embedding table transposed (``cfg.tie_embeddings``), for a strategy that `reads_tied_heads`."""
  tokens, denom = _denominators(strategy, batch["mask"], axes)
  grads, sums, usage = _student_local(
      step, params, batch, teacher_out, teacher_head, axes=axes, student_def=student_def, strategy=strategy,
      vocab=vocab, trainable=trainable, light=light, teacher_softcap=teacher_softcap, teachers=teachers,
      loss_scale=loss_scale, denom=denom, teacher_tied=teacher_tied)
  return _summed_metrics(grads, sums, usage, tokens, denom, axes, teachers[0])


def _denominators(strategy: Strategy, mask_BxT: jax.Array, axes: Any) -> tuple[jax.Array, jax.Array]:
  """``(tokens, denom)``: the unmasked tokens of the rows of ``mask_BxT`` and what the loss divides by (those tokens,
  or the strategy's ``count``), both summed over ``axes``: the global batch's."""
  mask_BxT = mask_BxT.astype(jnp.float32)
  # A strategy whose loss is a mean over something else than tokens (pairs of rows: preference
  # losses) says how many of those its local rows hold (`count`); the step sums that over `data`.
  count = strategy.count
  if count is not None and context_ways() > 1:
    raise ValueError(
        f"strategy {type(strategy).__name__} is a mean over whole rows (its count: pairs of rows), but the sequence "
        f"is split over mesh.axes.context={context_ways()}, so each device holds a slice of every row; use "
        "mesh.axes.context=1 with it (context parallelism takes strategies whose loss is a sum over tokens)")
  tokens, counted = psum_bundled((jnp.sum(mask_BxT), None if count is None else count(mask_BxT)), axes)
  return tokens, jnp.maximum(tokens if count is None else counted, 1.0)


def _student_local(
    step: jax.Array,
    params: Any,
    batch: dict[str, jax.Array],
    teacher_out: Any,
    teacher_head: jax.Array | None,
    *,
    axes: Any,
    student_def: nnx.GraphDef,
    strategy: Strategy,
    vocab: int | None,
    trainable: Any,
    light: bool,
    denom: jax.Array,
    teacher_softcap: float | None = None,
    teachers: tuple[tuple[str, ...], float] = ((), 1.0),
    loss_scale: float | None = None,
    micro_batches: int = 1,
    teacher_tied: bool = False,
):
  """``(grads, token sums, usage)`` of the student on the rows given, summed over no device: the gradient of this
  rows' token sums over ``denom`` (the global batch's, `_denominators`), and an MoE student's utilisation metrics.
  ``axes``: the mesh axes the step's rows are split over (an MoE student's routing counts are summed over them)."""
  capture = tuple(strategy.capture)
  with_logits, with_head = strategy.needs_logits, strategy.needs_head
  inputs_BxT, targets_BxT = batch["inputs"], batch["targets"]
  mask_BxT = batch["mask"].astype(jnp.float32)
  params_in, frozen = split_trainable(params, trainable)

  def loss_fn(params):
    # frozen parameters enter as constants of this trace (outer tracers inside `nnx.remat` blocks would not merge)
    params = join_trainable(params, jax.lax.stop_gradient(frozen))
    student = nnx.merge(student_def, params["student"])
    moe = getattr(getattr(student, "cfg", None), "moe", None)  # a mixture-of-experts student reports its routing
    if moe and micro_batches > 1:
      raise ValueError(
          f"{MICRO_BATCH_SETTING}: a mixture-of-experts student's load-balancing loss multiplies each expert's "
          f"assignments over the whole batch by its router probabilities, so the step cannot run its rows as "
          f"{micro_batches} micro-batches; leave {MICRO_BATCH_SETTING} at auto or set it to the rows each device "
          "holds per step")
    student_out = student(inputs_BxT, capture=capture + (("router",) if moe else ()), logits=with_logits,
                          **segments(batch))
    router, student_out = student_out.router, vocab_slice(student_out._replace(router=()), vocab)
    if with_head:  # token sums over all local rows; heads [D, V] with V split over `tensor`
      heads = (student.head_weight()[:, :vocab], teacher_head)
      caps = (getattr(student.cfg, "final_softcap", None), teacher_softcap)  # elementwise: applied per shard
      capped = {"softcaps": caps} if any(c is not None for c in caps) else {}
      if strategy.reads_tied_heads:  # which heads are tables transposed: a layout hint, the same values
        capped["tied_heads"] = (bool(student.cfg.tie_embeddings), teacher_tied)
      if light and strategy.drops_metrics:  # only the loss is read: the strategy may skip the metrics' work
        capped["metrics"] = False
      sums = strategy.per_batch(params["strategy"], student_out, teacher_out, heads, targets_BxT, mask_BxT, step,
                                **capped)
    else:
      per_seq = jax.vmap(strategy.per_sequence, in_axes=(None, 0, 0, 0, 0, None))
      sums = jax.tree.map(jnp.sum, per_seq(params["strategy"], student_out, teacher_out, targets_BxT, mask_BxT, step))
    usage = {}
    if teachers[0] and not light and MULTI_KEYS[0] in batch:  # each teacher's metrics: monitoring, no gradient
      sums = {**sums, **_teacher_sums(jax.lax.stop_gradient(student_out.logits), batch, mask_BxT, *teachers)}
    if moe:  # the router's terms, as shares of global means (`router_losses`): scaled to the step's token sums
      terms, usage = router_losses.router_terms(router, mask_BxT, moe, axes)
      sums = {**sums, "loss": sums["loss"] + denom * router_losses.weighted(terms, moe),
              **{k: denom * v for k, v in terms.items()}}
    return scale_gradient(sums["loss"], loss_scale) / denom, (sums, usage)

  (_, (sums, usage)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params_in)
  if light:
    sums, usage = {"loss": sums["loss"]}, {}
  return grads, sums, usage


def _summed_metrics(grads: Any, sums: dict, usage: dict, tokens: jax.Array, denom: jax.Array, axes: Any,
                    teacher_names: tuple[str, ...]) -> tuple[Any, dict]:
  """``(grads, metrics)``: gradients and token sums summed over ``axes`` (`sum_over_data`), the sums divided by the
  global ``denom`` (each teacher's by the tokens of the rows it serves), with ``usage`` and ``tokens``."""
  grads, sums = sum_over_data((grads, sums), axes)
  metrics = {k: v / denom for k, v in sums.items()} | usage
  for name in (n for n in teacher_names if f"tokens/{n}" in sums):  # means over the tokens of the rows it serves
    served = jnp.maximum(sums[f"tokens/{name}"], 1.0)
    metrics |= {f"{m}/{name}": sums[f"{m}/{name}"] / served for m in ("kl", "agreement")}
    metrics[f"tokens/{name}"] = sums[f"tokens/{name}"]
  metrics["tokens"] = tokens
  return grads, metrics


def _teacher_sums(logits_BxTxV, batch: dict, mask_BxT, names: tuple[str, ...], temperature: float) -> dict:
  """Token sums of each teacher's ``kl`` / ``agreement`` (`meshdistill.losses.teacher_terms`) and ``tokens`` over the
  rows it serves (``teachers_rows``)."""
  out: dict[str, jax.Array] = {}
  for n, name in enumerate(names):
    topk = losses.TopK(*(batch[k][:, n] for k in MULTI_KEYS[:3]))
    mask_n = mask_BxT * batch["teachers_rows"][:, n, None].astype(mask_BxT.dtype)
    terms = jax.vmap(losses.teacher_terms, in_axes=(0, 0, 0, None))(logits_BxTxV, topk, mask_n, temperature)
    out |= {f"{k}/{name}": jnp.sum(v) for k, v in terms.items()} | {f"tokens/{name}": jnp.sum(mask_n)}
  return out


def scale_gradient(loss: jax.Array, scale: float | None) -> jax.Array:
  """``loss`` with the same value and its gradient multiplied by ``scale`` (static loss scaling; ``None``: ``loss``):
  ``stop_gradient(l) + S * (l - stop_gradient(l))``. The step's whole loss is scaled (a mixture-of-experts student's
  router terms too), so unscaling every gradient by ``S`` in the optimizer restores the update."""
  if scale is None:
    return loss
  kept = jax.lax.stop_gradient(loss)
  return kept + scale * (loss - kept)


def sum_over_data(tree: Any, data_axis: Any) -> Any:
  """``tree`` (gradients, token sums) summed over ``data`` in few all-reduces (`psum_bundled`: one of the scalars,
  one combined of the arrays), except the gradients of weights split over ``data`` (`meshdistill.parallel.fsdp`): the
  backward pass of their all-gather already reduce-scattered them over ``data``, so they are summed over the other
  axes of ``data_axis`` only (``context``: each device held a slice of the rows' tokens)."""
  if data_axis is None:
    return tree
  is_split = lambda x: fsdp.data_dim(x) is not None  # noqa: E731
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_split)
  summed = [i for i, x in enumerate(leaves) if not is_split(x)]
  for i, x in zip(summed, psum_bundled([leaves[i] for i in summed], data_axis)):
    leaves[i] = x
  others = tuple(a for a in (data_axis if isinstance(data_axis, tuple) else (data_axis,)) if a != DATA)
  split = [i for i in range(len(leaves)) if i not in set(summed)]
  if others and split:
    for i, x in zip(split, psum_bundled([leaves[i] for i in split], others)):
      leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def apply_gradients(
    state: TrainState, grads: Any, metrics: dict, *, optimizer: optax.GradientTransformation, trainable: Any = None,
    one_device: bool = False,
):
  """The update half of the step: the optimizer on ``grads`` (of the trainable parameters, summed over ``data``);
  returns ``(new_state, metrics + grad_norm)``. Under `meshdistill.parallel.backends.ShardMapLayout` it runs on the
  global arrays (outside the ``shard_map``), so norms and moments are those of whole gradients."""
  params_in, frozen = split_trainable(state.params, trainable)
  if one_device:  # whole arrays on one device: the stacked gradients in their weights' layout (`_row_major`)
    grads = jax.tree.map(_row_major, grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, params_in)
  params = join_trainable(optax.apply_updates(params_in, updates), frozen)
  metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}  # the norm the optimizer clips with (CSE: once)
  return TrainState(state.step + 1, params, opt_state), metrics


def _row_major(grad: jax.Array) -> jax.Array:
  """A gradient of three or more axes (stacked layers' weights ``[L, ...]``, experts) in row-major layout, the
  layout its weight and optimizer moments are stored in, so that the update reads all three in place. Without it the
  compiler may keep a stacked gradient in the layout its backward pass formed it in and copy the weight and both
  moments into that layout and back every step: a Gemma 3 student whose 13 layers scan as two groups of six and one
  left over, compiled for TPU v5e, copied 42 float32 stacks of its layers' weights so (what it cost on the chip:
  `benchmarks/results/tpu_step.md`, "Changes to the code"). Only the layout changes. On one device only: over a
  mesh the constraint made XLA gather gradients split over ``data`` (``mesh.fsdp``) and experts."""
  if getattr(grad, "ndim", 0) < 3:
    return grad
  return with_layout_constraint(grad, Layout(major_to_minor=tuple(range(grad.ndim))))


per_device_step = SplitStep(per_device_gradients, apply_gradients)
step_halves = SplitStep.halves  # the halves of a `per_device_step` partial
