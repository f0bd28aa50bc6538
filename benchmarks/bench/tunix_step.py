"""tunix's two distillation programs compiled for a TPU topology on abstract arrays (nothing allocated).

tunix 0.1.7 runs logit distillation as two programs (`tunix.distillation.DistillationTrainer`):

* the **teacher program**: ``strategy.get_teacher_outputs(teacher, inputs)``, the strategy's ``nnx.jit``-ed teacher
  forward, called from the trainer's ``_prepare_inputs`` outside the train step; its ``[B, T-1, V]`` logits are then
  placed over ``fsdp`` (``sharding_utils.shard_input``) and handed to
* the **train step**: the trainer's own ``_train_step`` under ``nnx.jit(..., donate_argnames=("optimizer",))``
  (`PeftTrainer.jit_train_and_eval_step`): the student's forward, ``labels_fn``, `LogitStrategy.compute_loss`,
  ``nnx.value_and_grad`` and ``optimizer.update`` on its ``nnx.Optimizer``.

Both are compiled here with tunix's code: its models (`tunix.models.llama3`, `tunix.models.qwen3`) built by
``nnx.eval_shape``, the trainer constructed by tunix (inside ``nnx.eval_shape``, so its optimizer state is abstract
too) and its ``_train_step`` / ``get_teacher_outputs`` lowered. What is ours is only the usage around them, copied
in kind from tunix's documented logit-distillation example (``examples/logit_distillation.ipynb``): weights restored
as bfloat16 (``ShapeDtypeStruct(..., jnp.bfloat16, sharding=...)`` of ``nnx.get_named_sharding``), a ``("fsdp",
"tp")`` mesh, ``optax.adamw``, a forward returning ``logits[:, :-1, :]``, one-hot float32 labels masked by the input
mask, positions and a ``[B, T, T]`` causal attention mask built by ``gen_model_input_fn``.

One substitution: tunix's models constrain activations with a module-level ``shard(x, spec)`` that returns ``x``
unchanged when ``jax.devices()[0]`` is a CPU -- which it is on the host that compiles here for an abstract TPU
slice. `tpu_shard` is that function's TPU branch (``with_sharding_constraint`` on the ``with mesh:`` mesh), put in
its place while compiling, so the program is the one tunix compiles on a TPU host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.interpreters import pxla
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshdistill.models.tunix_adapter import _tunix_module  # tunix's model module of a family

GIB = 2**30

# name -> (tunix family as `meshdistill.models.tunix_adapter` names it, ModelConfig constructor); the pairs of
# issue 37's item 5
MODELS = {
    "llama3.1-8b": ("llama", "llama3p1_8b"),
    "llama3.2-1b": ("llama", "llama3p2_1b"),
    "qwen3-4b": ("qwen3", "qwen3_4b"),
    "qwen3-0.6b": ("qwen3", "qwen3_0p6b"),
}
TEMPERATURE, ALPHA, LEARNING_RATE = 2.0, 0.5, 1e-4  # values of tunix's example (its alpha 0.7 changes nothing here)


def model_config(name: str, remat: str = "none", flash: bool = False, tiny: bool = False):
  """tunix's ``ModelConfig`` of ``name`` (a key of `MODELS`), its ``remat_config`` set to ``remat`` (``none`` /
  ``block`` / ``decoder``), Qwen3's splash attention on with ``flash`` (Llama3 has none) and Qwen3's compute and
  parameter dtype bfloat16 (Llama3 computes in its weights' dtype). ``tiny``: 2 layers, for a quick check."""
  if name not in MODELS:
    raise ValueError(f"model={name!r}; choose one of {sorted(MODELS)}")
  family, ctor = MODELS[name]
  mod = _tunix_module(family)
  cfg = getattr(mod.ModelConfig, ctor)()
  fields = {"remat_config": getattr(mod.RematConfig, remat.upper())}
  if family == "qwen3":
    fields.update(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, use_flash_attention=flash)
  elif flash:
    raise ValueError(f"flash=True for {name}: tunix's Llama3 has no flash / splash attention; use flash=False")
  if tiny:
    fields["num_layers"] = 2
  return dataclasses.replace(cfg, **fields)


def _model_class(name: str):
  family = MODELS[name][0]
  mod = _tunix_module(family)
  return mod.Llama3 if family == "llama" else mod.Qwen3


def abstract_model(name: str, cfg, mesh: Mesh):
  """tunix's model of ``cfg`` as abstract bfloat16 weights placed by the model's own sharding annotations, as its
  example's ``get_sharded_model`` restores a checkpoint (``nnx.eval_shape`` + ``nnx.get_named_sharding``)."""
  cls = _model_class(name)
  abs_model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(params=0)))
  graphdef, state = nnx.split(abs_model)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=s), state,
                       nnx.get_named_sharding(state, mesh))
  return nnx.merge(graphdef, state)


def tpu_shard(x, s):
  """The TPU branch of tunix's ``shard(x, s)`` (`tunix.models.llama3.model.shard`): the activation constraint."""
  mesh = pxla.thread_resources.env.physical_mesh
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*s)))


@contextlib.contextmanager
def tunix_on_tpu(mesh: Mesh, names):
  """``with mesh:`` (tunix reads its mesh from there) and tunix's activation constraints applied as on a TPU host."""
  mods = {_tunix_module(MODELS[n][0]) for n in names}
  saved = {m: m.shard for m in mods}
  try:
    for m in mods:
      m.shard = tpu_shard
    with mesh:
      yield
  finally:
    for m, f in saved.items():
      m.shard = f


def strategy_for(vocab: int):
  """tunix's `LogitStrategy` with the forward, labels and inputs of its logit-distillation example."""
  from tunix.distillation import strategies  # pylint: disable=g-import-not-at-top
  from tunix.sft import utils  # pylint: disable=g-import-not-at-top

  def model_forward_fn(model, input_tokens, input_mask, positions, attention_mask):
    del input_mask
    logits, _ = model(input_tokens, positions, None, attention_mask)
    return logits[:, :-1, :]  # the last position has no target

  def labels_fn(input_tokens, input_mask, **kwargs):
    del kwargs
    labels = jax.nn.one_hot(input_tokens[:, 1:], vocab)  # float32 [B, T-1, V]
    return labels * input_mask[:, 1:].astype(labels.dtype)[..., None]

  def gen_model_input_fn(x):
    pad_mask = x.input_mask
    return {
        "input_tokens": x.input_tokens,
        "input_mask": x.input_mask,
        "positions": utils.build_positions_from_mask(pad_mask),
        "attention_mask": utils.make_causal_attn_mask(pad_mask),
    }

  strategy = strategies.LogitStrategy(student_forward_fn=model_forward_fn, teacher_forward_fn=model_forward_fn,
                                      labels_fn=labels_fn, temperature=TEMPERATURE, alpha=ALPHA)
  return strategy, gen_model_input_fn


def tunix_mesh(devices, fsdp: int, tp: int) -> Mesh:
  if fsdp * tp != len(devices):
    raise ValueError(f"mesh fsdp={fsdp} x tp={tp} needs {fsdp * tp} devices, the target has {len(devices)}")
  return Mesh(np.asarray(devices).reshape(fsdp, tp), ("fsdp", "tp"),
              axis_types=(jax.sharding.AxisType.Auto,) * 2)


def shard_bytes(tree) -> int:
  """Bytes one device holds of an abstract tree (each leaf's shard shape times its item size)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def _memory(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
         "temp": int(m.temp_size_in_bytes), "alias": int(m.alias_size_in_bytes)}
  out["total"] = out["arguments"] + out["outputs"] - out["alias"] + out["temp"]
  return out


def _compile(lowered) -> tuple[dict[str, Any], float]:
  """(memory or the compiler's out-of-memory message, compile seconds)."""
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return {"oom": str(e).strip().splitlines()[0][:400]}, time.perf_counter() - t0
  return _memory(compiled), time.perf_counter() - t0


@dataclasses.dataclass
class TunixPair:
  """tunix's teacher and student of a pair on a ``fsdp x tp`` mesh of a target's devices, ready to compile."""

  teacher: str
  student: str
  devices: tuple
  fsdp: int
  tp: int
  student_remat: str = "decoder"
  flash: bool = False  # splash attention in the models whose tunix family offers it (Qwen3)
  tiny: bool = False

  def __post_init__(self):
    self.mesh = tunix_mesh(self.devices, self.fsdp, self.tp)
    has_flash = lambda name: self.flash and MODELS[name][0] == "qwen3"  # noqa: E731 -- Llama3 has no splash option
    self.t_cfg = model_config(self.teacher, "none", has_flash(self.teacher), self.tiny)
    self.s_cfg = model_config(self.student, self.student_remat, has_flash(self.student), self.tiny)
    if self.t_cfg.vocab_size != self.s_cfg.vocab_size:
      raise ValueError(f"teacher vocab {self.t_cfg.vocab_size} != student vocab {self.s_cfg.vocab_size}")
    self.vocab = self.s_cfg.vocab_size

  def compile(self, batch: int, seq: int) -> dict[str, Any]:
    """Both programs at a global [batch, seq]: per-device memory of each, and the peak the pair needs."""
    from tunix.distillation import distillation_trainer as dt  # pylint: disable=g-import-not-at-top

    if batch % self.fsdp:
      raise ValueError(f"batch={batch} is not a multiple of fsdp={self.fsdp}: tunix's shard_input would replicate "
                       f"the batch on every device; use a multiple of {self.fsdp}")
    mesh, rows = self.mesh, NamedSharding(self.mesh, P("fsdp"))
    with tunix_on_tpu(mesh, (self.teacher, self.student)):
      teacher = abstract_model(self.teacher, self.t_cfg, mesh)
      student = abstract_model(self.student, self.s_cfg, mesh)
      strategy, gen_inputs = strategy_for(self.vocab)
      config = dt.TrainingConfig(eval_every_n_steps=1000, max_steps=1)
      trainers = []

      def build(s, t):  # tunix's trainer makes the student's nnx.Optimizer; abstract here
        trainer = dt.DistillationTrainer(student_model=s, teacher_model=t, strategy=strategy,
                                         optimizer=optax.adamw(LEARNING_RATE), training_config=config)
        trainers.append(trainer.with_gen_model_input_fn(gen_inputs))
        return trainer.optimizer

      optimizer = nnx.eval_shape(build, student, teacher)
      trainer = trainers[0]
      # the optimizer state placed as `PeftTrainer._shard_optimizer` places it: by its variables' own annotations
      o_graph, o_state = nnx.split(optimizer)
      o_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), o_state,
                             nnx.get_named_sharding(o_state, mesh))
      optimizer = nnx.merge(o_graph, o_state)

      tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows)
      mask = jax.ShapeDtypeStruct((batch, seq), jnp.bool_, sharding=rows)
      data = dt.TrainingInput(input_tokens=tokens, input_mask=mask)
      # (a) the teacher program: its inputs as gen_model_input_fn makes them, placed over fsdp (the most favourable
      # placement: tunix builds them before `shard_input`); its logits returned placed as `shard_input` puts them
      t_inputs = jax.eval_shape(gen_inputs, data)
      t_inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows), t_inputs)
      t_graph, t_state = nnx.split(teacher)

      def teacher_program(state, inputs):
        return strategy.get_teacher_outputs(nnx.merge(t_graph, state), inputs)

      t0 = time.perf_counter()
      logits = jax.eval_shape(teacher_program, t_state, t_inputs)
      lowered_t = jax.jit(teacher_program, out_shardings=rows).lower(t_state, t_inputs)
      t_lower = time.perf_counter() - t0
      t_mem, t_seconds = _compile(lowered_t)

      # (b) the train step as `PeftTrainer.jit_train_and_eval_step` jits it
      logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=rows)
      step_inputs = dt.TrainingInput(input_tokens=tokens, input_mask=mask, teacher_output=logits)
      t0 = time.perf_counter()
      lowered_s = nnx.jit(trainer.create_train_step_fn(), donate_argnames=("optimizer",)).lower(
          student, optimizer, step_inputs)
      s_lower = time.perf_counter() - t0
      s_mem, s_seconds = _compile(lowered_s)

    resident = {
        "teacher_weights": shard_bytes(nnx.state(teacher)),
        "student_weights": shard_bytes(nnx.state(student)),
        "optimizer_state": shard_bytes(o_state),
        "teacher_logits": shard_bytes(logits),
    }
    peak = None
    if "oom" not in t_mem and "oom" not in s_mem:
      # the teacher program runs while the student and its optimizer state stay resident, the train step while the
      # teacher's weights do; the logits live from the end of the first to the end of the second
      peak = max(t_mem["total"] + resident["student_weights"] + resident["optimizer_state"],
                 s_mem["total"] + resident["teacher_weights"])
    return {
        "teacher_program": t_mem, "train_step": s_mem, "resident": resident, "peak": peak,
        "logits_shape": list(logits.shape), "logits_dtype": str(jnp.dtype(logits.dtype)),
        "compile_seconds": {"teacher_program": t_seconds, "train_step": s_seconds},
        "lower_seconds": {"teacher_program": t_lower, "train_step": s_lower},
    }


def _bf16_model(cls, cfg, seed: int):
  """``cls(cfg)`` with random bfloat16 weights, initialised inside one ``nnx.jit``."""
  @nnx.jit
  def make():
    model = cls(cfg, rngs=nnx.Rngs(params=seed))
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                                   state))
    return model
  return make()


def run_steps(teacher: str, student: str, batches: tuple[int, ...], seq: int, steps: int, *,
              student_layers: int | None = None, student_remat: str = "decoder", flash: bool = True,
              tiny: bool = False) -> Iterator[dict[str, Any]]:
  """tunix's two programs RUN on this process's first device (the chip): random bfloat16 weights made by tunix's own
  model classes, tunix's trainer and optimizer, and ``steps`` timed steps (the teacher program, then the train step
  on its logits, as the trainer's loop calls them). Returns step seconds (median), peak bytes of the device where it
  reports them, or ``{"error": ...}`` (out of memory is a result: that batch does not fit).

  Yields one row per batch of ``batches``, in order, as soon as that batch is measured (a call stopped by its time
  limit keeps the rows it finished): the models are built once (minutes on a chip's host for a 1.7 B teacher) and
  each batch gets a fresh trainer (its own optimizer state) on them; each row with ``build_s`` (the models, shared),
  ``teacher_first_s`` / ``train_first_s`` (each program's first call: its compile and one run) and
  ``first_step_s`` (their sum)."""
  from tunix.distillation import distillation_trainer as dt  # pylint: disable=g-import-not-at-top

  mesh = tunix_mesh(jax.devices()[:1], 1, 1)
  has_flash = lambda name: flash and MODELS[name][0] == "qwen3"  # noqa: E731
  t_cfg = model_config(teacher, "none", has_flash(teacher), tiny)
  s_cfg = model_config(student, student_remat, has_flash(student), tiny)
  if student_layers is not None:
    s_cfg = dataclasses.replace(s_cfg, num_layers=student_layers)
  with tunix_on_tpu(mesh, (teacher, student)):
    t0 = time.perf_counter()
    try:
      # tunix's example restores bfloat16 weights into both models; random ones are made in one compiled program
      # per model (built eagerly, op by op, a 1.7 B model takes minutes on the chip's host)
      t_model = _bf16_model(_model_class(teacher), t_cfg, 0)
      s_model = _bf16_model(_model_class(student), s_cfg, 1)
    except Exception as e:  # noqa: BLE001
      for b in batches:
        yield {"batch": b, "seq": seq, "error": f"{type(e).__name__}: {str(e)[:400]}"}
      return
    build_s = time.perf_counter() - t0
    print(f"tunix: models built in {build_s:.1f} s", file=sys.stderr, flush=True)
    strategy, gen_inputs = strategy_for(s_cfg.vocab_size)
    t_graph, t_state = nnx.split(t_model)
    teacher_program = jax.jit(lambda state, x: strategy.get_teacher_outputs(nnx.merge(t_graph, state), x))
    for b in batches:
      out: dict[str, Any] = {"batch": b, "seq": seq, "build_s": build_s}
      try:
        trainer = dt.DistillationTrainer(student_model=s_model, teacher_model=t_model, strategy=strategy,
                                         optimizer=optax.adamw(LEARNING_RATE),
                                         training_config=dt.TrainingConfig(eval_every_n_steps=1000,
                                                                           max_steps=steps + 2))
        trainer = trainer.with_gen_model_input_fn(gen_inputs)
        rng = np.random.default_rng(0)
        tokens = jnp.asarray(rng.integers(0, s_cfg.vocab_size, (b, seq)), jnp.int32)
        data = dt.TrainingInput(input_tokens=tokens, input_mask=jnp.ones((b, seq), jnp.bool_))
        inputs = gen_inputs(data)
        train_step = nnx.jit(trainer.create_train_step_fn(), donate_argnames=("optimizer",))
        times = []
        for i in range(steps + 2):
          t0 = time.perf_counter()
          logits = jax.block_until_ready(teacher_program(t_state, inputs)) if i == 0 else teacher_program(
              t_state, inputs)
          t1 = time.perf_counter()
          result = train_step(s_model, trainer.optimizer,
                              dt.TrainingInput(input_tokens=tokens, input_mask=data.input_mask, teacher_output=logits))
          jax.block_until_ready(result)
          if i == 0:
            out.update(teacher_first_s=t1 - t0, train_first_s=time.perf_counter() - t1,
                       first_step_s=time.perf_counter() - t0)
            print(f"tunix: batch {b}: first step {out['first_step_s']:.1f} s (teacher program "
                  f"{out['teacher_first_s']:.1f} s, train step {out['train_first_s']:.1f} s, each compiling)",
                  file=sys.stderr, flush=True)
          if i >= 2:
            times.append(time.perf_counter() - t0)
        out["step_s"], out["step_times"] = float(np.median(times)), times
        stats = jax.devices()[0].memory_stats() or {}
        out["peak_bytes"] = stats.get("peak_bytes_in_use")
      except Exception as e:  # noqa: BLE001 -- out of memory is a result
        out["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      finally:
        trainer = logits = result = inputs = None  # noqa: F841 -- free this batch's buffers before the next
      yield out
