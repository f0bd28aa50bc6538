"""Attention kernels: `xla` (jax.nn.dot_product_attention) and the grouped explicit path agree, values and grads."""

import einops
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TEACHER_CFG, make_batch

import meshdistill as md
from meshdistill.models.decoder import _explicit_attention, _splash_attention

CFG = TEACHER_CFG.replace(n_heads=4, n_kv_heads=2)


def _repeated_reference(q, k, v):
  """Causal attention with key/value heads copied per query head (the textbook form)."""
  r = q.shape[2] // k.shape[2]
  k, v = (einops.repeat(a, "b s g k -> b s (g r) k", r=r) for a in (k, v))
  scores = jnp.einsum("bthk,bshk->bhts", q, k) / jnp.sqrt(q.shape[-1])
  T = q.shape[1]
  scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
  return jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, -1), v)


def test_grouped_explicit_and_xla_equal_the_repeated_reference():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 8, 6, 4), (2, 8, 2, 4), (2, 8, 2, 4)))
  want = _repeated_reference(q, k, v)
  got_explicit, probs = jax.jit(_explicit_attention)(q, k, v)
  got_xla = jax.jit(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True, implementation="xla"))(q, k, v)
  np.testing.assert_allclose(got_explicit, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_xla, want, rtol=1e-5, atol=1e-6)
  assert probs.shape == (2, 6, 8, 8)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def _loss_and_grads(attention):
  graphdef, params = nnx.split(md.init_model(CFG.replace(attention=attention), 0))
  batch = make_batch()

  def loss(params):
    m = nnx.merge(graphdef, params)
    logp = jax.nn.log_softmax(m(jnp.asarray(batch["inputs"])).logits)
    nll = -jnp.take_along_axis(logp, jnp.asarray(batch["targets"])[..., None], -1)[..., 0]
    return jnp.sum(nll * batch["mask"]) / batch["mask"].sum()

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return value, nnx.to_pure_dict(grads)


def test_xla_attention_values_and_grads_equal_explicit():
  ref_value, ref_grads = _loss_and_grads("explicit")
  value, grads = _loss_and_grads("xla")  # also what "auto" runs when nothing is captured
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, ref_grads)


def test_captured_probabilities_use_explicit_scores_under_any_kernel():
  tokens = jnp.asarray(make_batch()["inputs"])
  ref = md.init_model(CFG.replace(attention="explicit"), 0)(tokens, capture=("attn",))
  out = md.init_model(CFG.replace(attention="xla"), 0)(tokens, capture=("attn",))
  assert len(out.attn) == CFG.n_layers and out.attn[0].shape == (8, 4, 8, 8)
  np.testing.assert_allclose(out.attn[0], ref.attn[0], rtol=1e-6)
  np.testing.assert_allclose(out.logits, ref.logits, rtol=1e-5, atol=1e-6)


def test_unknown_attention_names_the_choices():
  with pytest.raises(ValueError, match=r"ModelConfig.attention='flash'.*'explicit', 'xla'"):
    CFG.replace(attention="flash")


def test_splash_interpreted_values_and_grads_equal_explicit():
  """The Pallas splash kernel in interpret mode (T = 128, its lane width) against the explicit path."""
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((1, 128, 4, 8), (1, 128, 2, 8), (1, 128, 2, 8)))
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  def run(attn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)

  want, want_grads = run(lambda *a: _explicit_attention(*a)[0])
  got, got_grads = run(_splash_attention)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, r in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="attention='splash' needs a sequence length that is a multiple of 128"):
    _splash_attention(q[:, :8], k[:, :8], v[:, :8])
