"""The quantized export in the compressed-tensors format (`md.export_quantized`, ``meshdistill export --quantized``):
transformers loads it (its compressed-tensors quantizer decompresses on load) to the quantization-aware student's
logits, and the integers it decompresses are the student's own.

Most tests need the ``compress`` extra (compressed-tensors and torch), which the ``test`` extra does not install (torch
is ~780 MB): they are skipped where it is absent. The first test runs everywhere.

Tolerances: the decompressed weights are compared bit for bit (``values * scale`` in float32 on both sides). The
logits of the same float32 weights computed by torch and by XLA differ only in the order of their float32 sums:
1e-5 on logits of magnitude ~4 (about 100 float32 roundings of relative 6e-8 each), the bound tests/test_hf_cli.py
holds transformers' logits of a plain export to.
"""

import importlib.util
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, make_batch

import meshdistill as md
from meshdistill.models.compress import QuantizeAware, dequantized, quantize_aware

HAVE_EXTRA = all(importlib.util.find_spec(m) is not None for m in ("compressed_tensors", "torch", "transformers"))
needs_extra = pytest.mark.skipif(not HAVE_EXTRA, reason="needs the compress extra (compressed-tensors, torch: "
                                 "pip install 'meshdistill[compress]'), which the test extra does not install")
TOL = 1e-5  # float32 sums in another order (module docstring)
INT4 = QuantizeAware(weights="int4", group_size=8)
FP8 = QuantizeAware(weights="fp8")
WEIGHT_ONLY = [INT4, QuantizeAware(weights="int8"), FP8, QuantizeAware(weights="fp8", group_size=8)]
ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def state_names(fmt):
  """The tensors of one compressed projection."""
  return ("weight_packed", "weight_shape", "weight_scale") if fmt == "pack-quantized" else ("weight", "weight_scale")


def _tokens():
  return jnp.asarray(make_batch()["inputs"])


def _transformers_logits(out, tokens):
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)).eval()
  with torch.no_grad():
    return model, model(torch.from_numpy(np.array(tokens)).long()).logits.numpy()


def test_the_quantized_export_without_compressed_tensors_names_the_extra(monkeypatch, tmp_path):
  from meshdistill.config import load_config
  from meshdistill.jobs import export

  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "compressed_tensors" else real(
      name, *a))
  model = md.init_model(STUDENT_CFG, seed=1)
  with pytest.raises(ImportError, match=r"compressed-tensors package and torch: pip install 'meshdistill\[compress\]'"):
    md.export_quantized(model, INT4, tmp_path / "q")
  assert not (tmp_path / "q").exists()
  cfg = load_config("tiny", ["student.quantize_aware={weights: int4, group_size: 16}"])
  with pytest.raises(ValueError, match=r"--quantized: .*pip install 'meshdistill\[compress\]'; or export without "):
    export.check_quantized(cfg, "RUN")


@needs_extra
@pytest.mark.parametrize("settings", WEIGHT_ONLY, ids=["int4-g8", "int8-channel", "fp8-channel", "fp8-g8"])
def test_transformers_loads_the_export_to_the_quantization_aware_logits(settings, tmp_path):
  model = md.init_model(STUDENT_CFG.replace(n_layers=2), seed=1)
  out = md.export_quantized(model, settings, tmp_path / "q")
  tokens = _tokens()
  hf, got = _transformers_logits(out, tokens)
  want = np.asarray(quantize_aware(model, settings)(tokens).logits)
  np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
  assert np.abs(got - np.asarray(model(tokens).logits)).max() > 100 * TOL  # the quantization is in what it loaded
  # the weights transformers decompressed are the student's grid, bit for bit
  grid = md.export_hf(dequantized(model, settings), tmp_path / "grid")
  from safetensors.numpy import load_file

  floats = load_file(str(grid / "model.safetensors"))
  state = {k: v.numpy() for k, v in hf.state_dict().items()}
  projections = [k for k in floats if k.endswith("_proj.weight")]
  assert len(projections) == 14  # 7 projections in each of 2 blocks
  for k in projections:
    np.testing.assert_array_equal(state[k], floats[k], err_msg=k)


@needs_extra
@pytest.mark.parametrize("settings", [INT4, QuantizeAware(weights="int8"),
                                      QuantizeAware(weights="int8", activations="int8"), FP8],
                         ids=["int4-g8", "int8-channel", "int8-int8-activations", "fp8-channel"])
def test_the_export_is_the_format_compressed_tensors_infers(settings, tmp_path):
  from compressed_tensors.quantization import QuantizationConfig
  from safetensors import safe_open

  model = md.init_model(STUDENT_CFG.replace(n_layers=2), seed=1)
  out = md.export_quantized(model, settings, tmp_path / "q")
  assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["config.json", "model.safetensors"]
  qc = json.loads((out / "config.json").read_text())["quantization_config"]
  parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != "version"})
  assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
  (scheme,) = parsed.config_groups.values()
  kind, bits = {"int4": ("int", 4), "int8": ("int", 8), "fp8": ("float", 8)}[settings.weights]
  w = scheme.weights
  assert (w.num_bits, w.type, w.symmetric, w.group_size) == (bits, kind, True, settings.group_size)
  assert w.strategy == ("group" if settings.group_size else "channel")
  # what compressed-tensors infers for a linear layer, as llm-compressor writes it
  fmt = ("naive-quantized" if kind == "float" else "int-quantized" if settings.activations == "int8"
         else "pack-quantized")
  assert qc["format"] == scheme.format == fmt
  if settings.activations == "int8":
    a = scheme.input_activations
    assert (a.num_bits, a.type, a.symmetric, a.dynamic, a.strategy) == (8, "int", True, True, "token")
  else:
    assert scheme.input_activations is None
  assert sorted(scheme.targets) == [r"re:.*mlp\.down_proj$", r"re:.*mlp\.gate_proj$", r"re:.*mlp\.up_proj$",
                                    r"re:.*self_attn\.k_proj$", r"re:.*self_attn\.o_proj$", r"re:.*self_attn\.q_proj$",
                                    r"re:.*self_attn\.v_proj$"]
  d, h = STUDENT_CFG.d_model, STUDENT_CFG.mlp_hidden
  down = "model.layers.1.mlp.down_proj"
  with safe_open(str(out / "model.safetensors"), "pt") as f:  # numpy has no float8
    names = set(f.keys())
    scale = f.get_tensor(down + ".weight_scale").numpy()
    assert scale.dtype == np.float32 and scale.shape == (d, h // (settings.group_size or h))
    if fmt == "pack-quantized":
      packed = f.get_tensor(down + ".weight_packed").numpy()
      assert packed.dtype == np.int32 and packed.shape == (d, h * bits // 32)  # [out, in * bits / 32]
      assert list(f.get_tensor(down + ".weight_shape").numpy()) == [d, h]
      assert down + ".weight" not in names
    else:
      import torch

      values = f.get_tensor(down + ".weight")
      assert values.dtype == (torch.float8_e4m3fn if kind == "float" else torch.int8) and values.shape == (d, h)
  from safetensors.numpy import load_file

  plain = load_file(str(md.export_hf(model, tmp_path / "plain") / "model.safetensors"))
  floats = {k for k in plain if not k.endswith("_proj.weight")}  # embedding, norms (LM head): float as exported plain
  assert floats and floats <= names and len(names) == len(floats) + 14 * len(state_names(fmt))


@needs_extra
def test_the_export_with_int8_activations_holds_the_weights_exactly(tmp_path):
  """transformers applies the activation rounding itself (compressed-tensors' dynamic per-token int8): the weights it
  decompresses are the student's exactly; its logits differ from qwix's by that rounding (docs/compress.md)."""
  settings = QuantizeAware(weights="int8", activations="int8")
  model = md.init_model(STUDENT_CFG.replace(n_layers=2), seed=1)
  out = md.export_quantized(model, settings, tmp_path / "q")
  hf, got = _transformers_logits(out, _tokens())
  floats = md.export_hf(dequantized(model, settings), tmp_path / "grid")
  from safetensors.numpy import load_file

  want = load_file(str(floats / "model.safetensors"))
  state = {k: v.numpy() for k, v in hf.state_dict().items()}
  for k in [k for k in want if k.endswith("_proj.weight")]:
    np.testing.assert_array_equal(state[k], want[k], err_msg=k)
  weights_only = np.asarray(dequantized(model, settings)(_tokens()).logits)
  assert np.abs(got - weights_only).max() > 100 * TOL  # the activations are quantized in transformers' forward


def _hf_example(run_dir, *overrides):
  sets = [f"teacher.hf={FIXTURES / 'hf_qwen3'}", f"data.source={FIXTURES / 'hf_text.jsonl'}", f"run.run_dir={run_dir}",
          *overrides]
  return ["--config", str(ROOT / "configs" / "hf_example.yaml"), *[a for s in sets for a in ("--set", s)]]


@pytest.fixture(scope="module")
def qad_run(tmp_path_factory):
  """A 2-step quantization-aware run (int4, groups of 16) of a scanned 2-block student of the Qwen3 fixture."""
  from meshdistill import cli

  run_dir = tmp_path_factory.mktemp("qad") / "run"
  args = _hf_example(run_dir, "student.init={from_teacher: true, layers: [0, 1]}", "student.scan_layers=true",
                     "student.quantize_aware={weights: int4, group_size: 16}", "train.steps=2", "train.warmup=1",
                     "train.eval_every=0", "checkpoint.every=2", "mesh.backend=single", "mesh.data=1", "mesh.tensor=1")
  assert cli.main(["distill", *args]) == 0
  return run_dir


def _run_student(run_dir):
  from meshdistill import jobs
  from meshdistill.config import run_config
  from meshdistill.storage.checkpoint import Checkpointer

  cfg = run_config(str(run_dir))
  mesh = jobs.build_mesh(cfg)
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0)
  _, teacher = jobs.run_teacher(cfg, ckpt.read_meta(None), mesh, None)
  distiller = jobs.make_distiller(cfg, teacher, mesh)
  state, _, _ = ckpt.restore(distiller, distiller.init_state(), None)
  ckpt.close()
  return distiller.student(state)


@needs_extra
def test_meshdistill_export_quantized_writes_what_transformers_loads_to_the_runs_logits(qad_run, tmp_path, capsys):
  from meshdistill import cli

  out = tmp_path / "q"
  assert cli.main(["export", str(qad_run), str(out), "--quantized"]) == 0
  assert "int4 weights in groups of 16 (compressed-tensors, pack-quantized)" in capsys.readouterr().out
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)
  student = _run_student(qad_run)  # the run's scanned student, through its fake quantization
  _, got = _transformers_logits(out, tokens)
  np.testing.assert_allclose(got, np.asarray(student(tokens).logits), rtol=0, atol=TOL)
  qc = json.loads((out / "config.json").read_text())["quantization_config"]
  assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 16
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  assert cli.main(["export", str(qad_run), str(out), "--quantized"]) == 2  # a non-empty OUT_DIR: refused, untouched
  assert "--overwrite" in capsys.readouterr().err
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  assert cli.main(["export", str(qad_run), str(out), "--quantized", "--overwrite"]) == 0  # an export's: replaced


@needs_extra
@pytest.mark.parametrize("settings", [INT4, QuantizeAware(weights="int8", activations="int8")],
                         ids=["int4-g8", "int8-int8-activations"])
def test_an_earlier_export_converts_to_what_the_export_writes_now(settings, tmp_path):
  """`md.convert_quantized`: a meshdistill.quantized/1 export becomes, tensor for tensor, the compressed-tensors export
  of the same student (the earlier layout stays readable by `md.load_quantized` too: tests/test_qad.py)."""
  from meshdistill.models.compress.quantized_export import FORMAT
  from safetensors import safe_open

  model = md.init_model(STUDENT_CFG.replace(n_layers=2), seed=1)
  old = md.export_quantized(model, settings, tmp_path / "old", tokenizer=str(FIXTURES / "hf_qwen3"), layout=FORMAT)
  converted = md.compress.convert_quantized(old, tmp_path / "converted")
  direct = md.export_quantized(model, settings, tmp_path / "direct", tokenizer=str(FIXTURES / "hf_qwen3"))

  def tensors(out):
    with safe_open(str(out / "model.safetensors"), "pt") as f:
      return {k: f.get_tensor(k) for k in f.keys()}

  got, want = tensors(converted), tensors(direct)
  assert got.keys() == want.keys()
  for k in want:
    assert got[k].dtype == want[k].dtype and bool((got[k] == want[k]).all()), k
  assert json.loads((converted / "config.json").read_text()) == json.loads((direct / "config.json").read_text())
  assert (converted / "tokenizer.json").read_bytes() == (FIXTURES / "hf_qwen3" / "tokenizer.json").read_bytes()
  with pytest.raises(ValueError, match="is a compressed-tensors export .* load it with transformers"):
    md.compress.convert_quantized(direct, tmp_path / "again")  # a compressed-tensors export is not an earlier one
  with pytest.raises(ValueError, match="is a compressed-tensors export"):
    md.load_quantized(direct)
  assert not (tmp_path / "again").exists()


@needs_extra
def test_a_bfloat16_export_holds_the_float_tensors_of_the_plain_bfloat16_export(tmp_path):
  """``dtype``: the tensors that stay float (embedding, norms) are those `md.export_hf` writes in that dtype; the scales
  stay float32."""
  from safetensors import safe_open

  model = md.init_model(STUDENT_CFG, seed=1)
  out = md.export_quantized(model, INT4, tmp_path / "q", dtype="bfloat16")
  plain = md.export_hf(model, tmp_path / "plain", dtype="bfloat16")
  with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(plain / "model.safetensors"), "pt") as g:
    floats = [k for k in g.keys() if not k.endswith("_proj.weight")]
    assert "model.embed_tokens.weight" in floats
    for k in floats:
      a, b = f.get_tensor(k), g.get_tensor(k)
      assert a.dtype == b.dtype and bool((a == b).all()), k
    assert str(f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").dtype) == "torch.float32"
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
