"""The programmatic API: a `Distiller` binds teacher, student, strategy, optimizer and layout.

>>> import meshdistill as md
>>> md.simulate_cpu_devices(8)                      # doctest: +SKIP
>>> mesh = md.make_mesh(data=2, tensor=4)           # doctest: +SKIP
>>> teacher = md.init_model(md.ModelConfig(n_layers=4), seed=0, mesh=mesh)  # doctest: +SKIP
>>> student = md.init_model(md.ModelConfig(n_layers=2), seed=1, mesh=mesh)  # doctest: +SKIP
>>> d = md.Distiller(student, teacher, mesh=mesh)  # doctest: +SKIP
>>> state = d.init_state()                          # doctest: +SKIP
>>> state, metrics = d.step(state, batch)           # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshdistill.mesh import DATA, TENSOR, check_batch, host_to_global, param_shardings
from meshdistill.models import Decoder
from meshdistill.models.lora import TRAINABLE as LORA_TRAINABLE
from meshdistill.models.lora import fitted_shardings, is_lora
from meshdistill.step import TOPK_KEYS, StepVariants, TrainState, per_device_step, resolve_backend, split_trainable
from meshdistill.strategies import LogitKD
from meshdistill.teacher_cache import TopKTeacher

log = logging.getLogger(__name__)

BATCH_KEYS = ("inputs", "targets", "mask")


def default_optimizer(learning_rate: float | optax.Schedule = 1e-3, clip: float = 1.0, weight_decay: float = 0.0):
  """Global-norm clipping followed by AdamW."""
  return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(learning_rate, weight_decay=weight_decay))


class Distiller(StepVariants):
  """Distils ``teacher`` into ``student`` with one compiled step per layout.

  Args:
    student, teacher: `Decoder` modules (built with `init_model`; placed anywhere, they
      are moved onto the layout). ``teacher`` may instead be a `meshdistill.teacher_cache.TopKTeacher`
      (no weights; every batch then carries its top-k, see `meshdistill.teacher_cache`). Their
      vocabularies must match, up to padding rows: see `resolve_shared_vocab` and ``shared_vocab``
      (an explicit shared token range).
    strategy: what to distil (default `LogitKD()`: tau=2, alpha=0.5).
    optimizer: an optax transformation for the student (default `default_optimizer()`).
    mesh: a ``(data, tensor)`` mesh from `make_mesh`; ``None`` means one device.
    backend: ``"shard_map"`` (default with a mesh), ``"single"`` (default without) or
      ``"pmap"`` (data-parallel compatibility path; needs ``tensor=1``).
    trainable: an nnx filter of the student parameters that train; the optimizer holds state for
      these only and the rest never moves. Default: the adapters of a LoRA student
      (`meshdistill.models.lora.apply_lora`), otherwise the whole student.
  """

  def __init__(
      self,
      student: Decoder,
      teacher: Decoder,
      *,
      strategy: Any = None,
      optimizer: optax.GradientTransformation | None = None,
      mesh: Mesh | None = None,
      backend: str | None = None,
      seed: int = 0,
      shared_vocab: int | None = None,
      trainable: Any = None,
  ):
    # A `TopKTeacher` (an offline cache, a teacher on other devices) has no weights here: every batch
    # brings the teacher's top-k (`step.TOPK_KEYS`) and the step runs no teacher.
    self.topk_teacher = teacher if isinstance(teacher, TopKTeacher) else None
    if self.topk_teacher is not None:
      if teacher.vocab > student.cfg.vocab_size:
        raise ValueError(f"{teacher.source} has token ids up to {teacher.vocab} but the student's vocab_size is "
                         f"{student.cfg.vocab_size}; use a student of the teacher's tokenizer")
      self.shared_vocab = resolve_shared_vocab(teacher.vocab, student.cfg.vocab_size, shared_vocab)
    else:
      self.shared_vocab = resolve_shared_vocab(teacher.cfg.vocab_size, student.cfg.vocab_size, shared_vocab)
    backend, mesh = resolve_backend(backend, mesh)
    if mesh is not None and backend == "shard_map":
      student.cfg.check_tensor_split(mesh.shape[TENSOR])
      if self.topk_teacher is None:
        teacher.cfg.check_tensor_split(mesh.shape[TENSOR])

    self.mesh, self.backend = mesh, backend
    self.strategy = strategy if strategy is not None else LogitKD()
    if self.topk_teacher is not None:
      self.topk_teacher.check_strategy(self.strategy)
    self.optimizer = optimizer if optimizer is not None else default_optimizer()
    self.student_cfg, self.teacher_cfg = student.cfg, teacher.cfg
    self.max_len = min(student.cfg.max_len, teacher.cfg.max_len)
    self.seed = seed
    self.student_def, self._student_init = nnx.split(student)
    self._student_specs = nnx.get_partition_spec(self._student_init)
    if trainable is None and is_lora(self._student_init):
      trainable = LORA_TRAINABLE
    self.trainable = trainable
    if self.topk_teacher is not None:
      self.teacher_def, self.teacher_params = None, {}
    else:
      self.teacher_def, teacher_params = nnx.split(teacher)
      self.teacher_params = self._place_params(teacher_params, nnx.get_partition_spec(teacher_params))
    self._step_fn = functools.partial(
        per_device_step,
        student_def=self.student_def,
        teacher_def=self.teacher_def,
        strategy=self.strategy,
        optimizer=self.optimizer,
        vocab=self.shared_vocab,
        trainable=trainable,
    )
    self._compiled = None
    self._strategy_variants: dict = {}  # `with_strategy` results, reused

  # ------------------------------------------------------------------ placement
  @property
  def n_replicas(self) -> int:
    return 1 if self.mesh is None else self.mesh.shape[DATA]

  def _place_params(self, params, specs):
    if self.backend == "single":
      return jax.device_put(params, jax.devices()[0])
    if self.backend == "shard_map":
      return jax.device_put(params, param_shardings(specs, self.mesh))
    return stack_replicas(jax.device_get(params), self.mesh.size)

  def init_state(self, student: Decoder | None = None) -> TrainState:
    """A fresh train state from ``student`` (default: the student given at construction)."""
    params = self._student_init if student is None else nnx.state(student)
    extra = self.strategy.init_params(self.student_cfg, self.teacher_cfg, jax.random.key(self.seed))
    if self.backend == "pmap":
      host = jax.device_get({"student": params, "strategy": extra})
      state = jax.jit(self._fresh_state)(host)
      return stack_replicas(jax.device_get(state), self.mesh.size)
    if self.backend == "single":
      return jax.jit(self._fresh_state)(jax.device_put({"student": params, "strategy": extra}, jax.devices()[0]))
    shardings = {
        "student": fitted_shardings(self._student_init, self.mesh),
        "strategy": jax.tree.map(lambda _: NamedSharding(self.mesh, P()), extra),
    }
    placed = jax.device_put({"student": params, "strategy": extra}, shardings)
    return jax.jit(self._fresh_state, out_shardings=self._state_shardings(placed, shardings))(placed)

  def _state_shardings(self, params, param_shardings_tree):
    """Shardings of a whole TrainState: optimizer moments follow their parameters."""
    replicated = NamedSharding(self.mesh, P())
    abstract = jax.eval_shape(self._fresh_state, params)
    opt = optax.tree_utils.tree_map_params(
        self.optimizer,
        lambda _, sharding: sharding,
        abstract.opt_state,
        split_trainable(param_shardings_tree, self.trainable)[0],
        transform_non_params=lambda _: replicated,
    )
    return TrainState(replicated, param_shardings_tree, opt)

  def _fresh_state(self, params) -> TrainState:
    params = jax.tree.map(jnp.copy, params)
    return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(split_trainable(params, self.trainable)[0]))

  # ---------------------------------------------------------------------- steps
  def check_batch(self, batch: dict) -> None:
    """Raises a clear error for a malformed batch (keys, shapes, length, divisibility)."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
      raise ValueError(f"batch is missing {missing}; a batch is a dict with {BATCH_KEYS}, each [batch, seq]")
    shapes = {k: tuple(np.shape(batch[k])) for k in BATCH_KEYS}
    if len(set(shapes.values())) != 1 or len(shapes["inputs"]) != 2:
      raise ValueError(f"batch arrays must share one [batch, seq] shape, got {shapes}")
    B, T = shapes["inputs"]
    if T > self.max_len:
      raise ValueError(
          f"sequence length {T} exceeds max_len={self.max_len} (student {self.student_cfg.max_len}, "
          f"teacher {self.teacher_cfg.max_len}); use seq_len <= {self.max_len}"
      )
    if self.mesh is not None:
      check_batch(B, self.mesh)
    if self.topk_teacher is not None:
      k = self.topk_teacher.k
      want = {TOPK_KEYS[0]: (B, T, k), TOPK_KEYS[1]: (B, T, k), TOPK_KEYS[2]: (B, T)}
      got = {key: tuple(np.shape(batch[key])) if key in batch else None for key in TOPK_KEYS}
      if got != want:
        raise ValueError(f"with {self.topk_teacher.source} every batch carries the teacher's top-k {want}, got {got}; "
                         "read the data through meshdistill.teacher_cache.CachedTeacherData (or a teacher_mesh source)")

  def _place_batch(self, batch: dict) -> dict:
    return place_batch(batch, self.backend, self.mesh)

  def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict[str, jax.Array]]:
    """One train step on a host batch ``{inputs, targets, mask}`` of shape [B, T].

    ``state`` is consumed (its buffers are donated); use the returned one.
    """
    self.check_batch(batch)
    new_state, metrics = self.compiled_step(state)(state, self.teacher_params, self._place_batch(batch))
    if self.backend == "pmap":
      metrics = jax.tree.map(lambda x: x[0], metrics)
    return new_state, metrics

  def lower(self, state: TrainState, batch: dict):
    """The lowered step for ``batch`` (``.compile().as_text()`` gives its HLO)."""
    self.check_batch(batch)
    return self.compiled_step(state).lower(state, self.teacher_params, self._place_batch(batch))

  def with_strategy(self, strategy: Any) -> "Distiller":
    """A Distiller like this one (same models, layout, placed teacher, optimizer) distilling with ``strategy``.

    Nothing is copied or re-placed; the new step compiles once, on first use, and asking again
    for an equal (hashable) strategy returns the same Distiller, compiled step included. Train
    states carry over: ``params["strategy"]`` of a state made for the old strategy is handed to
    the new one, which must accept it (a strategy without parameters of its own ignores it).
    Used to switch to a fallback loss after a divergence (`meshdistill.safeguards`).
    """
    try:
      known = self._strategy_variants.get(strategy)
    except TypeError:  # an unhashable strategy: no reuse
      known = None
    if known is not None:
      return known
    new = self._variant(strategy=strategy)
    new.strategy = strategy
    try:
      self._strategy_variants[strategy] = new
    except TypeError:
      pass
    return new

  # --------------------------------------------------------------------- access
  def unreplicate(self, tree):
    """For ``pmap`` the first replica of a stacked tree; otherwise ``tree`` unchanged."""
    return jax.tree.map(lambda x: x[0], tree) if self.backend == "pmap" else tree

  def student(self, state: TrainState) -> Decoder:
    """The student module holding the parameters of ``state``."""
    return nnx.merge(self.student_def, self.unreplicate(state.params)["student"])


PADDING_TOLERANCE = 0.01  # vocabularies this close (relative to the larger) differ by padding rows


def resolve_shared_vocab(teacher_vocab: int, student_vocab: int, shared_vocab: int | None = None) -> int | None:
  """The token range both models are compared on, or ``None`` when their vocabularies are equal.

  One tokenizer's models often pad the embedding to different sizes (Qwen2.5: 152064 for 7B,
  151936 for 0.5B); the rows past the tokenizer are never produced by it. Sizes within
  ``PADDING_TOLERANCE`` (1 %) of each other are taken as such padding and compared on
  ``[0, min(sizes))``, with a logged note. Other differences mean different tokenizers and
  raise, unless ``shared_vocab`` names the range explicitly (then 1 <= shared_vocab <= both).
  Inside the step both models' logits are sliced ``logits[..., :shared]``; keep it a
  multiple of the ``tensor`` size so the slice stays vocabulary-parallel.
  """
  small, large = sorted((teacher_vocab, student_vocab))
  if shared_vocab is not None:
    if not isinstance(shared_vocab, int) or not 1 <= shared_vocab <= small:
      raise ValueError(
          f"shared_vocab={shared_vocab!r} must be an integer in [1, {small}] (teacher vocab_size={teacher_vocab}, "
          f"student vocab_size={student_vocab})"
      )
    return None if shared_vocab == large else shared_vocab
  if small == large:
    return None
  if large - small > PADDING_TOLERANCE * large:
    raise ValueError(
        f"teacher vocab_size={teacher_vocab} != student vocab_size={student_vocab}; distillation compares "
        "distributions token by token, so both models need the same tokenizer (build the student with "
        f"vocab_size={teacher_vocab}); if they do share one and the larger is only padded, pass "
        f"shared_vocab=<tokenizer size, at most {small}>"
    )
  log.info(
      "teacher vocab_size=%d, student vocab_size=%d: treating the extra %d rows as padding of one tokenizer and "
      "distilling over token ids [0, %d)", teacher_vocab, student_vocab, large - small, small,
  )
  return small


def place_batch(batch: dict, backend: str, mesh: Mesh | None) -> dict:
  """Puts a host batch where a step of ``backend`` reads it (pmap: split into [n, B/n, T])."""
  keys = BATCH_KEYS + tuple(k for k in TOPK_KEYS if k in batch)  # a teacher's top-k may come with the batch
  batch = {k: batch[k] if isinstance(batch[k], jax.Array) else np.asarray(batch[k]) for k in keys}
  if backend == "single":
    return jax.device_put(batch, jax.devices()[0])
  if backend == "shard_map":
    return host_to_global(batch, mesh)
  n = mesh.size
  return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in batch.items()}


def stack_replicas(tree, n: int):
  """``n`` stacked host copies of every leaf: the classic pmap layout of a replicated state."""
  return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))).copy(), tree)
