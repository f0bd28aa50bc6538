"""LoRA / QLoRA students: exact start, only adapters move and hold optimizer state, layouts agree,
quantized storage stays integer, resume is exact, merged export reloads, bad settings are named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, make_batch
from flax import nnx

import meshdistill as md
from meshdistill.checkpoint import Checkpointer
from meshdistill.config import ConfigError, load_config
from meshdistill.models.hf import export_hf, load_hf
from meshdistill.models.lora import LoraConfig, apply_lora, is_lora, merge_lora

STEPS = 2


def _logits(model, tokens):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x).logits)(state, tokens))


def _run(layout: str, quantize: str | None):
  """(distiller, initial host params, final state, losses) of STEPS LoRA steps on ``layout``."""
  mesh = None if layout == "single" else md.make_mesh(data=2, tensor=4)
  teacher = md.init_model(TEACHER_CFG, seed=0, mesh=mesh)
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
  return {(layout, q): _run(layout, q) for layout in ("single", "2x4") for q in (None, "int8")}


def test_lora_student_starts_exactly_at_its_base_model():
  base = md.init_model(STUDENT_CFG, seed=1)
  tokens = jnp.asarray(make_batch(0)["inputs"])
  adapted = apply_lora(base, LoraConfig(rank=4), seed=2)
  assert is_lora(adapted) and not is_lora(base)
  np.testing.assert_array_equal(_logits(adapted, tokens), _logits(base, tokens))


def test_only_adapters_move_and_only_adapters_have_optimizer_state(runs):
  d, before, state, _ = runs[("single", None)]
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


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_lora_and_qlora_steps_on_2x4_equal_one_device(runs, quantize):
  single, sharded = runs[("single", quantize)][3], runs[("2x4", quantize)][3]
  np.testing.assert_allclose(sharded, single, rtol=1e-5)
  a = jax.device_get(runs[("single", quantize)][2].params)
  b = jax.device_get(runs[("2x4", quantize)][2].params)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-7), a, b)


def test_adapters_follow_their_base_weights_split_over_tensor(runs):
  _, _, state, _ = runs[("2x4", None)]
  attn = state.params["student"]["blocks"][0]["attn"]
  spec = lambda x: tuple(x[...].sharding.spec) + (None,) * (2 - len(x[...].sharding.spec))  # noqa: E731
  assert spec(attn["q"]["kernel"]) == spec(attn["q"]["kernel_lora_b"]) == (None, "tensor")  # column split
  assert spec(attn["q"]["kernel_lora_a"]) == (None, None)
  assert spec(attn["o"]["kernel"]) == spec(attn["o"]["kernel_lora_a"]) == ("tensor", None)  # row split
  assert spec(attn["o"]["kernel_lora_b"]) == (None, None)


def test_qlora_base_weights_stay_int8_storage_on_the_mesh(runs):
  _, before, state, _ = runs[("2x4", "int8")]
  q = state.params["student"]["blocks"][0]["attn"]["q"]["kernel"]["array"]
  qvalue = q["qvalue"][...]
  assert qvalue.dtype == jnp.int8 and qvalue.nbytes == qvalue.size
  assert qvalue.sharding.spec[1] == "tensor"
  assert all(s.data.dtype == jnp.int8 for s in qvalue.addressable_shards)
  np.testing.assert_array_equal(np.asarray(qvalue), np.asarray(before["student"]["blocks"][0]["attn"]["q"]["kernel"]
                                                                ["array"]["qvalue"][...]))


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
