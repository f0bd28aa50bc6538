"""The layouts (`meshdistill.parallel.layout.Layout` subclasses), one per ``mesh.backend``, and the registry
that picks one by name. This is the only module that knows the layouts.

* ``single`` (`SingleLayout`) -- plain `jax.jit` on one device, no mesh; collectives are identities;
* ``shard_map`` (`ShardMapLayout`) -- `jax.shard_map` over a ``(data, tensor)`` mesh, manual over
  ``data`` only. The ``tensor`` axis is compiler-managed: weights arrive split over ``tensor``
  (heads, MLP units, vocabulary) and XLA partitions the matmuls, reducing max/sum partial results
  over ``tensor`` for vocabulary reductions instead of gathering logits (audited by the tests);
  With ``fsdp`` (``mesh.fsdp``) weights are split over ``data`` too (`meshdistill.parallel.fsdp`): the step's
  gradient half runs under the ``shard_map``, the optimizer update on the global arrays.
  With ``student_split="batch"`` (``mesh.student_split``) only the teacher is split over ``tensor``; the
  student is replicated and runs on rows split over ``data`` x ``tensor`` (see `ShardMapLayout`).
  With a ``context`` axis (``mesh.axes: {context: n}``) the step is manual over it too and each device runs on a
  slice of its rows' tokens (context parallelism, see `ShardMapLayout`);
* ``pmap`` (`PmapLayout`) -- the classic `jax.pmap(axis_name="data")` path, data-parallel only. The
  state is stacked with one replica per device.

A new layout is one more `Layout` subclass here, registered in `LAYOUTS`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from meshdistill.core.batch import CROSS_KEYS, MULTI_KEYS
from meshdistill.core.state import SplitStep, TrainState, split_trainable
from meshdistill.parallel import fsdp as fsdp_lib
from meshdistill.parallel.layout import (
    STUDENT_SPLIT_SETTING, GlobalArrayLayout, Layout, fresh_train_state, host_batch, stack_replicas,
)
from meshdistill.parallel.mesh import CONTEXT, DATA, TENSOR, host_to_global, make_mesh
from meshdistill.parallel import rules as rules_lib
from meshdistill.parallel.rules import fitted_shardings, split_ways


class SingleLayout(GlobalArrayLayout):
  """One device, plain `jax.jit`."""

  name = "single"
  one_device = True

  @classmethod
  def check_settings(cls, data: int, tensor: int, axes: dict | None = None) -> str | None:
    others = "".join(f" x mesh.axes.{k}={v}" for k, v in (axes or {}).items() if v != 1)
    if data * tensor != 1 or others:
      return (
          f"mesh.backend='single' runs on one device but mesh.data={data} x mesh.tensor={tensor}{others}; "
          "set every size to 1, or use mesh.backend='shard_map'"
      )
    return None

  @classmethod
  def resolve_mesh(cls, mesh):
    if mesh is not None and mesh.size > 1:
      raise ValueError(f"backend='single' runs on one device but mesh has {mesh.size}; pass mesh=None")
    return mesh

  @classmethod
  def describe(cls, data: int, tensor: int) -> str:
    del data, tensor
    return "1 device"

  def _device_shardings(self, params):
    device = SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: device, params), device

  def place_batch(self, batch):
    return jax.device_put(host_batch(batch), jax.devices()[0])

  def compile(self, step_fn, state_shardings=None, compiler_options=None):
    del state_shardings
    return jax.jit(functools.partial(step_fn, data_axis=None), donate_argnums=0, compiler_options=compiler_options)


class ShardMapLayout(GlobalArrayLayout):
  """A ``(data, tensor)`` mesh: manual over ``data`` (`jax.shard_map`), compiler-managed over ``tensor``.

  ``student_split="tensor"`` (default): both models split Megatron-style over ``tensor``. ``"batch"``: the
  teacher as before; the student replicated over ``tensor``, and its forward, loss and backward run in a
  nested ``shard_map`` manual over ``tensor`` too, on the local rows split once more (`meshdistill.train.step`,
  ``student_axis``). The teacher's outputs reach the student's rows by one all-to-all of its logits (or, for a
  strategy forming logits from hidden states, one gather of its LM head: its hidden states are replicated over
  ``tensor`` already), and the gradients and token sums are summed over both axes at once. A student small
  enough to hold whole on each device then spends no all-reduce on its activations: on the 2x4 benchmark step
  (`benchmarks/throughput.py`) that is most of the step's collectives. The batch must be a multiple of
  ``data * tensor``; the student's optimizer moments are replicated as well (memory: `meshdistill.planner`).

  Context parallelism: a mesh with a ``context`` axis (``mesh.axes: {context: n}``, e.g. ``data=2 x context=2 x
  tensor=2``) runs the step manual over ``data`` and ``context``: the batch is placed split over ``data`` only and
  the ``shard_map`` hands each device its slice of ``seq_len / n`` tokens of every row (a local slice, no transfer).
  Both models run on the slice, attention gathering the whole row's keys and values over ``context``
  (`meshdistill.models._context.ContextShard`: causal mask, window and packed documents on global token indices);
  the loss, chunked or not, and the teacher's logits are the slice's; gradients and token sums are summed over
  ``data`` and ``context`` (the step's ``data_axis`` names both). Weights are replicated over ``context`` (no rule
  splits over it): the axis trades activation memory, which grows with the sequence, for the gathers of keys and
  values. Same numbers as one device. Not with ``student_split="batch"``, several teachers' own top-k or a teacher
  of another tokenizer (their batch keys are laid out otherwise), nor a strategy whose loss is a mean over whole
  rows (preference pairs).
  """

  name = "shard_map"
  spans_processes = True

  def __init__(self, mesh, fsdp: bool = False, student_split: str = "tensor"):
    super().__init__(mesh, fsdp, student_split)
    if self.context_ways > 1 and self.student_rows:
      raise ValueError(
          f"mesh.student_split='batch' with mesh.axes.context={self.context_ways}: the student would run on rows split "
          "over tensor while its tokens are split over context; use mesh.student_split='tensor' with context "
          "parallelism, or mesh.axes.context=1")

  @property
  def context_ways(self) -> int:
    """Into how many slices the step splits each row's tokens (the mesh's ``context`` axis; 1 without one)."""
    return 1 if self.mesh is None else int(dict(self.mesh.shape).get(CONTEXT, 1))

  def _row_axes(self) -> tuple[str, ...]:
    """The axes the step's rows and tokens are split over that need sums (size above 1): ``data``, ``context``."""
    return tuple(a for a in (DATA, CONTEXT) if dict(self.mesh.shape).get(a, 1) > 1)

  def _batch_specs(self, batch: dict):
    """The step's ``shard_map`` specs of ``batch``: rows over ``data``; with ``context``, tokens (the second
    dimension of every [B, T, ...] key) over it as well. Raises for keys laid out otherwise and a length ``context``
    does not divide."""
    n = self.context_ways
    if n == 1:
      return P(DATA)
    refused = [k for k in (*MULTI_KEYS, *CROSS_KEYS) if k in batch]
    if refused:
      raise ValueError(
          f"mesh.axes.context={n} splits each row's tokens, but the batch carries {refused[0]!r} (several teachers' "
          "own top-k, or a teacher of another tokenizer), whose second dimension is not the row's tokens; use "
          "mesh.axes.context=1 with them")
    T = np.shape(batch["inputs"])[1]
    if T % n:
      ok = [d for d in range(1, T + 1) if T % d == 0 and d <= self.mesh.size]
      raise ValueError(
          f"sequence length {T} (data.seq_len) is not divisible by mesh.axes.context={n}: each device holds seq_len / "
          f"context tokens of every row; use a seq_len that is a multiple of {n}, or mesh.axes.context in {ok}")
    return {k: P(DATA, CONTEXT) if np.ndim(x) >= 2 else P(DATA) for k, x in batch.items()}

  @classmethod
  def resolve_mesh(cls, mesh):
    if mesh is None:
      raise ValueError("backend='shard_map' needs a mesh: pass mesh=meshdistill.make_mesh(data=..., tensor=...)")
    return mesh

  supports_fsdp = True

  def vocab_ways(self):
    return split_ways(self.mesh, "vocab", self.rules)

  @property
  def rules(self):
    return rules_lib.FSDP if self.fsdp else rules_lib.TENSOR_PARALLEL

  @property
  def eval_mesh(self):
    return self.mesh

  def _device_shardings(self, params):
    # Partition metadata, minus `tensor` on dimensions it does not divide (quantization scales).
    return fitted_shardings(params, self.mesh), NamedSharding(self.mesh, P())

  def place_batch(self, batch):
    return host_to_global(host_batch(batch), self.mesh)

  def state_shardings(self, state):
    return jax.tree.map(lambda x: x.sharding, state)

  def compile(self, step_fn, state_shardings=None, compiler_options=None):
    # A size-1 `data` axis needs no collective (and XLA rejects an all-reduce over a
    # trivial manual axis), so the sum over `data` is dropped there.
    # With context parallelism the sums cover `context` too (each device held a slice of its rows' tokens).
    row_axes = self._row_axes()
    data_axis = None if not row_axes else row_axes[0] if len(row_axes) == 1 else row_axes
    out_shardings = None if state_shardings is None else (state_shardings, NamedSharding(self.mesh, P()))
    jit = functools.partial(jax.jit, donate_argnums=0, out_shardings=out_shardings, compiler_options=compiler_options)
    halves = SplitStep.halves(step_fn)
    if halves is None:  # a step that is not a `SplitStep` (`wrap_step`): the whole step per device
      if self.fsdp:
        raise ValueError(f"{fsdp_lib.SETTING}=true needs a step given as its gradient and update halves (a partial of a "
                         "meshdistill.core.state.SplitStep, e.g. meshdistill.train.step.per_device_step); wrap_step of "
                         "another function runs with mesh.fsdp=false")
      if self.student_rows:
        raise ValueError(f"{STUDENT_SPLIT_SETTING}='batch' needs a step given as its gradient and update halves (a "
                         "partial of a meshdistill.core.state.SplitStep, e.g. meshdistill.train.step.per_device_step: it runs "
                         f"the student on rows split over tensor); wrap_step of another function runs with "
                         f"{STUDENT_SPLIT_SETTING}='tensor'")
      return jit(self._whole_step(step_fn, data_axis, state_shardings))
    gradients, update = halves
    if self.student_rows:  # the student's part on rows split over `tensor` too
      gradients = functools.partial(gradients, student_axis=TENSOR)
    trainable = step_fn.keywords.get("trainable")
    specs = fsdp_lib.data_specs

    def program(state, teacher_params, batch):
      # The gradient half per device (manual over `data`); weights split over `data` arrive as shards.
      inputs = TrainState(state.step, state.params, None)  # no optimizer state: it never needs gathering
      body = jax.shard_map(
          functools.partial(gradients, data_axis=data_axis), mesh=self.mesh,
          in_specs=(specs(inputs), specs(teacher_params), self._batch_specs(batch)),
          out_specs=(specs(split_trainable(state.params, trainable)[0]), P()),
          axis_names=self._manual_axes(), check_vma=False,  # gradients are summed over `data` explicitly, as in pmap
      )
      grads, metrics = body(inputs, teacher_params, batch)
      if state_shardings is not None:  # gradients laid out as their parameters
        grads = jax.lax.with_sharding_constraint(grads, split_trainable(state_shardings.params, trainable)[0])
      # The update on the global arrays (compiler-managed): global norms and moments of whole gradients.
      new_state, metrics = update(state, grads, metrics, one_device=self.mesh.size == 1)
      if state_shardings is not None:
        new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
      return new_state, metrics

    return jit(program)

  def _whole_step(self, step_fn, data_axis, state_shardings):
    def pinned_step(state, teacher_params, batch):
      new_state, metrics = step_fn(state, teacher_params, batch, data_axis=data_axis)
      if state_shardings is not None:  # else XLA leaves the updated weights replicated over `tensor`
        new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
      return new_state, metrics

    def program(state, teacher_params, batch):
      return jax.shard_map(pinned_step, mesh=self.mesh, in_specs=(P(), P(), self._batch_specs(batch)),
                           out_specs=(P(), P()), axis_names=self._manual_axes(), check_vma=False)(
                               state, teacher_params, batch)

    return program

  def _manual_axes(self) -> set[str]:
    """The axes the step runs manual over: ``data``, and ``context`` where it splits the sequence."""
    return {DATA, CONTEXT} if self.context_ways > 1 else {DATA}


class PmapLayout(Layout):
  """`jax.pmap` over the devices of a ``data``-only mesh; states stacked, one replica per device."""

  name = "pmap"
  stacked = True
  takes_compiler_options = False

  @classmethod
  def check_settings(cls, data: int, tensor: int, axes: dict | None = None) -> str | None:
    del data
    others = [f"mesh.axes.{k}={v}" for k, v in (axes or {}).items() if v != 1]
    if tensor != 1 or others:
      bad = ", ".join(([f"mesh.tensor={tensor}"] if tensor != 1 else []) + others)
      return f"mesh.backend='pmap' is data-parallel only: {bad} must be 1 (or use mesh.backend='shard_map')"
    return None

  @classmethod
  def resolve_mesh(cls, mesh):
    if mesh is None:
      mesh = make_mesh(data=jax.device_count(), tensor=1)
    if mesh.shape[TENSOR] != 1:
      raise ValueError(
          f"backend='pmap' is data-parallel only, but mesh tensor={mesh.shape[TENSOR]}; use "
          "backend='shard_map' to split weights over tensor, or a mesh with tensor=1 "
          f"(make_mesh(data={mesh.size}, tensor=1))"
      )
    return mesh

  def place_params(self, params):
    return self.replicate(jax.device_get(params))

  def place_batch(self, batch):
    n = self.mesh.size
    return {k: np.asarray(v).reshape(n, -1, *np.shape(v)[1:]) for k, v in host_batch(batch).items()}

  def fresh_state(self, optimizer, params, trainable=None):
    host = jax.device_get(params)
    program = self.fresh_program((optimizer, trainable),
                                 lambda: jax.jit(functools.partial(fresh_train_state, optimizer, trainable)))
    return self.replicate(jax.device_get(program(host)))

  def compile(self, step_fn, state_shardings=None, compiler_options=None):
    del state_shardings
    if compiler_options:
      raise ValueError("compiler_options need backend 'single' or 'shard_map': jax.pmap takes no compiler options")
    fn = functools.partial(step_fn, data_axis=DATA)
    return jax.pmap(fn, axis_name=DATA, devices=list(self.mesh.devices.flat), donate_argnums=0)

  def host_metrics(self, metrics):
    return jax.tree.map(lambda x: x[0], metrics)

  def unreplicate(self, tree):
    return jax.tree.map(lambda x: x[0], tree)

  def replicate(self, tree):
    return stack_replicas(tree, self.mesh.size)

  def checkpoint_target(self, state):
    device = SingleDeviceSharding(jax.devices()[0])
    one = self.unreplicate(state)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=device), one)


LAYOUTS: dict[str, type[Layout]] = {cls.name: cls for cls in (ShardMapLayout, SingleLayout, PmapLayout)}
BACKENDS = tuple(LAYOUTS)


def layout_class(backend: str) -> type[Layout]:
  """The `Layout` subclass named ``backend``."""
  if backend not in LAYOUTS:
    raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
  return LAYOUTS[backend]


def make_layout(backend: str | None, mesh: Mesh | None, fsdp: bool = False, student_split: str = "tensor") -> Layout:
  """The layout of a ``(backend, mesh)`` pair. ``None`` picks ``"shard_map"`` with a mesh and ``"single"``
  without; ``"pmap"`` without a mesh gets a ``data``-only mesh over all devices. ``fsdp``: weights split over
  ``data`` too (`meshdistill.parallel.fsdp`; shard_map only). ``student_split``: ``"tensor"`` or ``"batch"`` (see
  `ShardMapLayout`; on layouts without a ``tensor`` axis both are the same)."""
  if isinstance(backend, Layout):  # a layout object already (e.g. the planner's abstract one)
    if fsdp and not backend.fsdp:
      raise ValueError(f"fsdp=True with a layout built without it: pass {type(backend).__name__}(mesh, fsdp=True)")
    if student_split != backend.student_split:
      raise ValueError(f"student_split={student_split!r} with a layout built with {backend.student_split!r}: pass "
                       f"{type(backend).__name__}(mesh, student_split={student_split!r})")
    return backend
  cls = layout_class(backend or ("shard_map" if mesh is not None else "single"))
  if fsdp and not cls.supports_fsdp:
    raise ValueError(fsdp_lib.unsupported(cls.name))
  return cls(cls.resolve_mesh(mesh), fsdp=fsdp, student_split=student_split)


def wrap_step(step_fn, backend: str, mesh: Mesh | None, state_shardings: Any = None, compiler_options=None):
  """Compiles ``step_fn(state, teacher_params, batch, data_axis=...)`` for a layout (see `Layout.compile`).

  ``state_shardings`` (shard_map only) pins the output state to the input layout.
  """
  return layout_class(backend)(mesh).compile(step_fn, state_shardings, compiler_options)
