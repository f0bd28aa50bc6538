"""One decoder block and its sublayers: `Attention` (grouped-query attention over the kernels of
`meshdistill.models._attention`), `MLP` (SwiGLU / GeGLU) and `Block` (pre-norms, the two sublayers, their optional
post-norms and the residual adds; a mixture-of-experts MLP, `meshdistill.models.moe.MoE`, in place of the dense one
on its layers). Each returns a `BlockOutput` (`meshdistill.models._output`). `meshdistill.models.decoder.Decoder`
stacks the blocks; their weights' logical names are the table in its docstring.
"""

from __future__ import annotations

import einops
import jax
import jax.numpy as jnp
from flax import nnx

from meshdistill.parallel.rules import annotate
from meshdistill.models._attention import (_explicit_attention, decode_in_kernel, decodes_in_kernel, heads_in_kernel,
                                          prep_in_kernel, query_prescale, rope, rope_tables, splash_attention)
from meshdistill.models._config import ModelConfig
from meshdistill.models._context import ContextShard
from meshdistill.models._output import BlockOutput
from meshdistill.models._visible import KVCache, Segments, segment_mask
from meshdistill.models._variants import gate_activation, head_norm, head_norm_scale, norm, post_norm
from meshdistill.models.moe import MoE


def _per_token(layer, x_BxTxD: jax.Array) -> jax.Array:
  """``layer`` (a Linear, or the tied head's ``attend``) on ``[..., D]`` as ONE ``[N, D]`` matmul. Its weight
  gradient then contracts one token axis; contracting ``[B, T]`` makes XLA's CPU dot copy the activation
  gradient into a transposed layout first (a third of the one-device step's time went to such copies)."""
  return layer(x_BxTxD.reshape(-1, x_BxTxD.shape[-1])).reshape(*x_BxTxD.shape[:-1], -1)


def _heads_out(layer, out, heads: str) -> jax.Array:
  """The attention's output projection ``layer`` (a Linear, weight ``[H * K, D]``) on its output ``out`` laid out as
  ``heads`` (``"b h t k"`` or ``"b t h k"``): ``[B, T, D]``. Head-major (the splash kernel's layout), a plain
  projection contracts heads and head_dim in ONE einsum with its weight seen as ``[H, K, D]``: the TPU compiler reads
  the heads in place, where ``[B, H, T, K] -> [B, T, H * K]`` first would be a copy of the whole output (and another
  of its gradient). A projection qwix rewrote (LoRA adapters, quantized or fake-quantized weights: it marks each
  module it rewrites with ``qwix_path``) computes through its own call, on the rearranged output, as every layout
  does. Same values either way (the same products, summed in the matmul's order)."""
  if heads == "b h t k" and getattr(layer, "qwix_path", None) is None:
    kernel = layer.kernel[...]
    out, kernel, _ = layer.promote_dtype((out, kernel, None), dtype=layer.dtype)
    return jnp.einsum("bhtk,hkd->btd", out, kernel.reshape(out.shape[1], out.shape[3], -1),
                      precision=layer.precision, preferred_element_type=layer.preferred_element_type)
  return _per_token(layer, einops.rearrange(out, f"{heads} -> b t (h k)"))


def _heads_in(layer, x_BxTxD, heads: str, head_dim: int) -> jax.Array:
  """A projection ``layer`` (weight ``[D, H * K]``) of ``x`` to heads laid out as ``heads``; head-major and plain (see
  `_heads_out`), ONE einsum with the weight seen as ``[D, H, K]``, written head-major by the matmul."""
  if heads == "b h t k" and getattr(layer, "qwix_path", None) is None:
    kernel = layer.kernel[...]
    bias = layer.bias[...] if layer.bias is not None else None
    x_BxTxD, kernel, bias = layer.promote_dtype((x_BxTxD, kernel, bias), dtype=layer.dtype)
    out = jnp.einsum("btd,dhk->bhtk", x_BxTxD, kernel.reshape(kernel.shape[0], -1, head_dim),
                     precision=layer.precision, preferred_element_type=layer.preferred_element_type)
    return out if bias is None else out + bias.reshape(-1, 1, head_dim)
  return einops.rearrange(_per_token(layer, x_BxTxD), f"b t (h k) -> {heads}", k=head_dim)


def _dtypes(cfg: ModelConfig) -> dict:
  """The nnx layers' dtypes: compute in ``cfg.dtype``, weights stored in ``cfg.param_dtype`` (cast where used)."""
  return {"dtype": cfg.compute_dtype, "param_dtype": cfg.weight_dtype}


def _part(init, *names):
  """``init`` with logical dimension names (`meshdistill.parallel.rules`: the layout maps them to mesh axes)."""
  return annotate(init, *names)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
    self.cfg = cfg
    self.window, self.theta, self.scaling = cfg.layer_attention(layer)  # sliding window, RoPE of this layer
    init = nnx.initializers.lecun_normal()
    D, H, KV, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.hd
    lin = lambda i, o, names, bias=False: nnx.Linear(  # noqa: E731
        i, o, use_bias=bias, kernel_init=_part(init, *names), bias_init=_part(nnx.initializers.zeros, names[1]),
        **_dtypes(cfg), rngs=rngs
    )
    self.q = lin(D, H * K, ("embed", "heads"), cfg.qkv_bias)
    kv_split = ("embed", "kv_replicated") if cfg.replicate_kv else ("embed", "kv_heads")
    self.k = lin(D, KV * K, kv_split, cfg.qkv_bias)
    self.v = lin(D, KV * K, kv_split, cfg.qkv_bias)
    self.o = lin(H * K, D, ("heads", "embed"))
    # per-head RMSNorm over head_dim with ``qk_norm`` (scales [K] replicated); None without
    self.q_norm = norm(cfg, K, rngs, "head_dim") if cfg.qk_norm else None
    self.k_norm = norm(cfg, K, rngs, "head_dim") if cfg.qk_norm else None

  def __call__(self, x_BxTxD: jax.Array, want_probs: bool, cache: KVCache | None = None,
               segments: Segments | None = None) -> BlockOutput:
    """`BlockOutput` with the output ``x`` ``[B, T, D]``, the attention probabilities ``probs`` when
    ``want_probs`` (None from a kernel that forms none: `ModelConfig.kernel` picks ``explicit`` for them), and with a
    ``cache`` (decoding) the updated ``cache``: the new keys/values are written at ``cache.index`` and the queries see
    the cache's valid slots up to their own.
    ``segments``: rows packed from several documents (`Segments`): every kernel attends within a document only and
    RoPE takes each token's position within its document. Under context parallelism (the step's rows split over
    the mesh's ``context`` axis, `ContextShard`) the keys and values of the whole row are gathered first and every
    mask compares global token indices."""
    cfg = self.cfg
    kind = cfg.kernel(x_BxTxD.shape[1], probs=want_probs, decoding=cache is not None)  # `auto`: splash on a TPU
    shard = ContextShard.here(x_BxTxD.shape[1]) if cache is None else None  # this device's slice of the sequence
    # The splash kernel reads and writes heads before tokens: the projections' outputs are laid out so from the
    # start (XLA writes the matmul in that layout), their norms and RoPE computed there, and no copy swaps them.
    heads = "b h t k" if kind == "splash" else "b t h k"
    T = x_BxTxD.shape[1]
    query_scale = cfg.query_scale
    if kind == "splash" and cache is None and prep_in_kernel(T, cfg.hd):  # one Pallas kernel each (`_head_prep`)
      stream = jnp.arange(T) if shard is None else shard.positions(T)[0]  # a slice's: its global positions
      cos, sin = rope_tables(stream if segments is None else segments.positions_BxT, cfg.hd, self.theta,
                             self.scaling)  # [T, K], or [B, T, K] for packed documents
      dtype = x_BxTxD.dtype
      q, k = (
          heads_in_kernel(_per_token(p, x_BxTxD), n, cos, sin, head_norm_scale(nm, dtype) if nm else None,
                          nm.epsilon if nm else 0.0, post)
          for p, n, nm, post in ((self.q, cfg.n_heads, self.q_norm, query_prescale(cfg.hd, query_scale, dtype)),
                                 (self.k, cfg.n_kv_heads, self.k_norm, 1.0)))
      v = _heads_in(self.v, x_BxTxD, heads, cfg.hd)
      query_scale = 1.0  # the queries left the kernel scaled as the splash path scales them
    else:
      q, k, v = (einops.rearrange(_per_token(p, x_BxTxD), f"b t (h k) -> {heads}", k=cfg.hd)
                 for p in (self.q, self.k, self.v))
      if cfg.qk_norm:
        q, k = head_norm(self.q_norm, q), head_norm(self.k_norm, k)
      pos = cache.positions_BxT if cache is not None else None if segments is None else segments.positions_BxT
      if pos is None and shard is not None:  # one stream's slice: its tokens' global positions
        pos = shard.positions(T)
      axis = heads.split().index("t")
      q, k = (rope(a, self.theta, self.scaling, pos, token_axis=axis) for a in (q, k))
    if cache is not None and decodes_in_kernel(cfg.attention, cache, T, want_probs):  # write and attend at once
      out, cache = decode_in_kernel(q, k, v, cache, window=self.window, scale=cfg.query_scale, cap=cfg.attn_softcap)
      return BlockOutput(_heads_out(self.o, out, heads), cache=cache)
    if cache is not None:
      cache = cache.write(k, v)
      k, v = cache.attended()
    visible = None if cache is None else cache.visible(T, self.window)  # [B, 1, T, S]
    options = {"window": self.window, "scale": query_scale, "cap": cfg.attn_softcap}
    ids = None if segments is None or cache is not None else segments.ids_BxT  # packed documents: within one only
    if shard is not None:  # the whole row's keys and values; causal mask, window and documents on global indices
      k, v = (shard.gather(a, axis=heads.split().index("t")) for a in (k, v))
    if shard is not None and kind not in ("explicit", "splash"):  # in blocks of queries: never the whole scores
      attend = lambda q_b, visible_b: jax.nn.dot_product_attention(  # noqa: E731
          q_b, k, v, mask=visible_b, implementation=kind, scale=cfg.query_scale).astype(v.dtype)
      out, probs_BxHxTxS = shard.attend(attend, q, self.window, ids), None
    elif kind == "explicit":
      if shard is not None:
        visible, ids = shard.visible(T, self.window, ids), None
      out, probs_BxHxTxS = _explicit_attention(q, k, v, visible, segment_ids_BxT=ids, **options)
    elif kind == "splash":
      out, probs_BxHxTxS = splash_attention(q, k, v, ids, context=shard, **options), None
    else:  # the causal mask and window are the kernel's; packed documents add their [B, 1, T, T] mask
      window = None if self.window is None or visible is not None else (self.window - 1, 0)
      mask = visible if ids is None else segment_mask(ids)
      out = jax.nn.dot_product_attention(
          q, k, v, mask=mask, is_causal=visible is None, implementation=kind, scale=cfg.query_scale,
          local_window_size=window,
      ).astype(v.dtype)
      probs_BxHxTxS = None
    out = _heads_out(self.o, out, heads)
    return BlockOutput(out, cache=cache, probs=probs_BxHxTxS if want_probs else None)


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    D, F = cfg.d_model, cfg.mlp_hidden
    lin = lambda i, o, names: nnx.Linear(  # noqa: E731
        i, o, use_bias=False, kernel_init=_part(init, *names), **_dtypes(cfg), rngs=rngs
    )
    self.gate = lin(D, F, ("embed", "mlp"))
    self.up = lin(D, F, ("embed", "mlp"))
    self.down = lin(F, D, ("mlp", "embed"))
    self.act = gate_activation(cfg)

  def __call__(self, x_BxTxD) -> BlockOutput:
    """`BlockOutput` with the output ``x`` only (the `MoE` in its place also reports its routing, ``aux``)."""
    x_NxD = x_BxTxD.reshape(-1, x_BxTxD.shape[-1])  # one token axis: see `_per_token`
    return BlockOutput(self.down(self.act(self.gate(x_NxD)) * self.up(x_NxD)).reshape(x_BxTxD.shape))


class Block(nnx.Module):
  """``block(x, want_probs) -> BlockOutput``: ``x`` the residual stream after the block, ``probs`` its attention's
  (`Attention`), ``aux`` its MLP's (a mixture of experts' `meshdistill.models.moe.Routing`, None from a dense MLP),
  with a ``cache`` (decoding) the updated ``cache``. ``layer``: its index (its window and RoPE); ``sparse``: the MLP is
  a mixture of experts (`meshdistill.models.moe.MoE`). The norms of the sublayers' outputs (``post_norms``) are
  declared either way: None without them."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0, sparse: bool = False):
    self.attn_norm = norm(cfg, cfg.d_model, rngs)
    self.attn = Attention(cfg, rngs=rngs, layer=layer)
    self.mlp_norm = norm(cfg, cfg.d_model, rngs)
    self.mlp = MoE(cfg, rngs=rngs) if sparse else MLP(cfg, rngs=rngs)
    # on each sublayer's output, before the residual add (Gemma 2 / 3)
    self.post_attn_norm = norm(cfg, cfg.d_model, rngs) if cfg.post_norms else None
    self.post_mlp_norm = norm(cfg, cfg.d_model, rngs) if cfg.post_norms else None

  def __call__(self, x_BxTxD, want_probs: bool, cache: KVCache | None = None,
               segments: Segments | None = None) -> BlockOutput:
    a = self.attn(self.attn_norm(x_BxTxD), want_probs, cache, segments)
    x_BxTxD = x_BxTxD + post_norm(self.post_attn_norm, a.x)
    h_BxTxD = self.mlp_norm(x_BxTxD)
    if isinstance(self.mlp, MoE) and self.mlp.moe.capacity_factor is not None:  # padding would take experts' places
      m = self.mlp(h_BxTxD, _not_padding(cache, segments, x_BxTxD.shape[1]))
    else:
      m = self.mlp(h_BxTxD)
    x_BxTxD = x_BxTxD + post_norm(self.post_mlp_norm, m.x)
    return BlockOutput(x_BxTxD, cache=a.cache, probs=a.probs, aux=m.aux)


def _not_padding(cache: KVCache | None, segments: Segments | None, T: int) -> jax.Array | None:
  """``[B, T]``: this call's tokens that are not padding, where the block knows: a decoding call's slots
  (``cache.valid_BxS`` from ``cache.index``), packed documents' ids (0 on padding); else None."""
  if cache is not None:
    return jax.lax.dynamic_slice_in_dim(cache.valid_BxS, cache.index, T, axis=1)
  return None if segments is None else segments.ids_BxT > 0
