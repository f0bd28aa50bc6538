"""Training throughput: meshdistill against tunix's DistillationTrainer on the same work, with a roofline.

The same teacher and student (the built-in decoder, sized for CPU), the same initial weights,
the same optimizer (global-norm clipping + AdamW, lr 1e-3) and the same batches go through

* tunix 0.1.7: `DistillationTrainer` + `LogitStrategy` (tau=2, alpha=0.5), driven through its
  public ``train()`` loop one batch per call, on the 2x4 mesh under GSPMD. Its strategy already
  wraps the teacher forward in ``nnx.jit`` (its jitted teacher call). tunix computes the teacher's
  outputs in ``_prepare_inputs`` BEFORE ``shard_input`` splits the batch over ``data``: given host
  numpy batches its teacher forward sees the unsplit batch and is computed on every ``data``
  replica. Two rows are therefore reported: "tunix" with each batch put on the mesh split over
  ``data`` inside the timed step (what ``shard_input`` would do, and what tunix's own examples feed:
  its best configuration, the headline peer), and "tunix, host numpy input" (what a plain
  iterator of numpy batches gives it);
* meshdistill: `Distiller` with `ChunkedLogitKD` (and `LogitKD`), one compiled program per step
  (shard_map over ``data``, weights split over ``tensor``), fed the same host numpy batches.

Every position counts (mask of ones): tunix's loss averages over all positions, so with no
padding both compute the same loss, ``alpha tau^2 KL + (1 - alpha) CE``, and their loss curves
must agree -- a check that the work really is the same.

The same meshdistill steps and the bare programs also run on ONE device (no mesh; in a child process whose
JAX has one CPU device, not on one of the 8 simulated ones), so the overhead of our step over a bare teacher
forward + bare student step is measured on one device and on the mesh. Timing: after warm-up steps, steps
of all systems (of each process) are interleaved round by round and each step is timed to completion
(``block_until_ready`` / the end of tunix's ``train()``); medians of the per-step times and medians of the
within-round ratios ("paired") are reported.

Training loops: the same systems also run their own training loops side by side over blocks of
``--loop-steps`` batches (ours: `meshdistill.loop.trainer.fit`, one logged step and the rest metrics-light per
block, as a run does; tunix: one ``train()`` call per block, its documented usage, so its per-call set-up
is paid once per block rather than per step; the bare programs: dispatched back to back, waited on at the
end), interleaved block by block: what a run costs per step, dispatch-ahead included.

Roofline: each row's analytic FLOPs per step (matmuls: 2 N_teacher + 6 N_student per token, N the
matmul weights incl. the tied LM head; plus attention 4 L T D per token forward, 3x that for the
student's forward + backward) against the matmul rate measured in the same rounds on the same
device set (a large float32 matmul, split over all devices on the mesh). The compiled programs'
``cost_analysis()`` FLOPs are printed beside the analytic count, and the number of all-reduces
in the compiled 2x4 step.

Run: ``python benchmarks/throughput.py [--vocab 1024 --steps 15 --loop-rounds 6 --loop-steps 10]``; writes
``benchmarks/results/throughput.md`` and the raw times beside it (``throughput.json``).
``--render`` rewrites the ``.md`` from that ``.json`` without timing anything (after a change to the
report, or to take in new `step_profile.py` rows).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

# A CPU benchmark (its mesh is simulated CPU devices): JAX, with libtpu installed (the `tpu` extra), does not
# probe for a TPU first (as the CLI and the tests set it; `step_profile.py` and `matmul_shapes.py` import this
# module before JAX). Read as JAX is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import meshdistill as md  # noqa: E402

# The one-device rows run in a child process of their own with ONE CPU device (`run`): in a process whose
# CPU client simulates 8 devices, a program placed on one of them runs slower than in a process with one device.
ONE_DEVICE_ENV = "MESHDISTILL_THROUGHPUT_ONE_DEVICE"
XLA_FLAGS_BEFORE = os.environ.get("XLA_FLAGS")
if os.environ.get(ONE_DEVICE_ENV) != "1":
  md.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tunix.distillation import distillation_trainer as tunix_trainer  # noqa: E402
from tunix.distillation.strategies import logit as tunix_logit  # noqa: E402

import _matmuls  # noqa: E402  (beside this file)
from meshdistill import losses  # noqa: E402
from meshdistill.parallel.collectives import all_reduce_census, all_reduce_instructions, mesh_axis_groups  # noqa: E402
from meshdistill.strategies import HardLabelCE, LogitKD  # noqa: E402
from meshdistill.strategies._chunked import ChunkedLogitKD  # noqa: E402
from meshdistill.loop.trainer import fit  # noqa: E402

RESULT = pathlib.Path(__file__).parent / "results" / "throughput.md"
# `all_reduce_census` of the same 2x4 steps at commit 6dda497 (before the bundled sums, the one-pass gradient norm
# and the metrics-light step): total (over `data` / over `tensor` / over part of `tensor`)
BEFORE_ALL_REDUCES = "37 (2 / 28 / 7) ChunkedLogitKD, 36 (2 / 27 / 7) LogitKD"
B, T = 8, 128
TAU, ALPHA, LR = 2.0, 0.5, 1e-3


def configs(vocab: int):
  teacher = md.ModelConfig(vocab_size=vocab, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=1024,
                           max_len=T)
  student = md.ModelConfig(vocab_size=vocab, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=512,
                           max_len=T)
  return teacher, student


def make_batches(n: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, (B, T + 1)).astype(np.int32) for _ in range(n)]


def ours_batch(x: np.ndarray) -> dict:
  return {"inputs": x[:, :-1], "targets": x[:, 1:], "mask": np.ones((B, T), np.float32)}


def timed(fn) -> tuple[float, float]:
  """(wall seconds, CPU seconds of this process) of ``fn()``."""
  wall, cpu = time.perf_counter(), time.process_time()
  fn()
  return time.perf_counter() - wall, time.process_time() - cpu


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
    """Our training loop (`meshdistill.loop.trainer.fit`, default options, no checkpoints or evaluation) over
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


# -------------------------------------------------------------------------------------- run
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


def run_loops(loops: dict, vocab: int, rounds: int, k: int) -> dict[str, list[float]]:
  """Each system's own training loop over the same ``k`` batches, round after round (``rounds`` timed, after
  warm-up): seconds per step of each block (the block's wall time / ``k``).

  Our loops (`Ours.loop`, `meshdistill.loop.trainer.fit` with ``log_every=k``) are first brought to a step
  count of ``k - 1`` modulo ``k`` so that every timed block is one logged (full) step and ``k - 1``
  metrics-light ones, the steady state of a run (a fit call runs full steps until its first log)."""
  batches = make_batches(k * (rounds + 2), vocab, seed=1)
  for name, system in loops.items():
    if isinstance(system, Ours):
      done = int(np.asarray(jax.device_get(system.d.unreplicate(system.state).step)))
      if (k - 1 - done) % k:
        system.loop(batches[: (k - 1 - done) % k], k)
    system.loop(batches[k : 2 * k], k)  # warm-up: compiles what the block runs
  times = {name: [] for name in loops}
  for r in range(rounds):
    xs = batches[(r + 2) * k : (r + 3) * k]
    for name, system in loops.items():
      wall, _ = timed(lambda: system.loop(xs, k))  # noqa: B023
      times[name].append(wall / k)
  return times


def run(vocab: int, steps: int, warmup: int, chunk: int, loop_rounds: int = 6, loop_steps: int = 10) -> dict:
  """Every row: first the one-device rows in a child process with one CPU device (`one_device_part`; first, before
  this process starts its JAX backend or builds tunix's trainers, whose threads could take CPU time beside it),
  then the 2x4 mesh rows here (8 simulated CPU devices); the same batches and initial weights in both."""
  one_res = one_device_part(vocab, steps, warmup, chunk, loop_rounds, loop_steps)
  mesh_res = run_part(False, vocab, steps, warmup, chunk, loop_rounds, loop_steps)
  res = {k: {**mesh_res[k], **one_res[k]}
         for k in ("times", "loop_times", "cpu", "compile_s", "stats", "matmul_flops", "ceiling")}
  losses = {**mesh_res["losses"], **one_res["losses"]}
  order = (OURS, REF, TUNIX, TUNIX_NP, TUNIX_REP, OURS + ROWS, REF + ROWS, OURS + DP, TUNIX_DP, ONE + OURS,
           ONE + REF + LIGHT, HAND, ONE + HAND)
  tcfg, scfg = configs(vocab)
  return {**res, "loop_steps": loop_steps, "losses": {k: losses[k] for k in order}, "tcfg": tcfg, "scfg": scfg}


def one_device_programs(ours: Ours, bare: Bare, x: np.ndarray) -> dict[str, str]:
  """The StableHLO of the one-device LogitKD step and of the bare programs on batch ``x``, by row name."""
  inputs, targets = x[:, :-1], x[:, 1:]
  return {
      ONE + REF: ours.d.lower(ours.state, ours_batch(x)).as_text(),
      ONE + BARE_T: bare.teacher_fwd.lower(bare.tparams, inputs).as_text(),
      ONE + BARE_S: bare.student_step.lower(bare.sparams, bare.opt_state, inputs, targets).as_text(),
  }


def matmul_ceilings(ours: Ours, bare: Bare, x: np.ndarray) -> dict[str, tuple[float, float]]:
  """(FLOPs, seconds) of the dots of `one_device_programs`, each dot timed alone at its shape (`_matmuls.ceiling`):
  the rate these models' matmul shapes reach with nothing else to run. (The chunked step's loss loop is not
  read; its dots are LogitKD's but for the LM head's, taken a chunk at a time.)"""
  alone: dict = {}
  return {name: _matmuls.ceiling(text, alone=alone) for name, text in one_device_programs(ours, bare, x).items()}


def ceiling_sentence(ceiling: dict, rate: float) -> str:
  """The targets' line on the matmul shapes' own ceiling (`matmul_ceilings`), if the run measured it."""
  if not ceiling:
    return ""
  frac = {k: fl / s / rate for k, (fl, s) in ceiling.items()}
  return (f" The models' own matmul shapes, every dot of a program timed alone in the same process "
          f"(`benchmarks/_matmuls.py`; `benchmarks/matmul_shapes.py` lists them): the LogitKD step's dots reach "
          f"{100 * frac[ONE + REF]:.0f}% of the rate with nothing else to run, the bare teacher forward's "
          f"{100 * frac[ONE + BARE_T]:.0f}%, the bare student step's {100 * frac[ONE + BARE_S]:.0f}%: the most a "
          "step of these models reaches on this machine.")


def one_device_env() -> dict[str, str]:
  """This process's environment for a child process whose JAX has one CPU device: the device-count flag this
  module added removed, the one-device switch on."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if XLA_FLAGS_BEFORE is not None:
    env["XLA_FLAGS"] = XLA_FLAGS_BEFORE
  env[ONE_DEVICE_ENV] = "1"
  return env


def one_device_part(vocab: int, steps: int, warmup: int, chunk: int, loop_rounds: int, loop_steps: int) -> dict:
  """`run_part` of the one-device rows in a child process whose JAX has one CPU device (this process's
  device-count flag removed from its environment); its results come back as JSON."""
  env = one_device_env()
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "one_device.json"
    subprocess.run([sys.executable, __file__, "--one-device-part", str(out), "--vocab", str(vocab), "--steps",
                    str(steps), "--warmup", str(warmup), "--chunk", str(chunk), "--loop-rounds", str(loop_rounds),
                    "--loop-steps", str(loop_steps)], env=env, check=True)
    return json.loads(out.read_text())


def run_part(one_device: bool, vocab: int, steps: int, warmup: int, chunk: int, loop_rounds: int,
             loop_steps: int) -> dict:
  """Times the mesh rows (``one_device=False``) or the one-device rows: steps interleaved round by round,
  then the training loops (`run_loops`)."""
  if one_device:  # the default device; `run` starts this part in a process that has no other
    mesh, pre = None, ONE
  else:
    mesh, pre = md.make_mesh(data=2, tensor=4), ""
    dp_mesh = md.make_mesh(data=8, tensor=1)
  tcfg, scfg = configs(vocab)
  chunked = lambda: ChunkedLogitKD(temperature=TAU, alpha=ALPHA, chunk_size=chunk)  # noqa: E731
  logit = lambda: LogitKD(temperature=TAU, alpha=ALPHA)  # noqa: E731
  systems = {
      pre + OURS: Ours(chunked(), mesh, tcfg, scfg),
      pre + REF: Ours(logit(), mesh, tcfg, scfg),
      # the steps the training loop runs between logging steps (same update, loss / grad_norm only)
      pre + OURS + LIGHT: Ours(chunked(), mesh, tcfg, scfg, light=True),
      pre + REF + LIGHT: Ours(logit(), mesh, tcfg, scfg, light=True),
      pre + HAND: Hand(mesh, tcfg, scfg),
  }
  if not one_device:
    systems.update({
        TUNIX: Tunix(mesh, tcfg, scfg, shard=True),
        TUNIX_NP: Tunix(mesh, tcfg, scfg, shard=False),
        # the same step with a CE-only strategy: the unused teacher is dropped by the compiler, so this
        # is a bare student step in meshdistill's step structure (shard_map over `data`)
        CE_ONLY: Ours(HardLabelCE(), mesh, tcfg, scfg),
        # the student replicated and run on rows split over data x tensor (`mesh.student_split: batch`)
        OURS + ROWS: Ours(chunked(), mesh, tcfg, scfg, split="batch"),
        REF + ROWS: Ours(logit(), mesh, tcfg, scfg, split="batch"),
        OURS + ROWS + LIGHT: Ours(chunked(), mesh, tcfg, scfg, light=True, split="batch"),
        REF + ROWS + LIGHT: Ours(logit(), mesh, tcfg, scfg, light=True, split="batch"),
        TUNIX_REP: Tunix(mesh, tcfg, scfg, shard=True, replicated_student=True),
        # every system's data-parallel form: on the mesh 8x1 nothing is split over `tensor`
        OURS + DP: Ours(chunked(), dp_mesh, tcfg, scfg),
        OURS + DP + LIGHT: Ours(chunked(), dp_mesh, tcfg, scfg, light=True),
        TUNIX_DP: Tunix(dp_mesh, tcfg, scfg, shard=True),
        HAND + DP: Hand(dp_mesh, tcfg, scfg),
    })
  bare = Bare(mesh, tcfg, scfg)
  probes = {pre + probe_name(shape): Matmul(mesh, *shape) for shape in PROBES}
  parts = {pre + BARE_T: bare.teacher, pre + BARE_S: bare.student, **{k: v.step for k, v in probes.items()}}
  if not one_device:
    bare_dp = Bare(dp_mesh, tcfg, scfg)
    parts.update({BARE_T + DP: bare_dp.teacher, BARE_S + DP: bare_dp.student})
  batches = make_batches(warmup + steps, vocab)
  stats = {name: s.compiled_stats(batches[0]) for name, s in systems.items() if isinstance(s, Ours)}
  times = {name: [] for name in [*systems, *parts]}
  cpu = {name: [] for name in times}
  compile_s = {}
  for i, x in enumerate(batches):
    for name, fn in [*((n, s.step) for n, s in systems.items()), *parts.items()]:
      wall, cpu_s = timed(lambda: fn(x))  # noqa: B023
      if i < warmup:
        compile_s[name] = compile_s.get(name, 0.0) + wall
      else:
        times[name].append(wall)
        cpu[name].append(cpu_s)
  ceiling = matmul_ceilings(systems[ONE + REF], bare, batches[0]) if one_device else {}
  if one_device:
    loops = {ONE + OURS: systems[ONE + OURS], ONE + REF: systems[ONE + REF], ONE + BARE: bare}
    losses = {ONE + OURS: systems[ONE + OURS].losses, ONE + REF + LIGHT: systems[ONE + REF + LIGHT].losses,
              ONE + HAND: systems[ONE + HAND].losses}
  else:
    loops = {OURS: systems[OURS], OURS + ROWS: systems[OURS + ROWS], REF + ROWS: systems[REF + ROWS],
             OURS + DP: systems[OURS + DP], TUNIX: systems[TUNIX], TUNIX_REP: systems[TUNIX_REP],
             TUNIX_DP: systems[TUNIX_DP], BARE: bare}
    losses = {OURS: systems[OURS].losses, REF: systems[REF].losses, TUNIX: systems[TUNIX].losses(),
              TUNIX_NP: systems[TUNIX_NP].losses(), TUNIX_REP: systems[TUNIX_REP].losses(),
              OURS + ROWS: systems[OURS + ROWS].losses, REF + ROWS: systems[REF + ROWS].losses,
              HAND: systems[HAND].losses, OURS + DP: systems[OURS + DP].losses, TUNIX_DP: systems[TUNIX_DP].losses()}
  loop_times = run_loops(loops, vocab, loop_rounds, loop_steps) if loop_rounds else {}
  return {"times": times, "loop_times": loop_times, "cpu": cpu, "compile_s": compile_s, "stats": stats,
          "matmul_flops": {k: v.flops for k, v in probes.items()}, "losses": losses, "ceiling": ceiling}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--vocab", type=int, default=1024)
  parser.add_argument("--steps", type=int, default=15, help="timed steps per system (after warm-up)")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--chunk", type=int, default=256, help="ChunkedLogitKD tokens per chunk (per device)")
  parser.add_argument("--loop-rounds", type=int, default=6,
                      help="timed rounds of the training loops side by side (0: none)")
  parser.add_argument("--loop-steps", type=int, default=10,
                      help="steps per loop block (our loop's log_every: one logged step, the rest metrics-light)")
  parser.add_argument("--out", type=pathlib.Path, default=RESULT)
  parser.add_argument("--render", action="store_true",
                      help="rewrite --out from the raw times its .json keeps (an earlier run), timing nothing")
  parser.add_argument("--one-device-part", type=pathlib.Path, default=None, metavar="JSON",
                      help=f"time only the one-device rows, in this process, and write their raw times to JSON (what "
                           f"the run does in its child process, started with {ONE_DEVICE_ENV}=1: one CPU device; "
                           "without it this process simulates 8 devices and the rows run on the first)")
  args = parser.parse_args(argv)
  if args.one_device_part is not None:
    part = run_part(True, args.vocab, args.steps, args.warmup, args.chunk, args.loop_rounds, args.loop_steps)
    args.one_device_part.write_text(json.dumps(part) + "\n")
    return
  if args.render:
    raw = json.loads(args.out.with_suffix(".json").read_text())
    for k, v in raw["args"].items():
      setattr(args, k, v)
    res = {**raw, "stats": {k: tuple(v) for k, v in raw["stats"].items()}}
    res["tcfg"], res["scfg"] = configs(args.vocab)
    write(args, res, {name: statistics.median(ts) for name, ts in res["times"].items()}, raw["seconds"])
    print(f"rewrote {args.out} from {args.out.with_suffix('.json')}")
    return
  t0 = time.time()
  load_start = os.getloadavg()
  res = run(args.vocab, args.steps, args.warmup, args.chunk, args.loop_rounds, args.loop_steps)
  res["load"], res["machine"] = (load_start, os.getloadavg()), machine()
  med = {name: statistics.median(ts) for name, ts in res["times"].items()}
  for name, ts in res["times"].items():
    print(f"{name}: median {1e3 * med[name]:.1f} ms over {len(ts)} steps", flush=True)
  for name, ts in res["loop_times"].items():
    print(f"loop, {name}: median {1e3 * statistics.median(ts):.1f} ms per step over {len(ts)} blocks", flush=True)
  for name, (flops, census) in res["stats"].items():
    print(f"{name}: compiled step {flops / 1e9:.2f} GFLOP (cost_analysis), all-reduces in the HLO {census}", flush=True)
  write(args, res, med, time.time() - t0)
  print(f"wrote {args.out}")


def machine() -> str:
  """Versions and the processor this process runs on (its model name and vector extensions: XLA's CPU kernels,
  and so the times and the last bits of the losses, differ between processors)."""
  cpu, isa = platform.machine(), ""
  try:
    info = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    info = ""
  for line in info.splitlines():
    key, _, value = line.partition(":")
    if key.strip() == "model name" and cpu == platform.machine():
      cpu = f"{value.strip()} ({platform.machine()})"
    elif key.strip() == "flags" and not isa:
      flags = value.split()
      isa = ", ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
  return (f"jax {jax.__version__}, Python {platform.python_version()}, {cpu}, {os.cpu_count()} CPU cores"
          + (f" ({isa})" if isa else ""))


PROFILE = pathlib.Path(__file__).parent / "results" / "step_profile.jsonl"


def profile_section() -> list[str]:
  """The op-kind breakdown of `benchmarks/step_profile.py` runs (``results/step_profile.jsonl``), if any."""
  if not PROFILE.exists():
    return []
  rows = [json.loads(line) for line in PROFILE.read_text().splitlines()]
  kinds = list(rows[0]["ms"])
  out = [
      "## Profile: where the step's time goes, before / after",
      "",
      "`python benchmarks/step_profile.py --label <label>`: a `jax.profiler` trace of the one-device step on these",
      "models; every op the XLA CPU runtime ran, grouped by what its HLO holds (matmul: a dot, with whatever is fused",
      "into it; reduction; copy/transpose: a layout change, with fused elementwise work; elementwise: the rest).",
      "Each op at its fastest of the traced steps (other jobs on the shared cores slow single runs) times its runs",
      "per step, summed over the runtime's threads (ops run concurrently, so the sum is not the step's wall time).",
      "*before*: the code before this round's changes (commit 6dda497); *after: ...*: with the changes named, in",
      "order (collectives and metrics-light step; then the decoder's token-flat matmuls; then the one-pass loss and",
      "metrics of `forward_kl_terms`). The load column matters: rows traced while the machine was loaded (1-minute",
      "load ~20 on 2 cores) show about twice the op time of rows traced on a quiet machine (~2), so compare shares",
      "across such rows, milliseconds only between rows of similar load. The last two runs (*same machine, before*:",
      "stacked reductions on one device too; *after: + separate reductions where V is whole*) were traced minutes",
      "apart on another machine than the rows above, whose op times sum about twice as high at the same load and the",
      "same step time: compare those two runs with each other, and with earlier rows by shares only.",
      "",
      "| run | step | load (1 min) | op ms / step | " + " | ".join(kinds) + " |",
      "|---|---|---:|---:|" + "---:|" * len(kinds),
  ]
  for r in rows:
    total = sum(r["ms"].values())
    shares = " | ".join(f"{100 * r['ms'][k] / total:.0f}% ({r['ms'][k]:.0f})" for k in kinds)
    out.append(f"| {r['label']} | {r['step']} | {r['load']:.1f} | {total:.0f} | {shares} |")
  return out + [""]


def per_round(t: dict[str, list[float]], num: str, den: tuple[str, ...]) -> list[float]:
  """t[num] / sum(t[d] for d in den) within each round."""
  return [t[num][i] / sum(t[d][i] for d in den) for i in range(len(t[num]))]


def paired(t: dict[str, list[float]], num: str, den: tuple[str, ...]) -> float:
  """Median over rounds of t[num] / sum(t[d] for d in den) within the round."""
  return statistics.median(per_round(t, num, den))


def ratio_of(t: dict[str, list[float]], med: dict[str, float], num: str,
             den: tuple[str, ...]) -> tuple[float, float, str]:
  """(ratio of medians, median of per-round ratios, their interquartile range) of num / sum(den)."""
  return med[num] / sum(med[d] for d in den), paired(t, num, den), spread(t, num, den)


def verdict(ok: bool) -> str:
  return "met" if ok else "NOT met"


def spread(t: dict[str, list[float]], num: str, den: tuple[str, ...]) -> str:
  """The range of the per-round ratios between their quartiles (the middle half of the rounds)."""
  q1, _, q3 = statistics.quantiles(per_round(t, num, den), n=4)
  return f"{q1:.2f}-{q3:.2f}x"


LOOP_OURS = (OURS, OURS + ROWS, REF + ROWS)


def loop_section(res, fl, rate, med) -> dict[str, list[str]]:
  """The training loops side by side (`run_loops`): the section's lines and the targets' lines ({} of each
  without loop times, e.g. a file rendered from a run before them)."""
  t = res.get("loop_times") or {}
  if not t:
    return {"lines": [], "targets": []}
  k, tokens = res["loop_steps"], B * T
  lmed = {name: statistics.median(v) for name, v in t.items()}

  def ratio(num: str, den: tuple[str, ...]) -> tuple[float, float, str]:
    return ratio_of(t, lmed, num, den)

  peers = [p for p in (TUNIX, TUNIX_REP, TUNIX_DP) if p in t]
  peer = min(peers, key=lmed.get)
  vs = {(o, p): ratio(p, (o,)) for o in (*LOOP_OURS, OURS + DP) if o in t for p in peers}
  bare = {o: ratio(o, (BARE,)) for o in LOOP_OURS} | {ONE + o: ratio(ONE + o, (ONE + BARE,)) for o in (OURS, REF)}
  slow = {"ours": lmed[OURS + ROWS] / med[OURS + ROWS + LIGHT], "tunix": lmed[TUNIX] / med[TUNIX],
          "rep": lmed[TUNIX_REP] / med[TUNIX_REP], "bare": lmed[BARE] / (med[BARE_T] + med[BARE_S]),
          "bare1": lmed[ONE + BARE] / (med[ONE + BARE_T] + med[ONE + BARE_S])}
  def where(o: str) -> str:
    return o.replace(ONE, "one device, ").replace("meshdistill ", "") if o.startswith(ONE) else (
        o.removeprefix("meshdistill ") + ", 2x4 mesh")

  lines = [
      "",
      "## Training loops side by side",
      "",
      f"Each system's own training loop over the same {k} batches per block, {len(t[TUNIX])} timed blocks interleaved",
      "round by round after a warm-up block; time per step = the block's wall time / "
      f"{k}. Ours: `meshdistill.loop.trainer.fit` (default options, `log_every={k}`, no checkpoints or evaluation), whose",
      f"steady state is one logged step with every metric and {k - 1} metrics-light steps per block, dispatched",
      "ahead (it reads losses only to log them); the blocks are aligned to that, and a block ends when the state",
      "after its last step is computed. tunix: one `train()` call over the",
      "block's batches (its usage, `train(train_ds)`; split input as in its rows above), so its per-call set-up is",
      "paid once per block; the step rows above call `train()` once per batch. Bare: the teacher forward and the",
      "student step dispatched back to back for every batch, waited on once per block (no distillation loss).",
      "These are what a run costs per step; the step rows above time one step at a time.",
      "",
      "| loop | median ms / step | tokens/s | GFLOP/s | of matmul rate | every block (ms / step) |",
      "|---|---:|---:|---:|---:|---|",
  ]
  for name, ts in t.items():
    r = rate[ONE if name.startswith(ONE) else ""]
    every = ", ".join(f"{1e3 * v:.0f}" for v in ts)
    rate_s = fl["step"] / lmed[name]
    lines.append(f"| {name} | {1e3 * lmed[name]:.1f} | {tokens / lmed[name]:.0f} | {rate_s / 1e9:.1f} | "
                 f"{100 * rate_s / r:.0f}% | {every} |")
  lines += [
      "",
      "| comparison (loops) | ratio of medians | paired | paired, middle half of the rounds |",
      "|---|---:|---:|---:|",
      *[f"| {'**' if p == peer else ''}tokens/s, {o.removeprefix('meshdistill ')} / {p}{'**' if p == peer else ''} | "
        f"{a:.2f}x | {b:.2f}x | {c} |" for (o, p), (a, b, c) in vs.items()],
      *[f"| our loop / the bare loop, {where(o)} | {a:.2f}x | {b:.2f}x | {c} |" for o, (a, b, c) in bare.items()],
      f"| tunix: step rows (one `train()` call per batch) / its loop (not paired: other rounds) | "
      f"{med[TUNIX] / lmed[TUNIX]:.2f}x | | |",
      "",
      "Per step, each loop against the same system timed one step at a time in the rounds above (loop / step-row "
      f"medians, not paired: ours, ChunkedLogitKD over the batch, against its metrics-light step {slow['ours']:.2f}x; "
      f"tunix {slow['tunix']:.2f}x, student replicated {slow['rep']:.2f}x; the bare programs {slow['bare']:.2f}x, one "
      f"device {slow['bare1']:.2f}x). A loop dispatches ahead: its host work and its next program (for tunix and the",
      "bare loop, the next teacher forward, which does not wait for the student step) run while the last program",
      "computes; on these 2 shared cores that competes with the compute's own threads rather than hiding behind",
      "them (on an accelerator the host work runs on cores of its own), so a loop need not be the faster form here.",
      "",
  ]
  best = max((o for o in (*LOOP_OURS, OURS + DP) if o in t), key=lambda o: min(vs[(o, peer)][:2]))
  roof = {o: fl["step"] / lmed[ONE + o] / rate[ONE] for o in (OURS, REF)}
  targets = [
      f"* In the training loops (above; each system's own loop, tunix's per-call set-up paid once per block): ours "
      f"/ tunix's faster loop (*{peer}*) >= 1.25x: best {best.removeprefix('meshdistill ')} "
      f"{vs[(best, peer)][0]:.2f}x by medians, {vs[(best, peer)][1]:.2f}x paired ({vs[(best, peer)][2]}): "
      f"**{verdict(min(vs[(best, peer)][:2]) >= 1.25)}**; ours / bare <= 1.05x on one device: ChunkedLogitKD "
      f"{bare[ONE + OURS][0]:.2f}x / {bare[ONE + OURS][1]:.2f}x, LogitKD {bare[ONE + REF][0]:.2f}x / "
      f"{bare[ONE + REF][1]:.2f}x: **{verdict(max(bare[ONE + OURS][0], bare[ONE + REF][0]) <= 1.05)}**; one device of "
      "the "
      f"matmul rate: {100 * roof[OURS]:.0f}% / {100 * roof[REF]:.0f}%: **{verdict(max(roof.values()) >= 0.7)}**.",
  ]
  return {"lines": lines, "targets": targets}


def fastest_layouts(t, med, ratio) -> str:
  """The first target's closing sentence: each system at its fastest layout of those in the run (ChunkedLogitKD),
  the full step and the metrics-light one, against tunix's fastest ("" for a run without the 8x1 rows)."""
  if TUNIX_DP not in t:
    return ""
  peer = min((TUNIX, TUNIX_REP, TUNIX_DP), key=med.get)
  out = (" Each system at its fastest layout of those run here (2x4 as above, or data parallel on 8x1; "
         f"tunix: *{peer}*):")
  for kind, names in (("full step", (OURS, OURS + ROWS, OURS + DP)),
                      ("metrics-light", (OURS + LIGHT, OURS + ROWS + LIGHT, OURS + DP + LIGHT))):
    ours = min(names, key=med.get)
    a, b, c = ratio(peer, (ours,))
    out += (f" ChunkedLogitKD {kind} (*{ours.removeprefix('meshdistill ')}*) {a:.2f}x by medians, {b:.2f}x paired "
            f"({c}): **{verdict(min(a, b) >= 1.25)}**;")
  return out[:-1] + "."


def dp_reading(t, med, ratio) -> list[str]:
  """The reading of the data-parallel (8x1) rows ([] for a run without them)."""
  if TUNIX_DP not in t:
    return []
  tun, hand = ratio(TUNIX_DP, (OURS + DP,)), ratio(HAND + DP, (OURS + DP,))
  tun_hand, layout = ratio(TUNIX_DP, (HAND + DP,)), ratio(TUNIX_DP, (TUNIX,))
  bare = ratio(OURS + DP, (BARE_T + DP, BARE_S + DP))
  return [
      f"Data parallel on 8x1 (no `tensor` split, no collective but the gradient sums): tunix / ours ChunkedLogitKD "
      f"{tun[0]:.2f}x by medians ({tun[1]:.2f}x paired), the hand-written step / ours {hand[0]:.2f}x ({hand[1]:.2f}x), "
      f"tunix / the hand-written step {tun_hand[0]:.2f}x ({tun_hand[1]:.2f}x); ours / the bare programs {bare[0]:.2f}x "
      f"({bare[1]:.2f}x). tunix on 8x1 / tunix on 2x4: {layout[0]:.2f}x ({layout[1]:.2f}x). Each device holds "
      "the whole vocabulary here, so the hand-written step forms its full `[B, T, V]` logits and their softmaxes per "
      "device, where the chunked loss forms them a chunk at a time from the final hidden states.",
  ]


def write(args, res, med, seconds: float) -> None:
  tokens = B * T
  t, cpu = res["times"], res["cpu"]
  cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
  fl = step_flops(res["tcfg"], res["scfg"])
  probe_rate = {k: f / med[k] for k, f in res["matmul_flops"].items()}
  # The roofline of each device set is the fastest probe on that device set (one device: no mesh; mesh: the
  # 8 simulated devices), measured in the same rounds.
  rate = {pre: max(r for k, r in probe_rate.items() if k.startswith(ONE) == (pre == ONE)) for pre in ("", ONE)}
  row_flops = {OURS: fl["step"], REF: fl["step"], OURS + LIGHT: fl["step"], REF + LIGHT: fl["step"],
               TUNIX: fl["step"], TUNIX_NP: fl["step"], TUNIX_REP: fl["step"], CE_ONLY: fl["student"],
               OURS + ROWS: fl["step"], REF + ROWS: fl["step"], OURS + ROWS + LIGHT: fl["step"],
               REF + ROWS + LIGHT: fl["step"],
               BARE_T: fl["teacher"], BARE_S: fl["student"], HAND: fl["step"],
               OURS + DP: fl["step"], OURS + DP + LIGHT: fl["step"], TUNIX_DP: fl["step"], HAND + DP: fl["step"],
               BARE_T + DP: fl["teacher"], BARE_S + DP: fl["student"]}
  tc, sc = res["tcfg"], res["scfg"]
  (l1, l5, l15), (e1, e5, e15) = res["load"]
  lines = [
      "# Throughput: meshdistill vs tunix on the same work, with a roofline",
      "",
      f"Produced by `python benchmarks/throughput.py --vocab {args.vocab} --steps {args.steps} --warmup {args.warmup} "
      f"--chunk {args.chunk} --loop-rounds {args.loop_rounds} --loop-steps {args.loop_steps}` "
      f"({seconds:.0f} s wall).",
      "",
      "## Set-up",
      "",
      f"* Machine: {os.cpu_count()} CPU cores, possibly shared with other jobs: load average (1/5/15 min)",
      f"  {l1:.1f}/{l5:.1f}/{l15:.1f} at the start, {e1:.1f}/{e5:.1f}/{e15:.1f} at the end (`os.getloadavg()`, as `uptime`",
      "  prints; it counts this benchmark's own threads too). Absolute times are slow and noisy; the ratios compare systems timed in the",
      "  same interleaved rounds (medians of per-round ratios: *paired*), which is what this measures.",
      "* Mesh 2x4 (`data`=2, `tensor`=4) of 8 simulated CPU devices sharing those cores. The `1 device:` rows run",
      "  first, in a child process whose JAX has one CPU device (no mesh; XLA's CPU client uses the cores for",
      "  intra-op threads), interleaved among themselves: a program placed on one of 8 simulated devices runs slower",
      "  than the same program in a process with one device (see throughput_notes.md), which is not what one device",
      "  means.",
      f"* Teacher: {tc.n_layers} layers, d={tc.d_model}, MLP {tc.mlp_hidden}; student: {sc.n_layers} layers, "
      f"d={sc.d_model}, MLP {sc.mlp_hidden}; V={sc.vocab_size}; B={B}, T={T} ({tokens} tokens per step), float32.",
      "* Same initial weights, optimizer (clip 1.0 + AdamW lr 1e-3) and batches (random tokens, no",
      "  padding) for every system; tau=2, alpha=0.5, forward KL + CE. Every system gets host numpy",
      "  batches and does its own transfer inside the timed step.",
      "* **tunix** (the headline peer row): each batch put on the mesh split over `data` before `train()`",
      "  (what tunix's `shard_input` does and its examples feed), so its jitted teacher forward (the",
      "  strategy `nnx.jit`s it) runs on the split batch. **tunix, host numpy input**: the same trainer",
      "  given numpy batches: tunix runs the teacher in `_prepare_inputs` before `shard_input`, so the",
      "  teacher forward sees the whole batch and is computed on every `data` replica. **tunix, student",
      "  replicated**: split input as in the headline row, the student's weights replicated instead of split over",
      "  `tensor` (the layout of our *student over the batch* rows; tunix still splits the batch over `data` only).",
      "  The targets compare against the faster of the two split-input tunix rows in the run.",
      "* **..., data parallel (8x1)**: the same systems on the mesh `data`=8, `tensor`=1 of the same 8 devices: both",
      "  models replicated, the batch split over all 8, no collective but the gradient sums (for models this small",
      "  the layout a user would pick; tunix given split input as in its headline row). The targets also compare",
      "  each system at its fastest layout of those run.",
      f"* {args.warmup} warm-up steps (compilation) per system, then {args.steps} timed steps each, interleaved;",
      "  each step timed to completion.",
      f"* ChunkedLogitKD with chunk_size={args.chunk} tokens per device.",
      "",
      "## Results",
      "",
      f"Roofline: analytic FLOPs per step: teacher forward {fl['teacher'] / 1e9:.2f} GFLOP (N_teacher = "
      f"{fl['n_t']:,} matmul weights), student forward + backward {fl['student'] / 1e9:.2f} GFLOP (N_student = "
      f"{fl['n_s']:,}), distillation step {fl['step'] / 1e9:.2f} GFLOP (KL / softmax elementwise work not counted).",
      f"Matmul rate measured in these rounds, on each device set: **one device {rate[ONE] / 1e9:.1f} GFLOP/s, "
      f"2x4 mesh {rate[''] / 1e9:.1f} GFLOP/s**: the fastest of {len(PROBES)} float32 matmul shapes timed on that "
      "device set (on the mesh, rows split over the 8 devices, the rate of the 2x4 and the 8x1 rows alike; median "
      "time of each, table below). Both device sets "
      "run on the same 2 cores. *of matmul rate* = (FLOPs / median step time) / the rate of the row's device set.",
      "",
      "| system | median step (ms) | tokens/s | median CPU s / step | GFLOP / step | GFLOP/s | of matmul rate "
      "| all timed steps (ms) |",
      "|---|---:|---:|---:|---:|---:|---:|---|",
  ]
  order = [OURS, REF, OURS + LIGHT, REF + LIGHT, OURS + ROWS, REF + ROWS, OURS + ROWS + LIGHT, REF + ROWS + LIGHT,
           OURS + DP, OURS + DP + LIGHT, TUNIX, TUNIX_REP, TUNIX_DP, TUNIX_NP, HAND, HAND + DP, CE_ONLY, BARE_T, BARE_S,
           BARE_T + DP, BARE_S + DP, ONE + OURS, ONE + REF, ONE + OURS + LIGHT, ONE + REF + LIGHT, ONE + HAND,
           ONE + BARE_T, ONE + BARE_S]
  for name in (n for n in order if n in t):  # a file rendered from an earlier run may lack some rows
    base = name.removeprefix(ONE)
    r = rate[ONE if name.startswith(ONE) else ""]
    f = row_flops[base]
    ts = ", ".join(f"{1e3 * v:.0f}" for v in t[name])
    lines.append(
        f"| {name} | {1e3 * med[name]:.1f} | {tokens / med[name]:.0f} | {cpu_med[name]:.3f} | {f / 1e9:.2f} | "
        f"{f / med[name] / 1e9:.1f} | {100 * f / med[name] / r:.0f}% | {ts} |"
    )
  for name, f in res["matmul_flops"].items():
    r = rate[ONE if name.startswith(ONE) else ""]
    ts = ", ".join(f"{1e3 * v:.0f}" for v in t[name])
    lines.append(f"| {name} | {1e3 * med[name]:.1f} | | {cpu_med[name]:.3f} | {f / 1e9:.2f} | "
                 f"{probe_rate[name] / 1e9:.1f} | {100 * probe_rate[name] / r:.0f}% | {ts} |")
  ours = (OURS, REF, OURS + LIGHT, REF + LIGHT)
  rows = (OURS + ROWS, REF + ROWS, OURS + ROWS + LIGHT, REF + ROWS + LIGHT)  # mesh only

  def ratio(num: str, den: tuple[str, ...]) -> tuple[float, float, str]:
    return ratio_of(t, med, num, den)

  sp = {k: ratio(TUNIX, (k,)) for k in (*ours, *rows)}
  sp_rep = {k: ratio(TUNIX_REP, (k,)) for k in (*ours, *rows)}
  sp_np = {k: ratio(TUNIX_NP, (k,)) for k in (OURS, REF)}
  ov = {**{pre + k: ratio(pre + k, (pre + BARE_T, pre + BARE_S)) for pre in (ONE, "") for k in ours},
        **{k: ratio(k, (BARE_T, BARE_S)) for k in rows}}
  tunix_split = ratio(TUNIX_NP, (TUNIX,))
  tunix_rep = ratio(TUNIX_REP, (TUNIX,))
  hand_tunix = ratio(TUNIX, (HAND,))
  hand = {**{pre + k: ratio(pre + k, (pre + HAND,)) for pre in (ONE, "") for k in ours},
          **{k: ratio(k, (HAND,)) for k in rows}}
  rows_vs_tensor = {r: ratio(k, (r,)) for k, r in zip(ours, rows)}
  loop = loop_section(res, fl, rate, med)
  lines += loop["lines"]
  lines += [
      "",
      "## Ratios (medians of step times / medians of per-round ratios, and their spread)",
      "",
      "| comparison | ratio of medians | paired | paired, middle half of the rounds |",
      "|---|---:|---:|---:|",
      *[f"| **tokens/s, {k.removeprefix('meshdistill ')} / tunix (input split over `data`)** | **{a:.2f}x** | {b:.2f}x | {c} |"
        for k, (a, b, c) in sp.items()],
      *[f"| tokens/s, {k.removeprefix('meshdistill ')} / tunix, student replicated (input split over `data`) | {a:.2f}x | "
        f"{b:.2f}x | {c} |" for k, (a, b, c) in sp_rep.items()],
      *[f"| tokens/s, {k.removeprefix('meshdistill ')} / tunix, host numpy input | {a:.2f}x | {b:.2f}x | {c} |"
        for k, (a, b, c) in sp_np.items()],
      f"| tunix: numpy input step / split input step | {tunix_split[0]:.2f}x | {tunix_split[1]:.2f}x | {tunix_split[2]} |",
      f"| tunix: student replicated step / student split over `tensor` step | {tunix_rep[0]:.2f}x | {tunix_rep[1]:.2f}x "
      f"| {tunix_rep[2]} |",
      *[f"| tokens/s, {k.removeprefix('meshdistill ')} / the same with the student split over `tensor` | {a:.2f}x | "
        f"{b:.2f}x | {c} |" for k, (a, b, c) in rows_vs_tensor.items()],
      *[f"| {'**' if k.startswith(ONE) else ''}our step / (bare teacher forward + bare student step), "
        f"{k.replace(ONE, 'one device, ').replace('meshdistill ', '') if k.startswith(ONE) else k.removeprefix('meshdistill ') + ', 2x4 mesh'}"
        f"{'**' if k.startswith(ONE) else ''} | {a:.2f}x | {b:.2f}x | {c} |" for k, (a, b, c) in ov.items()],
      *[f"| our step / the hand-written step, {k.replace(ONE, 'one device, ').replace('meshdistill ', '') if k.startswith(ONE) else k.removeprefix('meshdistill ') + ', 2x4 mesh'}"
        f" | {a:.2f}x | {b:.2f}x | {c} |" for k, (a, b, c) in hand.items()],
      "",
  ]
  roof = {k: fl["step"] / med[ONE + k] / rate[ONE] for k in ours}
  # tunix's faster layout of the two it was given (student split over `tensor`, or replicated), by medians
  peer = TUNIX if med[TUNIX] <= med[TUNIX_REP] else TUNIX_REP
  best = {k: ratio(peer, (k,)) for k in (OURS, OURS + ROWS, REF, REF + ROWS, OURS + ROWS + LIGHT, REF + ROWS + LIGHT)}
  light = (OURS + ROWS + LIGHT, REF + ROWS + LIGHT)
  targets = [
      f"* ours / tunix >= 1.25x with tunix given split input (ChunkedLogitKD, the full step, against tunix's faster "
      f"layout here: *{peer}*): student split over `tensor` **{verdict(min(best[OURS][:2]) >= 1.25)}** "
      f"({best[OURS][0]:.2f}x by medians, {best[OURS][1]:.2f}x paired, middle half of the rounds {best[OURS][2]}); "
      f"student over the batch (`mesh.student_split: batch`) **{verdict(min(best[OURS + ROWS][:2]) >= 1.25)}** "
      f"({best[OURS + ROWS][0]:.2f}x / {best[OURS + ROWS][1]:.2f}x, {best[OURS + ROWS][2]}). LogitKD: "
      f"{best[REF][0]:.2f}x / {best[REF][1]:.2f}x, over the batch {best[REF + ROWS][0]:.2f}x / "
      f"{best[REF + ROWS][1]:.2f}x. (Met: both the ratio of medians and the paired ratio at least 1.25.) "
      "The metrics-light step, which the training loop runs on every step it does not log (tunix computes its loss "
      "and none of these metrics), student over the batch: ChunkedLogitKD "
      f"{best[light[0]][0]:.2f}x / {best[light[0]][1]:.2f}x ({best[light[0]][2]}), LogitKD {best[light[1]][0]:.2f}x / "
      f"{best[light[1]][1]:.2f}x: **{verdict(min(best[k][i] for k in light for i in (0, 1)) >= 1.25)}**."
      + fastest_layouts(t, med, ratio),
      f"* ours / bare <= 1.05x on one device: ChunkedLogitKD {ov[ONE + OURS][0]:.2f}x, LogitKD {ov[ONE + REF][0]:.2f}x: "
      f"**{verdict(max(ov[ONE + OURS][0], ov[ONE + REF][0]) <= 1.05)}**; metrics-light steps (the loop's steps between "
      f"logs): {ov[ONE + OURS + LIGHT][0]:.2f}x, {ov[ONE + REF + LIGHT][0]:.2f}x: "
      f"**{verdict(max(ov[ONE + OURS + LIGHT][0], ov[ONE + REF + LIGHT][0]) <= 1.05)}** (the mesh ratios beside it "
      "come from 8 simulated devices time-sharing 2 cores).",
      f"* one-device step at >= 70% of the measured matmul rate: ChunkedLogitKD {100 * roof[OURS]:.0f}% "
      f"(metrics-light {100 * roof[OURS + LIGHT]:.0f}%), LogitKD {100 * roof[REF]:.0f}% (metrics-light "
      f"{100 * roof[REF + LIGHT]:.0f}%): **{verdict(min(roof.values()) >= 0.7)}** for all four"
      f"{'' if min(roof.values()) >= 0.7 else ', ' + verdict(max(roof.values()) >= 0.7) + ' for the best'}. "
      "What the models themselves allow, on one device in the same rounds: the hand-written one-program step "
      f"{100 * fl['step'] / med[ONE + HAND] / rate[ONE]:.0f}%; the bare teacher forward "
      f"{100 * fl['teacher'] / med[ONE + BARE_T] / rate[ONE]:.0f}% and the bare student step "
      f"{100 * fl['student'] / med[ONE + BARE_S] / rate[ONE]:.0f}% (its matmuls are [{B * T}, {res['scfg'].d_model}]-thin), "
      f"{100 * fl['step'] / (med[ONE + BARE_T] + med[ONE + BARE_S]) / rate[ONE]:.0f}% back to back."
      + ceiling_sentence(res.get("ceiling", {}), rate[ONE]),
  ]
  targets += loop["targets"]
  stats = res["stats"]
  by_source = stats[OURS][1]["by source"]
  floor = by_source[SOURCES[0]] + by_source[SOURCES[2]] + by_source[SOURCES[3]] + by_source[SOURCES[4]]
  half = int(BEFORE_ALL_REDUCES.split()[0]) / 2
  targets.append(
      f"* all-reduces per step on the 2x4 HLO down by at least half (from {BEFORE_ALL_REDUCES.split()[0]}, ChunkedLogitKD"
      f"): student split over `tensor` {stats[OURS][1]['total']} **{verdict(stats[OURS][1]['total'] <= half)}**; student "
      f"over the batch {stats[OURS + ROWS][1]['total']} (LogitKD {stats[REF + ROWS][1]['total']}) "
      f"**{verdict(stats[OURS + ROWS][1]['total'] <= half)}**, with the parity tests unchanged (tests/test_step.py and "
      "the other layout tests pass as before; tests/test_student_split.py checks this layout against one device).")
  lines += [
      "## Targets (issue 20), as measured here",
      "",
      *targets,
      "",
      "## Compiled step: FLOPs and all-reduces",
      "",
      "| step | cost_analysis GFLOP (per device program) | analytic GFLOP (whole step) | all-reduces in the HLO: total "
      "| over `data` | over `tensor` | over both (all 8 devices) | over part of `tensor` |",
      "|---|---:|---:|---:|---:|---:|---:|---:|",
      *[f"| {k} | {f / 1e9:.2f} | {fl['step'] / 1e9:.2f} | {c['total']} | {c.get('data', 0)} | {c.get('tensor', 0)} | "
        f"{c.get('data+tensor', 0)} | {c.get('other', 0)} |" for k, (f, c) in stats.items()],
      "",
      f"**All-reduce count per step on the 2x4 HLO: {stats[OURS][1]['total']} (ChunkedLogitKD), "
      f"{stats[REF][1]['total']} (LogitKD); metrics-light {stats[OURS + LIGHT][1]['total']}, "
      f"{stats[REF + LIGHT][1]['total']}; with the student over the batch {stats[OURS + ROWS][1]['total']} "
      f"(ChunkedLogitKD), {stats[REF + ROWS][1]['total']} (LogitKD).** Before the step-performance changes: "
      f"{BEFORE_ALL_REDUCES}. See the reading below for what the count is made of.",
      "",
      "All-reduces of the 2x4 steps by what produced them (`op_name` metadata of each compiled instruction):",
      "",
      "| source | " + " | ".join(k.removeprefix("meshdistill ") for k in stats if not k.startswith(ONE)) + " |",
      "|---|" + "---:|" * sum(not k.startswith(ONE) for k in stats),
      *[f"| {src} | " + " | ".join(str(c["by source"][src]) for k, (_, c) in stats.items() if not k.startswith(ONE))
        + " |" for src in SOURCES],
      "",
      f"With both models Megatron-style over `tensor`, the model's own all-reduces (embedding lookups "
      f"and matmuls), the data-axis sums and the optimizer's one gradient-norm sum are {floor} of ChunkedLogitKD's "
      f"{stats[OURS][1]['total']}: halving (to {half:.1f} or fewer) needs another split of the student, not fewer sums. "
      f"With the student over the batch: {stats[OURS + ROWS][1]['total']}: **all-reduces halved: "
      f"{verdict(stats[OURS + ROWS][1]['total'] <= half)}**.",
      "XLA CPU's cost analysis counts the per-device program (on the mesh: 1/8 of the batch rows, 1/4",
      "of the tensor-split weights) and includes elementwise work, so it is not comparable one to one",
      "with the analytic matmul count.",
      "",
      "## Losses side by side (same batches, same start)",
      "",
      "| step | " + " | ".join(res["losses"]) + " |",
      "|---:|" + "---:|" * len(res["losses"]),
  ]
  n = min(len(v) for v in res["losses"].values())
  for i in range(n):
    lines.append(f"| {i + 1} | " + " | ".join(f"{v[i]:.5f}" for v in res["losses"].values()) + " |")
  final = {k: v[n - 1] for k, v in res["losses"].items()}
  rel = max(abs(final[OURS] - final[k]) / abs(final[k]) for k in final)
  lines += [
      "",
      f"Final loss: ours {final[OURS]:.5f}, tunix {final[TUNIX]:.5f}; largest relative difference between any two "
      f"columns {rel:.1e}.",
      "",
      "Compile + warm-up seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in res["compile_s"].items()) + ".",
  ]
  structure = paired(t, CE_ONLY, (BARE_S,))
  lines += [
      "",
      "## Reading the numbers",
      "",
      "Where the difference to tunix comes from. Given host numpy batches, tunix's teacher forward runs",
      "on the unsplit batch on every `data` replica (its logits come out split over `tensor` only):",
      f"here its numpy-input step is {tunix_split[0]:.2f}x (paired {tunix_split[1]:.2f}x) its step with split input.",
      "Given split input, tunix runs the same model matmuls as we do; what differs is the structure:",
      "tunix runs the teacher forward as one jitted call and the student step as another, with its",
      "Python loop (metric buffering, a host read of the previous loss) around them; meshdistill runs",
      "the teacher forward, the student forward/backward and the update as one program. The teacher",
      f"logits handed between tunix's two programs are {B * T * args.vocab * 4 / 2**20:.0f} MiB here, cheap to pass.",
      f"Measured: ChunkedLogitKD / tunix (split input) = {sp[OURS][0]:.2f}x by medians, {sp[OURS][1]:.2f}x paired; "
      f"LogitKD / tunix = {sp[REF][0]:.2f}x / {sp[REF][1]:.2f}x.",
      f"The hand-written one-program step (the same math in plain JAX, one jit) is {hand_tunix[0]:.2f}x tunix by medians "
      f"({hand_tunix[1]:.2f}x paired): that much of the gain is running the teacher forward and the student update as "
      f"one program; ours / the hand-written step on the mesh is {hand[OURS][0]:.2f}x (ChunkedLogitKD) and "
      f"{hand[REF][0]:.2f}x (LogitKD) by medians, what the framework's step adds or saves beyond that (the chunked "
      "loss, the one-pass loss and metrics, the bundled sums).",
      *dp_reading(t, med, ratio),
      "An earlier version of this file compared against tunix's numpy-input row only.",
      "",
      "Where our step's time goes beyond the bare programs (2x4 mesh, paired): the same step with a",
      f"CE-only strategy (teacher dropped) is {structure:.2f}x the bare student step: the cost of the step's",
      "structure (shard_map manual over `data` with compiler-managed `tensor`, the explicit gradient",
      "psum, the metrics). On one device that structure is absent, see the one-device ratio above.",
      "",
      "Roofline: the matmul rate is what this machine reaches on one large float32 matmul on the same device set",
      "in the same rounds; the step's fraction of it is bounded by its non-matmul work (softmaxes, norms, the",
      "optimizer, copies), by matmuls too thin to reach the rate (the student's), and, on the mesh, by the",
      "all-reduces between 8 simulated devices that share 2 cores. The hand-written step and the bare programs",
      "(the targets' line above) show what these models allow before any framework code runs;",
      "`benchmarks/matmul_shapes.py` (results/matmul_shapes.md) times the step's own matmul shapes alone, with",
      "nothing else in the program: the fraction of the rate they reach is the most a step of these models can.",
      "",
      "What the all-reduces are (the by-source table above). Sums over `data` are 2 per step: the token count",
      "(needed before the loss) and one tuple all-reduce of every gradient and metric sum (JAX emits one",
      "all-reduce per gradient leaf; XLA's all-reduce combiner fuses them, and `psum_bundled` stacks the",
      "scalars into one). The optimizer, at jit level outside the shard_map, sums the squares of the",
      "`tensor`-split gradients once, one all-reduce over `tensor` (it did three times: an `and` of `isfinite`",
      "per leaf, the clipping norm inside the skip's `cond`, the `grad_norm` metric). The loss and its metrics",
      "reduce over the `tensor`-split vocabulary with one stacked max and one stacked sum per chunk for the",
      "default recipe (`meshdistill.losses.forward_kl_terms`: the loss's sums and the metrics' sums leave as one",
      "all-reduce, correlation's centred sums ride with the hidden-state gradient's, and the backward pass needs",
      "no reduction over V): 3 all-reduces in the chunk loop, 8 before. The rest are the models' own: under the",
      "Megatron-style split each row-parallel matmul's output (attention output and MLP down projection: 2 per",
      "layer in each forward), the input gradients of the column-parallel matmuls in the student backward, the",
      "embedding lookups, and (over part of `tensor`) the gradients of key/value heads that fewer heads than",
      "`tensor` devices share. Those alone exceed half the count before the step-performance changes, so",
      "halving needs another split, not fewer sums.",
      "",
      "The student over the batch (`mesh.student_split: batch`, `meshdistill.parallel.layout.ShardMapLayout`) is that split:",
      "the teacher stays split over `tensor`; the student, small enough to hold whole on every device, is",
      "replicated and runs its forward, loss and backward in a nested `shard_map` on the rows of its device (the",
      "batch split over `data` x `tensor`). Its activations then need no all-reduce; what is left is the teacher's",
      "forward (Megatron-style: 2 all-reduces a layer, and its embedding lookup), moving the teacher's outputs to",
      "the student's rows (an all-to-all of the logits, or for the chunked loss one gather of the teacher's LM",
      "head; neither is an all-reduce), and one bundled sum of the gradients and token sums over all 8 devices.",
      "The optimizer needs no collective at all (whole gradients). The teacher's inputs and outputs are pinned",
      "whole over rows (`meshdistill.train.step`): unpinned, the compiler carried the student's row split into the",
      "teacher, gathered its attention weights and gathered the activations back before each MLP (then 7",
      "all-reduces here, and 14 all-gathers that this census does not count; see throughput_notes.md).",
      "tunix splits its batch over the axes of `data_sharding_axis` for both models at once; with `data` (as its",
      "examples do) a replicated student (the *tunix, student replicated* row) computes the same rows on every",
      "`tensor` device.",
      "",
  ]
  lines += profile_section()
  lines.append(f"Environment: {res.get('machine') or machine()}.")
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text("\n".join(lines) + "\n")
  raw = {k: res[k] for k in ("times", "loop_times", "loop_steps", "cpu", "compile_s", "stats", "matmul_flops",
                             "losses", "load", "machine", "ceiling") if k in res}
  raw["args"] = {k: getattr(args, k) for k in ("vocab", "steps", "warmup", "chunk", "loop_rounds", "loop_steps")}
  raw["seconds"] = seconds
  args.out.with_suffix(".json").write_text(json.dumps(raw) + "\n")


if __name__ == "__main__":
  sys.exit(main())
