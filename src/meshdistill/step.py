"""The one distillation train step, and the three ways it is run.

`per_device_step` is written once, for the rows of the batch that one ``data`` shard
holds. It runs, in ONE compiled program:

1. the teacher forward pass (under `jax.lax.stop_gradient`; the teacher has no
   optimizer state and receives no gradient);
2. the student forward and backward pass, with the strategy's per-sequence loss
   `jax.vmap`-ed over the local rows;
3. the gradient sum over ``data`` and the optimizer update.

The loss is the token mean over unmasked tokens of the GLOBAL batch: numerator and
denominator are summed over ``data`` (``psum``), so every layout computes the same
number as one device.

Layouts (`wrap_step`):

* ``"single"`` -- plain `jax.jit`, no mesh, collectives are identities;
* ``"shard_map"`` -- `jax.shard_map` over a ``(data, tensor)`` mesh, manual over
  ``data`` only. The ``tensor`` axis is compiler-managed: weights arrive split over
  ``tensor`` (heads, MLP units, vocabulary) and XLA partitions the matmuls, reducing
  max/sum partial results over ``tensor`` for vocabulary reductions instead of
  gathering logits. This keeps the model code free of hand-written collectives
  while the HLO stays vocabulary-parallel (audited by the tests);
* ``"pmap"`` -- the classic `jax.pmap(axis_name="data")` path, data-parallel only.
  The state is stacked with one replica per device.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshdistill import losses
from meshdistill.mesh import DATA, TENSOR, make_mesh
from meshdistill.models._build import abstract_params

BACKENDS = ("single", "shard_map", "pmap")
# Batch keys of a teacher given by its top-k instead of its weights (`meshdistill.losses.TopK`):
# ids and log-probs [B, T, K], tail log-mass [B, T]; see `meshdistill.teacher_cache`.
TOPK_KEYS = ("teacher_ids", "teacher_logprobs", "teacher_tail")


class TrainState(NamedTuple):
  """Everything a step updates. ``params = {"student": nnx.State, "strategy": pytree}``."""

  step: jax.Array  # int32 scalar
  params: Any
  opt_state: Any


def _psum(x, axis: str | None):
  return x if axis is None else jax.lax.psum(x, axis)


def per_device_step(
    state: TrainState,
    teacher_params: Any,
    batch: dict[str, jax.Array],
    *,
    student_def: nnx.GraphDef,
    teacher_def: nnx.GraphDef,
    strategy: Any,
    optimizer: optax.GradientTransformation,
    data_axis: str | None,
    vocab: int | None = None,
    trainable: Any = None,
):
  """One step on this device's rows ``batch = {inputs, targets, mask}: [b, T]``.

  With `TOPK_KEYS` in ``batch`` the teacher is not run: its top-k from the batch (an offline cache,
  `meshdistill.teacher_cache`, or a teacher on its own devices, `meshdistill.teacher_mesh`) is
  handed to the strategy as a `meshdistill.losses.TopK`.

  ``trainable``: an nnx filter of the student parameters that train (e.g. ``nnx.LoRAParam``); the
  others are inputs of the step only: no gradient, no optimizer state, never moved (`split_trainable`).
  ``None``: the whole student trains.

  ``vocab``: when teacher and student vocabularies differ only by padding rows, the shared
  range ``[0, vocab)``; both models' logits (and LM heads) are sliced to it before the loss.

  Returns ``(new_state, metrics)``; metrics are token means over the global batch
  (plus ``grad_norm`` and ``tokens``), identical on every device.
  """
  capture = tuple(strategy.capture)
  # A strategy with `needs_head` forms logits itself from the final hidden states and the
  # LM heads (e.g. chunked over tokens); the models then skip their heads (`needs_logits`).
  with_logits = getattr(strategy, "needs_logits", True)
  with_head = getattr(strategy, "needs_head", False)
  inputs_BxT, targets_BxT = batch["inputs"], batch["targets"]
  mask_BxT = batch["mask"].astype(jnp.float32)

  if TOPK_KEYS[0] in batch:  # a teacher given by its top-k (offline cache, or a teacher on other devices)
    teacher_out = losses.TopK(*(jax.lax.stop_gradient(batch[k]) for k in TOPK_KEYS))
    teacher_head = None
  else:
    teacher = nnx.merge(teacher_def, teacher_params)
    teacher_out = _vocab_slice(jax.lax.stop_gradient(teacher(inputs_BxT, capture=capture, logits=with_logits)), vocab)
    teacher_head = jax.lax.stop_gradient(teacher.head_weight()[:, :vocab]) if with_head else None

  tokens = _psum(jnp.sum(mask_BxT), data_axis)
  # A strategy whose loss is a mean over something else than tokens (pairs of rows: preference
  # losses) says how many of those its local rows hold (`count`); the step sums that over `data`.
  count = getattr(strategy, "count", None)
  denom = jnp.maximum(tokens if count is None else _psum(count(mask_BxT), data_axis), 1.0)

  params_in, frozen = split_trainable(state.params, trainable)

  def loss_fn(params):
    params = join_trainable(params, frozen)
    student = nnx.merge(student_def, params["student"])
    student_out = _vocab_slice(student(inputs_BxT, capture=capture, logits=with_logits), vocab)
    if with_head:  # token sums over all local rows; heads [D, V] with V split over `tensor`
      heads = (student.head_weight()[:, :vocab], teacher_head)
      sums = strategy.per_batch(params["strategy"], student_out, teacher_out, heads, targets_BxT, mask_BxT, state.step)
      return sums["loss"] / denom, sums
    per_seq = jax.vmap(strategy.per_sequence, in_axes=(None, 0, 0, 0, 0, None))
    sums_B = per_seq(params["strategy"], student_out, teacher_out, targets_BxT, mask_BxT, state.step)
    sums = jax.tree.map(jnp.sum, sums_B)
    return sums["loss"] / denom, sums

  (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(params_in)
  grads = _psum(grads, data_axis)
  sums = _psum(sums, data_axis)

  updates, opt_state = optimizer.update(grads, state.opt_state, params_in)
  params = join_trainable(optax.apply_updates(params_in, updates), frozen)

  metrics = {k: v / denom for k, v in sums.items()}
  metrics["grad_norm"] = optax.global_norm(grads)
  metrics["tokens"] = tokens
  return TrainState(state.step + 1, params, opt_state), metrics


def split_trainable(params: dict, trainable: Any) -> tuple[dict, Any]:
  """``(trained, frozen)``: ``params`` with only the student parameters matching the nnx filter
  ``trainable`` (strategy parameters always train), and the rest of the student; ``trainable=None``:
  ``(params, None)``. The optimizer sees ``trained`` only."""
  if trainable is None:
    return params, None
  trained, frozen = nnx.split_state(params["student"], trainable, ...)
  return {**params, "student": trained}, frozen


def join_trainable(trained: dict, frozen: Any) -> dict:
  """The inverse of `split_trainable`."""
  if frozen is None:
    return trained
  return {**trained, "student": nnx.merge_state(trained["student"], frozen)}


def _vocab_slice(out, vocab: int | None):
  """``out`` with logits [B, T, V] cut to [B, T, vocab] (still split over ``tensor``); ``vocab=None`` keeps all."""
  if vocab is None or out.logits is None or out.logits.shape[-1] == vocab:
    return out
  return out._replace(logits=out.logits[..., :vocab])


def resolve_backend(backend: str | None, mesh: Mesh | None) -> tuple[str, Mesh | None]:
  """Validates a ``(backend, mesh)`` pair; returns the backend to use and its mesh.

  ``None`` picks ``"shard_map"`` with a mesh and ``"single"`` without; ``"pmap"`` without a
  mesh gets a ``data``-only mesh over all devices.
  """
  backend = backend or ("shard_map" if mesh is not None else "single")
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
  if backend == "shard_map" and mesh is None:
    raise ValueError("backend='shard_map' needs a mesh: pass mesh=meshdistill.make_mesh(data=..., tensor=...)")
  if backend == "single" and mesh is not None and mesh.size > 1:
    raise ValueError(f"backend='single' runs on one device but mesh has {mesh.size}; pass mesh=None")
  if backend == "pmap":
    if mesh is None:
      mesh = make_mesh(data=jax.device_count(), tensor=1)
    if mesh.shape[TENSOR] != 1:
      raise ValueError(
          f"backend='pmap' is data-parallel only, but mesh tensor={mesh.shape[TENSOR]}; use "
          "backend='shard_map' to split weights over tensor, or a mesh with tensor=1 "
          f"(make_mesh(data={mesh.size}, tensor=1))"
      )
  return backend, mesh


def wrap_step(step_fn, backend: str, mesh: Mesh | None, state_shardings: Any = None, compiler_options=None):
  """Compiles ``step_fn(state, teacher_params, batch, data_axis=...)`` for a layout.

  ``state_shardings`` (shard_map only) pins the output state to the input layout so the
  step never recompiles and the state keeps its sharding. ``compiler_options``: XLA options
  of the step's compilation (``single`` / ``shard_map``; ``jax.pmap`` takes none).
  """
  if compiler_options and backend == "pmap":
    raise ValueError("compiler_options need backend 'single' or 'shard_map': jax.pmap takes no compiler options")
  if backend == "single":
    return jax.jit(functools.partial(step_fn, data_axis=None), donate_argnums=0, compiler_options=compiler_options)
  if backend == "shard_map":
    # A size-1 `data` axis needs no collective (and XLA rejects an all-reduce over a
    # trivial manual axis), so the sum over `data` is dropped there.
    data_axis = DATA if mesh.shape[DATA] > 1 else None

    def pinned_step(state, teacher_params, batch):
      new_state, metrics = step_fn(state, teacher_params, batch, data_axis=data_axis)
      if state_shardings is not None:
        # Without this XLA leaves the updated weights replicated over `tensor` at the
        # shard_map boundary (an all-gather of every weight, vocabulary included).
        new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
      return new_state, metrics

    body = jax.shard_map(
        pinned_step,
        mesh=mesh,
        in_specs=(P(), P(), P(DATA)),
        out_specs=(P(), P()),
        axis_names={DATA},
        check_vma=False,  # gradients are summed over `data` explicitly, as in pmap
    )
    metric_sharding = NamedSharding(mesh, P())
    out_shardings = None if state_shardings is None else (state_shardings, metric_sharding)
    return jax.jit(body, donate_argnums=0, out_shardings=out_shardings, compiler_options=compiler_options)
  if backend == "pmap":
    devices = list(mesh.devices.flat)
    return jax.pmap(
        functools.partial(step_fn, data_axis=DATA),
        axis_name=DATA,
        devices=devices,
        donate_argnums=0,
    )
  raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")


class StepVariants:
  """A trainer's compiled step (`meshdistill.Distiller`, `meshdistill.hardlabel.HardLabelTrainer`), and
  copies of the trainer that build that step differently. Train states carry over between them;
  nothing is copied or re-placed, and each copy's step compiles once, on first use.

  A trainer using it holds ``_step_fn`` (a ``functools.partial`` of its per-device step),
  ``_compiled``, ``backend``, ``mesh``, ``student_cfg`` and ``student_def``; ``_MODEL_DEF`` names
  the keyword of the step function that takes the student's graph definition.
  """

  _MODEL_DEF = "student_def"
  compiler_options: dict | None = None  # XLA options of the step (see `wrap_step`)

  def compiled_step(self, state: TrainState):
    """The step compiled for ``state``'s layout (its output state is pinned to it on ``shard_map``)."""
    if self._compiled is None:
      shardings = jax.tree.map(lambda x: x.sharding, state) if self.backend == "shard_map" else None
      self._compiled = wrap_step(self._step_fn, self.backend, self.mesh, shardings, self.compiler_options)
    return self._compiled

  def _variant(self, **step_keywords):
    new = copy.copy(self)
    new._step_fn = functools.partial(self._step_fn.func, **{**self._step_fn.keywords, **step_keywords})
    new._compiled = None
    new._strategy_variants = {}  # variants of the copy are its own
    return new

  def with_compiler_options(self, options: dict | None):
    """A copy whose step compiles with the XLA ``options`` (e.g. `meshdistill.memory.CPU_MEMORY_SCHEDULER`)."""
    new = self._variant()
    new.compiler_options = dict(options) if options else None
    return new

  def with_remat(self, remat: str):
    """A copy whose student recomputes activations with policy ``remat`` (it changes no parameter,
    so ``init_state()`` still starts from the same student)."""
    cfg = self.student_cfg.replace(remat=remat)  # validates the name
    graphdef = abstract_params(cfg)[0]
    if getattr(self, "trainable", None) is not None:  # a student beyond the plain decoder (LoRA): keep its graph
      model = nnx.merge(self.student_def, self._student_init)
      model.cfg = cfg
      graphdef = nnx.split(model)[0]
    new = self._variant(**{self._MODEL_DEF: graphdef})
    new.student_cfg, new.student_def = cfg, graphdef
    return new
