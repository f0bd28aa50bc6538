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

This module holds `Decoder`, the runners of its blocks and `ModelOutput`; the block and its sublayers (`Block`,
`Attention`, `MLP`) live in `meshdistill.models._block`, what each returns (`BlockOutput`) in
`meshdistill.models._output`, `ModelConfig`, `RopeScaling`, `ATTENTION` and `REMAT_POLICIES` in
`meshdistill.models._config`, the attention kernels, `rope` and `KVCache` in `meshdistill.models._attention` (all
importable from here).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from meshdistill.parallel.fsdp import gathered, gathered_call, gathered_for
from meshdistill.models._attention import rope
from meshdistill.models._visible import KVCache, Segments
from meshdistill.models._block import MLP, Attention, Block, _dtypes, _part, _per_token
from meshdistill.models._config import ATTENTION, REMAT_POLICIES, ModelConfig, RopeScaling
from meshdistill.models._output import BlockOutput
from meshdistill.models._scan import layer_blocks, save_all_but_casts, scan_blocks, stacked_blocks
from meshdistill.models._variants import norm, scale_embed, softcap

__all__ = [
    "ATTENTION",
    "CAPTURABLE",
    "REMAT_POLICIES",
    "Attention",
    "Block",
    "BlockOutput",
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


class Decoder(nnx.Module):
  """Decoder-only LM. ``model(tokens_BxT, capture=("hidden", "attn")) -> ModelOutput``.

  Rows packed from several documents (``data.packing: documents``) pass ``segment_ids`` ``[B, T]`` (1, 2, ... per
  document, 0 on padding) and optionally ``positions`` ``[B, T]`` (each token's index in its document; derived from
  the ids when not given, `Segments.of`): attention then stays within a document and RoPE restarts at each,
  so a packed row's logits are those of its documents run one by one.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg = cfg.with_scan()  # `scan_layers: auto` decided for the platform the model is built for
    self.cfg = cfg
    self.embed = nnx.Embed(
        cfg.padded_vocab,
        cfg.d_model,
        # std 1/sqrt(D): with a tied head the initial logits then have unit scale
        embedding_init=_part(nnx.initializers.normal(stddev=cfg.d_model**-0.5), "vocab", "embed"),
        **_dtypes(cfg),
        rngs=rngs,
    )
    if cfg.scanned:  # one Block whose weights are stacked [L, ...] (see `meshdistill.models._scan`)
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
    runner = _block_runner("none" if cfg.remat == "auto" else cfg.remat, cfg.scanned)  # auto: the Distiller's
    run_block = lambda block, x, want_probs: runner(block, x, want_probs, segments)  # noqa: E731
    if cfg.scanned:  # the same run_block on each layer's slice of the stacked blocks
      x, hidden_L, attn_L, router_L = scan_blocks(self.blocks, x, run_block, want_hidden, want_attn, want_router,
                                                  cfg.scan_period, _place)
      hidden, attn, router = hidden + list(hidden_L), list(attn_L), list(router_L)
    else:
      for block in self.blocks:
        out = run_block(block, x, want_attn)
        x = out.x
        if want_hidden:
          hidden.append(x)
        if want_attn:
          attn.append(out.probs)
        if want_router and out.aux is not None:  # a dense block reports no routing
          router.append(out.aux)
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
    """Zero key/value caches for `decode_step`: one pair ``(k_BxGxSxK, v_BxGxSxK)`` per layer (`KVCache`; scanned
    blocks too: decoding runs their layers unrolled, `layer_blocks`), each placed with ``sharding`` (e.g. rows
    over ``data``) when given."""
    cfg = self.cfg

    def zeros():
      z = jnp.zeros((batch, cfg.n_kv_heads, slots, cfg.hd), cfg.compute_dtype)
      return z if sharding is None else jax.lax.with_sharding_constraint(z, sharding)

    return [(zeros(), zeros()) for _ in range(cfg.n_layers)]

  def decode_step(self, tokens_BxT, kv, valid_BxS, index, positions_BxT, *, last_only: bool = False,
                  kernel: bool = False):
    """The forward pass of ``tokens_BxT`` against a key/value cache: ``(logits float32 [B, T or 1, V], new kv)``.

    The same blocks and LM head as `__call__` (and the same vocabulary cut: ids ``>= vocab_size`` never
    appear), with this call's keys/values written into cache slots ``index ..`` (`KVCache`). ``kv``: from
    `empty_cache` or the previous call; ``valid_BxS`` must already mark this call's slots, and the slots it covers
    (the first ``valid_BxS.shape[1]``, a cache may hold more) are the ones attended to; ``positions_BxT``:
    each row's RoPE positions. ``last_only``: the logits of the last position only (``[B, 1, V]``). ``kernel``: the
    caches are placed per device (whole on one, or rows over ``data`` and key/value heads over ``tensor`` of the mesh
    in context), so a one-token call may write its keys and values and attend in one Pallas kernel per layer
    (`meshdistill.models._attention.decodes_in_kernel`: with ``attention`` ``auto`` on a TPU). The layers run
    unrolled, scanned blocks included (`layer_blocks`).
    """
    x = scale_embed(self.cfg, gathered(self.embed)(tokens_BxT))
    blocks = layer_blocks(self.blocks, _place) if self.cfg.scanned else self.blocks  # stacked: static slices
    if len(kv) != len(blocks):
      raise ValueError(f"{len(kv)} key/value caches for {len(blocks)} layers: one (k, v) pair per layer "
                       "(Decoder.empty_cache)")
    new_kv = []
    for block, (k, v) in zip(blocks, kv):
      out = block(x, False, KVCache(k, v, valid_BxS, index, positions_BxT, kernel))
      x = out.x
      new_kv.append((out.cache.k, out.cache.v))
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


def _call_block(block: Block, x_BxTxD: jax.Array, want_probs: bool,
                segments: Segments | None = None) -> BlockOutput:
  # Weights split over `data` (`meshdistill.parallel.fsdp`) are gathered here, inside the block's remat region.
  block, x_BxTxD = gathered_for(block, x_BxTxD)
  return block(x_BxTxD, want_probs, segments=segments)


def _block_runner(remat: str, scanned: bool = False):
  """``f(block, x, want_probs, segments) -> BlockOutput`` running one block, under `nnx.remat` unless
  ``remat="none"``.

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


def _plain_call(block: Block, x_BxTxD: jax.Array, want_probs: bool,
                segments: Segments | None = None) -> BlockOutput:
  return block(x_BxTxD, want_probs, segments=segments)


def param_count(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
