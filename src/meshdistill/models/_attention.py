"""Attention kernels of the decoder: rotary position embedding (`rope`) and causal grouped-query attention with explicit
float32 scores (`_explicit_attention`) or the Pallas splash kernel (`splash_attention`: per device on its heads of a
``tensor``-split mesh, compiled or interpreted as the target platform says, `target_platform`); a decoded token's
cache write and attention in one Pallas kernel (`decode_in_kernel`, `meshdistill.models._decode_attention`).
`meshdistill.models.decoder.Attention` chooses among them. What a query may see besides causality (a decoding cache's
slots, packed documents): `meshdistill.models._visible`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math

import einops
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# The splash kernel runs per device in a shard_map over the mesh's auto axes and reads its own query heads by
# `axis_index` over `tensor`: a collective over named mesh axes (as `_context` and `moe`: the places in models/ that
# name them).
from meshdistill.parallel.mesh import DATA, TENSOR, compiler_axes, target_platform  # noqa: F401  (re-exported)
# Context parallelism: a device's slice of the sequence, its kernel chosen by its index along `context`.
from meshdistill.models._context import CONTEXT, ContextShard
from meshdistill.models import _decode_attention, _head_prep
from meshdistill.models._config import ATTENTION_RESIDUALS, RopeScaling
from meshdistill.models._variants import band, per_head_matmul, softcap
from meshdistill.models._visible import segment_mask

log = logging.getLogger(__name__)
_warned_interpret = False


@functools.lru_cache(maxsize=None)
def _rotate_half_KxK(K: int) -> np.ndarray:
  """The signed permutation ``m`` with ``x @ m = [-x2, x1]`` (``x1, x2`` the halves of ``x [.., K]``): built once
  per head size on the host, so a traced step embeds it as a constant instead of forming it in every layer."""
  half = K // 2
  m = np.zeros((K, K), np.float32)
  m[np.arange(half) + half, np.arange(half)] = -1.0
  m[np.arange(half), np.arange(half) + half] = 1.0
  return m


def rope_tables(positions: jax.Array, K: int, theta: float, scaling: RopeScaling | None = None):
  """RoPE's ``(cos, sin)`` at ``positions [...]``: ``[..., K]`` float32, each frequency for both halves of a head."""
  inv = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)  # [K/2]
  if scaling is not None:
    inv = scaling.apply(inv)
  ang = positions.astype(jnp.float32)[..., None] * inv
  ang = jnp.concatenate([ang, ang], axis=-1)
  return jnp.cos(ang), jnp.sin(ang)


def rope(
    x: jax.Array, theta: float, scaling: RopeScaling | None = None, positions_BxT: jax.Array | None = None,
    *, token_axis: int = 1,
) -> jax.Array:
  """Rotary position embedding on the last axis (rotate-half convention) of ``x``: ``[B, T, H, K]``, or
  ``[B, H, T, K]`` with ``token_axis=2`` (the splash kernel's head-major layout).

  Positions are ``0 .. T-1`` unless ``positions_BxT`` gives each row its own (left-padded decoding).
  """
  T, K = x.shape[token_axis], x.shape[-1]
  if positions_BxT is None:
    positions_BxT = jnp.arange(T, dtype=jnp.float32)[None]  # [1, T]
  cos, sin = rope_tables(positions_BxT, K, theta, scaling)  # [B | 1, T, K]
  cos, sin = (jnp.expand_dims(a, 2 if token_axis == 1 else 1) for a in (cos, sin))  # a unit head axis
  # rotate-half, [-x2, x1], as a signed [K, K] permutation on the MXU: exact (one +-1 per column, float32
  # accumulation; float32 inputs at HIGHEST precision), and lane-aligned where slicing K in halves of 64 is not
  # (XLA relaid every q and k out so on a TPU).
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  rotated = per_head_matmul(x, jnp.asarray(_rotate_half_KxK(K), x.dtype), precision)
  return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


def _explicit_attention(q_BxTxHxK, k_BxSxGxK, v_BxSxGxK, visible_Bx1xTxS=None, *, window=None, scale=None,
                        cap=None, segment_ids_BxT=None):
  """Causal grouped-query attention with explicit float32 scores: ``(out [B, T, H, K], probs [B, H, T, S])``.

  Query head ``h`` reads key/value head ``h // (H / G)``; the einsums run over the groups, so
  key/value heads are never copied. ``scale``: of the scores (default ``K ** -0.5``); ``cap``: scores soft-capped
  (`meshdistill.models._variants.softcap`) before the mask; ``window``: a sliding window when ``visible`` is not
  given (a cache's ``visible`` carries its own); ``segment_ids_BxT``: packed documents (`Segments`), each query
  seeing keys of its own document only.
  """
  G, K = k_BxSxGxK.shape[2], q_BxTxHxK.shape[-1]
  T, S = q_BxTxHxK.shape[1], k_BxSxGxK.shape[1]
  q_BxTxGxRxK = einops.rearrange(q_BxTxHxK, "b t (g r) k -> b t g r k", g=G)
  scores = jnp.einsum("btgrk,bsgk->bgrts", q_BxTxGxRxK, k_BxSxGxK).astype(jnp.float32)
  scores = softcap(scores / jnp.sqrt(K) if scale is None else scores * scale, cap)
  scores_BxHxTxS = einops.rearrange(scores, "b g r t s -> b (g r) t s")
  if visible_Bx1xTxS is None:
    rows_Tx1, cols_1xS = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    visible = (cols_1xS <= rows_Tx1) & band(rows_Tx1, cols_1xS, window)
    if segment_ids_BxT is not None:
      visible = visible & segment_mask(segment_ids_BxT)
  else:
    visible = visible_Bx1xTxS
  scores_BxHxTxS = jnp.where(visible, scores_BxHxTxS, jnp.finfo(jnp.float32).min)
  probs_BxHxTxS = jax.nn.softmax(scores_BxHxTxS, axis=-1)
  probs = einops.rearrange(probs_BxHxTxS.astype(v_BxSxGxK.dtype), "b (g r) t s -> b g r t s", g=G)
  out = jnp.einsum("bgrts,bsgk->btgrk", probs, v_BxSxGxK)
  return einops.rearrange(out, "b t g r k -> b t (g r) k"), probs_BxHxTxS


def splash_attention(q_BxHxTxK, k_BxGxTxK, v_BxGxTxK, segment_ids_BxT=None, context: ContextShard | None = None,
                     **options):
  """`_splash_attention` placed for the mesh in context: ``out [B, H, T, K]`` (head-major, as the kernel reads
  and writes: a decoder projects into this layout, so no step swaps heads and tokens).

  The kernel is a Pallas custom call that XLA cannot partition (the TPU compiler refuses to: "Mosaic
  kernels cannot be automatically partitioned"), so it runs in a nested ``shard_map`` manual over every
  mesh axis that is still compiler-managed -- in a layout's step (manual over ``data``, as
  `meshdistill.parallel.fsdp` writes its gathers) that is ``tensor``; under ``jax.set_mesh`` (evaluation) both.
  Each device runs it on its own query heads ``[i*H/t, (i+1)*H/t)`` of the ``tensor`` axis (size ``t``)
  and the key/value heads they read (``h // (H/G)``): its local ``tensor`` block when ``t`` divides
  ``G``; otherwise (the k/v projections replicated over ``tensor``, `ModelConfig.for_tensor`) the
  device slices its group out of the replicated keys and values. Rows are split over a
  compiler-managed ``data`` axis that divides them. Interpret mode follows `target_platform`.
  Without a mesh in context (one device, a plain ``jit``) or with every axis manual already (``pmap``) the
  kernel runs as it is. ``segment_ids_BxT``: packed documents (`Segments`), split over rows with the queries.
  ``options``: `_splash_attention`'s ``window``, ``scale`` and ``cap``. ``context``: this device's slice of the
  sequence (`ContextShard`): the keys and values are the whole row's (gathered), and the device runs the kernel whose
  causal mask starts at its offset, chosen by ``lax.switch`` on its index along ``context`` (one compiled kernel per
  position on the axis: a mask is a static block pattern); the row's segment ids are gathered for the keys.
  """
  interpret = target_platform() != "tpu"
  global _warned_interpret
  if interpret and not _warned_interpret:
    _warned_interpret = True
    log.warning(
        "attention='splash' on %s runs the Pallas kernel in interpret mode: slow, meant for numerics checks; "
        "use attention='auto' (or 'xla') off TPU", target_platform()
    )
  segments = () if segment_ids_BxT is None else (segment_ids_BxT,)
  attend = functools.partial(_splash_attention, interpret=interpret, **options)
  if context is not None:  # the kernel of this device's offset; the keys' ids are the row's
    segments += () if segment_ids_BxT is None else (context.gather(segment_ids_BxT, axis=1),)
    T = q_BxHxTxK.shape[2]

    def attend(q, k, v, *ids):  # noqa: F811
      branches = [functools.partial(_shifted_splash, offset=i * T, interpret=interpret, **options)
                  for i in range(context.ways)]
      return jax.lax.switch(jax.lax.axis_index(CONTEXT), branches, q, k, v, *ids)

  mesh, free = compiler_axes()
  if not free:
    return attend(q_BxHxTxK, k_BxGxTxK, v_BxGxTxK, *segments)
  B, H = q_BxHxTxK.shape[:2]
  G = k_BxGxTxK.shape[1]
  t = mesh.shape[TENSOR] if TENSOR in free else 1
  if H % t:
    raise ValueError(
        f"ModelConfig.attention='splash' on a mesh with tensor={t} runs each device's query heads on their own, "
        f"but tensor={t} does not divide n_heads={H}; use a tensor axis dividing {H} or attention='xla'"
    )
  heads, R = H // t, H // G  # query heads per device, query heads per key/value head
  kv_split = G % t == 0
  rows = DATA if DATA in free and B % mesh.shape[DATA] == 0 else None
  q_spec = P(rows, TENSOR if t > 1 else None)
  kv_spec = q_spec if kv_split else P(rows)

  def local(q_BxHlxTxK, k_BxGxTxK, v_BxGxTxK, *segment_ids_BxT):
    if not kv_split:  # replicated keys/values: this device's query heads read groups (i*heads + j) // R
      first = jax.lax.axis_index(TENSOR) * heads
      if R % heads == 0:  # all of them in one group (G divides t): its key/value head
        pick = lambda a: jax.lax.dynamic_slice_in_dim(a, first // R, 1, axis=1)  # noqa: E731
      else:  # groups cut by the split (t divides neither G nor H/G): one key/value head per query head
        pick = lambda a: jnp.take(a, (first + jnp.arange(heads)) // R, axis=1)  # noqa: E731
      k_BxGxTxK, v_BxGxTxK = pick(k_BxGxTxK), pick(v_BxGxTxK)
    return attend(q_BxHlxTxK, k_BxGxTxK, v_BxGxTxK, *segment_ids_BxT)

  return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec) + (P(rows),) * len(segments), out_specs=q_spec,
                       axis_names=free, check_vma=False)(q_BxHxTxK, k_BxGxTxK, v_BxGxTxK, *segments)


def _shifted_splash(q, k, v, *ids, offset: int, **options):
  """`_splash_attention` of queries starting at token ``offset`` of the row (``ids``: the queries' and the row's
  segment ids, or none)."""
  return _splash_attention(q, k, v, *ids[:1], offset=offset, kv_segment_ids_BxS=ids[1] if ids else None, **options)


def query_prescale(K: int, scale: float | None, dtype) -> float:
  """The factor `_splash_attention` scales the queries by (``1 / sqrt(K)``, or ``scale``, each rounded to the
  queries' ``dtype`` as it rounds them), for a producer that applies it first (`heads_in_kernel`'s ``post_scale``);
  the splash call then gets ``scale=1.0`` and applies nothing."""
  rounded = lambda c: float(np.asarray(c, np.dtype(dtype)))  # noqa: E731  (on the host: a constant)
  return 1.0 / rounded(np.sqrt(K)) if scale is None else rounded(scale)


def prep_in_kernel(T: int, K: int) -> bool:
  """Whether the splash path's queries and keys take `heads_in_kernel` (one Pallas kernel for their norm, RoPE and
  head-major layout): compiled for a TPU, lane-wide heads, and no compiler-managed mesh axis of more than one
  device (the kernel cannot be partitioned; there the XLA form stays)."""
  if target_platform() != "tpu":
    return False
  mesh, free = compiler_axes()
  return _head_prep.usable(T, K, tuple(mesh.shape[a] for a in free))


def heads_in_kernel(y_BxTxHK, n_heads: int, cos_TxK, sin_TxK, scale_K=None, eps: float = 0.0, post_scale=1.0):
  """`_head_prep.norm_rope_heads` where `prep_in_kernel` said so: in a ``shard_map`` manual over the mesh's
  compiler-managed axes (all of size 1 there; the TPU compiler refuses a Mosaic kernel under any of them)."""
  fn = functools.partial(_head_prep.norm_rope_heads, n_heads=n_heads, eps=eps, post_scale=post_scale)
  _, free = compiler_axes()
  if not free:
    return fn(y_BxTxHK, cos_TxK=cos_TxK, sin_TxK=sin_TxK, scale_K=scale_K)
  args = (y_BxTxHK, cos_TxK, sin_TxK) + (() if scale_K is None else (scale_K,))
  local = lambda y, c, s, *w: fn(y, cos_TxK=c, sin_TxK=s, scale_K=w[0] if w else None)  # noqa: E731
  return jax.shard_map(local, in_specs=(P(),) * len(args), out_specs=P(), axis_names=free, check_vma=False)(*args)


def _decode_split(mesh, free, B: int, G: int):
  """``(rows, heads)``: the mesh axes a decoding kernel's rows and key/value heads are split over, per device, in the
  ``shard_map`` of `decode_in_kernel` (``data`` where it divides the rows, ``tensor`` where it divides the heads, as
  `meshdistill.models.generate` places the caches); None where another compiler-managed axis has more than one
  device or ``data`` / ``tensor`` split what they do not divide (XLA's attention keeps such caches)."""
  rows = DATA if DATA in free and mesh.shape[DATA] > 1 else None
  heads = TENSOR if TENSOR in free and mesh.shape[TENSOR] > 1 else None
  if any(mesh.shape[a] > 1 for a in free if a not in (rows, heads)):
    return None
  if (rows and B % mesh.shape[DATA]) or (heads and G % mesh.shape[TENSOR]):
    return None
  return rows, heads


def decodes_with_kernel(attention: str, platform: str) -> bool:
  """Whether a model of this ``attention`` decodes through the decoding kernel on ``platform`` where its caches allow
  (`decodes_in_kernel`): ``auto`` on a TPU, ``splash`` anywhere (interpreted off a TPU, as the splash kernel is)."""
  return attention == "splash" or (attention == "auto" and platform == "tpu")


def decodes_in_kernel(attention: str, cache, T: int, want_probs: bool) -> bool:
  """Whether a decoding call writes its token's key and value and attends in one Pallas kernel
  (`_decode_attention.decode_attention`): one token against caches its caller placed for a kernel per device
  (``cache.kernel``: whole on one device, or rows over ``data`` and key/value heads over ``tensor`` of the mesh in
  context, `_decode_split`) in the kernel's tiles (`_decode_attention.usable`), no probabilities captured, and the
  model's ``attention`` ``auto`` compiled for a TPU or ``splash`` (off a TPU interpreted, as the splash kernel is:
  for checks)."""
  if not (cache.kernel and T == 1 and not want_probs and decodes_with_kernel(attention, target_platform())):
    return False
  mesh, free = compiler_axes()
  B, G, S, K = cache.k.shape
  return _decode_split(mesh, free, B, G) is not None and _decode_attention.usable(S, cache.k.dtype.itemsize, K)


def decode_in_kernel(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, cache, *, window=None, scale=None, cap=None):
  """``(out [B, 1, H, K], cache)``: `_decode_attention.decode_attention` where `decodes_in_kernel` said so, the
  token's key and value written into ``cache`` (a `KVCache`) by the kernel; in a ``shard_map`` manual over the mesh's
  compiler-managed axes, each device on its rows and key/value heads (`_decode_split`; a query head reads its
  group's key/value head, so the queries split with them)."""
  B, _, H, K = q_BxTxHxK.shape
  G = k_BxTxGxK.shape[2]
  scale = K**-0.5 if scale is None else scale
  fn = functools.partial(_decode_attention.decode_attention, scale=scale, cap=cap, window=window,
                         interpret=target_platform() != "tpu")
  args = (q_BxTxHxK.reshape(B, G, H // G, K), k_BxTxGxK.reshape(B, G, K), v_BxTxGxK.reshape(B, G, K), cache.k,
          cache.v, cache.valid_BxS, jnp.asarray(cache.index, jnp.int32))
  mesh, free = compiler_axes()
  if free:
    rows, heads = _decode_split(mesh, free, B, G)
    split = P(rows, heads)
    fn = jax.shard_map(fn, in_specs=(split,) * 5 + (P(rows), P()), out_specs=(split,) * 3, axis_names=free,
                       check_vma=False)
  out, k, v = fn(*args)
  return out.reshape(B, 1, H, K), cache._replace(k=k, v=v)


# the blocks `splash_blocks` puts in place of `splash_block_sizes` while a program is traced inside it (None: the
# package's own)
_BLOCKS: contextvars.ContextVar = contextvars.ContextVar("splash_blocks", default=None)


@contextlib.contextmanager
def splash_blocks(sizes):
  """The splash kernel's blocks for the attention traced inside this context: ``sizes(T, *, itemsize, head_dim,
  capped)`` returns the kernel's ``BlockSizes`` (as `splash_block_sizes`, which it replaces). A program traced
  before, or after the context ends, keeps the package's own. For timing other blocks on a chip
  (`benchmarks/tpu_step.py`'s ``blocks=`` setting); the package's blocks are the ones its tests check."""
  if not callable(sizes):
    raise TypeError(f"splash_blocks takes a function (T, *, itemsize, head_dim, capped) -> BlockSizes, got {sizes!r}")
  token = _BLOCKS.set(sizes)
  try:
    yield
  finally:
    _BLOCKS.reset(token)


def splash_block_sizes(T: int, *, itemsize: int = 2, head_dim: int = 128, capped: bool = False):
  """The splash kernel's blocks for sequence length ``T`` and inputs of ``itemsize`` bytes, ``head_dim`` and a
  soft-cap of the scores or not: queries in blocks of ``gcd(T, 512)`` tokens, keys and values read in blocks of
  ``gcd(T, 1024)`` and computed ``gcd(T, 512)`` at a time; the fused backward kernel (dq accumulated in the dk/dv
  pass instead of a pass of its own) on blocks of ``gcd(T, 1024)`` queries and keys where they fit the kernel's
  16 MiB of scoped on-chip memory on a v5e, ``gcd(T, 512)`` elsewhere.

  Fit (compiled for a v5e with libtpu, T = 2048, `tests/test_on_chip_support.py`): 1024-token backward blocks
  fit bfloat16 inputs of head_dim <= 128 and bfloat16 ones of head_dim 256 without a soft-cap; a soft-cap at
  head_dim 256 needs 17.4 MiB, float32 inputs 17-42 MiB (at 'highest' matmul precision, or head_dim 256 with a
  soft-cap). 512-token blocks fit all of these.
  Why these: on a v5e the fused backward kernel on 1024-token blocks was the fastest backward timed on the heads of
  Qwen3, Llama 3.2 and Gemma 3, and the forward blocks tried gained too little to take (the timings:
  `benchmarks/results/tpu_step.md`, "Changes to the code")."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=g-import-not-at-top

  q, kv = math.gcd(T, 512), math.gcd(T, 1024)
  fits = itemsize <= 2 and (head_dim <= 128 or not capped)
  bwd = kv if fits else q
  return splash.BlockSizes(
      block_q=q, block_kv=kv, block_kv_compute=q, block_q_dkv=bwd, block_kv_dkv=bwd, block_kv_dkv_compute=bwd,
      use_fused_bwd_kernel=True,
  )


def _splash_attention(q_BxHxTxK, k_BxGxTxK, v_BxGxTxK, segment_ids_BxT=None, interpret: bool | None = None, *,
                      window: int | None = None, scale: float | None = None, cap: float | None = None,
                      offset: int = 0, kv_segment_ids_BxS=None):
  """Causal grouped-query attention with the Pallas splash kernel on the heads given, head-major:
  ``out [B, H, T, K]`` from queries ``[B, H, T, K]`` and keys/values ``[B, G, T, K]``.

  The kernel's multi-query form (one key/value head shared by ``H / G`` query heads) is vmapped
  over batch and key/value groups, so key/value heads are never copied. ``interpret``: Pallas
  interpret mode (slow: for numerics checks off TPU); None follows `target_platform`. Blocks: `splash_block_sizes` (or
  those of `splash_blocks`); ``T`` must be a multiple of 128 (the kernel's lane width). The decoder calls it through
  `splash_attention`, which splits heads over ``tensor``. ``window``: the kernel's local mask (a query sees itself and
  the ``window - 1`` keys before it); ``scale``: of the scores (default ``K ** -0.5``, applied to the queries); ``cap``:
  the kernel's soft-cap of the scores. ``segment_ids_BxT``: packed documents (`Segments`): the kernel's own segment ids
  (a query sees keys of its segment only), one row's for all its heads. Context parallelism (`ContextShard`): keys
  and values of the whole row ``[B, G, S, K]``, the queries those of tokens ``offset .. offset + T`` of it (the mask
  shifted so), ``kv_segment_ids_BxS`` the row's segment ids (default: ``segment_ids_BxT``, keys and queries alike).
  """
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=g-import-not-at-top

  B, H, T, K = q_BxHxTxK.shape
  G, S = k_BxGxTxK.shape[1], k_BxGxTxK.shape[2]
  if T % 128:
    raise ValueError(
        f"ModelConfig.attention='splash' needs a sequence length that is a multiple of 128, got {T}; "
        "pad the sequence or use attention='xla'"
    )
  if interpret is None:
    interpret = target_platform() != "tpu"
  itemsize = max(jnp.dtype(x.dtype).itemsize for x in (q_BxHxTxK, k_BxGxTxK, v_BxGxTxK))
  sizes = (_BLOCKS.get() or splash_block_sizes)(T, itemsize=itemsize, head_dim=K, capped=cap is not None)
  one = (splash.CausalMask((T, S), offset=offset) if window is None
         else splash.LocalMask((T, S), (window - 1, 0), offset=offset))
  mask = splash.MultiHeadMask([one for _ in range(H // G)])
  q_BxGxRxTxK = q_BxHxTxK.reshape(B, G, H // G, T, K)  # query heads in their groups: a free reshape
  if scale is None:
    q_BxGxRxTxK = q_BxGxRxTxK / jnp.sqrt(K).astype(q_BxHxTxK.dtype)
  elif not (isinstance(scale, (int, float)) and scale == 1.0):  # 1.0: queries scaled already (`heads_in_kernel`)
    q_BxGxRxTxK = q_BxGxRxTxK * jnp.asarray(scale, q_BxHxTxK.dtype)

  def run(q, k, v, *ids):
    # The kernel is made inside the function that runs it: it holds its mask's block tables as arrays, created in
    # the trace that makes it, so each trace (the custom_vjp of `_at_default_precision`, a remat's recomputation)
    # gets its own instead of reading another's (an escaped tracer).
    kernel = splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret,
                                                  attn_logits_soft_cap=cap,
                                                  residual_checkpoint_name=ATTENTION_RESIDUALS)
    if not ids:
      return jax.vmap(jax.vmap(kernel))(q, k, v)
    per_row = lambda q, k, v, ids, kv_ids: jax.vmap(  # noqa: E731  (each row's ids for every group of its heads)
        lambda q, k, v: kernel(q, k, v, segment_ids=splash.SegmentIds(q=ids, kv=kv_ids)))(q, k, v)
    return jax.vmap(per_row)(q, k, v, ids[0], ids[-1])

  if itemsize <= 2 and jax.config.jax_default_matmul_precision not in (None, "default", "bfloat16", "fastest"):
    run = _at_default_precision(run)
  ids = () if segment_ids_BxT is None else (segment_ids_BxT,) + (() if kv_segment_ids_BxS is None else
                                                                  (kv_segment_ids_BxS,))
  out = run(q_BxGxRxTxK, k_BxGxTxK, v_BxGxTxK, *ids)
  return out.reshape(B, H, T, K).astype(v_BxGxTxK.dtype)


def _at_default_precision(fn):
  """``fn`` (the splash kernel on bfloat16 inputs) traced at the default matmul precision, its backward pass too
  (`jax.vjp` in the forward rule, its function called in the backward one): under a higher
  `jax.default_matmul_precision` Mosaic refuses a bfloat16 product ("Bad lhs type"; "Unsupported dot precision:
  HIGH"), and for bfloat16 operands it would mean nothing more (their products are exact in the float32
  accumulator)."""
  @jax.custom_vjp
  def run(*args):
    with jax.default_matmul_precision("default"):
      return fn(*args)

  def forward(*args):
    with jax.default_matmul_precision("default"):
      return jax.vjp(fn, *args)

  def backward(vjp_fn, g):
    with jax.default_matmul_precision("default"):
      return vjp_fn(g)

  run.defvjp(forward, backward)
  return run
