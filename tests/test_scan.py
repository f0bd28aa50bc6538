"""Scanned blocks (`ModelConfig.scan_layers`): the same numbers as unrolled blocks for the same weights, with
captures, remat and on a mesh; conversions, Hugging Face import/export, generation, student init and checkpoints
across the two layouts; clear errors where stacked weights cannot serve (LoRA)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import STUDENT_CFG, TEACHER_CFG, assert_trees_close, make_batch
from jax.sharding import PartitionSpec as P

import meshdistill as md
from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.data import ByteTokenizer
from meshdistill.train.freezing import Stage, progressive_freeze
from meshdistill.models.generate import SamplingConfig, generate
from meshdistill.models.hf import export_hf, load_hf
from meshdistill.models.lora import LoraConfig, apply_lora
from meshdistill.models.stacking import is_stacked, stack_layers, to_scanned, to_unrolled, unstack_layers
from meshdistill.teachers.sources import student_from_teacher
from meshdistill.teachers.checkpoint import load_teacher, save_teacher
from test_hf import FIXTURES

TEACHER = TEACHER_CFG.replace(n_layers=3)
STUDENT = STUDENT_CFG.replace(n_layers=2)
# A tiny Gemma 3: local (sliding, own RoPE base) and global layers alternating (the real one: 5 local, 1 global;
# tests/test_family_blocks.py scans the 4-layer fixture, local, local, global, local), 5 layers = 2 groups of 2 + 1
GROUPED = TEACHER_CFG.replace(
    n_layers=5, sliding_window=3, layer_types=("sliding_attention", "full_attention") * 2 + ("sliding_attention",),
    rope_theta=1e6, rope_local_theta=1e4, qk_norm=True, post_norms=True, norm_offset=True, geglu=True,
    embed_scale=True, query_scale=0.3)


def _strategy():
  """Logit KD plus attention maps and hidden states: every capture the scan has to return."""
  return md.strategies.Composite(terms={
      "kd": md.LogitKD(), "attn": md.strategies.AttentionTransfer(), "feat": md.strategies.FeaturePooling()})


def _state_equal(a, b):
  return jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), nnx.state(a), nnx.state(b)))


def test_stacked_weights_have_an_unsplit_layer_axis_and_convert_back_exactly():
  mesh = md.make_mesh(2, 4)
  unrolled = md.init_model(TEACHER, seed=0, mesh=mesh)
  scanned = to_scanned(unrolled)
  q = scanned.blocks.attn.q.kernel
  assert q.shape == (TEACHER.n_layers, TEACHER.d_model, TEACHER.n_heads * TEACHER.hd)
  assert q.get_value().sharding.spec == P(None, None, "tensor")  # (None, *per-layer)
  assert nnx.get_partition_spec(nnx.state(scanned)).blocks.mlp.down.kernel.get_value() == P(None, "tensor", None)
  np.testing.assert_array_equal(q[1], unrolled.blocks[1].attn.q.kernel[...])
  assert is_stacked(nnx.state(scanned)) and not is_stacked(nnx.state(unrolled))
  assert _state_equal(to_unrolled(scanned), unrolled)
  state, cfg = nnx.state(unrolled), unrolled.cfg  # fitted to the mesh: key/value projections replicated
  assert jax.tree.all(jax.tree.map(
      lambda x, y: bool(jnp.array_equal(x, y)), unstack_layers(stack_layers(state, cfg), cfg), state))
  # a scanned model built directly is laid out the same way
  direct = md.init_model(TEACHER.replace(scan_layers=True), seed=0, mesh=mesh)
  assert direct.blocks.attn.q.kernel.get_value().sharding.spec == P(None, None, "tensor")


def _captured_value_and_grad(cfg, tokens):
  """``value_and_grad(model) -> ((loss, ModelOutput), grads)`` of a loss on the logits, attention maps and hidden
  states of ``tokens``, so every layer's captures reach the gradient."""

  def value_and_grad(model):
    graphdef, state = nnx.split(model)

    def f(state):
      out = nnx.merge(graphdef, state)(tokens, capture=("attn", "hidden"))
      assert len(out.hidden) == cfg.n_layers + 1 and len(out.attn) == cfg.n_layers
      return jnp.sum(out.logits**2) + sum(jnp.sum(a * (i + 1)) for i, a in enumerate(out.attn)) + sum(
          jnp.sum(h * (i + 1)) for i, h in enumerate(out.hidden)), out

    return jax.jit(jax.value_and_grad(f, has_aux=True))(state)

  return value_and_grad


def test_scanned_forward_captures_and_grads_equal_unrolled():
  """remat none here; remat full: the grouped test below and the distiller steps (captures through scanned remat)."""
  cfg = TEACHER
  unrolled = md.init_model(cfg, seed=3)
  scanned = to_scanned(unrolled)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)))
  value_and_grad = _captured_value_and_grad(cfg, tokens)
  (l0, out0), g0 = value_and_grad(unrolled)
  (l1, out1), g1 = value_and_grad(scanned)
  assert float(l1) == pytest.approx(float(l0), rel=1e-5)
  assert_trees_close((out1.logits, out1.hidden, out1.attn), (out0.logits, out0.hidden, out0.attn))
  # float32 sums in another order: elements near zero in a gradient of scale ~100 differ by ~1e-7 of that scale
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b)))),
               unstack_layers(g1, cfg), g0)


def test_layers_of_several_kinds_scan_in_groups_equal_unrolled_and_freeze_by_layer():
  """Gemma 3's local / global layers scanned as groups of ``scan_period`` layers (the last layer after the loop):
  logits, captures and gradients equal the unrolled model's; progressive freezing of the stacked weights moves the
  same layers as per-layer blocks, the frozen ones not at all."""
  cfg = GROUPED.replace(remat="full")
  assert cfg.scan_period == 2 and cfg.replace(layer_types=None).scan_period == 1
  assert cfg.with_layers([0, 2, 1, 4]).scan_period == 3  # a layer subset: sliding, sliding, global, sliding
  unrolled = md.init_model(cfg, seed=3)
  scanned = to_scanned(unrolled)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 10)))  # 10 > the window 3
  value_and_grad = _captured_value_and_grad(cfg, tokens)
  (l0, out0), g0 = value_and_grad(unrolled)
  (l1, out1), g1 = value_and_grad(scanned)
  assert len(out1.attn) == cfg.n_layers and float(l1) == pytest.approx(float(l0), rel=1e-5)
  assert_trees_close((out1.logits, out1.hidden, out1.attn), (out0.logits, out0.hidden, out0.attn), atol=1e-5)
  band = np.tril(np.triu(np.ones((10, 10)), -2))  # a sliding layer's query sees itself and the 2 tokens before
  assert not np.any(np.asarray(out1.attn[4]) * (1 - band)) and np.any(np.asarray(out1.attn[3]) * (1 - band))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b)))),
               unstack_layers(g1, cfg), g0)
  tx = progressive_freeze([Stage(start_step=0, freeze=0.5, lr=1e-2)], cfg.n_layers, optax.sgd(1.0), clip=None)
  params = {"student": nnx.state(scanned, nnx.Param)}
  updates = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])({"student": g1}, params)["student"]
  moved = [i for i in range(cfg.n_layers) if np.any(np.asarray(updates.blocks.attn.q.kernel[i]))]
  assert moved == list(range(cfg.n_layers - len(moved), cfg.n_layers)) and 0 < len(moved) < cfg.n_layers
  for u, g in zip(jax.tree.leaves(updates.blocks), jax.tree.leaves(g1.blocks)):  # plain SGD on the layers that move
    np.testing.assert_array_equal(np.asarray(u[: -len(moved)]), 0.0)
    np.testing.assert_allclose(np.asarray(u[-len(moved):]), -1e-2 * np.asarray(g[-len(moved):]), rtol=1e-6)


@pytest.mark.parametrize("shape", [None, (2, 4)], ids=["1dev", "2x4"])
def test_distiller_steps_with_attention_and_feature_transfer_equal_unrolled(shape):
  mesh = None if shape is None else md.make_mesh(*shape)
  teacher = md.init_model(TEACHER, seed=0, mesh=mesh)
  student = md.init_model(STUDENT.replace(remat="full"), seed=1, mesh=mesh)
  runs = {}
  for scan in (False, True):
    t, s = (to_scanned(teacher), to_scanned(student)) if scan else (teacher, student)
    d = md.Distiller(s, t, strategy=_strategy(), mesh=mesh, optimizer=optax.adam(1e-2))
    state = d.init_state()
    losses = []
    for i in range(2):
      state, metrics = d.step(state, make_batch(seed=i, batch=8, seq=8))
      losses.append(float(metrics["loss"]))
    student_after = d.student(state)
    runs[scan] = losses, nnx.state(to_unrolled(student_after))
  np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
  assert_trees_close(runs[True][1], runs[False][1])


def test_hf_import_export_round_trip_with_scanned_blocks(tmp_path):
  mesh = md.make_mesh(2, 4)
  unrolled = load_hf(FIXTURES / "hf_llama", mesh)
  scanned = load_hf(FIXTURES / "hf_llama", mesh, scan_layers=True)
  assert scanned.cfg.scan_layers and is_stacked(nnx.state(scanned))
  tokens = jnp.asarray(np.load(FIXTURES / "hf_llama" / "reference.npz")["tokens"])
  np.testing.assert_allclose(scanned(tokens).logits, unrolled(tokens).logits, atol=1e-5, rtol=1e-5)
  out = export_hf(scanned, tmp_path / "out")
  again = load_hf(out, mesh)
  assert _state_equal(again, unrolled)  # the written tensors are the per-layer checkpoint's


@pytest.mark.parametrize("cfg", [TEACHER, GROUPED], ids=["one-kind", "groups"])
def test_scanned_generation_equals_unrolled(cfg):
  """Cached decoding over stacked blocks; with layers of several kinds (2 groups of 2 + 1, sliding window 3) past
  the window, each layer's cache seen through its own window."""
  model = md.init_model(cfg, seed=0)
  prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 4)).astype(np.int32)
  mask = np.ones_like(prompts, bool)
  mask[0, 0] = False  # a left-padded row
  cfg = SamplingConfig(max_new_tokens=5, temperature=0.0)
  a = generate(model, prompts, mask, None, cfg, return_logits=True)
  b = generate(to_scanned(model), prompts, mask, None, cfg, return_logits=True)
  np.testing.assert_array_equal(b.tokens_BxN, a.tokens_BxN)
  np.testing.assert_allclose(b.logits_BxNxV, a.logits_BxNxV, rtol=1e-5, atol=1e-5)


def test_student_from_scanned_teacher_copies_the_chosen_layers():
  teacher = md.init_model(TEACHER, seed=0)
  want = student_from_teacher(teacher, (2, 0), TEACHER.replace(n_layers=2))
  got = student_from_teacher(to_scanned(teacher), (2, 0), TEACHER.replace(n_layers=2, scan_layers=True))
  assert got.cfg.scan_layers
  assert _state_equal(to_unrolled(got), want)


def test_student_checkpoint_restores_across_scan_layers(tmp_path):
  d = md.Distiller(to_scanned(md.init_model(STUDENT, seed=1)), md.init_model(TEACHER, seed=0))
  state = d.init_state()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every=1)
  ckpt.save(1, d, state, {}, {})
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), read_only=True)
  unrolled = ckpt.restore_student(STUDENT, None)
  assert not unrolled.cfg.scan_layers
  assert _state_equal(to_scanned(unrolled), d.student(state))
  # the whole train state (optimizer moments stacked too) restores only onto the same layout, with a clear error
  other = md.Distiller(md.init_model(STUDENT, seed=1), md.init_model(TEACHER, seed=0))
  with pytest.raises(ValueError, match="scan_layers"):
    ckpt.restore(other, other.init_state())


def test_saved_unrolled_teacher_loads_scanned(tmp_path):
  teacher = md.init_model(TEACHER, seed=0)
  tok = ByteTokenizer()
  path = save_teacher(str(tmp_path / "teacher"), teacher, tok, {})
  loaded = load_teacher(path, TEACHER.replace(scan_layers=True), None, tok)
  assert loaded.cfg.scan_layers and _state_equal(to_unrolled(loaded), teacher)


def test_lora_refuses_stacked_blocks_and_freezing_checks_their_layer_axis():
  scanned = md.init_model(STUDENT.replace(scan_layers=True), seed=1)
  with pytest.raises(ValueError, match="student.scan_layers=false"):
    apply_lora(scanned, LoraConfig(rank=2))
  params = {"student": nnx.state(scanned, nnx.Param)}
  tx = progressive_freeze([Stage(start_step=0, freeze=0.5, lr=1e-3)], STUDENT.n_layers + 1)
  with pytest.raises(ValueError, match=f"n_layers={STUDENT.n_layers + 1}"):  # stacked [2, ...] read as 3 blocks
    tx.init(params)
  mixed = {**params, "other": {"blocks": {0: {"w": jnp.zeros(2)}}}}
  with pytest.raises(ValueError, match="scan_layers=true or false"):
    progressive_freeze([Stage(start_step=0, lr=1e-3)], STUDENT.n_layers).init(mixed)


def test_config_takes_freezing_but_refuses_lora_with_a_scanned_student():
  from meshdistill.config import ConfigError, load_config

  assert load_config(None, ["student.scan_layers=true", "teacher.scan_layers=true"]).student.scan_layers
  cfg = load_config(None, ["student.scan_layers=true", "train.freeze=[{start_step: 0, freeze: 0.5, lr: 0.003}]"])
  assert cfg.train.stages()[0].freeze == 0.5
  with pytest.raises(ConfigError, match="student.scan_layers=false"):
    load_config(None, ["student.scan_layers=true", "student.lora.rank=4"])
