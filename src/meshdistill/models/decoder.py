"""A Llama-style decoder-only transformer in Flax NNX, partitioned over the ``tensor`` axis.

Blocks: pre-RMSNorm, rotary position embedding (RoPE), grouped-query attention,
SwiGLU MLP; tied or untied LM head.

Weights carry partition metadata over the mesh axis ``tensor``:

==========================  ================  =====================
weight                      shape             split over ``tensor``
==========================  ================  =====================
embedding                   [V, D]            V (vocabulary)
attention q / k / v         [D, H*Hd]         heads
attention out               [H*Hd, D]         heads
MLP gate / up               [D, F]            F (hidden units)
MLP down                    [F, D]            F
untied LM head              [D, V]            V
norm scales                 [D]               replicated
==========================  ================  =====================

So the logits ``[B, T, V]`` come out split over ``tensor`` along V. On request
(``capture=``) the forward pass also returns per-layer hidden states and attention
probabilities; capturing never changes parameters or module state.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp
from flax import nnx

from meshdistill.mesh import TENSOR

CAPTURABLE = ("hidden", "attn", "final")

# Per-block rematerialisation (`jax.checkpoint`) policies, by `ModelConfig.remat` name:
# "none" keeps every activation for the backward pass; "full" keeps only each block's
# input and recomputes the block; "dots" keeps matmul outputs; "dots_no_batch" keeps
# only matmuls without batch dimensions (the weight projections, not attention scores).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama-3 rotary frequency scaling (Hugging Face ``rope_scaling`` with ``rope_type="llama3"``).

  Wavelengths longer than ``original_max_len / low_freq_factor`` are stretched by ``factor``,
  those shorter than ``original_max_len / high_freq_factor`` kept, the band between blended.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192

  def __post_init__(self):
    if not self.high_freq_factor > self.low_freq_factor > 0 or self.factor <= 0 or self.original_max_len < 1:
      raise ValueError(
          f"RopeScaling{dataclasses.astuple(self)} needs factor > 0, high_freq_factor > low_freq_factor > 0 "
          "and original_max_len >= 1 (e.g. Llama 3.1: factor=8, low_freq_factor=1, high_freq_factor=4, "
          "original_max_len=8192)"
      )

  def apply(self, inv_freq: jax.Array) -> jax.Array:
    """Scaled inverse frequencies ``[K/2]`` from the plain ones."""
    wavelen = 2 * jnp.pi / inv_freq
    low_wavelen = self.original_max_len / self.low_freq_factor
    high_wavelen = self.original_max_len / self.high_freq_factor
    smooth = (self.original_max_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
    blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
    out = jnp.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
    return jnp.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), blended, out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Sizes of a decoder. Head dimension is ``d_model // n_heads`` unless given."""

  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int | None = None
  mlp_hidden: int = 512
  max_len: int = 512
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  dtype: str = "float32"  # compute dtype of activations; params stay float32
  remat: str = "none"  # per-block rematerialisation policy, a key of REMAT_POLICIES
  qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3)
  qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
  rope_scaling: RopeScaling | None = None  # Llama-3 frequency scaling (a dict of its fields also works)

  def __post_init__(self):
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden", "max_len"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"ModelConfig.{name}={v!r} must be a positive integer")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
          "(grouped-query attention shares each key/value head among n_heads/n_kv_heads query heads)"
      )
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
          f"ModelConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
          "set head_dim explicitly or choose d_model as a multiple of n_heads"
      )
    if self.head_dim is not None and self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (rotary embedding)")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"ModelConfig.dtype={self.dtype!r}; choose float32, bfloat16 or float16")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat={self.remat!r}; choose one of {tuple(REMAT_POLICIES)}")

  @property
  def hd(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def check_tensor_split(self, tensor: int) -> None:
    """Raises when a ``tensor``-split weight dimension is not divisible by ``tensor``."""
    dims = {
        "vocab_size": self.vocab_size,
        "n_heads * head_dim": self.n_heads * self.hd,
        "n_kv_heads * head_dim": self.n_kv_heads * self.hd,
        "mlp_hidden": self.mlp_hidden,
    }
    bad = {k: v for k, v in dims.items() if v % tensor}
    if bad:
      desc = ", ".join(f"{k}={v}" for k, v in bad.items())
      raise ValueError(
          f"mesh tensor={tensor} does not divide {desc}; these weight dimensions are split "
          f"over the tensor axis: choose sizes that are multiples of {tensor} or a smaller tensor axis"
      )


class ModelOutput(NamedTuple):
  """Forward-pass result.

  ``logits``: [B, T, V] (V split over ``tensor``), ``None`` when called with ``logits=False``;
  ``hidden``: (L+1) x [B, T, D] (embeddings, then after each block); ``attn``: L x
  [B, H, T, T] attention probabilities; ``final``: [B, T, D] final-norm output, the
  input of the LM head (see `Decoder.head_weight`). Uncaptured entries are empty/None.
  """

  logits: jax.Array | None
  hidden: tuple = ()
  attn: tuple = ()
  final: jax.Array | None = None


class KVCache(NamedTuple):
  """One attention layer's key/value cache for decoding (`meshdistill.generate`).

  ``k_BxSxGxK`` / ``v_BxSxGxK``: keys (after RoPE) and values of ``S`` slots (G = n_kv_heads, split
  over ``tensor`` like the k/v projections); ``valid_BxS``: slots holding a real token (left padding
  is never attended); ``index``: the slot of the first token of this call; ``positions_BxT``: the
  RoPE positions of this call's tokens, per row.
  """

  k_BxSxGxK: jax.Array
  v_BxSxGxK: jax.Array
  valid_BxS: jax.Array
  index: jax.Array
  positions_BxT: jax.Array

  def write(self, k_BxTxGxK: jax.Array, v_BxTxGxK: jax.Array) -> "KVCache":
    at = (0, self.index, 0, 0)
    return self._replace(
        k_BxSxGxK=jax.lax.dynamic_update_slice(self.k_BxSxGxK, k_BxTxGxK.astype(self.k_BxSxGxK.dtype), at),
        v_BxSxGxK=jax.lax.dynamic_update_slice(self.v_BxSxGxK, v_BxTxGxK.astype(self.v_BxSxGxK.dtype), at),
    )

  def visible(self, T: int) -> jax.Array:
    """``[B, 1, T, S]``: query ``t`` (slot ``index + t``) sees valid slots ``<= index + t``."""
    S = self.k_BxSxGxK.shape[1]
    causal_TxS = jnp.arange(S)[None, :] <= self.index + jnp.arange(T)[:, None]
    return causal_TxS[None, None] & self.valid_BxS[:, None, None, :]


def _part(init, *names):
  return nnx.with_partitioning(init, names)


def rope(
    x_BxTxHxK: jax.Array, theta: float, scaling: RopeScaling | None = None, positions_BxT: jax.Array | None = None
) -> jax.Array:
  """Rotary position embedding on the last axis (rotate-half convention).

  Positions are ``0 .. T-1`` unless ``positions_BxT`` gives each row its own (left-padded decoding).
  """
  T, K = x_BxTxHxK.shape[1], x_BxTxHxK.shape[-1]
  inv = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)  # [K/2]
  if scaling is not None:
    inv = scaling.apply(inv)
  if positions_BxT is None:
    ang_TxK2 = jnp.arange(T, dtype=jnp.float32)[:, None] * inv[None, :]
    sin = jnp.sin(ang_TxK2)[None, :, None, :]
    cos = jnp.cos(ang_TxK2)[None, :, None, :]
  else:
    ang_BxTxK2 = positions_BxT.astype(jnp.float32)[..., None] * inv
    sin, cos = jnp.sin(ang_BxTxK2)[:, :, None, :], jnp.cos(ang_BxTxK2)[:, :, None, :]
  x = x_BxTxHxK.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxK.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.lecun_normal()
    D, H, KV, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.hd
    lin = lambda i, o, names, bias=False: nnx.Linear(  # noqa: E731
        i, o, use_bias=bias, kernel_init=_part(init, *names), bias_init=_part(nnx.initializers.zeros, names[1]),
        dtype=cfg.compute_dtype, rngs=rngs
    )
    self.q = lin(D, H * K, (None, TENSOR), cfg.qkv_bias)
    self.k = lin(D, KV * K, (None, TENSOR), cfg.qkv_bias)
    self.v = lin(D, KV * K, (None, TENSOR), cfg.qkv_bias)
    self.o = lin(H * K, D, (TENSOR, None))
    if cfg.qk_norm:  # per-head RMSNorm over head_dim, scales [K] replicated
      self.q_norm = nnx.RMSNorm(K, epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, rngs=rngs)
      self.k_norm = nnx.RMSNorm(K, epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, rngs=rngs)

  def __call__(self, x_BxTxD: jax.Array, want_probs: bool, cache: KVCache | None = None):
    """``(output, attention probabilities or None)``; with a ``cache`` (decoding), ``(output, updated cache)``:
    the new keys/values are written at ``cache.index`` and the queries see the cache's valid slots up to their own."""
    cfg = self.cfg
    K = cfg.hd
    q = einops.rearrange(self.q(x_BxTxD), "b t (h k) -> b t h k", k=K)
    k = einops.rearrange(self.k(x_BxTxD), "b t (h k) -> b t h k", k=K)
    v = einops.rearrange(self.v(x_BxTxD), "b t (h k) -> b t h k", k=K)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    pos = None if cache is None else cache.positions_BxT
    q, k = rope(q, cfg.rope_theta, cfg.rope_scaling, pos), rope(k, cfg.rope_theta, cfg.rope_scaling, pos)
    if cache is not None:
      cache = cache.write(k, v)
      k, v = cache.k_BxSxGxK, cache.v_BxSxGxK
    group = cfg.n_heads // cfg.n_kv_heads
    k = einops.repeat(k, "b t g k -> b t (g r) k", r=group)
    v = einops.repeat(v, "b t g k -> b t (g r) k", r=group)
    T = x_BxTxD.shape[1]
    scores_BxHxTxS = jnp.einsum("bthk,bshk->bhts", q, k).astype(jnp.float32) / jnp.sqrt(K)
    causal_TxS = jnp.tril(jnp.ones((T, T), dtype=bool)) if cache is None else cache.visible(T)
    scores_BxHxTxS = jnp.where(causal_TxS, scores_BxHxTxS, jnp.finfo(jnp.float32).min)
    probs_BxHxTxS = jax.nn.softmax(scores_BxHxTxS, axis=-1)
    out = jnp.einsum("bhts,bshk->bthk", probs_BxHxTxS.astype(v.dtype), v)
    out = self.o(einops.rearrange(out, "b t h k -> b t (h k)"))
    if cache is not None:
      return out, cache
    return out, (probs_BxHxTxS if want_probs else None)


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    D, F = cfg.d_model, cfg.mlp_hidden
    lin = lambda i, o, names: nnx.Linear(  # noqa: E731
        i, o, use_bias=False, kernel_init=_part(init, *names), dtype=cfg.compute_dtype, rngs=rngs
    )
    self.gate = lin(D, F, (None, TENSOR))
    self.up = lin(D, F, (None, TENSOR))
    self.down = lin(F, D, (TENSOR, None))

  def __call__(self, x_BxTxD):
    return self.down(jax.nn.silu(self.gate(x_BxTxD)) * self.up(x_BxTxD))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    norm = lambda: nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, rngs=rngs)  # noqa: E731
    self.attn_norm = norm()
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x_BxTxD, want_probs: bool, cache: KVCache | None = None):
    a, probs = self.attn(self.attn_norm(x_BxTxD), want_probs, cache)  # with a cache: (a, updated cache)
    x_BxTxD = x_BxTxD + a
    x_BxTxD = x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD))
    return x_BxTxD, probs


class Decoder(nnx.Module):
  """Decoder-only LM. ``model(tokens_BxT, capture=("hidden", "attn")) -> ModelOutput``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(
        cfg.vocab_size,
        cfg.d_model,
        # std 1/sqrt(D): with a tied head the initial logits then have unit scale
        embedding_init=_part(nnx.initializers.normal(stddev=cfg.d_model**-0.5), TENSOR, None),
        dtype=cfg.compute_dtype,
        rngs=rngs,
    )
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
    self.final_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, rngs=rngs)
    if cfg.tie_embeddings:
      self.head = nnx.data(None)
    else:
      self.head = nnx.Linear(
          cfg.d_model,
          cfg.vocab_size,
          use_bias=False,
          kernel_init=_part(nnx.initializers.lecun_normal(), None, TENSOR),
          dtype=cfg.compute_dtype,
          rngs=rngs,
      )

  def __call__(
      self, tokens_BxT: jax.Array, *, capture: tuple[str, ...] = (), logits: bool = True
  ) -> ModelOutput:
    cfg = self.cfg
    unknown = set(capture) - set(CAPTURABLE)
    if unknown:
      raise ValueError(f"capture={capture!r}: unknown {sorted(unknown)}; choose from {CAPTURABLE}")
    if tokens_BxT.ndim != 2:
      raise ValueError(f"tokens must be [batch, seq], got shape {tokens_BxT.shape}")
    T = tokens_BxT.shape[1]
    if T > cfg.max_len:
      raise ValueError(
          f"sequence length {T} exceeds the model's max_len={cfg.max_len}; "
          f"use seq_len <= {cfg.max_len} or build the model with a larger max_len"
      )
    want_hidden, want_attn = "hidden" in capture, "attn" in capture
    x = self.embed(tokens_BxT)
    hidden, attn = [x] if want_hidden else [], []
    run_block = _block_runner(cfg.remat)
    for block in self.blocks:
      x, probs = run_block(block, x, want_attn)
      if want_hidden:
        hidden.append(x)
      if want_attn:
        attn.append(probs)
    x = self.final_norm(x)
    final = x if "final" in capture else None
    if not logits:
      return ModelOutput(None, tuple(hidden), tuple(attn), final)
    logits_BxTxV = self.embed.attend(x) if self.head is None else self.head(x)
    return ModelOutput(logits_BxTxV.astype(jnp.float32), tuple(hidden), tuple(attn), final)

  def head_weight(self) -> jax.Array:
    """The LM-head matrix as [D, V] (V split over ``tensor``)."""
    if self.head is None:
      return self.embed.embedding[...].T
    return self.head.kernel[...]


def _call_block(block: Block, x_BxTxD: jax.Array, want_probs: bool):
  return block(x_BxTxD, want_probs)


def _block_runner(remat: str):
  """``f(block, x, want_probs)`` running one block, under `nnx.remat` unless ``remat="none"``.

  Rematerialisation changes what the backward pass stores, never the values.
  """
  if remat == "none":
    return _call_block
  return nnx.remat(_call_block, policy=REMAT_POLICIES[remat], static_argnums=(2,))


def param_count(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
