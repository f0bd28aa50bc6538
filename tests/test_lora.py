"""LoRA / QLoRA students: exact start, only adapters move and hold optimizer state, layouts agree,
quantized storage stays integer, resume is exact, merged export reloads, bad settings are named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, assert_trees_close, make_batch
from flax import nnx

import meshdistill as md
from meshdistill.checkpoint import Checkpointer
from meshdistill.config import ConfigError, load_config
from meshdistill.models.hf import export_hf, load_hf
from meshdistill.models.lora import QUANTIZE, LoraConfig, apply_lora, is_lora, merge_lora
from meshdistill.models.quantize import is_quantized, quantize_model, weight_bytes

STEPS = 2


def _logits(model, tokens):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x).logits)(state, tokens))


def _run(layout: str, quantize: str | None, teacher_quantize: str | None = None):
  """(distiller, initial host params, final state, losses) of STEPS LoRA steps on ``layout`` (a float student
  with adapters when ``quantize`` is None and ``teacher_quantize`` is set)."""
  mesh = None if layout == "single" else md.make_mesh(data=2, tensor=4)
  teacher = md.init_model(TEACHER_CFG, seed=0, mesh=mesh)
  if teacher_quantize:
    teacher = quantize_model(teacher, teacher_quantize, mesh=mesh)
  student = apply_lora(md.init_model(STUDENT_CFG, seed=1, mesh=mesh), LoraConfig(rank=4, quantize=quantize),
                       seed=2, mesh=mesh)
  d = md.Distiller(student, teacher, mesh=mesh)
  state = d.init_state()
  before = jax.device_get(state.params)
  losses = []
  for i in range(STEPS):
    state, m = d.step(state, make_batch(i))
    losses.append(float(m["loss"]))
  return d, before, state, losses


@pytest.fixture(scope="module")
def runs():
  return {(layout, q): _run(layout, q) for layout in ("single", "2x4") for q in (None, *QUANTIZE)}


@pytest.fixture(scope="module")
def teacher_runs():
  """LoRA steps distilling from an int8 teacher, on one device and on 2x4."""
  return {layout: _run(layout, None, teacher_quantize="int8") for layout in ("single", "2x4")}


def test_lora_student_starts_exactly_at_its_base_model():
  base = md.init_model(STUDENT_CFG, seed=1)
  tokens = jnp.asarray(make_batch(0)["inputs"])
  adapted = apply_lora(base, LoraConfig(rank=4), seed=2)
  assert is_lora(adapted) and not is_lora(base)
  np.testing.assert_array_equal(_logits(adapted, tokens), _logits(base, tokens))


@pytest.mark.parametrize("quantize", [None, "int4", "nf4"])
def test_only_adapters_move_and_only_adapters_have_optimizer_state(runs, quantize):
  d, before, state, _ = runs[("single", quantize)]
  after = jax.device_get(state.params)
  old, new = dict(nnx.to_flat_state(before["student"])), dict(nnx.to_flat_state(after["student"]))
  for key, var in old.items():
    same = np.array_equal(np.asarray(var[...]), np.asarray(new[key][...]))
    if isinstance(var, nnx.LoRAParam):
      if key[-1] == "kernel_lora_b":  # B starts at 0 and must have trained
        assert not same, key
    else:
      assert same, f"frozen base weight {key} moved"
  adapters = sum(v.size for v in jax.tree.leaves(nnx.filter_state(before["student"], nnx.LoRAParam)))
  total = sum(v.size for v in jax.tree.leaves(before["student"]))
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0)
  assert moments == 2 * adapters < total  # Adam's two moments, of the adapters only


@pytest.mark.parametrize("quantize", [None, *QUANTIZE])
def test_lora_and_qlora_steps_on_2x4_equal_one_device(runs, quantize):
  single, sharded = runs[("single", quantize)][3], runs[("2x4", quantize)][3]
  np.testing.assert_allclose(sharded, single, rtol=1e-5)
  a = jax.device_get(runs[("single", quantize)][2].params)
  b = jax.device_get(runs[("2x4", quantize)][2].params)
  assert_trees_close(b, a, rtol=1e-5, atol=1e-7)  # by path: k/v are replicated on 2x4 (2 kv heads < tensor=4)


def test_adapters_follow_their_base_weights_split_over_tensor(runs):
  _, _, state, _ = runs[("2x4", None)]
  attn = state.params["student"]["blocks"][0]["attn"]
  spec = lambda x: tuple(x[...].sharding.spec) + (None,) * (2 - len(x[...].sharding.spec))  # noqa: E731
  assert spec(attn["q"]["kernel"]) == spec(attn["q"]["kernel_lora_b"]) == (None, "tensor")  # column split
  assert spec(attn["q"]["kernel_lora_a"]) == (None, None)
  assert spec(attn["o"]["kernel"]) == spec(attn["o"]["kernel_lora_a"]) == ("tensor", None)  # row split
  assert spec(attn["o"]["kernel_lora_b"]) == (None, None)


STORAGE = {"int8": jnp.int8, "int4": jnp.int4, "nf4": jnp.uint4}  # nf4: 16 NormalFloat levels, stored uint4


@pytest.mark.parametrize("quantize", QUANTIZE)
def test_qlora_base_weights_stay_integer_storage_on_the_mesh(runs, quantize):
  _, before, state, _ = runs[("2x4", quantize)]
  for module in ("attn/q", "attn/o", "mlp/down"):
    section, name = module.split("/")
    q = state.params["student"]["blocks"][0][section][name]["kernel"]["array"]
    qvalue = q["qvalue"][...]
    # one byte per weight at most (4-bit types are not packed on CPU; a TPU packs them two per byte)
    assert qvalue.dtype == STORAGE[quantize] and qvalue.nbytes == qvalue.size
    assert "tensor" in tuple(qvalue.sharding.spec)
    shards = qvalue.addressable_shards
    assert all(s.data.dtype == STORAGE[quantize] and s.data.nbytes == s.data.size for s in shards)
    assert sum(s.data.size for s in shards) == qvalue.size * 2  # split over tensor=4, replicated over data=2
    assert q["scale"][...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(qvalue), np.asarray(
        before["student"]["blocks"][0][section][name]["kernel"]["array"]["qvalue"][...]))


def _float_leaves(tree):
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def test_int8_teacher_stays_int8_on_the_mesh_and_its_steps_on_2x4_equal_one_device(teacher_runs):
  d, _, state, losses = teacher_runs["2x4"]
  single = teacher_runs["single"]
  np.testing.assert_allclose(losses, single[3], rtol=1e-5)
  assert_trees_close(jax.device_get(state.params), jax.device_get(single[2].params), rtol=1e-5, atol=1e-7)
  assert is_quantized(d.teacher_params)
  q = d.teacher_params["blocks"][1]["mlp"]["up"]["kernel"]["array"]
  qvalue = q["qvalue"][...]
  assert qvalue.dtype == jnp.int8 and qvalue.nbytes == qvalue.size and "tensor" in tuple(qvalue.sharding.spec)
  assert all(s.data.dtype == jnp.int8 and s.data.nbytes * 4 == s.data.size * 4 for s in qvalue.addressable_shards)
  assert weight_bytes(d.teacher_params) < 0.5 * weight_bytes(nnx.state(md.init_model(TEACHER_CFG, seed=0)))


def test_quantized_teacher_receives_no_gradient(teacher_runs):
  d, _, state, _ = teacher_runs["single"]
  batch = jax.device_put({k: jnp.asarray(v) for k, v in make_batch(5).items()})
  leaves, treedef = jax.tree.flatten(d.teacher_params)
  floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]

  def loss_of_teacher(float_leaves):
    full = list(leaves)
    for i, x in zip(floats, float_leaves):
      full[i] = x
    _, metrics = md.per_device_step(
        state, jax.tree.unflatten(treedef, full), batch, student_def=d.student_def, teacher_def=d.teacher_def,
        strategy=d.strategy, optimizer=d.optimizer, data_axis=None, trainable=d.trainable,
    )
    return metrics["loss"]

  grads = jax.jit(jax.grad(loss_of_teacher))([leaves[i] for i in floats])  # scales, embeddings, norms, head
  assert grads and all(float(jnp.max(jnp.abs(g))) == 0.0 for g in grads)


def test_int8_teacher_logits_are_close_to_the_float_teachers():
  teacher = md.init_model(TEACHER_CFG, seed=0)
  tokens = jnp.asarray(make_batch(4)["inputs"])
  want = _logits(teacher, tokens)
  errors = {}
  for q in QUANTIZE:
    got = _logits(quantize_model(teacher, q), tokens)
    errors[q] = float(np.abs(got - want).max() / np.abs(want).max())
  assert 0 < errors["int8"] < 0.02 < errors["int4"] and errors["nf4"] < 0.5, errors


def test_lora_checkpoint_resumes_exactly(tmp_path, runs):
  d, _, state, _ = runs[("single", None)]
  ckpt = Checkpointer(str(tmp_path / "ck"), every=0)
  ckpt.save(STEPS, d, state, {"pos": 0}, {"kind": "distill"})
  restored, _, _ = ckpt.restore(d, d.init_state())
  ckpt.close()
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), restored, state)
  batch = make_batch(7)
  _, m1 = d.step(jax.tree.map(jnp.copy, state), batch)
  _, m2 = d.step(restored, batch)
  assert float(m1["loss"]) == float(m2["loss"])


def test_merged_export_reloads_to_the_adapter_models_logits(tmp_path, runs):
  d, _, state, _ = runs[("single", None)]
  student = d.student(state)
  tokens = jnp.asarray(make_batch(3)["inputs"])
  export_hf(merge_lora(student), tmp_path / "hf")
  reloaded = load_hf(tmp_path / "hf")
  np.testing.assert_allclose(_logits(reloaded, tokens), _logits(student, tokens), rtol=1e-5, atol=1e-5)


def test_bad_lora_settings_name_the_setting():
  with pytest.raises(ConfigError, match=r"student.lora.targets names \['qkv'\].*choose from"):
    load_config(None, ["student.lora.rank=8", "student.lora.targets=[q, qkv]"])
  with pytest.raises(ValueError, match=r"student.lora.rank=40 is larger than the layer .*choose a rank <= 8"):
    apply_lora(md.init_model(STUDENT_CFG, seed=1), LoraConfig(rank=40))
  with pytest.raises(ConfigError, match="student.lora.rank"):
    load_config(None, ["student.lora.rank=-2"])
