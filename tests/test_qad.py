"""Quantization-aware students (`student.quantize_aware`, `meshdistill.models.compress.qat`): the forward pass is the
post-training-quantized student's, gradients reach the float weights, a distillation step on 2x4 equals one device,
and the config section checks its values."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import STUDENT_CFG, TEACHER_CFG, assert_trees_close, make_batch, run_steps

import meshdistill as md
from meshdistill.config import ConfigError, load_config
from meshdistill.models.compress import QuantizeAware, dequantized, post_training, quantize_aware
from meshdistill.models.compress.quantized_export import FORMAT

INT4 = QuantizeAware(weights="int4", group_size=8)


@pytest.mark.parametrize("settings", [INT4, QuantizeAware(weights="int8"), QuantizeAware(weights="fp8")])
def test_the_quantization_aware_forward_is_the_post_training_quantized_one(settings):
  model = md.init_model(STUDENT_CFG, seed=1)
  tokens = jnp.asarray(make_batch()["inputs"])
  qat = np.asarray(quantize_aware(model, settings)(tokens).logits)
  np.testing.assert_allclose(qat, np.asarray(post_training(model, settings)(tokens).logits), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(qat, np.asarray(dequantized(model, settings)(tokens).logits), rtol=1e-5, atol=1e-5)
  assert np.abs(qat - np.asarray(model(tokens).logits)).max() > 1e-4  # the quantization is really in the forward


def test_gradients_go_straight_through_to_the_float_weights():
  from flax import nnx

  model = md.init_model(STUDENT_CFG, seed=1)
  tokens = jnp.asarray(make_batch()["inputs"])
  grads = nnx.grad(lambda m: jnp.mean(m(tokens).logits ** 2))(quantize_aware(model, INT4))
  kernel = grads.blocks[0].mlp.up.kernel.get_value()
  assert kernel.shape == (STUDENT_CFG.d_model, STUDENT_CFG.mlp_hidden) and float(jnp.abs(kernel).sum()) > 0


def _qad_run(mesh):
  student = quantize_aware(md.init_model(STUDENT_CFG, seed=1, mesh=mesh), INT4)
  d = md.Distiller(student, md.init_model(TEACHER_CFG, seed=0, mesh=mesh), mesh=mesh)
  return run_steps(d, [make_batch(seed=s) for s in range(2)])


def test_a_quantization_aware_distillation_step_on_2x4_equals_one_device():
  params, metrics = _qad_run(md.make_mesh(data=2, tensor=4))
  want_params, want_metrics = _qad_run(None)
  assert_trees_close(params, want_params)
  for got, want in zip(metrics, want_metrics):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  plain = md.Distiller(md.init_model(STUDENT_CFG, seed=1), md.init_model(TEACHER_CFG, seed=0))
  _, float_metrics = run_steps(plain, [make_batch(seed=0)])
  assert abs(float(float_metrics[0]["loss"]) - float(want_metrics[0]["loss"])) > 1e-5  # not the float student


def _scanned_and_unrolled():
  from meshdistill.models.stacking import to_unrolled

  scanned = md.init_model(STUDENT_CFG.replace(n_layers=2, scan_layers=True), seed=1)
  return scanned, to_unrolled(scanned)


def test_a_scanned_quantization_aware_student_quantizes_as_the_unrolled_one():
  scanned, unrolled = _scanned_and_unrolled()  # qwix sees blocks/attn/q in one, blocks/0/attn/q in the other
  tokens = jnp.asarray(make_batch()["inputs"])
  qat = np.asarray(quantize_aware(scanned, INT4)(tokens).logits)
  assert np.abs(qat - np.asarray(scanned(tokens).logits)).max() > 1e-3  # not the float student's logits
  np.testing.assert_allclose(qat, np.asarray(quantize_aware(unrolled, INT4)(tokens).logits), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(qat, np.asarray(post_training(scanned, INT4)(tokens).logits), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(qat, np.asarray(dequantized(scanned, INT4)(tokens).logits), rtol=1e-5, atol=1e-5)


def test_a_scanned_quantization_aware_distillation_step_equals_the_unrolled_one():
  losses = []
  for student in _scanned_and_unrolled():
    d = md.Distiller(quantize_aware(student, INT4), md.init_model(TEACHER_CFG, seed=0))
    _, metrics = run_steps(d, [make_batch(seed=s) for s in range(2)])
    losses.append([float(m["loss"]) for m in metrics])
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_a_quantization_rule_that_matches_no_projection_is_an_error():
  import qwix

  from meshdistill.models.quantize import apply_rules

  provider = qwix.QtProvider([qwix.QtRule(module_path="nowhere/q", weight_qtype=jnp.int8)])
  with pytest.raises(ValueError, match="student.quantize_aware: no projection of the model matched"):
    apply_rules(md.init_model(STUDENT_CFG, seed=1), provider, jnp.zeros((1, 1), jnp.int32), "student.quantize_aware")


@pytest.mark.parametrize("override, match", [
    ("student.quantize_aware={weights: int3}", r"student.quantize_aware.weights='int3'; choose one of \['int8', "
                                                r"'int4', 'fp8'\]"),
    ("student.quantize_aware={weights: int4, bits: 4}", "student.quantize_aware.bits"),
    ("student.quantize_aware={group_size: 32}", "group_size are set but weights is null"),
    ("student.quantize_aware={weights: int8, activations: int4}", r"activations='int4'; choose one of \['none', "
                                                                   r"'int8'\]"),
])
def test_config_errors_name_the_setting(override, match):
  with pytest.raises(ConfigError, match=match):
    load_config("tiny", [override])


def test_config_section_round_trips_and_excludes_lora():
  cfg = load_config("tiny", ["student.quantize_aware={weights: int4, group_size: 16}"])
  assert cfg.models.student_quantize_aware == QuantizeAware(weights="int4", group_size=16)
  assert cfg.to_dict()["student"]["quantize_aware"] == {"weights": "int4", "activations": "none", "group_size": 16}
  with pytest.raises(ConfigError, match="student.quantize_aware and student.lora exclude each other"):
    load_config("tiny", ["student.quantize_aware={weights: int4}", "student.lora.rank=4"])


def test_a_group_size_that_does_not_divide_a_projection_is_named():
  with pytest.raises(ValueError, match=r"group_size=12 does not divide .*'d_model': 16"):
    quantize_aware(md.init_model(STUDENT_CFG, seed=1), QuantizeAware(weights="int4", group_size=12))


def test_the_export_holds_the_quantized_weights_and_gives_the_quantization_aware_logits(tmp_path):
  from meshdistill.models.hf import export_hf, load_hf

  model = md.init_model(STUDENT_CFG, seed=1)
  settings = QuantizeAware(weights="int4")  # one scale per output channel: at most 16 values in each column
  out = export_hf(dequantized(model, settings), tmp_path / "hf")
  again = load_hf(out)
  kernel = np.asarray(again.blocks[0].mlp.up.kernel.get_value())
  assert max(len(np.unique(kernel[:, j])) for j in range(kernel.shape[1])) <= 16
  tokens = jnp.asarray(make_batch()["inputs"])
  np.testing.assert_allclose(np.asarray(again(tokens).logits),
                             np.asarray(quantize_aware(model, settings)(tokens).logits), rtol=1e-5, atol=1e-5)


def test_the_planner_builds_the_quantization_aware_student_the_config_asks_for():
  from flax import nnx

  from meshdistill.planner import Knobs, make_planner

  overrides = ["student.quantize_aware={weights: int4}", "train.batch_size=8", "data.seq_len=16",
               "teacher.d_model=32", "teacher.mlp_hidden=64", "student.d_model=16", "student.mlp_hidden=32",
               "teacher.n_layers=2", "student.n_layers=1"]
  d = make_planner(devices="cpu:8", overrides=overrides)._distiller(Knobs(2, 4, "none", None, 8))
  model = md.init_model(load_config(None, overrides).student.for_tensor(4), seed=1)
  planned = nnx.merge(d.student_def, nnx.state(model))  # the planner's student program on real weights
  tokens = jnp.asarray(make_batch()["inputs"])
  np.testing.assert_allclose(np.asarray(planned(tokens).logits),
                             np.asarray(post_training(model, QuantizeAware(weights="int4"))(tokens).logits),
                             rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- the quantized export
QUANTIZED = [INT4, QuantizeAware(weights="int8", activations="int8")]


@pytest.mark.parametrize("settings", QUANTIZED, ids=["int4-g8", "int8-int8-activations"])
def test_the_quantized_export_loads_to_the_quantization_aware_forward(settings, tmp_path):
  from safetensors import safe_open

  from meshdistill.models.compress.qat import quantized_weights

  model = md.init_model(STUDENT_CFG.replace(n_layers=2), seed=1)
  out = md.export_quantized(model, settings, tmp_path / "q", layout=FORMAT)  # the earlier layout: read as before
  tokens = jnp.asarray(make_batch()["inputs"])
  loaded = md.load_quantized(out)
  np.testing.assert_array_equal(np.asarray(loaded(tokens).logits), np.asarray(quantize_aware(model, settings)(tokens).logits))
  got, want = quantized_weights(loaded), quantized_weights(post_training(model, settings))
  assert len(got) == 14 and got.keys() == want.keys()  # 7 projections in each of 2 blocks
  for k in want:  # the same integers, the same scales, the same integer type
    assert got[k].qvalue.dtype == want[k].qvalue.dtype
    np.testing.assert_array_equal(np.asarray(got[k].qvalue, np.float32), np.asarray(want[k].qvalue, np.float32))
    np.testing.assert_array_equal(np.asarray(got[k].scale), np.asarray(want[k].scale))
  floats = md.load_quantized(out, dequantize=True)  # exactly the grid the student trained through
  assert_trees_close(nnx.state(floats, nnx.Param), nnx.state(dequantized(model, settings), nnx.Param), rtol=0, atol=0)
  bits = {"int4": 4, "int8": 8}[settings.weights]
  with safe_open(str(out / "quantized.safetensors"), "numpy") as f:
    meta = f.metadata()
    values, scales = f.get_tensor("model.layers.1.mlp.down_proj.weight"), f.get_tensor("model.layers.1.mlp.down_proj.weight_scale")
  assert meta["format"] == "meshdistill.quantized/1" and len(json.loads(meta["quantized"])) == 14
  assert json.loads(meta["quantization"]) == {"weights": settings.weights, "activations": settings.activations,
                                              "group_size": settings.group_size}
  groups = STUDENT_CFG.mlp_hidden // (settings.group_size or STUDENT_CFG.mlp_hidden)
  assert values.dtype == np.int8 and values.shape == (STUDENT_CFG.d_model, STUDENT_CFG.mlp_hidden)  # [out, in]
  assert scales.dtype == np.float32 and scales.shape == (STUDENT_CFG.d_model, groups)
  assert -(2 ** (bits - 1)) <= values.min() and values.max() <= 2 ** (bits - 1) - 1  # int4: -8..7 in int8 bytes
  assert np.abs(values).max() >= 2 ** (bits - 1) - 1  # the whole range is used (absmax scales)


def test_the_quantized_export_refuses_fp8_and_a_float_student(tmp_path):
  model = md.init_model(STUDENT_CFG, seed=1)
  with pytest.raises(ValueError, match=r"weights='fp8': the meshdistill.quantized/1 layout holds integer weights"):
    md.export_quantized(model, QuantizeAware(weights="fp8"), tmp_path / "fp8", layout=FORMAT)
  with pytest.raises(ValueError, match="weights is null: the student is not quantized"):
    md.export_quantized(model, QuantizeAware(), tmp_path / "float")
  with pytest.raises(ValueError, match=r"has format 'pt'; this version reads 'meshdistill.quantized/1'"):
    md.export_hf(model, tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "quantized.safetensors")
    md.load_quantized(tmp_path / "hf")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written for the refused exports


def _hf_example(run_dir, *overrides):
  root = pathlib.Path(__file__).resolve().parents[1]
  fixtures = root / "tests" / "fixtures"
  sets = [f"teacher.hf={fixtures / 'hf_qwen3'}", f"data.source={fixtures / 'hf_text.jsonl'}", f"run.run_dir={run_dir}",
          *overrides]
  return ["--config", str(root / "configs" / "hf_example.yaml"), *[a for s in sets for a in ("--set", s)]]


def test_meshdistill_export_quantized_refuses_a_float_run_before_writing(tmp_path, capsys):
  from meshdistill import cli
  from meshdistill.config import dump_config, load_config

  run_dir, out = tmp_path / "run", tmp_path / "out"
  run_dir.mkdir()
  dump_config(load_config(_hf_example(run_dir)[1], [a for a in _hf_example(run_dir)[3::2]]), run_dir / "config.yaml")
  assert cli.main(["export", str(run_dir), str(out), "--quantized"]) == 2
  assert "trained a float student (student.quantize_aware.weights is null); export it without --quantized" in (
      capsys.readouterr().err)
  assert not out.exists()
