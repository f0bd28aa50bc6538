"""The programmatic API: a `Distiller` binds teacher, student, strategy, optimizer and layout.

It is the one trainer: teacher pretraining and hard-label baselines are a `Distiller` without a
teacher (``teacher=None``, see `meshdistill.train.hardlabel`). Where arrays live and how the step is
compiled is the `meshdistill.parallel.layout.Layout`'s job.

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

import copy
import functools
import logging
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from meshdistill.parallel.backends import make_layout
from meshdistill.parallel.mesh import platform_of
from meshdistill.models import Decoder, fit_model, frozen_model
from meshdistill.models.lora import TRAINABLE as LORA_TRAINABLE
from meshdistill.models.lora import is_lora
from meshdistill.train.accumulate import check_micro_batch
from meshdistill.train.memory import auto_remat
from meshdistill.train.optimizers import check_loss_scale, default_optimizer
from meshdistill.core.vocab import PADDING_TOLERANCE, resolve_shared_vocab  # noqa: F401 -- also read from here
from meshdistill.train.step import (
    BATCH_KEYS, CROSS_KEYS, MULTI_KEYS, SEGMENT_KEYS, TARGET_LOGPROB_KEY, TOPK_KEYS, TrainState, per_device_step,
)
from meshdistill.strategies import LogitKD, Strategy, default_recipe, label
from meshdistill.train.teacher import TeacherOutput, TopKTeacher, decide

log = logging.getLogger(__name__)


class Distiller:
  """Distils ``teacher`` into ``student`` with one compiled step per layout.

  Args:
    student, teacher: `Decoder` modules (built with `init_model`; placed anywhere, they
      are moved onto the layout). Their vocabularies must match, up to padding rows: see
      `resolve_shared_vocab` and ``shared_vocab`` (an explicit shared token range).
      ``teacher`` may instead be a `meshdistill.teachers.cache.TopKTeacher` (no weights; every batch
      then carries its top-k, see `meshdistill.teachers.cache`).
      ``teacher=None`` trains the student alone with a ``strategy`` that uses no teacher
      (`meshdistill.train.hardlabel.HardLabelTrainer`).
    strategy: what to distil (default `LogitKD()`: tau=2, alpha=0.5).
    optimizer: an optax transformation for the student (default `default_optimizer()`).
    mesh: a ``(data, tensor)`` mesh from `make_mesh`; ``None`` means one device.
    backend: ``"shard_map"`` (default with a mesh), ``"single"`` (default without), ``"pmap"``
      (data-parallel compatibility path; needs ``tensor=1``), or a `meshdistill.parallel.layout.Layout` object:
      see `meshdistill.parallel.backends`.
    trainable: an nnx filter of the student parameters that train; the optimizer holds state for
      these only and the rest never moves. Default: the adapters of a LoRA student
      (`meshdistill.models.lora.apply_lora`), otherwise the whole student.
    fsdp: split the weights of both models and the student's optimizer moments over ``data`` as well
      (ZeRO-3 style, `meshdistill.parallel.fsdp`; ``backend="shard_map"`` only); same numbers, less memory per device.
    student_split: ``"tensor"`` (default): the student split over ``tensor`` like the teacher; ``"batch"``: the
      student replicated, run on the batch rows split over ``data`` x ``tensor`` (a student small enough to hold
      whole on each device then needs no collective in its forward and backward passes; see
      `meshdistill.parallel.backends.ShardMapLayout`). Same numbers either way; not with ``fsdp``.
    loss_scale: static loss scaling, a setting of the step (`meshdistill.train.step.scale_gradient`): the loss
      gradient is multiplied by it while the loss and every metric keep their values; pair it with an ``optimizer``
      that divides the gradients by the same factor, ``safeguarded(..., loss_scale=S)`` (`make_optimizer` does
      for ``safeguards.loss_scale``). ``None`` (default): off. The strategy stays as given, and `with_strategy`
      (the guard's fallback) keeps the scale.
    micro_batch: rows each device runs through one forward and backward pass (gradient accumulation,
      `meshdistill.train.accumulate`: the device's rows of a step as micro-batches in one program, the same loss,
      gradients and metrics); it must divide the rows each device holds per step. ``None`` (default): the whole
      local batch at once. ``"auto"``: chosen on the first step with the student's remat ``auto``: the whole batch
      where it fits the device's memory (and where no memory limit is known, as on a CPU), else micro-batches that
      do.
  """

  compiler_options: dict | None = None  # XLA options of the step (see `with_compiler_options`)

  def __init__(
      self,
      student: Decoder,
      teacher: Decoder | TopKTeacher | None = None,
      *,
      strategy: Strategy | None = None,
      optimizer: optax.GradientTransformation | None = None,
      mesh: Mesh | None = None,
      backend: str | None = None,
      seed: int = 0,
      shared_vocab: int | None = None,
      trainable: Any = None,
      fsdp: bool = False,
      student_split: str = "tensor",
      loss_scale: float | None = None,
      micro_batch: int | str | None = None,
  ):
    check_micro_batch(micro_batch)
    if loss_scale is not None:
      check_loss_scale(loss_scale)
    if teacher is None and strategy is None:
      raise ValueError("Distiller without a teacher needs a strategy that uses none, e.g. strategy=HardLabelCE()")
    if getattr(getattr(student, "cfg", None), "param_dtype", "float32") not in ("float32", "auto"):
      raise ValueError(f"student.param_dtype={student.cfg.param_dtype!r}: the student trains with float32 weights; "
                       "build it with param_dtype='float32' (dtype='bfloat16' computes in bfloat16)")
    # What the teacher gives the step, decided once (`meshdistill.train.teacher.decide`): a model, or a `TopKTeacher`
    # (an offline cache, a teacher on other devices: no weights here, every batch brings the teacher's top-k under
    # `TOPK_KEYS` and the step runs no teacher), or none; on the student's tokens or on its own.
    self.teacher_output = self._decide_teacher(teacher, strategy)
    self.topk_teacher = self.teacher_output.topk
    self.cross_tokenizer = self.teacher_output.own_tokenizer
    self.shared_vocab = None
    # A teacher of another tokenizer (live, or a cross-tokenizer cache whose top-k is over the teacher's own
    # vocabulary, spread there by the step) shares no vocabulary with the student.
    if self.topk_teacher is not None and not self.cross_tokenizer:
      if teacher.cross:  # a cross-tokenizer cache with a strategy of one vocabulary: that is the error to name
        teacher.check_strategy(strategy if strategy is not None else LogitKD())
      if teacher.vocab > student.cfg.vocab_size:
        raise ValueError(f"{teacher.source} has token ids up to {teacher.vocab} but the student's vocab_size is "
                         f"{student.cfg.vocab_size}; use a student of the teacher's tokenizer")
      self.shared_vocab = resolve_shared_vocab(teacher.vocab, student.cfg.vocab_size, shared_vocab)
    elif self.topk_teacher is None and teacher is not None and not self.cross_tokenizer:
      self.shared_vocab = resolve_shared_vocab(teacher.cfg.vocab_size, student.cfg.vocab_size, shared_vocab)
    self.layout = make_layout(backend, mesh, fsdp, student_split)
    # pads a vocabulary / replicates key/value heads where the mesh's `tensor` needs it
    student = self._fit(student)
    if teacher is not None and self.topk_teacher is None:
      # a frozen teacher of param_dtype "auto" is stored in its compute dtype (`ModelConfig.frozen`)
      teacher = frozen_model(self._fit(teacher), platform_of(self.layout.mesh))
    # none named: LogitKD, as its chunked form on a large vocabulary (`strategies.default_recipe`: same numbers)
    self.strategy = strategy if strategy is not None else default_recipe(
        LogitKD(), student.cfg.vocab_size, teacher is not None and self.topk_teacher is None)
    if teacher is None and self.strategy.needs_teacher:  # the strategy contract's capability
      raise ValueError(f"Distiller without a teacher needs a strategy that uses none (needs_teacher = False, e.g. "
                       f"strategy=HardLabelCE()); {label(self.strategy)} needs a teacher")
    if self.topk_teacher is not None:
      self.topk_teacher.check_strategy(self.strategy)
    self.optimizer = optimizer if optimizer is not None else default_optimizer()
    self.student_cfg = student.cfg
    self.teacher_cfg = None if teacher is None else teacher.cfg
    self.max_len = student.cfg.max_len if teacher is None else min(student.cfg.max_len, teacher.cfg.max_len)
    self.seed = seed
    self.student_def, self._student_init = nnx.split(student)
    if trainable is None and is_lora(self._student_init):
      trainable = LORA_TRAINABLE
    self.trainable = trainable
    self.teacher_def, self.teacher_params = None, ({} if self.topk_teacher is not None else None)
    if teacher is not None and self.topk_teacher is None:
      self.teacher_def, teacher_params = nnx.split(teacher)
      self.teacher_params = self.layout.place_params(teacher_params)
    self._step_fn = functools.partial(
        per_device_step,
        student_def=self.student_def,
        teacher_def=self.teacher_def,
        strategy=self.strategy,
        optimizer=self.optimizer,
        vocab=self.shared_vocab,
        trainable=trainable,
        teacher_output=self.teacher_output,
        **self._teacher_names(),
        loss_scale=None if loss_scale is None else float(loss_scale),
        micro_batch=None if micro_batch == "auto" else micro_batch,  # auto: the whole batch until decided
    )
    self.micro_batch = micro_batch
    self._compiled = None
    self._strategy_variants: dict = {}  # `with_strategy` results, reused
    self._light = None  # the `metrics_light` variant, once asked for

  # ------------------------------------------------------------------ layout
  @property
  def mesh(self) -> Mesh | None:
    return self.layout.mesh

  @property
  def backend(self) -> str:
    """The layout's name (``single`` / ``shard_map`` / ``pmap``)."""
    return self.layout.name

  @property
  def loss_scale(self) -> float | None:
    """The step's static loss scale (``None``: off)."""
    return self._step_fn.keywords.get("loss_scale")

  @property
  def n_replicas(self) -> int:
    return self.layout.n_replicas

  def init_state(self, student: Decoder | None = None) -> TrainState:
    """A fresh train state from ``student`` (default: the student given at construction).

    The student given at construction is kept for later calls in host memory once a state holds it on the
    devices (`_keep_initial_student_on_host`): a state and the trainer would otherwise hold two device copies of the
    student's float32 weights for the whole run."""
    params = self._student_init if student is None else nnx.state(self._fit(student))
    extra = self.strategy.init_params(self.student_cfg, self.teacher_cfg, jax.random.key(self.seed))
    state = self.layout.fresh_state(self.optimizer, {"student": params, "strategy": extra}, self.trainable)
    if student is None:
      self._student_init = _keep_initial_student_on_host(self._student_init)
    return state

  def _decide_teacher(self, teacher: Decoder | TopKTeacher | None, strategy: Strategy | None) -> TeacherOutput:
    """What ``teacher`` gives the step for ``strategy`` (`meshdistill.train.teacher.decide`)."""
    return decide(teacher, strategy)

  def _teacher_names(self) -> dict:
    """The step's keywords for several teachers combined into one top-k (their per-teacher metrics)."""
    names = () if self.topk_teacher is None else self.topk_teacher.names
    if self.topk_teacher is not None and self.cross_tokenizer:  # a cross-tokenizer cache, spread over its vocabulary
      return {"topk_vocab": self.topk_teacher.vocab, "teacher_temperature": self.topk_teacher.temperature}
    return {"teacher_names": names, "teacher_temperature": self.topk_teacher.temperature} if names else {}

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
      models = f"student {self.student_cfg.max_len}" + (
          "" if self.teacher_cfg is None else f", teacher {self.teacher_cfg.max_len}")
      raise ValueError(f"sequence length {T} exceeds max_len={self.max_len} ({models}); use seq_len <= {self.max_len}")
    self.layout.check_batch(B)
    self._check_cross_batch(batch, B)
    self._check_segments(batch, B, T)
    if self.topk_teacher is not None:
      k = self.topk_teacher.k
      if self.cross_tokenizer:  # a cross-tokenizer cache: per teacher token, with the target's log-probability
        Tt = np.shape(batch["teacher_inputs"])[1]
        want = {TOPK_KEYS[0]: (B, Tt, k), TOPK_KEYS[1]: (B, Tt, k), TOPK_KEYS[2]: (B, Tt), TARGET_LOGPROB_KEY: (B, Tt)}
      else:
        want = {TOPK_KEYS[0]: (B, T, k), TOPK_KEYS[1]: (B, T, k), TOPK_KEYS[2]: (B, T)}
      got = {key: tuple(np.shape(batch[key])) if key in batch else None for key in want}
      n = len(self.topk_teacher.names)
      if n:  # several teachers: each one's own top-k too
        want |= dict(zip(MULTI_KEYS, ((B, n, T, k), (B, n, T, k), (B, n, T), (B, n))))
        got |= {key: tuple(np.shape(batch[key])) if key in batch else None for key in MULTI_KEYS}
      if got != want:
        raise ValueError(f"with {self.topk_teacher.source} every batch carries the teacher's top-k {want}, got {got}; "
                         "read the data through meshdistill.teachers.cache.CachedTeacherData (or a teacher_mesh source)")

  def _check_segments(self, batch: dict, B: int, T: int) -> None:
    """Rows packed from several documents (`SEGMENT_KEYS`, ``data.packing: documents``) carry both keys at the
    tokens' shape, and go to models that run in the step (a top-k teacher's was computed without them)."""
    has = [k for k in SEGMENT_KEYS if k in batch]
    if not has:
      return
    if len(has) != len(SEGMENT_KEYS):
      raise ValueError(f"a batch of packed documents carries both {list(SEGMENT_KEYS)} (data.packing: documents), "
                       f"this one only {has}")
    shapes = {k: tuple(np.shape(batch[k])) for k in SEGMENT_KEYS}
    if set(shapes.values()) != {(B, T)}:
      raise ValueError(f"{list(SEGMENT_KEYS)} must be [batch, seq] = {(B, T)} like inputs, got {shapes}")
    if self.topk_teacher is not None:
      raise ValueError(f"data.packing=documents with {self.topk_teacher.source}: the teacher's top-k was computed on "
                       "rows whose documents attend to each other, so it would not match the student's; use "
                       "data.packing=stream with it, or a teacher that runs in the step (its weights)")

  def _check_cross_batch(self, batch: dict, B: int) -> None:
    """A batch of two tokenizations goes with a cross-tokenizer strategy, and only with one."""
    has = [k for k in CROSS_KEYS if k in batch]
    name = type(self.strategy).__name__
    if has and not self.cross_tokenizer:
      raise ValueError(
          f"the batch carries a teacher of another tokenizer ({has[0]}, ...; data.teacher_tokenizer is set) but "
          f"strategy {name} compares the two models token by token over one vocabulary, so it is refused here "
          "(attention transfer and feature losses also need the same tokens on both sides); use distill.kind: "
          "byte_kl, span_kl or uld, or drop data.teacher_tokenizer"
      )
    if not self.cross_tokenizer:
      return
    if len(has) != len(CROSS_KEYS):
      raise ValueError(f"strategy {name} needs the teacher's own tokens and the alignment in every batch "
                       f"({list(CROSS_KEYS)}); set data.teacher_tokenizer (missing: "
                       f"{[k for k in CROSS_KEYS if k not in batch]})")
    Tt = np.shape(batch["teacher_inputs"])[1]
    if Tt > self.teacher_cfg.max_len:
      raise ValueError(f"teacher sequence length {Tt} exceeds the teacher's max_len={self.teacher_cfg.max_len}; "
                       f"use data.teacher_seq_len <= {self.teacher_cfg.max_len}")
    rows = {k: tuple(np.shape(batch[k]))[:1] for k in CROSS_KEYS}
    if set(rows.values()) != {(B,)}:
      raise ValueError(f"cross-tokenizer batch arrays must have {B} rows like inputs, got {rows}")

  def compiled_step(self, state: TrainState):
    """The step compiled for ``state``'s layout (its output state pinned to it where the layout needs that)."""
    if self._compiled is None:
      shardings = self.layout.state_shardings(state)
      self._compiled = self.layout.compile(self._step_fn, shardings, self.compiler_options)
    return self._compiled

  def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict[str, jax.Array]]:
    """One train step on a host batch ``{inputs, targets, mask}`` of shape [B, T].

    ``state`` is consumed (its buffers are donated); use the returned one. A student of ``remat="auto"`` gets its
    policy on the first call (`meshdistill.train.memory.auto_remat`: the first policy whose step fits the device).
    """
    self.check_batch(batch)
    if self.student_cfg.remat == "auto":
      self.decide_remat(state, batch)
    new_state, metrics = self.compiled_step(state)(state, self.teacher_params, self.layout.place_batch(batch))
    return new_state, self.layout.host_metrics(metrics)

  def decide_remat(self, state: TrainState, batch: dict) -> str:
    """Makes a student remat of ``auto`` a policy for this step on these devices (`auto_remat`; compiles candidates
    unless the choice is known for this program) and returns it; this Distiller then runs that policy."""
    if self.student_cfg.remat != "auto":
      return self.student_cfg.remat
    chosen, choice, _ = auto_remat(self, state, batch)
    self.student_cfg, self.student_def, self._step_fn = chosen.student_cfg, chosen.student_def, chosen._step_fn
    self._compiled, self._light, self._strategy_variants = None, None, {}
    return choice.remat

  def lower(self, state: TrainState, batch: dict):
    """The lowered step for ``batch`` (``.compile().as_text()`` gives its HLO)."""
    self.check_batch(batch)
    return self.compiled_step(state).lower(state, self.teacher_params, self.layout.place_batch(batch))

  def _fit(self, model):
    """``model`` ready for the layout: padded / re-partitioned for the ways it splits the vocabulary (a vocabulary
    or key/value head count that ``tensor`` does not divide), then laid out by its rules."""
    ways = self.layout.vocab_ways()
    return self.layout.fit_model(model if ways is None else fit_model(model, ways))

  # ------------------------------------------------------------------ variants
  def _variant(self, **step_keywords):
    new = copy.copy(self)
    new._step_fn = functools.partial(self._step_fn.func, **{**self._step_fn.keywords, **step_keywords})
    new._compiled = None
    new._strategy_variants = {}  # variants of the copy are its own
    new._light = None
    return new

  def metrics_light(self) -> "Distiller":
    """This Distiller with the metrics-light step (`meshdistill.train.step.per_device_step`'s ``light``): the same
    update, bit for bit, with only ``loss``, ``grad_norm`` and ``tokens`` as metrics. Compiled once, on first
    use; `meshdistill.train.loop.trainer.fit` runs it on the steps whose metrics it does not log."""
    if self._step_fn.keywords.get("light"):
      return self
    if self._light is None:
      self._light = self._variant(light=True)
    return self._light

  def with_strategy(self, strategy: Strategy) -> "Distiller":
    """A Distiller like this one (same models, layout, placed teacher, optimizer) distilling with ``strategy``.

    Nothing is copied or re-placed; the new step compiles once, on first use, and asking again
    for an equal (hashable) strategy returns the same Distiller, compiled step included. Train
    states carry over: ``params["strategy"]`` of a state made for the old strategy is handed to
    the new one, which must accept it (a strategy without parameters of its own ignores it).
    Used to switch to a fallback loss after a divergence (`meshdistill.train.loop.guard`).
    """
    try:
      known = self._strategy_variants.get(strategy)
    except TypeError:  # an unhashable strategy: no reuse
      known = None
    if known is not None:
      return known
    new = self._variant(strategy=strategy, teacher_output=self.teacher_output.for_strategy(strategy))
    new.strategy = strategy
    try:
      self._strategy_variants[strategy] = new
    except TypeError:
      pass
    return new

  def with_compiler_options(self, options: dict | None):
    """A copy whose step compiles with the XLA ``options`` (e.g. `meshdistill.train.memory.CPU_MEMORY_SCHEDULER`)."""
    new = self._variant()
    new.compiler_options = dict(options) if options else None
    return new

  def with_micro_batch(self, micro_batch: int | None):
    """A copy whose step runs each device's rows as micro-batches of ``micro_batch`` rows (``None``: the whole local
    batch at once; `meshdistill.train.accumulate`); the same training, another program."""
    check_micro_batch(micro_batch, auto=False)
    new = self._variant(micro_batch=micro_batch)
    new.micro_batch = micro_batch
    return new

  def with_remat(self, remat: str):
    """A copy whose student recomputes activations with policy ``remat`` (it changes no parameter,
    so ``init_state()`` still starts from the same student)."""
    cfg = self.student_cfg.replace(remat=remat)  # validates the name
    # the student's own graph with the new config: a student beyond the plain decoder (LoRA adapters, a
    # quantization-aware wrapper) keeps what wraps it
    model = nnx.merge(self.student_def, self._student_init)
    model.cfg = cfg
    graphdef = nnx.split(model)[0]
    new = self._variant(student_def=graphdef)
    new.student_cfg, new.student_def = cfg, graphdef
    return new

  # --------------------------------------------------------------------- access
  def unreplicate(self, tree):
    """One replica of a tree in the layout's state form (for ``pmap`` the first; otherwise ``tree``)."""
    return self.layout.unreplicate(tree)

  def student(self, state: TrainState) -> Decoder:
    """The student module holding the parameters of ``state``."""
    return nnx.merge(self.student_def, self.unreplicate(state.params)["student"])


def _keep_initial_student_on_host(params):
  """``params`` with their device arrays copied to host memory (numpy), so that the trainer's reference no longer keeps
  the device buffers alive (a model the caller still holds keeps its own). Arrays of several processes (not fully
  addressable here) stay as they are: each process could only copy its own shards."""
  arrays = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
  if not arrays or not all(x.is_fully_addressable for x in arrays):
    return params
  return jax.device_get(params)
