"""The systems the throughput benchmark compares, on the same work: the models, batches and names of its rows.

The same teacher and student (the built-in decoder, sized for CPU), the same initial weights, the same optimizer
(global-norm clipping + AdamW, lr 1e-3) and the same batches go through each system:

* `Ours`: a meshdistill `Distiller` (one compiled program per step; ``light``: its metrics-light step);
* `Tunix`: tunix 0.1.7's `DistillationTrainer` + `LogitStrategy` (tau=2, alpha=0.5), one batch per ``train()``;
* `Bare`: a bare teacher forward and a bare student step, jitted apart (no distillation loss);
* `Hand`: the same distillation step written by hand in plain JAX, one jit;
* `Matmul`: a float32 matmul probe, the rate each row's FLOPs are compared with.

Each has ``step(x)`` (one batch, returns when its work is done: what `bench.harness.interleave` times) and,
where the benchmark runs its training loop, ``loop(xs, log_every)``. Importing this module sets up the CPU
devices first (`bench.devices`).
"""

from __future__ import annotations

import re
import warnings

from bench import devices  # noqa: F401  (before JAX: the CPU devices)
import meshdistill as md
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tunix.distillation import distillation_trainer as tunix_trainer
from tunix.distillation.strategies import logit as tunix_logit

from bench import matmuls
from meshdistill import losses
from meshdistill.parallel.collectives import all_reduce_census, all_reduce_instructions, mesh_axis_groups
from meshdistill.train.loop.trainer import fit

B, T = 8, 128  # rows per batch, tokens per row
TAU, ALPHA, LR = 2.0, 0.5, 1e-3  # the KD recipe every system runs, and the learning rate


def configs(vocab: int):
  """(teacher, student) model configs of the throughput benchmark, sized for CPU."""
  teacher = md.ModelConfig(vocab_size=vocab, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=1024,
                           max_len=T)
  student = md.ModelConfig(vocab_size=vocab, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=512,
                           max_len=T)
  return teacher, student


def make_batches(n: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
  """``n`` host batches of random tokens, each [B, T + 1] (inputs and their next tokens)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, (B, T + 1)).astype(np.int32) for _ in range(n)]


def ours_batch(x: np.ndarray) -> dict:
  """A [B, T + 1] token batch as meshdistill's step takes it (every position counts)."""
  return {"inputs": x[:, :-1], "targets": x[:, 1:], "mask": np.ones((B, T), np.float32)}


# ---------------------------------------------------------------------------------- systems
class Ours:
  """A meshdistill Distiller stepping through the batches (``mesh=None``: one device); ``light``: its
  metrics-light step (what the training loop runs on the steps it does not log); ``split``: its
  ``student_split`` (``"batch"``: the student replicated, on rows split over ``data`` x ``tensor``)."""

  def __init__(self, strategy, mesh, tcfg, scfg, light: bool = False, split: str = "tensor"):
    teacher, student = md.init_model(tcfg, seed=0, mesh=mesh), md.init_model(scfg, seed=1, mesh=mesh)
    self.d = md.Distiller(student, teacher, strategy=strategy, optimizer=md.default_optimizer(LR), mesh=mesh,
                          student_split=split)
    if light:
      self.d = self.d.metrics_light()
    self.state = self.d.init_state()
    self.losses = []

  def step(self, x):
    self.state, metrics = self.d.step(self.state, ours_batch(x))
    jax.block_until_ready(metrics)
    self.losses.append(float(metrics["loss"]))

  def compiled_stats(self, x) -> tuple[float, dict]:
    """(cost_analysis FLOPs of the compiled step, its HLO's all-reduces by mesh axis: `all_reduce_census`)."""
    compiled = self.d.lower(self.state, ours_batch(x)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = compiled.as_text()
    census = all_reduce_census(hlo, self.d.mesh)
    if self.d.mesh is not None:
      census["by source"] = census_by_source(hlo, self.d.mesh)
    return float(cost.get("flops", float("nan"))), census

  def loop(self, xs, log_every: int):
    """Our training loop (`meshdistill.train.loop.trainer.fit`, default options, no checkpoints or evaluation) over
    ``xs``, continuing this system's state; returns once the state after the last step is computed (fit itself
    returns with that step possibly in flight: it reads losses only where a hook needs them)."""
    data = md.data.BatchList(ours_batch(x) for x in xs)
    self.state = fit(self.d, data, steps=None, log_every=log_every, state=self.state).state
    jax.block_until_ready(self.state)


class Tunix:
  """tunix's DistillationTrainer + LogitStrategy on our decoders (no adapter needed: the strategy
  takes forward functions, which call the NNX decoder and return its logits; it ``nnx.jit``s them).

  ``shard``: put each batch on the mesh split over ``data`` (inside the timed step) before handing it
  to ``train()``, so the teacher forward in ``_prepare_inputs`` runs on the split batch.
  ``replicated_student``: the student's weights replicated over the mesh instead of split over ``tensor``
  (tunix trains a model where its weights are; its batch is split over ``data`` only, so each ``tensor``
  device then runs the student on the same rows: no collectives in the student, its work done 4 times)."""

  def __init__(self, mesh, tcfg, scfg, shard: bool, replicated_student: bool = False):
    vocab = scfg.vocab_size
    teacher = md.init_model(tcfg, seed=0, mesh=mesh)
    student = md.init_model(scfg, seed=1, mesh=None if replicated_student else mesh)
    if replicated_student:
      nnx.update(student, jax.device_put(nnx.state(student), NamedSharding(mesh, P())))

    def forward(model, input_tokens, input_mask):
      del input_mask
      return model(input_tokens[:, :-1]).logits

    def labels(input_tokens, input_mask):
      del input_mask
      return jax.nn.one_hot(input_tokens[:, 1:], vocab)

    strategy = tunix_logit.LogitStrategy(forward, forward, labels, temperature=TAU, alpha=ALPHA)
    config = tunix_trainer.TrainingConfig(eval_every_n_steps=10**9, data_sharding_axis=(md.DATA,))
    self.mesh = mesh
    self.rows = NamedSharding(mesh, P(md.DATA)) if shard else None
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      with mesh:  # tunix reads the legacy `with mesh:` context (deprecated in jax)
        self.trainer = tunix_trainer.DistillationTrainer(student, teacher, strategy, md.default_optimizer(LR), config)
    # one batch per train() call; without this tunix would skip batches it counts as seen
    self.trainer.is_managed_externally = True

  def step(self, x):
    tokens, mask = x, np.ones_like(x)
    if self.rows is not None:
      tokens, mask = jax.device_put((tokens, mask), self.rows)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      with self.mesh:
        self.trainer.train([tunix_trainer.TrainingInput(input_tokens=tokens, input_mask=mask)])

  def loop(self, xs, log_every: int):
    """tunix's own loop: one ``train()`` over ``xs`` (its usage: ``train(train_ds)``), so its per-call set-up
    is paid once per block, not per step; ``train()`` waits for all its steps before it returns."""
    del log_every  # tunix buffers its metrics and writes them every step
    inputs = []
    for x in xs:
      tokens, mask = x, np.ones_like(x)
      if self.rows is not None:
        tokens, mask = jax.device_put((tokens, mask), self.rows)
      inputs.append(tunix_trainer.TrainingInput(input_tokens=tokens, input_mask=mask))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      with self.mesh:
        self.trainer.train(inputs)

  def losses(self) -> list[float]:
    self.trainer.close()  # flushes the last buffered step's metrics
    return [float(v) for v in self.trainer.metrics_logger.get_metric_history("", "loss", "train")]


class Bare:
  """A bare teacher forward (logits) and a bare student step (CE, backward, update), jitted apart."""

  def __init__(self, mesh, tcfg, scfg):
    teacher, student = md.init_model(tcfg, seed=0, mesh=mesh), md.init_model(scfg, seed=1, mesh=mesh)
    self.tdef, self.tparams = nnx.split(teacher)
    self.sdef, self.sparams = nnx.split(student)
    self.tx = md.default_optimizer(LR)
    self.opt_state, self.rows = _opt_state(self.tx, self.sparams, mesh)
    self.teacher_fwd = jax.jit(lambda p, x: nnx.merge(self.tdef, p)(x).logits)

    def student_step(params, opt_state, inputs, targets):
      def loss_fn(p):
        logits = nnx.merge(self.sdef, p)(inputs).logits
        return jnp.mean(jax.vmap(losses.cross_entropy)(logits, targets))

      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = self.tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    shardings = jax.tree.map(lambda x: x.sharding, (self.sparams, self.opt_state))
    self.student_step = jax.jit(student_step, donate_argnums=(0, 1), out_shardings=(*shardings, None))

  def teacher(self, x):
    jax.block_until_ready(self.teacher_fwd(self.tparams, jax.device_put(x[:, :-1], self.rows)))

  def student(self, x):
    inputs, targets = jax.device_put((x[:, :-1], x[:, 1:]), self.rows)
    self.sparams, self.opt_state, loss = self.student_step(self.sparams, self.opt_state, inputs, targets)
    jax.block_until_ready(loss)

  def loop(self, xs, log_every: int):
    """The bare programs back to back over ``xs`` (a teacher forward and a student step per batch, no
    distillation loss, nothing read on the host) dispatched without waiting; waits once, at the end, for all."""
    del log_every
    out = []
    for x in xs:
      inputs, targets = jax.device_put((x[:, :-1], x[:, 1:]), self.rows)
      logits = self.teacher_fwd(self.tparams, inputs)
      self.sparams, self.opt_state, loss = self.student_step(self.sparams, self.opt_state, inputs, targets)
      out.append((logits, loss))
    jax.block_until_ready(out)  # every teacher forward too (they do not depend on each other)


class Hand:
  """The same distillation step written by hand in plain JAX, as one jitted function: teacher forward,
  student forward/backward on forward KL at tau mixed with CE by alpha, clip + AdamW. No framework: its
  time is the step's math as XLA compiles it (on the mesh: weights split over `tensor` as for every
  system, the batch over `data`, everything else left to the compiler's partitioner)."""

  def __init__(self, mesh, tcfg, scfg):
    teacher, student = md.init_model(tcfg, seed=0, mesh=mesh), md.init_model(scfg, seed=1, mesh=mesh)
    tdef, self.tparams = nnx.split(teacher)
    sdef, self.sparams = nnx.split(student)
    tx = md.default_optimizer(LR)
    self.opt_state, self.rows = _opt_state(tx, self.sparams, mesh)
    self.losses = []

    def step(params, opt_state, tparams, inputs, targets):
      teacher_BxTxV = jax.lax.stop_gradient(nnx.merge(tdef, tparams)(inputs).logits)
      logp_t = jax.nn.log_softmax(teacher_BxTxV / TAU, axis=-1)

      def loss_fn(p):
        student_BxTxV = nnx.merge(sdef, p)(inputs).logits
        kl = jnp.sum(jnp.exp(logp_t) * (logp_t - jax.nn.log_softmax(student_BxTxV / TAU, axis=-1)), axis=-1)
        onehot = jax.nn.one_hot(targets, student_BxTxV.shape[-1], dtype=jnp.float32)
        ce = -jnp.sum(onehot * jax.nn.log_softmax(student_BxTxV, axis=-1), axis=-1)
        return jnp.mean(ALPHA * TAU**2 * kl + (1.0 - ALPHA) * ce)

      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    shardings = jax.tree.map(lambda x: x.sharding, (self.sparams, self.opt_state))
    self.fn = jax.jit(step, donate_argnums=(0, 1), out_shardings=(*shardings, None))

  def step(self, x):
    inputs, targets = jax.device_put((x[:, :-1], x[:, 1:]), self.rows)
    self.sparams, self.opt_state, loss = self.fn(self.sparams, self.opt_state, self.tparams, inputs, targets)
    self.losses.append(float(loss))


def _opt_state(tx, sparams, mesh):
  """(AdamW state placed like the parameters, where a batch's rows go) on ``mesh`` or one device."""
  if mesh is None:
    return jax.jit(tx.init)(sparams), jax.devices()[0]
  opt_shardings = optax.tree_map_params(
      tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, sparams), sparams,
      transform_non_params=lambda _: NamedSharding(mesh, P()),
  )
  return jax.jit(tx.init, out_shardings=opt_shardings)(sparams), NamedSharding(mesh, P(md.DATA))


class Matmul:
  """A float32 matmul [m, k] x [k, n] on a device set: on ``mesh`` its rows (m per device) split over
  every device (no communication), else on one device. ``flops`` per call."""

  def __init__(self, mesh, m: int, k: int, n: int):
    rows = m * (mesh.size if mesh is not None else 1)
    key_a, key_b = jax.random.split(jax.random.key(0))
    if mesh is None:
      where_a = where_b = jax.devices()[0]
    else:
      where_a, where_b = NamedSharding(mesh, P((md.DATA, md.TENSOR))), NamedSharding(mesh, P())
    self.a = jax.device_put(jax.random.normal(key_a, (rows, k), jnp.float32), where_a)
    self.b = jax.device_put(jax.random.normal(key_b, (k, n), jnp.float32), where_b)
    self.fn = jax.jit(jnp.matmul)
    self.flops = 2.0 * rows * k * n

  def step(self, x):
    del x
    jax.block_until_ready(self.fn(self.a, self.b))


# ------------------------------------------------------------------------------- FLOP counts
def matmul_params(cfg) -> int:
  """Weights used in matmuls: every parameter with 2+ dimensions (the tied embedding counted once, as the head)."""
  model = md.init_model(cfg, seed=0)
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if x.ndim >= 2)


def step_flops(tcfg, scfg) -> dict[str, float]:
  """Analytic FLOPs per step of each kind of program (matmuls and attention scores / mixing)."""
  tokens = B * T
  n_t, n_s = matmul_params(tcfg), matmul_params(scfg)
  attn_fwd = lambda c: 4.0 * c.n_layers * T * c.d_model  # noqa: E731  QK^T and PV per token, full T x T
  teacher = tokens * (2.0 * n_t + attn_fwd(tcfg))
  student = tokens * 3.0 * (2.0 * n_s + attn_fwd(scfg))
  return {"teacher": teacher, "student": student, "step": teacher + student, "n_t": n_t, "n_s": n_s}


SOURCES = ("sums over `data` (or over all devices)", "loss and metrics (reductions over V)", "embedding lookups",
           "model matmuls (tensor-parallel activations and input gradients)",
           "optimizer (gradient norm, outside the shard_map)", "other")


def census_by_source(hlo: str, mesh) -> dict[str, int]:
  """The all-reduces of a compiled step by what produced them, from each instruction's ``op_name``
  metadata (an all-reduce the combiner fused from several sources counts once, under the first source
  of `SOURCES` it holds). Those over `data` (whole groups of `data`), or over every device (a student run on
  rows split over both axes, ``student_split="batch"``), are the step's explicit sums."""
  explicit = (mesh_axis_groups(mesh, (md.DATA,)), mesh_axis_groups(mesh, (md.DATA, md.TENSOR)))
  out = dict.fromkeys(SOURCES, 0)
  for groups, op in all_reduce_instructions(hlo):
    if groups in explicit:
      out[SOURCES[0]] += 1
    elif "shard_map" not in op:
      out[SOURCES[4]] += 1
    elif re.search(r"log_softmax|reduce_max|reduce_sum|while/body", op):
      out[SOURCES[1]] += 1
    elif re.search(r"gather|_take", op):
      out[SOURCES[2]] += 1
    elif "dot_general" in op:
      out[SOURCES[3]] += 1
    else:
      out[SOURCES[5]] += 1
  return out



# ------------------------------------------------------------------------------------ row names
OURS, REF = "meshdistill ChunkedLogitKD", "meshdistill LogitKD"
LIGHT = ", metrics-light"
TUNIX, TUNIX_NP = "tunix", "tunix, host numpy input"
TUNIX_REP = "tunix, student replicated"
DP = ", data parallel (8x1)"  # the mesh 8x1: both models replicated, the batch split over 8 devices
TUNIX_DP = TUNIX + DP
ROWS = ", student over the batch"
BARE_T, BARE_S = "bare teacher forward", "bare student step"
CE_ONLY = "meshdistill step, CE only"
HAND = "hand-written step (plain JAX, one jit)"
BARE = "bare teacher forward + bare student step"
# rate probes [m (per device), k] x [k, n]: the teacher MLP's shape at this batch, a square one, a tall one
PROBES = ((B * T, 256, 1024), (1024, 1024, 1024), (4096, 1024, 1024))
MATMUL = "float32 matmul"


def probe_name(shape) -> str:
  return f"{MATMUL} [{shape[0]}, {shape[1]}] x [{shape[1]}, {shape[2]}] per device"
ONE = "1 device: "


def one_device_programs(ours: Ours, bare: Bare, x: np.ndarray) -> dict[str, str]:
  """The StableHLO of the one-device LogitKD step and of the bare programs on batch ``x``, by row name."""
  inputs, targets = x[:, :-1], x[:, 1:]
  return {
      ONE + REF: ours.d.lower(ours.state, ours_batch(x)).as_text(),
      ONE + BARE_T: bare.teacher_fwd.lower(bare.tparams, inputs).as_text(),
      ONE + BARE_S: bare.student_step.lower(bare.sparams, bare.opt_state, inputs, targets).as_text(),
  }


def matmul_ceilings(ours: Ours, bare: Bare, x: np.ndarray) -> dict[str, tuple[float, float]]:
  """(FLOPs, seconds) of the dots of `one_device_programs`, each dot timed alone at its shape (`matmuls.ceiling`):
  the rate these models' matmul shapes reach with nothing else to run. (The chunked step's loss loop is not
  read; its dots are LogitKD's but for the LM head's, taken a chunk at a time.)"""
  alone: dict = {}
  return {name: matmuls.ceiling(text, alone=alone) for name, text in one_device_programs(ours, bare, x).items()}
