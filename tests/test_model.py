"""The built-in decoder: causality, captures, partitioning metadata, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TEACHER_CFG
from flax import nnx

import meshdistill as md


def test_changing_a_future_token_never_changes_earlier_logits():
  model = md.init_model(TEACHER_CFG, seed=0)
  x = jax.random.randint(jax.random.key(0), (2, 12), 0, TEACHER_CFG.vocab_size)
  base = model(x).logits
  for t in (3, 7, 11):
    y = x.at[:, t].set((x[:, t] + 1) % TEACHER_CFG.vocab_size)
    out = model(y).logits
    np.testing.assert_array_equal(np.asarray(out[:, :t]), np.asarray(base[:, :t]))
    assert not np.allclose(out[:, t], base[:, t])


def test_capture_returns_hidden_states_and_attention_without_touching_params():
  model = md.init_model(TEACHER_CFG, seed=0)
  before = jax.tree.map(np.asarray, nnx.state(model))
  x = jnp.arange(20).reshape(2, 10) % TEACHER_CFG.vocab_size
  plain = model(x)
  out = model(x, capture=("hidden", "attn", "final"))
  L, H = TEACHER_CFG.n_layers, TEACHER_CFG.n_heads
  assert len(out.hidden) == L + 1 and out.hidden[0].shape == (2, 10, TEACHER_CFG.d_model)
  assert len(out.attn) == L and out.attn[0].shape == (2, H, 10, 10)
  np.testing.assert_allclose(np.asarray(jnp.sum(out.attn[1], -1)), 1.0, rtol=1e-5)
  assert float(jnp.max(jnp.abs(jnp.triu(out.attn[0], k=1)))) == 0.0  # causal
  # capturing "attn" takes the explicit-score kernel (attention="auto" is xla otherwise): equal up to rounding,
  # which differs by CPU (2e-6 on logits of magnitude ~3 on one AVX-512 machine: a few float32 ulps)
  np.testing.assert_allclose(np.asarray(out.logits), np.asarray(plain.logits), rtol=1e-5, atol=1e-5)
  explicit = md.init_model(TEACHER_CFG.replace(attention="explicit"), seed=0)
  np.testing.assert_array_equal(np.asarray(explicit(x, capture=("attn",)).logits), np.asarray(explicit(x).logits))
  assert out.final.shape == (2, 10, TEACHER_CFG.d_model)
  np.testing.assert_allclose(np.asarray(out.final @ model.head_weight()), np.asarray(plain.logits), rtol=1e-5, atol=1e-5)
  assert model(x, logits=False).logits is None
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(model)))


def test_untied_head_and_gqa_shapes():
  cfg = TEACHER_CFG.replace(tie_embeddings=False, n_heads=8, n_kv_heads=2, head_dim=8)
  model = md.init_model(cfg, seed=0)
  assert model.head_weight().shape == (cfg.d_model, cfg.vocab_size)
  assert model.blocks[0].attn.k.kernel.shape == (cfg.d_model, 2 * 8)
  assert model(jnp.zeros((1, 4), jnp.int32)).logits.shape == (1, 4, cfg.vocab_size)
  assert md.param_count(model) > md.param_count(md.init_model(TEACHER_CFG, 0))


def test_bf16_compute_keeps_float32_params_and_logits():
  model = md.init_model(TEACHER_CFG.replace(dtype="bfloat16"), seed=0)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))
  out = model(jnp.zeros((1, 4), jnp.int32))
  assert out.logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out.logits)))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"n_heads": 6, "n_kv_heads": 4}, "n_heads=6 must be a multiple of n_kv_heads=4"),
        ({"d_model": 30}, "d_model=30 is not divisible by n_heads=4"),
        ({"vocab_size": 0}, "vocab_size=0 must be a positive integer"),
        ({"dtype": "int8"}, "dtype='int8'"),
    ],
)
def test_bad_model_config_is_rejected(kw, match):
  with pytest.raises(ValueError, match=match):
    TEACHER_CFG.replace(**kw)


def test_sequence_longer_than_max_len_is_rejected():
  model = md.init_model(TEACHER_CFG, seed=0)
  with pytest.raises(ValueError, match="sequence length 17 exceeds the model's max_len=16"):
    model(jnp.zeros((1, 17), jnp.int32))
  with pytest.raises(ValueError, match="capture"):
    model(jnp.zeros((1, 4), jnp.int32), capture=("logits",))


def test_models_built_on_a_mesh_one_after_another_each_hold_their_own_seeds_weights():
  """`init_model` on a mesh compiles its initialiser once per config and mesh and reuses it: every seed must still
  give that seed's weights (those of the one-device initialisation, to float32 rounding: the jitted embedding
  initialiser may differ from the eager one in the last bit), and a seed built again the same weights bit for bit."""
  mesh = md.make_mesh(data=2, tensor=4)
  flat = lambda model: [np.asarray(v[...]) for _, v in nnx.to_flat_state(nnx.state(model))]  # noqa: E731
  first, other, again = (flat(md.init_model(TEACHER_CFG, seed, mesh)) for seed in (0, 5, 0))
  for seed, got in ((0, first), (5, other)):
    for g, want in zip(got, flat(md.init_model(TEACHER_CFG, seed))):
      np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7)
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  assert all(not np.array_equal(a, b) for a, b in zip(first, other) if a.ndim >= 2)  # every weight matrix drawn anew
