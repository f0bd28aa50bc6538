"""LoRA / QLoRA students: exact start, only adapters move and hold optimizer state, layouts agree,
quantized storage stays integer, resume is exact, merged export reloads, bad settings are named."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, assert_trees_close, make_batch
from flax import nnx

import meshdistill as md
from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.config import ConfigError, dump_config, load_config
from meshdistill.models.hf import export_hf, load_hf
from meshdistill.jobs.export import export_run
from meshdistill.core.fsutil import OutputExistsError
from meshdistill.models.lora import QUANTIZE, LoraConfig, adapter_count, apply_lora, is_lora, merge_lora
from meshdistill.models.peft import export_adapter
from meshdistill.planner import Knobs, make_planner
from meshdistill.planner._compile import shard_bytes
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
  """LoRA / QLoRA steps on one device and on 2x4 (the nf4 student distils from an int8 teacher)."""
  return {(layout, q): _run(layout, q, teacher_quantize="int8" if q == "nf4" else None)
          for layout in ("single", "2x4") for q in (None, *QUANTIZE)}


def test_lora_student_starts_exactly_at_its_base_model():
  base = md.init_model(STUDENT_CFG, seed=1)
  tokens = jnp.asarray(make_batch(0)["inputs"])
  adapted = apply_lora(base, LoraConfig(rank=4), seed=2)
  assert is_lora(adapted) and not is_lora(base)
  np.testing.assert_array_equal(_logits(adapted, tokens), _logits(base, tokens))


def test_lora_and_quantized_copies_of_a_splash_model_build():
  """qwix runs the model once to find its projections: for attention='splash' on a sequence the kernel takes (128;
  one token failed its length check)."""
  model = md.init_model(STUDENT_CFG.replace(attention="splash", max_len=128), seed=1)
  assert is_lora(apply_lora(model, LoraConfig(rank=2), seed=2))
  assert is_quantized(quantize_model(model, "int8"))


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


def test_int8_teacher_stays_int8_on_the_mesh(runs):
  d = runs[("2x4", "nf4")][0]  # its 2x4 steps equal one device's: test_lora_and_qlora_steps_on_2x4_equal_one_device
  assert is_quantized(d.teacher_params) and not is_quantized(runs[("2x4", "int8")][0].teacher_params)
  q = d.teacher_params["blocks"][1]["mlp"]["up"]["kernel"]["array"]
  qvalue = q["qvalue"][...]
  assert qvalue.dtype == jnp.int8 and qvalue.nbytes == qvalue.size and "tensor" in tuple(qvalue.sharding.spec)
  shards = qvalue.addressable_shards
  assert all(s.data.dtype == jnp.int8 and s.data.nbytes == s.data.size for s in shards)
  assert sum(s.data.size for s in shards) == qvalue.size * 2  # split over tensor=4, replicated over data=2
  assert weight_bytes(d.teacher_params) < 0.5 * weight_bytes(nnx.state(md.init_model(TEACHER_CFG, seed=0)))


def test_quantized_teacher_receives_no_gradient(runs):
  d, _, state, _ = runs[("single", "nf4")]
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


def test_a_scanned_teacher_is_quantized_as_the_unrolled_one():
  from meshdistill.models.stacking import to_unrolled

  scanned = md.init_model(TEACHER_CFG.replace(scan_layers=True), seed=0)  # qwix sees blocks/attn/q, no layer index
  quantized = quantize_model(scanned, "int4")
  tokens = jnp.asarray(make_batch(4)["inputs"])
  assert is_quantized(quantized)
  np.testing.assert_allclose(_logits(quantized, tokens), _logits(quantize_model(to_unrolled(scanned), "int4"), tokens),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantize", [None, "nf4"])  # nf4 weights (uint4) are stored widened to uint8
def test_lora_checkpoint_resumes_exactly(tmp_path, runs, quantize):
  d, _, state, _ = runs[("single", quantize)]
  ckpt = Checkpointer(str(tmp_path / "ck"), every=0)
  ckpt.save(STEPS, d, state, {"pos": 0}, {"kind": "distill"})
  restored, _, _ = ckpt.restore(d, d.init_state())
  ckpt.close()
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y), strict=True), restored, state)
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


def test_lora_student_under_remat_steps_like_without(runs):
  d, _, _, _ = runs[("single", "int4")]
  batch = make_batch(9)
  _, plain = d.step(d.init_state(), batch)
  _, remat = d.with_remat("full").step(d.init_state(), batch)  # frozen base and adapters inside nnx.remat blocks
  np.testing.assert_allclose(float(remat["loss"]), float(plain["loss"]), rtol=1e-6)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_peft_adapter_directory_applied_to_its_base_gives_the_merged_export(tmp_path, runs, quantize):
  from safetensors.numpy import load_file

  d, _, state, _ = runs[("2x4", quantize)]
  student = d.student(state)
  export_adapter(student, tmp_path / "adapter")
  export_hf(merge_lora(student), tmp_path / "merged")
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
  assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
  assert config["base_model_name_or_path"] == str(tmp_path / "adapter" / "base")
  adapters = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  base = load_file(str(tmp_path / "adapter" / "base" / "model.safetensors"))
  merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
  assert base.keys() == merged.keys()
  a = adapters["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
  b = adapters["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
  assert a.shape == (STUDENT_CFG.d_model, 4)[::-1] and b.shape == (STUDENT_CFG.n_heads * 4, 4)  # [r, in], [out, r]
  scale = config["lora_alpha"] / config["r"]
  adapted = 0
  for name, w in base.items():
    stem = "base_model.model." + name.removesuffix(".weight")
    if stem + ".lora_A.weight" in adapters:
      w = w + scale * adapters[stem + ".lora_B.weight"] @ adapters[stem + ".lora_A.weight"]
      adapted += 1
    np.testing.assert_allclose(w, merged[name], rtol=1e-5, atol=1e-5, err_msg=name)
  assert adapted == 7 * STUDENT_CFG.n_layers == len(adapters) // 2
  with pytest.raises(OutputExistsError, match="already exists"):  # refused, as the merged export
    export_adapter(student, tmp_path / "adapter")


def test_bad_quantize_settings_name_the_setting(tmp_path):
  with pytest.raises(ConfigError, match=r"teacher.quantize='int3'; choose one of \['int8', 'int4', 'nf4'\]"):
    load_config(None, ["teacher.quantize=int3"])
  with pytest.raises(ConfigError, match="teacher.quantize and teacher.cache exclude each other"):
    load_config(None, ["teacher.quantize=int8", f"teacher.cache={tmp_path}"])
  with pytest.raises(ConfigError, match=r"student.lora.quantize='fp4'"):
    load_config(None, ["student.lora.rank=4", "student.lora.quantize=fp4"])
  cfg = load_config(None, ["teacher.quantize=nf4"])
  assert cfg.models.teacher_quantize == "nf4" and cfg.to_dict()["teacher"]["quantize"] == "nf4"
  run_dir = tmp_path / "run"  # a run without adapters: --adapter is refused before anything is read or written
  run_dir.mkdir()
  dump_config(cfg, str(run_dir / "config.yaml"))
  assert load_config(str(run_dir / "config.yaml")).models.teacher_quantize == "nf4"  # round trip
  with pytest.raises(ValueError, match="--adapter writes LoRA adapters.*student.lora.rank is 0"):
    export_run(str(run_dir), str(tmp_path / "out"), adapter=True)
  assert not (tmp_path / "out").exists()


def test_planner_builds_the_lora_student_and_quantized_teacher_the_config_asks_for():
  overrides = ["student.lora.rank=4", "student.lora.quantize=int4", "teacher.quantize=int8", "train.batch_size=8",
               "data.seq_len=16", "teacher.d_model=32", "teacher.mlp_hidden=64", "student.d_model=16",
               "student.mlp_hidden=32", "teacher.n_layers=2", "student.n_layers=1"]
  p = md.plan(devices="cpu:8", overrides=overrides, mesh="2x4")
  cfg = load_config(None, overrides)
  student = apply_lora(md.init_model(cfg.student, seed=0), cfg.models.student_lora)
  assert p.params["student_trained"] == adapter_count(student) < p.params["student"]
  assert p.memory["optimizer_state"] < p.memory["student_weights"]  # moments of the adapters only
  k = Knobs(2, 4, "none", None, 8)
  assert is_quantized(make_planner(devices="cpu:8", overrides=overrides)._distiller(k).teacher_params)
  plain = make_planner(devices="cpu:8", overrides=overrides[3:])._distiller(k)
  assert p.memory["teacher_weights"] < 0.65 * shard_bytes(plain.teacher_params)  # int8 projections, float embeddings
