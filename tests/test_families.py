"""The model contract and the family registry: what a model must offer, and adding a Hugging Face family as one module.

Modules under test are imported inside each test, so each test fails on its own where they are missing.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest
from flax import nnx

import meshdistill as md

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
GEMMA2_BLOCK = {"geglu": True, "norm_offset": True, "embed_scale": True, "post_norms": True}
GEMMA3_BLOCK = {**GEMMA2_BLOCK, "qk_norm": True}
TINY = md.ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=32, max_len=16)


def _tunix_lm():
  from meshdistill.models.tunix_adapter import TunixConfig, TunixLM

  cfg = TunixConfig(family="qwen3", vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                    mlp_hidden=32, max_len=16, tie_embeddings=True)
  return TunixLM(cfg, nnx.Module())  # the adapter's own members are what the contract checks


def test_built_in_decoder_and_tunix_adapter_satisfy_the_model_contract():
  from meshdistill.models import contract

  decoder = md.models.init_model(TINY)
  assert isinstance(decoder, contract.DecodingModel) and isinstance(decoder, contract.LanguageModel)
  assert isinstance(decoder.cfg, contract.ModelSpec) and contract.missing_members(decoder, contract.DecodingModel) == []
  tunix = _tunix_lm()
  assert isinstance(tunix, contract.LanguageModel) and isinstance(tunix.cfg, contract.ModelSpec)
  assert not isinstance(tunix, contract.DecodingModel)  # no cached decode step
  assert contract.missing_members(tunix, contract.DecodingModel) == ["empty_cache", "decode_step"]

  class NoHead:
    cfg = TINY

    def __call__(self, tokens_BxT, *, capture=(), logits=True):
      return None

  assert not isinstance(NoHead(), contract.LanguageModel)
  with pytest.raises(TypeError, match=r"teacher of type NoHead is not a LanguageModel: it lacks \['head_weight'\]"):
    contract.check_model(NoHead(), contract.LanguageModel, "teacher")


def test_generate_names_what_a_model_without_a_cached_decode_step_lacks():
  from meshdistill.models.generate import SamplingConfig, generate

  prompts = jnp.ones((2, 3), jnp.int32)
  with pytest.raises(TypeError, match=r"generate's model of type TunixLM is not a DecodingModel.*'decode_step'"):
    generate(_tunix_lm(), prompts, prompts > 0, None, SamplingConfig(max_new_tokens=2, temperature=0.0))


@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen3", "hf_qwen2", "hf_mistral", "hf_gemma3", "hf_gemma2",
                                  "hf_qwen3_moe", "hf_mixtral"])
def test_each_fixture_is_recognised_and_its_config_round_trips(name):
  from meshdistill.models import families

  hf = json.loads((FIXTURES / name / "config.json").read_text())
  fam = families.family_for(hf)
  assert fam.name == name[3:] and fam is families.get(name[3:])
  cfg = fam.from_hf(hf)
  written = fam.to_hf(cfg)
  assert written["architectures"] == hf["architectures"] and written["model_type"] == hf["model_type"]
  assert fam.from_hf(written) == cfg
  assert families.default_for(cfg) is fam  # a loaded model exports as its own family
  assert families.family_for({"model_type": hf["model_type"]}) is fam  # no architectures: by model_type


MOE = {"n_experts": 4, "top_k": 2, "expert_hidden": 16}


@pytest.mark.parametrize("block", [{}, {"qk_norm": True}, {"qkv_bias": True}, GEMMA2_BLOCK, GEMMA3_BLOCK, {"moe": MOE},
                                   {"qk_norm": True, "moe": dict(MOE, dense_layers=(1,))}])
def test_weight_names_map_both_ways_for_every_parameter(block):
  from meshdistill.models import families
  from meshdistill.models import abstract_params

  cfg = TINY.replace(tie_embeddings=False, **block)
  fam = families.default_for(cfg)
  assert fam.experts == ("moe" in block)  # a mixture-of-experts decoder is written by an MoE family, and only it
  paths = [tuple(k) for k, _ in nnx.to_flat_state(abstract_params(cfg)[1])]
  names = {fam.weight_name(p)[0] for p in paths}
  assert len(names) == len(paths)  # no two parameters share a tensor name
  for p in paths:
    name, transposed = fam.weight_name(p)
    assert fam.param_path(name) == (p, transposed)
  with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.rotary_emb.inv_freq' has no counterpart"):
    fam.param_path("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_unknown_architecture_or_family_lists_the_supported_ones():
  from meshdistill.models import families

  with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\], model_type='gpt2' is not supported; "
                     r"supported architectures: \['Gemma2ForCausalLM', 'Gemma3ForCausalLM', 'LlamaForCausalLM', "
                     r"'MistralForCausalLM', 'MixtralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', "
                     r"'Qwen3MoeForCausalLM'\]"):
    families.family_for({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
  names = r"\['gemma2', 'gemma3', 'llama', 'mistral', 'mixtral', 'qwen2', 'qwen3', 'qwen3_moe'\]"
  with pytest.raises(ValueError, match=r"family='gpt2'; choose one of " + names):
    families.get("gpt2")


def test_a_family_cannot_claim_another_familys_architecture_or_block_default():
  from meshdistill.models import families
  from meshdistill.models.families.llama import Llama

  before = families.names()
  with pytest.raises(ValueError, match=r"\['LlamaForCausalLM'\] already name family 'llama'"):
    families.register(type("Copy", (Llama,), {"name": "copy", "architectures": ("LlamaForCausalLM",)}))
  with pytest.raises(ValueError, match=r"'other' and 'llama' are both default_export"):
    families.register(type("Other", (Llama,), {"name": "other", "architectures": ("OtherLM",), "default_export": True}))
  assert families.names() == before


def test_planner_presets_are_collected_from_the_family_modules():
  from meshdistill import planner
  from meshdistill.models import families

  assert planner.PRESETS == families.presets()
  assert sorted(families.get("llama").presets) == ["llama3.1-70b", "llama3.1-8b", "llama3.2-1b", "llama3.2-3b"]
  assert sorted(families.get("qwen3").presets) == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-32b", "qwen3-4b", "qwen3-8b"]
  for name, hf in planner.PRESETS.items():
    assert name in families.family_for(hf).presets
  cfg, label = planner.resolve_model("qwen3-8b", who="teacher")
  assert (label, cfg.qk_norm, cfg.d_model, cfg.n_layers) == ("qwen3-8b", True, 4096, 36)


TOY = '''
"""Toy (``ToyForCausalLM``): the Llama block under another name; no sliding window."""

from meshdistill.models.families import register
from meshdistill.models.families.llama import Llama


@register
class Toy(Llama):
  name = "toy"
  architectures = ("ToyForCausalLM",)
  rope_scaling = False
  presets = {"toy-7b": {
      "architectures": ["ToyForCausalLM"], "model_type": "toy", "vocab_size": 32768, "hidden_size": 4096,
      "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
      "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
      "sliding_window": None, "tie_word_embeddings": False,
  }}

  def check_hf(self, hf, where):
    super().check_hf(hf, where)
    if hf.get("sliding_window") is not None:
      raise ValueError(f"{where}: sliding_window={hf['sliding_window']} is not supported; expected null")

  def hf_fields(self, cfg):
    return {"sliding_window": None}
'''

PROBE = '''
import json, os, sys, tempfile
import numpy as np
import jax.numpy as jnp
import meshdistill as md
from meshdistill.models import families
from meshdistill.models.hf import export_hf, load_hf
from meshdistill.planner import PRESETS, resolve_model

hf = {"architectures": ["ToyForCausalLM"], "model_type": "toy", "vocab_size": 32, "hidden_size": 16,
      "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
      "head_dim": 8, "hidden_act": "silu", "max_position_embeddings": 16, "rms_norm_eps": 1e-5,
      "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False}
fam = families.family_for(hf)
assert fam.name == "toy" and fam is families.family_for({"model_type": "toy"}), fam
cfg = fam.from_hf(hf)
written = fam.to_hf(cfg)
assert written["architectures"] == ["ToyForCausalLM"] and written["model_type"] == "toy", written
assert written["sliding_window"] is None and fam.from_hf(written) == cfg
assert families.default_for(cfg).name == "llama"  # a plain block still exports as llama unless asked
assert "toy-7b" in PRESETS and resolve_model("toy-7b", who="teacher")[0].d_model == 4096
with tempfile.TemporaryDirectory() as tmp:
  model = md.models.init_model(cfg, seed=1)
  export_hf(model, os.path.join(tmp, "out"), family="toy")
  with open(os.path.join(tmp, "out", "config.json")) as f:
    assert json.load(f)["architectures"] == ["ToyForCausalLM"]
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  back = load_hf(os.path.join(tmp, "out"))
  assert back.cfg == cfg.replace(scan_layers=False), (back.cfg, cfg)  # a built model says its layout
  np.testing.assert_allclose(back(tokens).logits, model(tokens).logits, atol=1e-6)
try:
  fam.from_hf(dict(hf, sliding_window=4096), where="toy/config.json")
except ValueError as e:
  print(e)
else:
  sys.exit("sliding_window=4096 was accepted")
print("families:", families.names())
'''


def test_a_new_family_that_differs_only_in_config_is_one_new_module(tmp_path):
  """Copy the package, add models/families/toy.py, and read, write, export and reload a config of that family."""
  src = os.path.dirname(os.path.dirname(os.path.abspath(md.__file__)))
  shutil.copytree(os.path.join(src, "meshdistill"), tmp_path / "meshdistill",
                  ignore=shutil.ignore_patterns("__pycache__"))
  (tmp_path / "meshdistill" / "models" / "families" / "toy.py").write_text(textwrap.dedent(TOY))
  env = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  assert "toy/config.json: sliding_window=4096 is not supported; expected null" in run.stdout
  assert "families: ['gemma2', 'gemma3', 'llama', 'mistral', 'mixtral', 'qwen2', 'qwen3', 'qwen3_moe', 'toy']" in run.stdout
