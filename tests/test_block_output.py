"""One output type for the decoder's layers: every block kind (dense, mixture-of-experts, a dense layer of an MoE
model, Gemma's sliding layer with post-norms), its attention and its MLP return a `BlockOutput` whose fields say what
it produced (attention probabilities when asked for, the updated cache when decoding, routing from experts), with or
without rematerialisation; it is a pytree of those fields and not a tuple, and a block's optional norms are declared
None instead of missing. That the decoder computes what it did before: tests/test_forward_reference.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdistill as md
from meshdistill.models.decoder import BlockOutput, KVCache, _block_runner
from meshdistill.models.moe import MoeConfig, Routing

B, T, S = 2, 6, 8  # rows, tokens of a call, cache slots
BASE = md.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_len=16)
GEMMA = BASE.replace(sliding_window=3, layer_types=("sliding_attention", "full_attention"), qk_norm=True,
                     post_norms=True, norm_offset=True, geglu=True, attn_softcap=5.0)
MOE = BASE.replace(moe=MoeConfig(n_experts=4, top_k=2, expert_hidden=16, dense_layers=(1,)))
# name: (config, layer, the block's MLP is a mixture of experts)
KINDS = {"dense": (BASE, 0, False), "gemma_sliding": (GEMMA, 0, False), "moe": (MOE, 0, True),
         "moe_model_dense_layer": (MOE, 1, False)}


@pytest.fixture(scope="module")
def models():
  return {name: md.init_model(cfg, seed=0) for name, (cfg, _, _) in KINDS.items()}


def _x(cfg):
  return jax.random.normal(jax.random.key(0), (B, T, cfg.d_model), cfg.compute_dtype)


def _cache(model):
  k, v = model.empty_cache(B, S)[0]
  return KVCache(k, v, jnp.ones((B, S), bool).at[:, T:].set(False), 0, jnp.broadcast_to(jnp.arange(T), (B, T)))


def _assert_fields(out, cfg, *, probs: bool, cache: bool, experts: bool):
  assert type(out) is BlockOutput
  assert out.x.shape == (B, T, cfg.d_model)
  assert (out.probs is not None) == probs and (out.cache is not None) == cache
  if probs:
    assert out.probs.shape == (B, cfg.n_heads, T, T)
    np.testing.assert_allclose(np.asarray(jnp.sum(out.probs, -1)), 1.0, rtol=1e-5)  # rows of a softmax
  if cache:
    assert type(out.cache) is KVCache and out.cache.k.shape == (B, cfg.n_kv_heads, S, cfg.hd)
    assert np.any(np.asarray(out.cache.k[:, :, :T])) and not np.any(np.asarray(out.cache.k[:, :, T:]))  # this call's
  assert isinstance(out.aux, Routing) if experts else out.aux is None
  if experts:
    assert out.aux.logits_BxTxE.shape == (B, T, cfg.moe.n_experts)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("probs, cache", [(False, False), (True, False), (False, True)],
                         ids=["plain", "with_probs", "with_cache"])
def test_every_block_kind_returns_one_output_type_with_the_fields_it_produced(kind, probs, cache, models):
  cfg, layer, experts = KINDS[kind]
  block = models[kind].blocks[layer]
  kv = _cache(models[kind]) if cache else None
  _assert_fields(block(_x(cfg), probs, kv), cfg, probs=probs, cache=cache, experts=experts)
  _assert_fields(block.attn(_x(cfg), probs, kv), cfg, probs=probs, cache=cache, experts=False)
  _assert_fields(block.mlp(_x(cfg)), cfg, probs=False, cache=False, experts=experts)


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_a_block_under_remat_returns_the_same_output(remat, models):
  """`nnx.remat` (and the plain call) pass the output type through with the same values."""
  cfg, layer, _ = KINDS["moe"]
  block, x = models["moe"].blocks[layer], _x(cfg)
  want = block(x, True)
  got = _block_runner(remat)(block, x, True)
  assert type(got) is BlockOutput and jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_block_output_is_a_pytree_of_its_fields_and_not_a_tuple():
  x = jnp.ones((B, T, 4))
  out = BlockOutput(x)
  assert jax.tree.leaves(out) == [x] and jax.tree.structure(out).num_leaves == 1  # None fields: empty nodes
  routed = BlockOutput(x, aux=Routing(jnp.zeros((B, T, 3)), jnp.zeros((B, T))))
  assert jax.tree.structure(routed).num_leaves == 3
  doubled = jax.jit(lambda o: jax.tree.map(lambda a: 2 * a, o))(routed)
  assert type(doubled) is BlockOutput and doubled.cache is None and doubled.probs is None
  np.testing.assert_array_equal(doubled.x, 2 * x)
  assert not isinstance(out, tuple)
  with pytest.raises(TypeError):
    x_, cache_ = out  # noqa: F841  (read by field: an unpacking by position fails)
  with pytest.raises(dataclasses.FrozenInstanceError):
    out.x = x  # type: ignore[misc]


def test_optional_norms_are_declared_none_and_hold_no_weights(models):
  dense, gemma = models["dense"].blocks[0], models["gemma_sliding"].blocks[0]
  assert dense.post_attn_norm is None and dense.post_mlp_norm is None
  assert dense.attn.q_norm is None and dense.attn.k_norm is None
  assert all(isinstance(m, nnx.Module) for m in (gemma.post_attn_norm, gemma.post_mlp_norm, gemma.attn.q_norm,
                                                 gemma.attn.k_norm))
  held = {p[0] for p, _ in nnx.to_flat_state(nnx.state(dense))}
  assert held == {"attn", "attn_norm", "mlp", "mlp_norm"}
