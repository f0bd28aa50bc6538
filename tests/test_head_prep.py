"""`models._head_prep.norm_rope_heads` (the queries' and keys' per-head norm, RoPE and head-major layout in one Pallas
kernel, on a TPU) against the XLA form it replaces (`head_norm`, `rope`, a rearrange): values and gradients, in Pallas
interpret mode here; compiled for a v5e, the decoder's splash path takes it."""

import types

import einops
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

import meshdistill as md
from meshdistill.models._attention import prep_in_kernel, rope, rope_tables
from meshdistill.models._head_prep import norm_rope_heads, usable
from meshdistill.models._variants import OffsetRMSNorm, head_norm, head_norm_scale

B, T, H, K = 2, 256, 3, 128


def _norm(kind, dtype, rng):
  if kind == "rms":  # nnx.RMSNorm's attributes as head_norm reads them
    return types.SimpleNamespace(epsilon=1e-6, dtype=dtype, scale=jnp.asarray(rng.normal(size=K) + 1, jnp.float32))
  if kind == "offset":  # Gemma's 1 + w
    m = OffsetRMSNorm.__new__(OffsetRMSNorm)
    m.__dict__.update(epsilon=1e-6, scale=jnp.asarray(0.3 * rng.normal(size=K), jnp.float32))
    return m
  return None


def _with_scale(m, w):
  """``m`` with its scale ``w`` (a traced value: the norm's gradient is taken with respect to it)."""
  if m is None:
    return None
  new = OffsetRMSNorm.__new__(OffsetRMSNorm) if isinstance(m, OffsetRMSNorm) else types.SimpleNamespace()
  vars(new).update(vars(m), scale=w)
  return new


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind, post", [("rms", 1.0), ("offset", 0.0884), (None, 1.0)], ids=["rms", "offset", "none"])
def test_the_kernel_gives_the_norm_and_rope_of_each_head_and_their_gradients(dtype, kind, post):
  rng = np.random.default_rng(0)
  y = jnp.asarray(2 * rng.normal(size=(B, T, H * K)), dtype)
  g = jnp.asarray(rng.normal(size=(B, H, T, K)), dtype)
  m = _norm(kind, dtype, rng)
  theta = 10000.0

  def xla(y, w):
    x = einops.rearrange(y, "b t (h k) -> b h t k", k=K)
    if m is not None:
      x = head_norm(_with_scale(m, w), x)
    x = rope(x, theta, None, None, token_axis=2)
    return x if post == 1.0 else x * jnp.asarray(post, dtype)

  def kernel(y, w):
    cos, sin = rope_tables(jnp.arange(T), K, theta)
    scale = None if m is None else head_norm_scale(_with_scale(m, w), dtype)
    return norm_rope_heads(y, H, cos, sin, scale, 1e-6, post, interpret=True)

  w = jnp.zeros(K) if m is None else m.scale
  grads = lambda fn: jax.grad(lambda y, w: jnp.sum(fn(y, w).astype(jnp.float32) * g), argnums=(0, 1))(y, w)  # noqa: E731
  with jax.default_matmul_precision("highest"):
    want, want_grads = xla(y, w), grads(xla)
  got, got_grads = kernel(y, w), grads(kernel)
  assert got.shape == (B, H, T, K) and got.dtype == dtype
  # float32: the same products in another order; bfloat16: the XLA form rounds the rotation's two gradient terms
  # to bfloat16 apart and adds them there (the kernel adds in float32, then rounds once)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  assert rel_err(got, want) < tol, rel_err(got, want)
  assert rel_err(got_grads[0], want_grads[0]) < tol, rel_err(got_grads[0], want_grads[0])
  if m is not None:
    assert rel_err(got_grads[1], want_grads[1]) < tol, rel_err(got_grads[1], want_grads[1])
    assert rel_err(want_grads[1], 0 * want_grads[1]) > 0.1  # the scale's gradient is not trivially zero


def test_the_kernel_applies_to_lane_wide_heads_on_one_device_only():
  assert usable(2048, 128, ()) and usable(2048, 256, (1, 1))
  assert not usable(2048, 64, ())  # Llama 3.2 1B's heads: half a lane row
  assert not usable(2048, 128, (1, 4))  # heads split over tensor by the compiler: the XLA form stays
  assert not prep_in_kernel(2048, 128)  # compiled for this CPU


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
@pytest.mark.parametrize("head_dim, kernels", [(128, True), (64, False)])
def test_the_decoder_takes_the_kernel_where_it_runs_splash_on_a_tpu(head_dim, kernels):
  """Compiled for one v5e chip (nothing runs): a qk-norm decoder's splash path forms its queries and keys with the
  kernel, forward and backward; heads narrower than a lane row keep the XLA form."""
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from meshdistill.models import abstract_params
  from meshdistill.planner._hardware import tpu_target

  cfg = md.ModelConfig(vocab_size=256, d_model=256, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=head_dim,
                       mlp_hidden=512, max_len=256, qk_norm=True, attention="splash", dtype="bfloat16")
  mesh = Mesh(np.array(tpu_target("v5e:2x2").devices[:1]).reshape(1, 1), ("data", "tensor"))
  placed = NamedSharding(mesh, PartitionSpec())
  graphdef, state, _ = abstract_params(cfg)
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), state)
  tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=placed)

  def loss(state, tokens):
    return jnp.sum(nnx.merge(graphdef, state)(tokens).logits.astype(jnp.float32))

  with jax.set_mesh(mesh):  # the mesh says the target: a TPU's (as a layout's step or the planner's)
    hlo = jax.jit(jax.grad(loss)).lower(state, tokens).compile().as_text()
  assert ("norm_rope_heads_bwd" in hlo) == kernels and ("norm_rope_heads" in hlo) == kernels


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
@pytest.mark.parametrize("dtype, heads, head_dim", [("bfloat16", 32, 128), ("float32", 32, 128), ("bfloat16", 8, 256),
                                                    ("float32", 8, 256)])
def test_the_kernels_fit_a_v5e_chips_on_chip_memory(dtype, heads, head_dim):
  """Compiled for one v5e chip: forward and backward fit its 16 MiB of scoped on-chip memory (too large a block fails
  the compile) for wide projections in either dtype."""
  from jax.sharding import SingleDeviceSharding

  from meshdistill.planner._hardware import tpu_target

  device = SingleDeviceSharding(tpu_target("v5e:2x2").devices[0])
  T = 2048
  y = jax.ShapeDtypeStruct((2, T, heads * head_dim), jnp.dtype(dtype), sharding=device)
  table = jax.ShapeDtypeStruct((T, head_dim), jnp.float32, sharding=device)
  scale = jax.ShapeDtypeStruct((head_dim,), jnp.float32, sharding=device)

  def loss(y, cos, sin, w):
    return jnp.sum(norm_rope_heads(y, heads, cos, sin, w, 1e-6, 0.1).astype(jnp.float32))

  hlo = jax.jit(jax.grad(loss, argnums=(0, 3))).lower(y, table, table, scale).compile().as_text()
  assert "norm_rope_heads_bwd" in hlo
