"""Hugging Face checkpoints: logits equal transformers', sharded loading, export, vocab padding, clear errors.

The fixtures (tests/fixtures/hf_*) and their reference logits come from transformers via
scripts/make_hf_fixtures.py; these tests need neither torch nor transformers.
"""

import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, make_batch
from flax import nnx
from safetensors.numpy import load_file

import meshdistill as md
from meshdistill.train.distiller import resolve_shared_vocab
from meshdistill.parallel.mesh import TENSOR
from meshdistill.models.hf import export_hf, load_hf, read_hf_config

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FAMILIES = ("hf_llama", "hf_qwen3", "hf_qwen2", "hf_mistral", "hf_gemma3", "hf_gemma2", "hf_qwen3_moe", "hf_mixtral")


@pytest.fixture(scope="module")
def mesh():
  return md.make_mesh(data=2, tensor=4)


def _reference(name):
  ref = np.load(FIXTURES / name / "reference.npz")
  return ref["tokens"], ref["logits"]


def _copy(name, tmp_path) -> pathlib.Path:
  dst = tmp_path / name
  shutil.copytree(FIXTURES / name, dst)
  return dst


def _edit_config(path, **changes):
  cfg = json.loads((path / "config.json").read_text())
  for k, v in changes.items():
    if v is None:
      cfg.pop(k, None)
    else:
      cfg[k] = v
  (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name", FAMILIES)
def test_2x4_loaded_logits_equal_transformers(name, mesh):
  tokens, want = _reference(name)
  model = load_hf(FIXTURES / name, mesh)
  got = np.asarray(model(jnp.asarray(tokens)).logits)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_llama3_rope_scaling_is_what_makes_the_llama_logits_match(tmp_path):
  path = _copy("hf_llama", tmp_path)
  _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_scaling=None)
  tokens, want = _reference("hf_llama")
  got = np.asarray(load_hf(path)(jnp.asarray(tokens)).logits)
  assert np.abs(got - want).max() > 1e-2


def test_configs_read_from_hf_fields():
  llama = load_hf(FIXTURES / "hf_llama").cfg
  assert (llama.qk_norm, llama.qkv_bias, llama.tie_embeddings, llama.rope_theta) == (False, False, False, 500000.0)
  assert llama.rope_scaling == md.models.decoder.RopeScaling(factor=8.0, original_max_len=16)
  qwen3 = load_hf(FIXTURES / "hf_qwen3").cfg
  assert (qwen3.qk_norm, qwen3.tie_embeddings, qwen3.d_model, qwen3.hd) == (True, True, 48, 16)
  assert load_hf(FIXTURES / "hf_qwen2").cfg.qkv_bias


def test_2x4_load_puts_a_quarter_of_each_tensor_split_weight_on_each_device(mesh):
  model = load_hf(FIXTURES / "hf_llama", mesh)
  split = 0
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    x = var.get_value()
    spec = x.sharding.spec
    want = tuple(d // 4 if i < len(spec) and spec[i] == TENSOR else d for i, d in enumerate(x.shape))
    split += want != x.shape
    assert len(x.addressable_shards) == 8, path
    assert {s.data.shape for s in x.addressable_shards} == {want}, path
  # q, o and the 3 MLP matrices per block, embedding and untied head; 2 kv heads < tensor=4: k/v replicated
  assert split == 2 * 5 + 2


def test_each_device_reads_only_its_slice_from_disk(mesh, monkeypatch):
  import safetensors

  reads = []
  real = safetensors.safe_open

  class Recorder:
    def __init__(self, *a, **k):
      self._f = real(*a, **k)

    def __enter__(self):
      self._f.__enter__()
      return self

    def __exit__(self, *exc):
      return self._f.__exit__(*exc)

    def keys(self):
      return self._f.keys()

    def get_slice(self, name):
      sl = self._f.get_slice(name)

      class S:
        get_shape = sl.get_shape

        def __getitem__(self, idx):
          block = sl[idx]
          reads.append((name, tuple(sl.get_shape()), block.shape))
          return block

      return S()

  monkeypatch.setattr(safetensors, "safe_open", Recorder)
  load_hf(FIXTURES / "hf_llama", mesh)
  q = [(full, got) for n, full, got in reads if n == "model.layers.0.self_attn.q_proj.weight"]
  assert q and all(got == (full[0] // 4, full[1]) for full, got in q), q
  head = [got for n, full, got in reads if n == "lm_head.weight"]
  assert head and all(got == (32, 64) for got in head), head


@pytest.mark.parametrize("shape", [(600, 300), (1, 700), (513, 1), (256, 512), (0, 3)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_checkpoint_window_is_transposed_tile_by_tile_to_exactly_its_transpose(shape, dtype):
  """`_safetensors.transposed` (the [out, in] -> [in, out] read of every projection): whole tiles, the ragged last
  ones and single rows or columns; the fixtures' tensors fit one tile, these do not."""
  from meshdistill.models._safetensors import TILE, transposed

  assert max(shape) > TILE or 0 in shape
  b = np.random.default_rng(0).standard_normal(shape).astype(jnp.dtype(dtype))
  got = transposed(b[:, ::-1])  # a strided view, as a window of a wider tensor can be
  assert got.dtype == b.dtype and got.flags.c_contiguous and got.shape == shape[::-1]
  np.testing.assert_array_equal(got, b[:, ::-1].T)


def test_export_then_reload_is_identical(mesh, tmp_path):
  model = load_hf(FIXTURES / "hf_llama", mesh)
  out = export_hf(model, tmp_path / "out", tokenizer=FIXTURES / "hf_llama")
  again = load_hf(out, mesh)
  a, b = nnx.state(model, nnx.Param), nnx.state(again, nnx.Param)
  assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b))
  # the written tensors are the original checkpoint's, name for name
  original = {}
  for f in (FIXTURES / "hf_llama").glob("*.safetensors"):
    original.update(load_file(f))
  written = load_file(out / "model.safetensors")
  assert sorted(written) == sorted(original)
  for k, v in original.items():
    np.testing.assert_array_equal(written[k], v.astype(np.float32), err_msg=k)
  src, dst = read_hf_config(FIXTURES / "hf_llama"), read_hf_config(out)
  for key in ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings"):
    assert dst[key] == src[key], key
  assert dst["rope_scaling"]["rope_type"] == "llama3" and dst["rope_theta"] == 500000.0
  assert (out / "generation_config.json").is_file()


@pytest.mark.parametrize("name", ("hf_qwen3", "hf_qwen2"))
def test_qwen_export_keeps_family_and_bfloat16(name, tmp_path):
  model = load_hf(FIXTURES / name)
  out = export_hf(model, tmp_path / "out", dtype="bfloat16")
  cfg = read_hf_config(out)
  assert cfg["model_type"] == name[3:] and cfg["architectures"] == read_hf_config(FIXTURES / name)["architectures"]
  written = load_file(out / "model.safetensors")
  assert {str(v.dtype) for v in written.values()} == {"bfloat16"}
  assert ("lm_head.weight" in written) == (not model.cfg.tie_embeddings)
  tokens, want = _reference(name)
  np.testing.assert_allclose(np.asarray(load_hf(out)(jnp.asarray(tokens)).logits), want, atol=1e-4, rtol=0)


def test_missing_shard_file_is_named(tmp_path):
  path = _copy("hf_llama", tmp_path)
  (path / "model-00003-of-00005.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="model-00003-of-00005.safetensors"):
    load_hf(path)


def test_config_that_does_not_match_the_weights_names_tensor_and_shapes(tmp_path):
  path = _copy("hf_llama", tmp_path)
  _edit_config(path, intermediate_size=128)
  with pytest.raises(ValueError, match=re.escape("mlp.down_proj.weight") + r".*\[64, 96\].*\[64, 128\]"):
    load_hf(path)


def test_unsupported_architecture_names_fields_and_supported_list(tmp_path):
  path = _copy("hf_qwen2", tmp_path)
  _edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
  with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\], model_type='gpt2'.*LlamaForCausalLM"):
    load_hf(path)


def test_missing_config_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf(tmp_path)


def test_padded_vocab_is_detected_and_different_tokenizers_are_not():
  assert resolve_shared_vocab(152064, 151936) == 151936
  assert resolve_shared_vocab(151936, 151936) is None
  assert resolve_shared_vocab(300, 256, shared_vocab=256) == 256
  with pytest.raises(ValueError, match="teacher vocab_size=152064 != student vocab_size=128256"):
    resolve_shared_vocab(152064, 128256)
  with pytest.raises(ValueError, match=r"shared_vocab=300 must be an integer in \[1, 256\]"):
    resolve_shared_vocab(300, 256, shared_vocab=300)


def test_2x4_padded_teacher_vocab_distils_like_the_unpadded_teacher(mesh):
  """Teacher with 8 padding rows (V=136) vs the same teacher cut to the student's V=128: same step."""
  tcfg, scfg = TEACHER_CFG.replace(vocab_size=136), STUDENT_CFG.replace(vocab_size=128)
  padded = md.init_model(tcfg, 0)
  cut = md.init_model(tcfg.replace(vocab_size=128), 0)
  cut.embed.embedding[...] = padded.embed.embedding[...][:128]
  nnx.update(cut.blocks, nnx.state(padded.blocks))
  nnx.update(cut.final_norm, nnx.state(padded.final_norm))
  batch = make_batch(vocab=128)
  metrics = []
  for teacher in (cut, padded):
    d = md.Distiller(md.init_model(scfg, 1), teacher, mesh=mesh, shared_vocab=128)
    state, m = d.step(d.init_state(), batch)
    metrics.append(jax.device_get(m))
  assert d.shared_vocab == 128
  for k in metrics[0]:
    np.testing.assert_allclose(metrics[1][k], metrics[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
  hlo = d.lower(d.init_state(), batch).compile().as_text()
  gathered = [ln for ln in hlo.splitlines() if "all-gather" in ln and re.search(r"\b(128|136)\b", ln.split("all-gather")[0])]
  assert not gathered, gathered


def test_tunix_qwen3_adapter_equals_transformers_and_distils_on_4x2():
  from meshdistill.models.tunix_adapter import load_tunix_hf

  mesh = md.make_mesh(data=4, tensor=2)  # tunix splits whole heads: 2 kv heads -> tensor <= 2
  teacher = load_tunix_hf(FIXTURES / "hf_qwen3", mesh)
  tokens, want = _reference("hf_qwen3")
  out = teacher(jnp.asarray(tokens), capture=("hidden", "final"))
  np.testing.assert_allclose(np.asarray(out.logits), want, atol=1e-4, rtol=0)
  assert len(out.hidden) == 3 and out.final.shape == (2, 12, 48)
  q = teacher.inner.layers[0].attn.q_proj.w[...]
  assert {s.data.shape for s in q.addressable_shards} == {(48, 2, 16)}
  with pytest.raises(ValueError, match="attn"):
    teacher(jnp.asarray(tokens), capture=("attn",))
  student = md.init_model(load_hf(FIXTURES / "hf_qwen3").cfg.replace(n_layers=1, d_model=24, mlp_hidden=48), 1, mesh)
  d = md.Distiller(student, teacher, mesh=mesh)
  _, metrics = d.step(d.init_state(), make_batch(vocab=128))
  assert np.isfinite(float(metrics["loss"])) and float(metrics["kl"]) > 0
