"""The `Layout`: where a trainer's arrays live and how its one step is compiled.

A `Layout` places parameters and host batches, builds a fresh `TrainState` (optimizer moments take their
parameter's sharding), compiles the per-device step, and converts between its state form and one replica
(`unreplicate` / `replicate`). Trainers, checkpoints, evaluation and jobs ask it; none of them tests a backend
name. This module holds the base class, `GlobalArrayLayout` (the layouts whose states are global arrays placed by
shardings) and what every layout shares (the ``mesh.student_split`` values, the batch's step keys, a step-0 state); the layouts themselves (``single``, ``shard_map``, ``pmap``) and the registry
that picks one by name (`make_layout`, `layout_class`) are `meshdistill.parallel.backends`.
"""

from __future__ import annotations

import abc
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from meshdistill.parallel import fsdp as fsdp_lib
from meshdistill.parallel import rules as rules_lib
from meshdistill.parallel.mesh import DATA, TENSOR, check_batch, global_batch_size
from meshdistill.core.batch import BATCH_KEYS, CROSS_KEYS, MULTI_KEYS, SEGMENT_KEYS, TARGET_LOGPROB_KEY, TOPK_KEYS
from meshdistill.core.state import TrainState, split_trainable

# How the student is laid out over `tensor` (`mesh.student_split`): split like the teacher, or replicated with
# the batch rows split over `tensor` as well (`meshdistill.parallel.backends.ShardMapLayout`).
STUDENT_SPLITS = ("tensor", "batch")
STUDENT_SPLIT_SETTING = "mesh.student_split"


def host_batch(batch: dict) -> dict:
  """The step's keys of a batch (a teacher's top-k, several teachers' own top-k, a teacher's own tokens, or packed
  documents' segment ids and positions, when they come with the batch, included); device arrays kept."""
  extra = TOPK_KEYS + MULTI_KEYS + CROSS_KEYS + (TARGET_LOGPROB_KEY,) + SEGMENT_KEYS
  keys = BATCH_KEYS + tuple(k for k in extra if k in batch)
  return {k: batch[k] if isinstance(batch[k], jax.Array) else np.asarray(batch[k]) for k in keys}


def fresh_train_state(optimizer: optax.GradientTransformation, trainable, params):
  """Step 0, a copy of ``params`` (so the caller's buffers survive donation) and fresh optimizer state of the
  parameters that train (``trainable``: an nnx filter of the student's, see `meshdistill.train.step.split_trainable`)."""
  params = jax.tree.map(jnp.copy, params)
  return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(split_trainable(params, trainable)[0]))


def stack_replicas(tree, n: int):
  """``n`` stacked host copies of every leaf: the classic pmap layout of a replicated state."""
  return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))).copy(), tree)


class Layout(abc.ABC):
  """Where arrays live and how the step runs; subclasses are the layouts (`meshdistill.parallel.backends`)."""

  name: ClassVar[str]
  one_device: ClassVar[bool] = False  # runs without a mesh, on one device
  stacked: ClassVar[bool] = False  # states carry one replica per device along a leading axis
  takes_compiler_options: ClassVar[bool] = True  # the step's compilation accepts XLA options
  spans_processes: ClassVar[bool] = False  # one mesh may cover the devices of several processes
  supports_fsdp: ClassVar[bool] = False  # weights (and optimizer moments) may be split over `data` (`fsdp`)
  # The mesh axes the layout uses, in mesh order: the config's `mesh` sizes and the planner's search range over
  # them; a mesh may have more axes (each then needs size 1 here, or rules that use it).
  axes: ClassVar[tuple[str, ...]] = (DATA, TENSOR)

  def __init__(self, mesh: Mesh | None, fsdp: bool = False, student_split: str = "tensor"):
    if fsdp and not self.supports_fsdp:
      raise ValueError(fsdp_lib.unsupported(self.name))
    check_student_split(student_split, fsdp)
    self.mesh = mesh
    self.fsdp = bool(fsdp)  # weights of both models split over `data` as well (`meshdistill.parallel.fsdp`)
    self.student_split = student_split

  @property
  def rules(self) -> rules_lib.Rules:
    """The rules table mapping the models' logical dimension names to this layout's mesh axes
    (`meshdistill.parallel.rules`)."""
    return rules_lib.REPLICATED

  @property
  def student_rows(self) -> bool:
    """The student is replicated and runs on rows split over ``tensor`` as well (``student_split="batch"`` on a
    mesh whose ``tensor`` axis has more than one device; elsewhere both splits are the same layout)."""
    return self.student_split == "batch" and self.mesh is not None and self.mesh.shape[TENSOR] > 1

  # ------------------------------------------------------------------ settings
  @classmethod
  def check_settings(cls, data: int, tensor: int, axes: dict | None = None) -> str | None:
    """What is wrong with a ``mesh.data`` x ``mesh.tensor`` config (``axes``: ``mesh.axes``, the mesh's other
    axes) for this layout, or None. The base: axes the layout does not declare (`axes`) hold replicas."""
    del data, tensor, axes
    return None

  @classmethod
  def resolve_mesh(cls, mesh: Mesh | None) -> Mesh | None:
    """The mesh to run on (validated; a default where the layout has one)."""
    return mesh

  @classmethod
  def describe(cls, data: int, tensor: int) -> str:
    """The layout of ``data`` x ``tensor`` devices in words."""
    return f"{data}x{tensor} (data x tensor)"

  @property
  def n_replicas(self) -> int:
    """Number of ``data`` shards of the batch."""
    return 1 if self.mesh is None else self.mesh.shape[DATA]

  def fit_model(self, model):
    """``model`` with this layout's rules applied (weights split over ``data`` or not, `fsdp`); raises when it cannot
    be laid out here. A model whose vocabulary or key/value head count ``tensor`` does not divide is first padded /
    re-partitioned for `vocab_ways` (`meshdistill.models.fit_model`, which the `Distiller` applies before this)."""
    return rules_lib.apply(model, self.rules, self.mesh)

  def vocab_ways(self) -> int | None:
    """The number of ways this layout splits a model's vocabulary (a model is padded for it first), or None: it
    takes a model as it is."""
    return None

  @property
  def eval_mesh(self) -> Mesh | None:
    """The mesh evaluation places batches on (None: the default device)."""
    return None

  # ------------------------------------------------------------------ placement
  @abc.abstractmethod
  def place_params(self, params):
    """Puts model parameters (an ``nnx.State``) where the step reads them."""

  @abc.abstractmethod
  def place_batch(self, batch: dict) -> dict:
    """Puts a host batch ``{inputs, targets, mask}`` [B, T] where the step reads it."""

  def check_batch(self, batch_size: int) -> None:
    check_batch(batch_size, self.mesh)
    if self.student_rows:
      data, tensor = self.mesh.shape[DATA], self.mesh.shape[TENSOR]
      batch_size = global_batch_size(batch_size, self.mesh)  # a process passes its own rows
      if batch_size % (data * tensor):
        raise ValueError(
            f"train.batch_size={batch_size} with {STUDENT_SPLIT_SETTING}='batch': the student runs on rows split over "
            f"mesh.data={data} x mesh.tensor={tensor} devices, so the batch size must be a multiple of {data * tensor} "
            f"(e.g. {data * tensor * max(1, round(batch_size / (data * tensor)))}); or set {STUDENT_SPLIT_SETTING}="
            "'tensor'"
        )

  @abc.abstractmethod
  def fresh_state(self, optimizer, params: dict, trainable=None):
    """A step-0 `TrainState` of ``params = {"student": ..., "strategy": ...}`` in this layout's state form."""

  def fresh_program(self, key, make):
    """The jitted program that makes step-0 states, ``make()`` once per ``key`` (the optimizer, the trainable filter
    and where the state's leaves go) and kept on this layout: the fresh states of several seeds or runs of one
    trainer compile once (a new jit per call would compile each time). An unhashable key is not kept."""
    try:
      hash(key)
    except TypeError:  # e.g. a trainable filter given as a list
      return make()
    programs = self.__dict__.setdefault("_fresh_programs", {})
    if key not in programs:
      programs[key] = make()
    return programs[key]

  # ------------------------------------------------------------------ the step
  def state_shardings(self, state) -> Any:
    """The shardings `compile` pins a step's output state to (None: the layout needs no pinning)."""
    del state
    return None

  @abc.abstractmethod
  def compile(self, step_fn, state_shardings: Any = None, compiler_options: dict | None = None):
    """``step_fn(state, teacher_params, batch, data_axis=...)`` compiled for this layout.

    ``state_shardings`` (`state_shardings` of a state) pin the output state to the input layout, so
    the step never recompiles and the state keeps its sharding. ``compiler_options``: XLA options.
    """

  def host_metrics(self, metrics: dict) -> dict:
    """The step's metrics as one value each (still on device)."""
    return metrics

  # ------------------------------------------------------------------ replicas
  def unreplicate(self, tree):
    """One replica of a tree in this layout's state form (the tree itself where states are not stacked)."""
    return tree

  def replicate(self, tree):
    """The inverse of `unreplicate`: a tree of one replica in this layout's state form."""
    return tree

  def checkpoint_target(self, state):
    """Abstract leaves (shape, dtype, sharding) a checkpoint of ``state`` is restored onto."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


class GlobalArrayLayout(Layout):
  """A layout whose states are plain global arrays placed by shardings (``single``, ``shard_map``): it says where
  parameters go (`_device_shardings`); placement and fresh states follow from that."""

  @abc.abstractmethod
  def _device_shardings(self, params):
    """Shardings of model parameters ``params`` (an ``nnx.State``, split as its partition metadata says)
    and of replicated leaves."""

  def place_params(self, params):
    shardings, _ = self._device_shardings(params)
    return jax.device_put(params, shardings)

  def fresh_state(self, optimizer, params: dict, trainable=None):
    """A step-0 `TrainState` of ``params = {"student": ..., "strategy": ...}``: the student split as its
    partition metadata says, strategy parameters replicated, optimizer moments (of the ``trainable``
    parameters only) sharded as their parameters."""
    fresh, shardings, out_shardings = self.state_plan(optimizer, params, trainable)
    leaves, tree = jax.tree.flatten(out_shardings)
    program = self.fresh_program((optimizer, trainable, tree, tuple(leaves)),
                                 lambda: jax.jit(fresh, out_shardings=out_shardings))
    return program(jax.device_put(params, shardings))

  def state_plan(self, optimizer, params: dict, trainable=None):
    """``(fresh, param_shardings, state_shardings)`` of `fresh_state`: the function making a step-0 state
    from ``params``, where the params go and where each leaf of the state goes (``params`` may be abstract)."""
    student_sh, replicated = self._device_shardings(params["student"])
    if self.student_rows:  # a replica of the student on every device (`meshdistill.parallel.backends.ShardMapLayout`)
      student_sh = jax.tree.map(lambda _: replicated, student_sh)
    shardings = {"student": student_sh, "strategy": jax.tree.map(lambda _: replicated, params["strategy"])}
    fresh = functools.partial(fresh_train_state, optimizer, trainable)
    abstract = jax.eval_shape(fresh, params)
    opt = optax.tree_utils.tree_map_params(
        optimizer, lambda _, sharding: sharding, abstract.opt_state, split_trainable(shardings, trainable)[0],
        transform_non_params=lambda _: replicated,
    )
    return fresh, shardings, type(abstract)(replicated, shardings, opt)


def check_student_split(student_split: str, fsdp: bool = False) -> None:
  """Raises a clear error for a ``mesh.student_split`` value that does not exist or does not combine with fsdp."""
  if student_split not in STUDENT_SPLITS:
    raise ValueError(f"{STUDENT_SPLIT_SETTING}={student_split!r}; choose one of {list(STUDENT_SPLITS)}")
  if fsdp and student_split == "batch":
    raise ValueError(
        f"{fsdp_lib.SETTING}=true with {STUDENT_SPLIT_SETTING}='batch': fsdp splits both models' weights over data, "
        f"'batch' keeps a whole student on every device; use one of them ({STUDENT_SPLIT_SETTING}='tensor' with "
        f"{fsdp_lib.SETTING}=true, or {fsdp_lib.SETTING}=false)"
    )
