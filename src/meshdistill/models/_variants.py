"""The block options some families turn on (`ModelConfig` fields; all off for the Llama block), as small pieces
the decoder (`meshdistill.models.decoder`) and its attention kernels (`meshdistill.models._attention`) call:

=====================  ==================================================  ==============
option                 what it changes                                     families
=====================  ==================================================  ==============
``sliding_window``     a sliding layer's query sees itself and the         Mistral, Gemma
                       ``sliding_window - 1`` tokens before it (`band`)
``layer_types``        which layers slide and which see everything         Gemma 2 / 3
``rope_local_theta``   the RoPE base of sliding layers                     Gemma 3
``geglu``              MLP gate through tanh-approximated GELU             Gemma
``norm_offset``        RMSNorm applied as ``1 + w`` in float32 (`norm`)    Gemma
``embed_scale``        embeddings times ``sqrt(d_model)`` (`scale_embed`)  Gemma
``post_norms``         RMSNorm on attention / MLP outputs before the adds  Gemma 2 / 3
``query_scale``        attention score scale (``query_pre_attn_scalar``)   Gemma
``attn_softcap``       ``cap * tanh(scores / cap)`` before the mask        Gemma 2
``final_softcap``      ``cap * tanh(logits / cap)`` on each vocabulary     Gemma 2
                       shard (`softcap`; the chunked loss applies it too)
``qk_norm``            RMSNorm over each query / key head, its mean        Qwen3, Gemma 3
                       square a [K, K] matmul (`head_norm`)
=====================  ==================================================  ==============
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshdistill.models._config import ModelConfig
from meshdistill.parallel.rules import annotate


class OffsetRMSNorm(nnx.Module):
  """RMSNorm whose scale is stored as ``w`` (zeros at init) and applied as ``1 + w``, computed in float32 and cast
  back to the input's dtype, as Gemma's. The parameter is ``scale`` ``[D]`` (replicated), like `nnx.RMSNorm`'s."""

  def __init__(self, dim: int, *, epsilon: float, param_dtype, name: str = "embed", rngs: nnx.Rngs | None = None):
    del rngs
    self.epsilon = epsilon
    self.scale = nnx.Param(annotate(nnx.initializers.zeros, name)(jax.random.key(0), (dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def per_head_matmul(x: jax.Array, m_KxK: jax.Array, precision=None) -> jax.Array:
  """``x [..., K] @ m_KxK`` in float32, written as a dot with a unit batch dimension: the ``dots_no_batch`` remat
  policy then does not save its output (cheap to form again), and XLA drops the unit dimension."""
  y = jnp.einsum("z...k,zkj->z...j", x[None], m_KxK[None], precision=precision, preferred_element_type=jnp.float32)
  return y[0]


def head_norm(norm_module: nnx.Module, x: jax.Array) -> jax.Array:
  """``norm_module`` (`nnx.RMSNorm` or `OffsetRMSNorm` over the last axis, a head's ``K`` features) applied to
  ``x [..., K]``, its mean square formed by a ``[K, K]`` matmul instead of a reduction.

  The same values (float32 statistics, output in ``x``'s dtype), laid out for a TPU: the mean square comes out
  of the MXU already broadcast over the ``K`` lanes it scales, where a reduction's per-row result has to be
  broadcast back, which made XLA relayout the heads of every projection (a copy of q and k per layer). The
  matmul reads the squares at ``HIGH`` precision (three bfloat16 passes: float32's accuracy to about 2^-17).
  """
  K = x.shape[-1]
  x32 = x.astype(jnp.float32)
  mean_sq = per_head_matmul(x32 * x32, jnp.full((K, K), 1.0 / K, jnp.float32), jax.lax.Precision.HIGH)
  return (x32 * jax.lax.rsqrt(mean_sq + norm_module.epsilon) * head_norm_scale(norm_module, x.dtype)).astype(x.dtype)


def head_norm_scale(norm_module: nnx.Module, dtype) -> jax.Array:
  """The float32 ``[K]`` factor ``norm_module`` multiplies the normalised features by, for inputs of ``dtype``:
  ``1 + w`` of `OffsetRMSNorm`, the scale of `nnx.RMSNorm` rounded to its compute dtype (as the module does)."""
  scale = norm_module.scale[...]
  if isinstance(norm_module, OffsetRMSNorm):  # 1 + w in float32, as the module
    return 1.0 + scale.astype(jnp.float32)
  return scale.astype(norm_module.dtype or dtype).astype(jnp.float32)


def norm(cfg: ModelConfig, dim: int, rngs: nnx.Rngs, name: str = "embed") -> nnx.Module:
  """The RMSNorm of ``cfg``'s blocks over ``dim`` features whose logical name is ``name``
  (`meshdistill.parallel.rules`): `OffsetRMSNorm` with ``norm_offset``, else `nnx.RMSNorm`."""
  if cfg.norm_offset:
    return OffsetRMSNorm(dim, epsilon=cfg.norm_eps, param_dtype=cfg.weight_dtype, name=name)
  return nnx.RMSNorm(dim, epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
                     scale_init=annotate(nnx.initializers.ones, name), rngs=rngs)


def post_norm(module: nnx.Module | None, y: jax.Array) -> jax.Array:
  """A sublayer's output as the residual adds it: through ``module``, the block's norm of that output (``post_norms``:
  Gemma 2 / 3), or as it is where the block has none (``module`` None: the attribute is declared either way)."""
  return y if module is None else module(y)


def gelu_tanh(x: jax.Array) -> jax.Array:
  """GELU with the tanh approximation (transformers' ``gelu_pytorch_tanh``)."""
  return jax.nn.gelu(x, approximate=True)


def gate_activation(cfg: ModelConfig):
  """The MLP gate's activation: `gelu_tanh` with ``geglu``, else SiLU (module-level functions: a model's static
  attributes stay equal between builds)."""
  return gelu_tanh if cfg.geglu else jax.nn.silu


def scale_embed(cfg: ModelConfig, x_BxTxD: jax.Array) -> jax.Array:
  """Embeddings times ``sqrt(d_model)`` with ``embed_scale`` (the factor rounded to the compute dtype first)."""
  if not cfg.embed_scale:
    return x_BxTxD
  return x_BxTxD * jnp.asarray(cfg.d_model**0.5, x_BxTxD.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """``cap * tanh(x / cap)`` (elementwise: a vocabulary shard needs no other shard), or ``x`` when ``cap`` is None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def band(rows: jax.Array, cols: jax.Array, window: int | None) -> jax.Array | bool:
  """Causal visibility with a sliding window: key ``col`` is visible to query ``row`` when ``row - window < col``
  (``col <= row`` is the causal mask's part); ``True`` everywhere without a window."""
  return True if window is None else cols > rows - window
