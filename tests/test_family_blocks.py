"""Mistral, Gemma 2 and Gemma 3 text against transformers' own checkpoints (tests/fixtures/hf_mistral, hf_gemma2,
hf_gemma3, written by scripts/make_hf_fixtures.py): logits beyond the sliding window on 1 device (2x4: test_hf), each
option the fixtures carry shown to matter, every attention kind with a window, cached generation past the window,
the distillation step on 2x4 (and 4x2 with fsdp) equal to one device, the soft-capped chunked loss, export round
trips, layer subsets, LoRA names and presets."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import make_batch, token_major

import meshdistill as md
from meshdistill.models._attention import _explicit_attention, _splash_attention
from meshdistill.models.generate import SamplingConfig, generate, left_pad
from meshdistill.models.hf import export_hf, load_hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
NEW = ("hf_mistral", "hf_gemma3", "hf_gemma2")


def _reference(name):
  ref = np.load(FIXTURES / name / "reference.npz")
  return jnp.asarray(ref["tokens"]), ref["logits"]


def _rebuilt(model, **changes):
  """``model``'s weights in a decoder whose config has ``changes`` (an option switched off, another kernel)."""
  other = md.init_model(model.cfg.replace(**changes), seed=0)
  nnx.update(other, nnx.state(model, nnx.Param))
  return other


@pytest.fixture(scope="module")
def loaded():
  return {name: load_hf(FIXTURES / name) for name in NEW}


@pytest.mark.parametrize("name", NEW)
def test_one_device_logits_equal_transformers_beyond_the_window_in_both_kernels(name, loaded):
  tokens, want = _reference(name)
  model = loaded[name]
  assert model.cfg.sliding_window < tokens.shape[1]
  for m in (model, _rebuilt(model, attention="explicit")):  # 2x4: tests/test_hf.py; 4x2 + fsdp: the step below
    np.testing.assert_allclose(np.asarray(m(tokens).logits), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name, off", [
    ("hf_mistral", {"sliding_window": None}),
    ("hf_gemma3", {"rope_local_theta": None}),
    ("hf_gemma3", {"query_scale": None}),
    ("hf_gemma3", {"layer_types": ("sliding_attention",) * 4}),
    ("hf_gemma2", {"attn_softcap": None}),
    ("hf_gemma2", {"final_softcap": None}),
    ("hf_gemma2", {"embed_scale": False}),
])
def test_each_option_the_fixtures_carry_changes_their_logits(name, off, loaded):
  tokens, want = _reference(name)
  got = np.asarray(_rebuilt(loaded[name], **off)(tokens).logits)
  assert np.abs(got - want).max() > 1e-3


def test_sliding_window_and_soft_cap_agree_in_explicit_xla_and_splash_kernels():
  """T = 128 (splash's lane width), window 16, Gemma's score scale and cap: splash interpreted on CPU, its local mask
  against the explicit band; XLA's ``local_window_size`` against the same (no cap: XLA's kernel has none)."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((1, 128, 4, 8), (1, 128, 2, 8), (1, 128, 2, 8)))
  opts = {"window": 16, "scale": 24.0**-0.5}
  want, _ = _explicit_attention(q, k, v, cap=2.0, **opts)
  np.testing.assert_allclose(token_major(_splash_attention)(q, k, v, cap=2.0, **opts), want, rtol=1e-5, atol=1e-6)
  plain, _ = _explicit_attention(q, k, v, **opts)
  xla = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=opts["scale"], local_window_size=(15, 0))
  np.testing.assert_allclose(xla, plain, rtol=1e-5, atol=1e-6)
  full, _ = _explicit_attention(q, k, v, scale=opts["scale"])
  assert np.abs(np.asarray(full - plain)).max() > 1e-2  # the window is what differs


@pytest.mark.parametrize("name, attention", [("hf_mistral", "auto"), ("hf_gemma2", "splash")])
def test_cached_generation_past_the_window_equals_the_full_forward(name, attention, loaded):
  """Mistral: a window on every layer; Gemma 2: sliding and global layers, and with attention='splash' the cached
  pass falls back to scores that still carry the soft-cap. (Gemma 3's sliding layers take the same cached path.)"""
  model = loaded[name] if attention == "auto" else _rebuilt(loaded[name], attention=attention)
  prompts = [[5, 9, 2], [7, 1, 4, 8, 3, 6]]  # left padding on the first row
  tokens, mask = left_pad(prompts)
  n = 8  # both rows end well past the window (4)
  gen = generate(model, tokens, mask, None, SamplingConfig(max_new_tokens=n, temperature=0.0), return_logits=True)
  for r, prompt in enumerate(prompts):
    seq = np.asarray([*prompt, *np.asarray(gen.tokens_BxN[r])], np.int32)[None]
    full = np.asarray(loaded[name](jnp.asarray(seq)).logits[0])
    want = full[len(prompt) - 1: len(prompt) - 1 + n]
    np.testing.assert_allclose(np.asarray(gen.logits_BxNxV[r]), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert list(np.asarray(gen.tokens_BxN[r])) == list(want.argmax(-1))


def _step(name, shape, fsdp=False, strategy=None):
  """One distillation step: the fixture as teacher, a student of its blocks [0, last] (its layer types kept)."""
  mesh = None if shape is None else md.make_mesh(*shape)
  teacher = load_hf(FIXTURES / name, mesh)
  base = load_hf(FIXTURES / name).cfg
  student = md.init_model(base.with_layers([0, base.n_layers - 1]), seed=1, mesh=mesh)
  kw = {} if strategy is None else {"strategy": strategy}
  d = md.Distiller(student, teacher, mesh=mesh, fsdp=fsdp, **kw)
  _, metrics = d.step(d.init_state(), make_batch(vocab=128, seq=8))
  return jax.device_get(metrics)


def test_gemma3_step_on_4x2_with_fsdp_equals_one_device():
  """Sliding and global layers, q/k norms, post-norms and 1 + w norms through the backward pass, weights split over
  data x tensor (Mistral's block is Llama's plus the window these sliding layers exercise)."""
  want, got = _step("hf_gemma3", None), _step("hf_gemma3", (4, 2), fsdp=True)
  assert float(want["kl"]) > 0
  for k in ("loss", "kl", "grad_norm"):
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)


def test_gemma2_chunked_loss_on_2x4_soft_caps_each_vocabulary_shard_like_the_full_logits_on_one_device():
  """Gemma 2 (final cap 3) teacher and student: the chunked loss on 2x4 (logits formed from the heads chunk by chunk,
  V=130 padded and split over tensor=4) equals LogitKD on the models' own capped logits on one device; without the
  cap in the chunked loss it would not."""
  full = _step("hf_gemma2", None)
  chunked = _step("hf_gemma2", (2, 4), strategy=md.strategies.ChunkedLogitKD(chunk_size=4))
  for k in ("loss", "kl", "grad_norm"):
    np.testing.assert_allclose(chunked[k], full[k], rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("name", NEW)
def test_export_round_trip_keeps_family_options_and_logits(name, loaded, tmp_path):
  model = loaded[name]
  out = export_hf(model, tmp_path / "out")
  hf = json.loads((out / "config.json").read_text())
  src = json.loads((FIXTURES / name / "config.json").read_text())
  assert hf["architectures"] == src["architectures"] and hf["sliding_window"] == src["sliding_window"]
  back = load_hf(out)
  assert back.cfg == model.cfg
  tokens, _ = _reference(name)
  np.testing.assert_allclose(np.asarray(back(tokens).logits), np.asarray(model(tokens).logits), atol=1e-5, rtol=0)


def test_layer_subset_keeps_layer_types_and_scan_groups(loaded):
  cfg = loaded["hf_gemma3"].cfg
  sub = cfg.with_layers([1, 2])
  assert sub.layer_types == ("sliding_attention", "full_attention") and sub.layer_attention(1) == (None, 1e6,
                                                                                                  cfg.rope_scaling)
  assert sub.layer_attention(0) == (4, 10_000.0, None)
  # scanned in groups of layers that repeat: local, local, global | local; local, global; every Mistral layer alike
  assert (cfg.scan_period, sub.scan_period, loaded["hf_gemma2"].cfg.scan_period) == (3, 2, 2)
  assert loaded["hf_mistral"].cfg.scan_period == 1
  with pytest.raises(ValueError, match=r"family 'llama' cannot write \['sliding_window'\].*families that can: "
                     r"\['mistral'\]"):
    export_hf(md.init_model(md.ModelConfig(sliding_window=8)), "unused", family="llama")


def test_scanned_gemma3_fixture_equals_transformers_and_exports_as_unscanned(loaded, tmp_path):
  """The fixture's local, local, global, local layers scanned as one group of 3 and one layer after the loop."""
  from safetensors.numpy import load_file

  scanned = load_hf(FIXTURES / "hf_gemma3", scan_layers=True)
  assert scanned.cfg.scan_layers and scanned.blocks.attn.q.kernel.shape[0] == 4
  tokens, want = _reference("hf_gemma3")
  np.testing.assert_allclose(np.asarray(scanned(tokens).logits), want, atol=1e-4, rtol=0)
  a, b = export_hf(scanned, tmp_path / "scanned"), export_hf(loaded["hf_gemma3"], tmp_path / "unscanned")
  assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
  got, exp = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
  assert got.keys() == exp.keys() and all(np.array_equal(got[k], exp[k]) for k in exp)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_lora_targets_name_each_familys_own_projections(family):
  """PEFT adapters are named through the shared projection names; each family's checkpoint must use the same ones."""
  from meshdistill.models import families
  from meshdistill.models._hf_config import weight_names
  from meshdistill.models.lora import TARGETS

  fam = families.get(family)
  for t in TARGETS:
    key = ("blocks", 3, "attn" if t in "qkvo" else "mlp", t, "kernel")
    assert fam.weight_name(key) == weight_names(key)
  assert fam.weight_name(("blocks", 3, "attn", "q", "kernel"))[0] == "model.layers.3.self_attn.q_proj.weight"


def test_presets_resolve_to_the_published_sizes():
  from meshdistill import planner

  sizes = {}
  for name in ("gemma-3-1b", "gemma-3-12b", "gemma-2-9b", "mistral-7b-v0.3", "mistral-small-24b"):
    cfg, _ = planner.resolve_model(name, who="teacher")
    sizes[name] = cfg
  g3 = sizes["gemma-3-12b"]
  assert (g3.layer_types[:6], g3.sliding_window, g3.rope_local_theta, g3.rope_scaling.factor) == (
      ("sliding_attention",) * 5 + ("full_attention",), 1024, 10_000.0, 8.0)
  assert sizes["gemma-2-9b"].final_softcap == 30.0 and sizes["gemma-2-9b"].layer_types[:2] == (
      "sliding_attention", "full_attention")
  assert sizes["gemma-3-1b"].query_scale == 256**-0.5 and sizes["gemma-3-1b"].vocab_size == 262144
  assert sizes["mistral-7b-v0.3"].sliding_window is None and sizes["mistral-small-24b"].d_model == 5120
