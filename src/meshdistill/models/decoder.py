"""A Llama-style decoder-only transformer in Flax NNX; its weights name their dimensions with logical names.

Blocks: pre-RMSNorm, rotary position embedding (RoPE), grouped-query attention,
SwiGLU MLP (or, with ``ModelConfig.moe``, a mixture of SwiGLU experts: `meshdistill.models.moe`); tied or untied LM
head.

Weights carry logical dimension names (`meshdistill.parallel.rules`); the layout's rules table maps them to mesh
axes (the tensor-parallel table's axis in the last column):

==========================  ================  ======================  ===================
weight                      shape             logical names           ``tensor`` splits
==========================  ================  ======================  ===================
embedding                   [V', D]           vocab, embed            V' (padded to a multiple of tensor)
attention q                 [D, H*Hd]         embed, heads            heads
attention k / v             [D, G*Hd]         embed, kv_heads         heads (``kv_replicated``: G < tensor)
attention out               [H*Hd, D]         heads, embed            heads
q / k / v biases            [H*Hd] / [G*Hd]   heads / kv_heads        heads
q / k norm scales           [Hd]              head_dim                --
MLP gate / up               [D, F]            embed, mlp              F (hidden units)
MLP down                    [F, D]            mlp, embed              F
MoE router                  [D, E]            embed, --               --
MoE experts gate / up       [E, D, F]         experts, embed, mlp     F (E over ``expert``)
MoE experts down            [E, F, D]         experts, mlp, embed     F (E over ``expert``)
untied LM head              [D, V']           embed, vocab            V'
norm scales                 [D]               embed                   --
==========================  ================  ======================  ===================

(``ModelConfig.for_tensor`` pads and replicates; the decoder cuts the padding off its outputs, in the full
forward pass and in `Decoder.decode_step`, the cached decoding pass `meshdistill.models.generate` runs.)
With ``mesh.fsdp`` the layout's table splits ``embed`` over ``data`` as well and the decoder
gathers a module's weights where it runs it (`meshdistill.parallel.fsdp.gathered`: per block, inside remat).
So the logits ``[B, T, V]`` come out split over ``tensor`` along V. On request
(``capture=``) the forward pass also returns per-layer hidden states and attention
probabilities; capturing never changes parameters or module state. With ``ModelConfig.scan_layers``
``blocks`` is one `Block` whose weights are stacked ``[L, ...]`` (logical name ``layers``, unsplit), run under
``nnx.scan`` (`meshdistill.models._scan`) with the same per-block runner as the unrolled loop.

This module holds the modules (`Decoder`, `Block`, `Attention`, `MLP`) and `ModelOutput`;
`ModelConfig`, `RopeScaling`, `ATTENTION` and `REMAT_POLICIES` live in `meshdistill.models._config`,
the attention kernels, `rope` and `KVCache` in `meshdistill.models._attention` (all importable from here).
"""

from __future__ import annotations

from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp
from flax import nnx

from meshdistill.parallel.fsdp import gathered, gathered_call, gathered_for
from meshdistill.parallel.rules import annotate
from meshdistill.models._attention import (KVCache, Segments, _explicit_attention, heads_in_kernel, prep_in_kernel,
                                          query_prescale, rope, rope_tables, segment_mask, splash_attention)
from meshdistill.models._config import ATTENTION, REMAT_POLICIES, ModelConfig, RopeScaling
from meshdistill.models._context import ContextShard
from meshdistill.models._scan import layer_blocks, save_all_but_casts, scan_blocks, stacked_blocks
from meshdistill.models._variants import gate_activation, head_norm, head_norm_scale, norm, scale_embed, softcap
from meshdistill.models.moe import MoE, Routing

__all__ = [
    "ATTENTION",
    "CAPTURABLE",
    "REMAT_POLICIES",
    "Attention",
    "Block",
    "Decoder",
    "KVCache",
    "MLP",
    "ModelConfig",
    "ModelOutput",
    "RopeScaling",
    "Segments",
    "param_count",
    "rope",
]

CAPTURABLE = ("hidden", "attn", "final", "router")


class ModelOutput(NamedTuple):
  """Forward-pass result.

  ``logits``: [B, T, V] (V split over ``tensor``), ``None`` when called with ``logits=False``;
  ``hidden``: (L+1) x [B, T, D] (embeddings, then after each block); ``attn``: L x
  [B, H, T, T] attention probabilities; ``final``: [B, T, D] final-norm output, the
  input of the LM head (see `Decoder.head_weight`); ``router``: one `meshdistill.models.moe.Routing` per
  mixture-of-experts layer (router logits [B, T, E], dropped assignments [B, T]). Uncaptured entries are empty/None.
  """

  logits: jax.Array | None
  hidden: tuple = ()
  attn: tuple = ()
  final: jax.Array | None = None
  router: tuple = ()


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
    if cfg.qk_norm:  # per-head RMSNorm over head_dim, scales [K] replicated
      self.q_norm, self.k_norm = norm(cfg, K, rngs, "head_dim"), norm(cfg, K, rngs, "head_dim")

  def __call__(self, x_BxTxD: jax.Array, want_probs: bool, cache: KVCache | None = None,
               segments: Segments | None = None):
    """``(output, attention probabilities or None)``; with a ``cache`` (decoding), ``(output, updated cache)``:
    the new keys/values are written at ``cache.index`` and the queries see the cache's valid slots up to their own.
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
          for p, n, nm, post in ((self.q, cfg.n_heads, getattr(self, "q_norm", None),
                                  query_prescale(cfg.hd, query_scale, dtype)),
                                 (self.k, cfg.n_kv_heads, getattr(self, "k_norm", None), 1.0)))
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
    if cache is not None:
      cache = cache.write(k, v)
      k, v = cache.k, cache.v
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
    if cache is not None:
      return out, cache
    return out, (probs_BxHxTxS if want_probs else None)


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

  def __call__(self, x_BxTxD):
    x_NxD = x_BxTxD.reshape(-1, x_BxTxD.shape[-1])  # one token axis: see `_per_token`
    return self.down(self.act(self.gate(x_NxD)) * self.up(x_NxD)).reshape(x_BxTxD.shape)


class Block(nnx.Module):
  """``block(x, want_probs) -> (x, attention probabilities or None, Routing or None)``; with a ``cache``
  (decoding) ``(x, updated cache)``. ``layer``: its index (its window and RoPE); ``sparse``: the MLP is a mixture of
  experts (`meshdistill.models.moe.MoE`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0, sparse: bool = False):
    self.attn_norm = norm(cfg, cfg.d_model, rngs)
    self.attn = Attention(cfg, rngs=rngs, layer=layer)
    self.mlp_norm = norm(cfg, cfg.d_model, rngs)
    self.mlp = MoE(cfg, rngs=rngs) if sparse else MLP(cfg, rngs=rngs)
    if cfg.post_norms:  # on each sublayer's output, before the residual add (Gemma 2 / 3)
      self.post_attn_norm, self.post_mlp_norm = norm(cfg, cfg.d_model, rngs), norm(cfg, cfg.d_model, rngs)

  def __call__(self, x_BxTxD, want_probs: bool, cache: KVCache | None = None, segments: Segments | None = None):
    a, probs = self.attn(self.attn_norm(x_BxTxD), want_probs, cache, segments)  # with a cache: (a, updated cache)
    x_BxTxD = x_BxTxD + (self.post_attn_norm(a) if hasattr(self, "post_attn_norm") else a)
    m, routing = self.mlp(self.mlp_norm(x_BxTxD)), None
    if isinstance(m, tuple):  # a mixture of experts: (output, Routing)
      m, routing = m
    x_BxTxD = x_BxTxD + (self.post_mlp_norm(m) if hasattr(self, "post_mlp_norm") else m)
    return (x_BxTxD, probs) if cache is not None else (x_BxTxD, probs, routing)


class Decoder(nnx.Module):
  """Decoder-only LM. ``model(tokens_BxT, capture=("hidden", "attn")) -> ModelOutput``.

  Rows packed from several documents (``data.packing: documents``) pass ``segment_ids`` ``[B, T]`` (1, 2, ... per
  document, 0 on padding) and optionally ``positions`` ``[B, T]`` (each token's index in its document; derived from
  the ids when not given, `Segments.of`): attention then stays within a document and RoPE restarts at each,
  so a packed row's logits are those of its documents run one by one.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(
        cfg.padded_vocab,
        cfg.d_model,
        # std 1/sqrt(D): with a tied head the initial logits then have unit scale
        embedding_init=_part(nnx.initializers.normal(stddev=cfg.d_model**-0.5), "vocab", "embed"),
        **_dtypes(cfg),
        rngs=rngs,
    )
    if cfg.scan_layers:  # one Block whose weights are stacked [L, ...] (see `meshdistill.models._scan`)
      self.blocks = stacked_blocks(lambda r: Block(cfg, rngs=r, sparse=_sparse(cfg, 0)), cfg.n_layers, rngs)
    else:
      self.blocks = nnx.List([Block(cfg, rngs=rngs, layer=i, sparse=_sparse(cfg, i)) for i in range(cfg.n_layers)])
    self.final_norm = norm(cfg, cfg.d_model, rngs)
    if cfg.tie_embeddings:
      self.head = nnx.data(None)
    else:
      self.head = nnx.Linear(
          cfg.d_model,
          cfg.padded_vocab,
          use_bias=False,
          kernel_init=_part(nnx.initializers.lecun_normal(), "embed", "vocab"),
          **_dtypes(cfg),
          rngs=rngs,
      )

  def __call__(
      self, tokens_BxT: jax.Array, *, capture: tuple[str, ...] = (), logits: bool = True,
      segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
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
    segments = Segments.of(tokens_BxT, segment_ids, positions)
    want_hidden, want_attn, want_router = "hidden" in capture, "attn" in capture, "router" in capture
    x = scale_embed(cfg, gathered(self.embed)(tokens_BxT))
    hidden, attn, router = [x] if want_hidden else [], [], []
    runner = _block_runner("none" if cfg.remat == "auto" else cfg.remat, cfg.scan_layers)  # auto: the Distiller's
    run_block = lambda block, x, want_probs: runner(block, x, want_probs, segments)  # noqa: E731
    if cfg.scan_layers:  # the same run_block on each layer's slice of the stacked blocks
      x, hidden_L, attn_L, router_L = scan_blocks(self.blocks, x, run_block, want_hidden, want_attn, want_router,
                                                  cfg.scan_period, _place)
      hidden, attn, router = hidden + list(hidden_L), list(attn_L), list(router_L)
    else:
      for block in self.blocks:
        x, probs, routing = run_block(block, x, want_attn)
        if want_hidden:
          hidden.append(x)
        if want_attn:
          attn.append(probs)
        if want_router and routing is not None:
          router.append(routing)
    final_norm, x = gathered_for(self.final_norm, x)
    x = final_norm(x)
    final = x if "final" in capture else None
    return ModelOutput(self._logits(x) if logits else None, tuple(hidden), tuple(attn), final, tuple(router))

  def _logits(self, final_BxTxD: jax.Array) -> jax.Array:
    """float32 logits ``[B, T, V]`` of final-norm outputs (V split over ``tensor``, vocabulary padding cut off)."""
    head, x = gathered_for(self.embed if self.head is None else self.head, final_BxTxD)
    logits_BxTxV = _per_token(head.attend if self.head is None else head, x)
    if self.cfg.padded_vocab != self.cfg.vocab_size:  # padding rows never reach a loss or a sampler
      logits_BxTxV = logits_BxTxV[..., : self.cfg.vocab_size]  # (XLA keeps the shards padded)
    return softcap(logits_BxTxV.astype(jnp.float32), self.cfg.final_softcap)  # elementwise: per vocabulary shard

  def empty_cache(self, batch: int, slots: int, sharding=None):
    """Zero key/value caches for `decode_step`: one pair ``(k_BxSxGxK, v_BxSxGxK)`` per layer (scanned blocks
    too: decoding runs their layers unrolled, `layer_blocks`), each placed with ``sharding`` (e.g. rows
    over ``data``) when given."""
    cfg = self.cfg

    def zeros():
      z = jnp.zeros((batch, slots, cfg.n_kv_heads, cfg.hd), cfg.compute_dtype)
      return z if sharding is None else jax.lax.with_sharding_constraint(z, sharding)

    return [(zeros(), zeros()) for _ in range(cfg.n_layers)]

  def decode_step(self, tokens_BxT, kv, valid_BxS, index, positions_BxT, *, last_only: bool = False):
    """The forward pass of ``tokens_BxT`` against a key/value cache: ``(logits float32 [B, T or 1, V], new kv)``.

    The same blocks and LM head as `__call__` (and the same vocabulary cut: ids ``>= vocab_size`` never
    appear), with this call's keys/values written into cache slots ``index ..`` (`KVCache`). ``kv``: from
    `empty_cache` or the previous call; ``valid_BxS`` must already mark this call's slots; ``positions_BxT``:
    each row's RoPE positions. ``last_only``: the logits of the last position only (``[B, 1, V]``). The layers run
    unrolled, scanned blocks included (`layer_blocks`).
    """
    x = scale_embed(self.cfg, gathered(self.embed)(tokens_BxT))
    blocks = layer_blocks(self.blocks, _place) if self.cfg.scan_layers else self.blocks  # stacked: static slices
    if len(kv) != len(blocks):
      raise ValueError(f"{len(kv)} key/value caches for {len(blocks)} layers: one (k, v) pair per layer "
                       "(Decoder.empty_cache)")
    new_kv = []
    for block, (k, v) in zip(blocks, kv):
      x, cache = block(x, False, KVCache(k, v, valid_BxS, index, positions_BxT))
      new_kv.append((cache.k, cache.v))
    final_norm, x = gathered_for(self.final_norm, x[:, -1:] if last_only else x)
    return self._logits(final_norm(x)), new_kv

  def head_weight(self) -> jax.Array:
    """The LM-head matrix as [D, V] (V split over ``tensor``; padding rows cut off)."""
    w_DxV = gathered(self.embed).embedding[...].T if self.head is None else gathered(self.head).kernel[...]
    return w_DxV[:, : self.cfg.vocab_size] if self.cfg.padded_vocab != self.cfg.vocab_size else w_DxV


def _sparse(cfg: ModelConfig, layer: int) -> bool:
  """Whether layer ``layer`` of a decoder of ``cfg`` is a mixture-of-experts block."""
  return cfg.moe is not None and cfg.moe.sparse(layer)


def _place(block: Block, layer: int) -> None:
  """Makes ``block`` (a slice of scanned blocks, built as layer 0) attend as layer ``layer``: its sliding window and
  RoPE, static values (`ModelConfig.layer_attention`; the weights of every layer have one structure)."""
  attn = block.attn
  attn.window, attn.theta, attn.scaling = attn.cfg.layer_attention(layer)


def _call_block(block: Block, x_BxTxD: jax.Array, want_probs: bool, segments: Segments | None = None):
  # Weights split over `data` (`meshdistill.parallel.fsdp`) are gathered here, inside the block's remat region.
  block, x_BxTxD = gathered_for(block, x_BxTxD)
  return block(x_BxTxD, want_probs, segments=segments)


def _block_runner(remat: str, scanned: bool = False):
  """``f(block, x, want_probs, segments)`` running one block, under `nnx.remat` unless ``remat="none"``.

  Rematerialisation changes what the backward pass stores, never the values. A scanned block with
  ``remat="none"`` keeps everything but its dtype casts (`save_all_but_casts`): what a scan keeps for the
  backward pass is stacked over layers, and the compute-dtype copies of the weights would be a second copy.
  """
  if remat == "none" and scanned:
    return nnx.remat(_call_block, policy=save_all_but_casts, static_argnums=(2,))
  if remat == "none":
    return _call_block
  rematted = nnx.remat(_call_block, policy=REMAT_POLICIES[remat], static_argnums=(2,))
  if remat != "full":
    return rematted

  def run(block, x_BxTxD, want_probs, segments=None):  # weights split over `data`: gathered again in the backward
    out = gathered_call(_plain_call, block, x_BxTxD, want_probs, segments)  # pass, in order
    return rematted(block, x_BxTxD, want_probs, segments) if out is None else out

  return run


def _plain_call(block: Block, x_BxTxD: jax.Array, want_probs: bool, segments: Segments | None = None):
  return block(x_BxTxD, want_probs, segments=segments)


def param_count(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
