"""The queries' and keys' way into the splash kernel on a TPU: per-head RMSNorm, RoPE and the head-major layout in
one Pallas kernel (`norm_rope_heads`), its backward pass in another.

The splash kernel reads ``[B, H, T, K]`` (each head's tokens contiguous), a projection writes ``[B, T, H * K]``
(each token's heads contiguous). Written in XLA (`einops.rearrange`, `head_norm`, `rope`), the TPU compiler formed
the projection token-major and copied it twice to reach the kernel's layout, with the norm's and RoPE's float32
products between the copies, in the forward pass and again in the backward one (what those copies cost, and what
this kernel saves, on a TPU v5e: `benchmarks/results/tpu_step.md`, "Changes to the code"). Here a kernel reads whole
rows of the projection (head ``h`` in lanes ``h K .. (h + 1) K``), normalises and rotates each head in on-chip
memory, scales the queries for the scores, and writes each head where the splash kernel reads it; the backward kernel
reads the incoming gradient head-major and writes the projection's gradient token-major, where its weight-gradient
matmul reads it. A grid step takes whole rows (as many heads as fit 4 KiB of a row) rather than one head's 128 lanes,
which would be a strided read.

The values are `head_norm` then `rope`'s, roundings included: the normalised heads are rounded to the input's dtype
before the rotation (as `head_norm` returns them), and in the backward pass the rotation's gradient is rounded so
before the norm's. RoPE's rotate-half is a roll by ``K / 2`` lanes with the signs of ``[-x2, x1]``: for a shift of
half the lanes the roll's direction does not matter. Needs ``K`` a multiple of 128 (the lane width) and ``T`` a
multiple of 8; the decoder uses it only where it runs the splash kernel on a TPU (`usable`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def usable(T: int, K: int, free_axis_sizes: tuple[int, ...]) -> bool:
  """Whether `norm_rope_heads` applies: lane-wide heads, sequences in whole sublane tiles, and every
  compiler-managed mesh axis of size 1 (the kernel is a Mosaic call that XLA cannot partition; with an axis to
  split over, the decoder keeps the XLA form)."""
  return K % 128 == 0 and T % 8 == 0 and all(n == 1 for n in free_axis_sizes)


def _blocks(T: int, H: int, K: int, itemsize: int) -> tuple[int, int]:
  """Tokens and heads per grid step: ``gcd(T, 256)`` tokens and as many whole heads as fit 4 KiB of each row, so
  that a step reads whole rows of the projection (contiguous, where one head's 128 lanes of each row were a strided
  read at under half the chip's bandwidth) and the backward kernel's six buffers stay near 6 MiB of the 16 MiB of
  scoped on-chip memory."""
  heads = max(h for h in range(1, H + 1) if H % h == 0 and (h == 1 or h * K * itemsize <= 4096))
  return math.gcd(T, 256), heads


def _rotate_half(x, K: int):
  """``[-x2, x1]`` of each row of ``x [rows, K]``: a roll by half the lanes, the first half negated."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.where(lane < K // 2, -1.0, 1.0) * pltpu.roll(x, K // 2, 1)


def _table(ref):
  """A block of RoPE's table, ``[tokens, K]``: shared by the rows, or this row's (``[1, tokens, K]`` blocks of
  packed documents' per-row positions)."""
  return ref[0] if len(ref.shape) == 3 else ref[...]


def _forward_kernel(y_ref, s_ref, cos_ref, sin_ref, out_ref, *, K, eps, norm, dtype, post):
  cos, sin, s = _table(cos_ref), _table(sin_ref), s_ref[...]
  for h in range(out_ref.shape[1]):  # the block's heads: lanes h K .. (h + 1) K of its rows
    x = y_ref[0, :, h * K:(h + 1) * K].astype(jnp.float32)
    if norm:
      r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
      x = (x * r * s).astype(dtype).astype(jnp.float32)  # `head_norm` returns the input's dtype
    out = x * cos + _rotate_half(x, K) * sin
    if post != 1.0:  # the queries' score scale, after `rope`'s rounding (as the splash path multiplies them)
      out = out.astype(dtype).astype(jnp.float32) * post
    out_ref[0, h] = out.astype(out_ref.dtype)


def _backward_kernel(y_ref, g_ref, s_ref, cos_ref, sin_ref, dy_ref, ds_ref, *, K, eps, norm, dtype, post):
  cos, sin, s = _table(cos_ref), _table(sin_ref), s_ref[...]
  ds = jnp.zeros((1, K), jnp.float32)
  for h in range(g_ref.shape[1]):
    g = g_ref[0, h].astype(jnp.float32)
    if post != 1.0:
      g = (g * post).astype(dtype).astype(jnp.float32)
    # the rotation's transpose: d n = g cos + R^T (g sin), R^T z = -R z for the signed permutation R
    dn = g * cos - _rotate_half(g * sin, K)
    if norm:
      dn = dn.astype(dtype).astype(jnp.float32)  # the gradient of `head_norm`'s output, in its dtype
      x = y_ref[0, :, h * K:(h + 1) * K].astype(jnp.float32)
      r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
      ds = ds + jnp.sum(dn * x * r, axis=0, keepdims=True)
      dxs = dn * s
      dn = r * dxs - x * (r * r * r) * jnp.mean(x * dxs, axis=-1, keepdims=True)
    dy_ref[0, :, h * K:(h + 1) * K] = dn.astype(dy_ref.dtype)
  ds_ref[0] = ds


def _specs(B, H, T, K, itemsize, per_row: bool = False):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  bt, hb = _blocks(T, H, K, itemsize)
  n_t, n_h = T // bt, H // hb
  token_major = pl.BlockSpec((1, bt, hb * K), lambda b, t, g: (b, t, g))
  head_major = pl.BlockSpec((1, hb, bt, K), lambda b, t, g: (b, g, t, 0))
  table = (pl.BlockSpec((1, bt, K), lambda b, t, g: (b, t, 0)) if per_row  # each row's positions (packed documents)
           else pl.BlockSpec((bt, K), lambda b, t, g: (t, 0)))
  scale = pl.BlockSpec((1, K), lambda b, t, g: (0, 0))
  partial = pl.BlockSpec((1, 1, K), lambda b, t, g: ((b * n_t + t) * n_h + g, 0, 0))
  return (B, n_t, n_h), token_major, head_major, table, scale, partial


def _cost(y, arrays: int, grid, T: int, K: int, norm: bool):
  """What XLA's cost analysis (and the planner's HBM term, `meshdistill.planner`) counts for a kernel: ``arrays``
  passes over the projection's bytes (forward: read, write; backward: two reads, a write) and the tables it reads
  once per batch row and head group; about 12 elementwise operations per element, one square root per row with a
  norm."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  tables = 2 * T * K * 4 * grid[0] * grid[2]
  return pl.CostEstimate(flops=12 * y.size, transcendentals=(y.size // K) if norm else 0,
                         bytes_accessed=arrays * y.size * y.dtype.itemsize + tables)


def _forward(y, s, cos, sin, H, eps, norm, post, interpret):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  B, T, HK = y.shape
  K = HK // H
  grid, token_major, head_major, table, scale, _ = _specs(B, H, T, K, y.dtype.itemsize, cos.ndim == 3)
  kernel = functools.partial(_forward_kernel, K=K, eps=eps, norm=norm, dtype=y.dtype, post=post)
  return pl.pallas_call(
      kernel, grid=grid, in_specs=[token_major, scale, table, table], out_specs=head_major,
      out_shape=jax.ShapeDtypeStruct((B, H, T, K), y.dtype), interpret=interpret, name="norm_rope_heads",
      cost_estimate=_cost(y, 2, grid, T, K, norm),
  )(y, s, cos, sin)


def _backward(y, g, s, cos, sin, H, eps, norm, post, interpret):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  B, T, HK = y.shape
  K = HK // H
  grid, token_major, head_major, table, scale, partial = _specs(B, H, T, K, y.dtype.itemsize, cos.ndim == 3)
  kernel = functools.partial(_backward_kernel, K=K, eps=eps, norm=norm, dtype=y.dtype, post=post)
  n = grid[0] * grid[1] * grid[2]
  dy, ds = pl.pallas_call(
      kernel, grid=grid, in_specs=[token_major, head_major, scale, table, table], out_specs=[token_major, partial],
      out_shape=[jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct((n, 1, K), jnp.float32)],
      interpret=interpret, name="norm_rope_heads_bwd", cost_estimate=_cost(y, 3, grid, T, K, norm),
  )(y, g, s, cos, sin)
  return dy, ds.sum(axis=(0, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _norm_rope_heads(y, s, cos, sin, H, eps, norm, post, interpret):
  return _forward(y, s, cos, sin, H, eps, norm, post, interpret)


def _fwd(y, s, cos, sin, H, eps, norm, post, interpret):
  return _forward(y, s, cos, sin, H, eps, norm, post, interpret), (y, s, cos, sin)


def _bwd(H, eps, norm, post, interpret, res, g):
  y, s, cos, sin = res
  dy, ds = _backward(y, g, s, cos, sin, H, eps, norm, post, interpret)
  return dy, ds.reshape(s.shape).astype(s.dtype), jnp.zeros_like(cos), jnp.zeros_like(sin)


_norm_rope_heads.defvjp(_fwd, _bwd)


def norm_rope_heads(y_BxTxHK: jax.Array, n_heads: int, cos_TxK: jax.Array, sin_TxK: jax.Array,
                    scale_K: jax.Array | None = None, eps: float = 1e-6, post_scale: float = 1.0, *,
                    interpret: bool = False) -> jax.Array:
  """``rope(head_norm(q))`` (or ``rope(q)`` without ``scale_K``) of the projection ``y [B, T, H * K]``, as
  ``[B, H, T, K]`` in ``y``'s dtype.

  ``cos_TxK``, ``sin_TxK``: RoPE's tables (`meshdistill.models._attention.rope_tables`; constants: no gradient),
  ``[T, K]`` for every row or ``[B, T, K]``, each row's own (rows packed from several documents: RoPE restarts at
  each, `meshdistill.models._visible.Segments`);
  ``scale_K``: the norm's float32 scale as it multiplies (`meshdistill.models._variants.head_norm_scale`), None for
  no norm; ``eps``: the norm's epsilon; ``post_scale``: a factor applied last, to the result rounded to ``y``'s
  dtype (the queries' score scale, which the splash kernel then need not apply). Gradients flow to ``y`` and ``scale_K``. ``interpret``: Pallas interpret
  mode (any backend; for checks).
  """
  B, T, HK = y_BxTxHK.shape
  K = HK // n_heads
  norm = scale_K is not None
  s = (scale_K if norm else jnp.ones((K,), jnp.float32)).astype(jnp.float32).reshape(1, K)
  cos, sin = jax.lax.stop_gradient(cos_TxK), jax.lax.stop_gradient(sin_TxK)
  return _norm_rope_heads(y_BxTxHK, s, cos.astype(jnp.float32), sin.astype(jnp.float32), n_heads, float(eps), norm,
                          float(post_scale), interpret)


__all__ = ["norm_rope_heads", "usable"]
