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
import optax
from flax import nnx
from jax.sharding import Mesh

from meshdistill.parallel.backends import make_layout
from meshdistill.parallel.mesh import platform_of
from meshdistill.models import Decoder, fit_model, frozen_model
from meshdistill.models.lora import TRAINABLE as LORA_TRAINABLE
from meshdistill.models.lora import is_lora
from meshdistill.train.accumulate import check_micro_batch
from meshdistill.train.batch_checks import check_batch
from meshdistill.train.tuning import Tuning, auto_tune, pending
from meshdistill.train.optimizers import check_loss_scale, default_optimizer
from meshdistill.core.vocab import PADDING_TOLERANCE, resolve_shared_vocab  # noqa: F401 -- also read from here
from meshdistill.train.step import TrainState, per_device_step
from meshdistill.strategies import ChunkedLogitKD, LogitKD, Strategy, default_recipe, label
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
      do (`meshdistill.train.tuning`).
    chunk_size: ``"auto"``: a `ChunkedLogitKD` strategy's chunk size is chosen on the first step with the remat and
      micro-batch (the fastest estimated where the device has an estimate, `meshdistill.train.cost`; else its own);
      the strategy computes with its own until then. ``None`` (default): the strategy's own. With no ``strategy``
      given, the default loss's chunked form (`meshdistill.strategies.default_recipe`) takes ``"auto"``.
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
      chunk_size: str | None = None,
  ):
    check_micro_batch(micro_batch)
    if chunk_size not in (None, "auto"):
      raise ValueError(f"chunk_size={chunk_size!r}: None (the strategy's own) or 'auto' (chosen at start-up); name a "
                       "chunk size on the strategy, ChunkedLogitKD(chunk_size=...)")
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
    given_teacher = teacher
    if teacher is not None and self.topk_teacher is None:
      # a frozen teacher of param_dtype "auto" is stored in its compute dtype (`ModelConfig.frozen`)
      teacher = frozen_model(self._fit(teacher), platform_of(self.layout.mesh))
    # none named: LogitKD, as its chunked form on a large vocabulary (`strategies.default_recipe`: same numbers),
    # whose chunk size is then the start-up tuning's
    self.strategy = strategy if strategy is not None else default_recipe(
        LogitKD(), student.cfg.vocab_size, teacher is not None and self.topk_teacher is None)
    self.chunk_size = "auto" if strategy is None and isinstance(self.strategy, ChunkedLogitKD) else chunk_size
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
      _share_placed(given_teacher, teacher.cfg, self.teacher_params)
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
    """Raises a clear error for a malformed batch (keys, shapes, length, divisibility; `batch_checks`)."""
    check_batch(self, batch)

  def compiled_step(self, state: TrainState):
    """The step compiled for ``state``'s layout (its output state pinned to it where the layout needs that)."""
    if self._compiled is None:
      shardings = self.layout.state_shardings(state)
      self._compiled = self.layout.compile(self._step_fn, shardings, self.compiler_options)
    return self._compiled

  def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict[str, jax.Array]]:
    """One train step on a host batch ``{inputs, targets, mask}`` of shape [B, T].

    ``state`` is consumed (its buffers are donated); use the returned one. Settings left at ``auto`` (the student's
    remat, ``micro_batch``, ``chunk_size``) are decided on the first call (`decide_auto`).
    """
    self.check_batch(batch)
    if pending(self):
      self.decide_auto(state, batch)
    new_state, metrics = self.compiled_step(state)(state, self.teacher_params, self.layout.place_batch(batch))
    return new_state, self.layout.host_metrics(metrics)

  def decide_auto(self, state: TrainState, batch: dict, **tune) -> Tuning | None:
    """Decides this Distiller's settings left at ``auto`` -- the student's remat, ``micro_batch``, ``chunk_size`` --
    for the step on ``batch`` on these devices (`meshdistill.train.tuning.auto_tune`, keywords ``tune``: compiles
    candidates unless the choice is kept for this program; nothing runs, ``state`` is kept) and returns the
    `Tuning` (None: nothing was ``auto``); this Distiller then runs the choice."""
    if not pending(self):
      return None
    chosen, tuning = auto_tune(self, state, batch, **tune)
    self.__dict__.update(chosen.__dict__)
    self._compiled, self._light, self._strategy_variants = None, None, {}
    return tuning

  def decide_remat(self, state: TrainState, batch: dict) -> str:
    """The student's remat policy once `decide_auto` has made every ``auto`` setting a choice (compiles candidates
    unless the choice is kept for this program); this Distiller then runs it."""
    self.decide_auto(state, batch)
    return self.student_cfg.remat

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

  def with_chunk_size(self, chunk_size: int):
    """A copy whose `ChunkedLogitKD` loss forms ``chunk_size`` tokens of logits at a time (`with_strategy`); the
    same numbers, another program."""
    if not isinstance(self.strategy, ChunkedLogitKD):
      raise ValueError(f"with_chunk_size({chunk_size!r}): {label(self.strategy)} is not a chunked loss "
                       "(ChunkedLogitKD)")
    new = self.with_strategy(self.strategy.replace(chunk_size=chunk_size))
    new.chunk_size = chunk_size
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


def _share_placed(model, cfg, placed) -> None:
  """Makes ``model`` (the teacher as the caller gave it) hold ``placed`` -- its weights as the step reads them:
  fitted to the layout, stored as a frozen teacher (``cfg``), placed on the devices -- in place of its own, so that
  a caller that keeps the teacher (a run's job, for its final evaluation) holds no second copy of its weights on the
  devices (a 1.7B teacher in bfloat16: 3.4 GB of a chip's memory). Where the layout changed the weights' shapes (a
  padded vocabulary, ``pmap``'s per-device stacks) or their structure, the model keeps its own."""
  if not isinstance(model, nnx.Module):
    return
  own = dict(nnx.to_flat_state(nnx.state(model)))
  new = dict(nnx.to_flat_state(placed))
  if own.keys() != new.keys() or any(own[k].get_value().shape != new[k].get_value().shape for k in own):
    return
  nnx.update(model, placed)
  if hasattr(model, "cfg"):
    model.cfg = cfg
