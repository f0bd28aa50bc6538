"""The default recipe's per-token values and its gradient with respect to the student logits in ONE read of a chunk's
logits, in a Pallas kernel on a TPU (`kl_value_and_grad`).

The chunked loss (`meshdistill.losses._chunked`) forms each chunk's float32 logits of both models and then, in XLA,
makes two passes over them: the forward pass of `meshdistill.losses._fused` (its sums over V) and the backward one
(the logits' gradient, whose normalisers need every column first). Both passes read both chunks from HBM; on a TPU
v5e they are bound by that bandwidth. Here a grid step holds a block of rows of both chunks in on-chip memory and
sweeps it twice there (sums, then the gradient), so HBM is read once. The maxima and the plain logit sums (the
correlation's means) come in from XLA, which reduces them in the fusion that forms the logits.

Not the default (`ChunkedLogitKD.loss_kernel="xla"`): on a v5e chip the kernel is bound by its vector work, not by
the bytes it saves (the Qwen3 pair's 4 x 2048 step: 35.1 ms for its 8 runs a step against 30.7 ms for XLA's two passes,
the step 415 against 411 ms; ``benchmarks/results/tpu_step.md``). It is kept as the tested starting point of a
faster one (fewer vector operations per logit, wider column steps).

The values are those of `forward_kl_terms` and the gradient that of its ``loss`` sum, formed by the same formulas in
float32 (the sums in another order: equal within float32 rounding), masked tokens exactly 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from meshdistill.parallel.mesh import compiler_axes, target_platform

ROWS = 16  # rows of both chunks per grid step: a bfloat16 gradient's tile (16 sublanes)
LANES = 128  # columns per inner step: one lane tile
# the on-chip memory the kernel may use: two grid steps' blocks (the pipeline's double buffer) of both float32 chunks
# and the gradient; a v5e core has 128 MiB
VMEM_BYTES = 100 << 20
NAMES = ("kl", "ce", "teacher_ce", "corr", "agree", "loss")


def vmem_bytes(V: int, grad_itemsize: int = 2) -> int:
  """On-chip bytes of a grid step's double-buffered blocks for a vocabulary of ``V``."""
  return 2 * ROWS * V * (4 + 4 + grad_itemsize)


def kl_kernel_usable(V: int, grad_itemsize: int = 2) -> bool:
  """Whether `kl_value_and_grad` takes a vocabulary of ``V``: whole lane tiles and a block within `VMEM_BYTES`
  (V up to about 390k columns)."""
  return V % LANES == 0 and vmem_bytes(V, grad_itemsize) <= VMEM_BYTES - (4 << 20)


LOSS_KERNELS = ("xla", "pallas")  # `ChunkedLogitKD.loss_kernel`


def kl_kernel_applies(V: int, kernel: str = "pallas") -> bool:
  """Whether the chunked loss of the default recipe takes `kl_value_and_grad` for a vocabulary of ``V`` with
  ``loss_kernel=kernel``: ``pallas`` (on a TPU compiled, elsewhere interpreted: slow, for numerics checks) where the
  program being traced splits nothing over a compiler-managed mesh axis (the kernel's sums need every column of a row
  on its device) and V is `kl_kernel_usable`; ``xla`` never."""
  if kernel not in LOSS_KERNELS:
    raise ValueError(f"ChunkedLogitKD.loss_kernel={kernel!r}; choose one of {LOSS_KERNELS}")
  if kernel == "xla":
    return False
  mesh, free = compiler_axes()
  return all(mesh.shape[axis] == 1 for axis in free) and kl_kernel_usable(V)


def kl_token_value_and_grad(params, student_CxV, teacher_CxV, targets_C, mask_C, *, grad_dtype):
  """`kl_value_and_grad` as the chunk loop calls a token function's fused form (``params``: the recipe's
  ``temperature`` and ``alpha``; interpreted off a TPU). The gradient is written in ``grad_dtype`` (the head's), in
  bfloat16 where a TPU's default-precision matmuls would round a float32 one to it before reading it: half the bytes,
  the same products."""
  if target_platform() == "tpu" and jax.config.jax_default_matmul_precision in (None, "default", "bfloat16", "fastest"):
    grad_dtype = jnp.bfloat16
  return kl_value_and_grad(student_CxV, teacher_CxV, targets_C, mask_C, params["temperature"], params["alpha"],
                           grad_dtype=grad_dtype)


def _kernel(scalars_ref, rows_ref, s_ref, t_ref, terms_ref, d_ref, *, unroll):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  tau, alpha = scalars_ref[0], scalars_ref[1]
  R, V = s_ref.shape
  rows = rows_ref[...]  # [R, 8]: max s, max t, sum s, sum t, target, keep
  m_s, m_t = rows[:, 0:1], rows[:, 1:2]
  mean_s, mean_t = rows[:, 2:3] / V, rows[:, 3:4] / V
  target, keep = rows[:, 4:5].astype(jnp.int32), rows[:, 5:6]
  m_s_tau, m_t_tau = m_s / tau, m_t / tau  # divided, as `_fused._shifted` does (a product by 1 / tau rounds apart)
  lane = jax.lax.broadcasted_iota(jnp.int32, (R, LANES), 1)
  steps = V // LANES

  def columns(j):
    start = pl.multiple_of(j * LANES, LANES)
    return start, s_ref[:, pl.ds(start, LANES)], t_ref[:, pl.ds(start, LANES)]

  def sums(j, acc):
    start, s, t = columns(j)
    a_tau, b_tau = s / tau - m_s_tau, t / tau - m_t_tau
    a_1, b_1 = s - m_s, t - m_t
    e_t_tau = jnp.exp(b_tau)
    is_target = lane + start == target
    a_c, b_c = s - mean_s, t - mean_t
    terms = (
        jnp.exp(a_tau), e_t_tau, jnp.where(e_t_tau > 0, e_t_tau * (b_tau - a_tau), 0.0), jnp.exp(a_1),
        jnp.where(is_target, a_1, 0.0), jnp.exp(b_1), jnp.where(is_target, b_1, 0.0),
        jnp.where(jnp.logical_and(s >= m_s, t >= m_t), 1.0, 0.0), a_c * b_c, a_c * a_c, b_c * b_c,
    )
    return tuple(x + y for x, y in zip(acc, terms))

  zero = jnp.zeros((R, LANES), jnp.float32)
  acc = jax.lax.fori_loop(0, steps, sums, (zero,) * 11, unroll=unroll)
  (z_s_tau, z_t_tau, kl_num, z_s_1, s_target, z_t_1, t_target, n_top, cov, var_a, var_b) = (
      jnp.sum(x, axis=1, keepdims=True) for x in acc)

  in_vocab = jnp.logical_and(target >= 0, target < V)
  kl = kl_num / z_t_tau + (jnp.log(z_s_tau) - jnp.log(z_t_tau))
  ce = jnp.where(in_vocab, jnp.log(z_s_1) - s_target, 0.0)
  values = (kl, ce, jnp.where(in_vocab, jnp.log(z_t_1) - t_target, 0.0),
            cov / jnp.maximum(jnp.sqrt(var_a * var_b), 1e-12), jnp.where(n_top > 0, 1.0, 0.0),
            alpha * tau * tau * kl + (1.0 - alpha) * ce)
  out = zero
  for i, value in enumerate(values):
    out = jnp.where(lane == i, value, out)
  terms_ref[...] = jnp.where(keep > 0, out, 0.0)

  # the gradient of the loss sum: w_tau (p_s,tau - p_t,tau) + w_1 (p_s - onehot), 0 on masked tokens
  w_tau = jnp.where(keep > 0, alpha * tau, 0.0)
  w_1 = jnp.where(keep > 0, 1.0 - alpha, 0.0)
  inv_z_s_tau, inv_z_t_tau, inv_z_s_1 = 1.0 / z_s_tau, 1.0 / z_t_tau, 1.0 / z_s_1

  def gradient(j, carry):
    start, s, t = columns(j)
    p_s_tau = jnp.exp(s / tau - m_s_tau) * inv_z_s_tau
    p_t_tau = jnp.exp(t / tau - m_t_tau) * inv_z_t_tau
    p_s_1 = jnp.exp(s - m_s) * inv_z_s_1
    onehot = jnp.where(lane + start == target, 1.0, 0.0)
    d_ref[:, pl.ds(start, LANES)] = (w_tau * (p_s_tau - p_t_tau) + w_1 * (p_s_1 - onehot)).astype(d_ref.dtype)
    return carry

  jax.lax.fori_loop(0, steps, gradient, 0, unroll=unroll)


@functools.partial(jax.jit, static_argnames=("grad_dtype", "interpret", "unroll"))
def kl_value_and_grad(s_CxV, t_CxV, targets_C, keep_C, tau, alpha, *, grad_dtype=jnp.bfloat16,
                      interpret: bool | None = None, unroll: int = 4):
  """`forward_kl_terms`'s per-token values (``{name: [C]}``, float32, 0 where ``keep_C`` is False) and the gradient
  of their ``loss`` sum with respect to the student logits (``[C, V]`` in ``grad_dtype``), from float32 logits
  ``s_CxV`` (student) and ``t_CxV`` (teacher) read once. ``C`` is padded to whole blocks of `ROWS` (padded rows are
  masked); ``V`` must be `kl_kernel_usable`. ``tau``, ``alpha``: scalars (traced or not); no gradient flows through
  this function (it IS the gradient). ``interpret``: Pallas interpret mode (slow: for numerics checks off a TPU); None
  follows `target_platform`."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  C, V = s_CxV.shape
  itemsize = jnp.dtype(grad_dtype).itemsize
  if interpret is None:
    interpret = target_platform() != "tpu"
  if s_CxV.dtype != jnp.float32 or t_CxV.dtype != jnp.float32 or t_CxV.shape != (C, V):
    raise ValueError(f"kl_value_and_grad takes float32 [C, V] logits of both models, got {s_CxV.dtype}{s_CxV.shape} "
                     f"and {t_CxV.dtype}{t_CxV.shape}")
  if not kl_kernel_usable(V, itemsize):
    raise ValueError(f"kl_value_and_grad: a vocabulary of {V} is not usable (a multiple of {LANES}, a block of "
                     f"{ROWS} rows of both models within {VMEM_BYTES >> 20} MiB of on-chip memory); use the XLA path "
                     "(`forward_kl_terms`)")
  keep = keep_C.astype(jnp.float32)
  rows = jnp.stack([jnp.max(s_CxV, axis=1), jnp.max(t_CxV, axis=1), jnp.sum(s_CxV, axis=1), jnp.sum(t_CxV, axis=1),
                    targets_C.astype(jnp.float32), keep], axis=1)  # targets are exact in float32 below 2**24
  pad = -C % ROWS
  if pad:  # padded rows: keep 0, logits 0 (their values and gradient are written as 0 and dropped)
    s_CxV, t_CxV = (jnp.pad(x, ((0, pad), (0, 0))) for x in (s_CxV, t_CxV))
    rows = jnp.pad(rows, ((0, pad), (0, 0)))
  rows = jnp.pad(rows, ((0, 0), (0, 8 - rows.shape[1])))
  scalars = jnp.stack([jnp.asarray(tau, jnp.float32), jnp.asarray(alpha, jnp.float32)])
  n = (C + pad) // ROWS
  call = pl.pallas_call(
      functools.partial(_kernel, unroll=unroll),
      grid=(n,),
      in_specs=[
          pl.BlockSpec(memory_space=pltpu.SMEM),
          pl.BlockSpec((ROWS, 8), lambda i: (i, 0)),
          pl.BlockSpec((ROWS, V), lambda i: (i, 0)),
          pl.BlockSpec((ROWS, V), lambda i: (i, 0)),
      ],
      out_specs=[pl.BlockSpec((ROWS, LANES), lambda i: (i, 0)), pl.BlockSpec((ROWS, V), lambda i: (i, 0))],
      out_shape=[jax.ShapeDtypeStruct((n * ROWS, LANES), jnp.float32), jax.ShapeDtypeStruct((n * ROWS, V), grad_dtype)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_BYTES),
      interpret=interpret,
      name="kl_value_and_grad",
  )
  _, free = compiler_axes()
  if free:  # a Mosaic kernel is never auto-partitioned: manual over the mesh's axes (each of size 1 where it applies)
    call = jax.shard_map(call, in_specs=P(), out_specs=P(), axis_names=free, check_vma=False)
  terms, d = call(scalars, rows, s_CxV, t_CxV)
  return {name: terms[:C, i] for i, name in enumerate(NAMES)}, d[:C]


__all__ = ["LOSS_KERNELS", "kl_kernel_applies", "kl_value_and_grad", "kl_token_value_and_grad", "kl_kernel_usable"]
