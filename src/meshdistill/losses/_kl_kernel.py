"""The default recipe's per-token values and its gradient with respect to the student logits in ONE read of a chunk's
logits, in a Pallas kernel on a TPU (`kl_value_and_grad`).

The chunked loss (`meshdistill.losses._chunked`) forms each chunk's float32 logits of both models and then, in XLA,
makes two passes over them: the forward pass of `meshdistill.losses._fused` (its sums over V) and the backward one
(the logits' gradient, whose normalisers need every column first). Both passes read both chunks from HBM; on a TPU
v5e they are bound by that bandwidth. Here a grid step holds a block of rows of both chunks in on-chip memory and
sweeps it twice there (sums, then the gradient), so HBM is read once. The maxima and the plain logit sums (the
correlation's means) and the logits at the target ids come in from XLA, which reduces them in the fusion that forms
the logits.

The default on a TPU (`ChunkedLogitKD.loss_kernel="auto"`). On a v5e chip a form with a division per logit was
bound by its vector work, so here a logit costs few vector operations: the shifted logits are ``(s - max s) / tau``
as a product by ``1 / tau`` (no division per element), each softmax's normaliser is folded into its row's weight of
the gradient, and no column is compared with the target ids in the sums (``benchmarks/loss_kernel.py`` and
``benchmarks/results/tpu_step.md``: its time against XLA's passes). Elsewhere the loss stays in XLA (interpreted,
the kernel is for numerics checks only).

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
LOSS_NAMES = ("kl", "ce", "loss")  # what the gradient and a metrics-light step need
NAMES = LOSS_NAMES + ("teacher_ce", "corr", "agree")  # the order of the values' lanes


def vmem_bytes(V: int, grad_itemsize: int = 2) -> int:
  """On-chip bytes of a grid step's double-buffered blocks for a vocabulary of ``V``."""
  return 2 * ROWS * V * (4 + 4 + grad_itemsize)


def kl_kernel_usable(V: int, grad_itemsize: int = 2) -> bool:
  """Whether `kl_value_and_grad` takes a vocabulary of ``V``: whole lane tiles and a block within `VMEM_BYTES`
  (V up to about 390k columns)."""
  return V % LANES == 0 and vmem_bytes(V, grad_itemsize) <= VMEM_BYTES - (4 << 20)


LOSS_KERNELS = ("auto", "xla", "pallas")  # `ChunkedLogitKD.loss_kernel`


def kl_kernel_applies(V: int, kernel: str = "pallas", platform: str | None = None, head_dtype=jnp.bfloat16) -> bool:
  """Whether the chunked loss of the default recipe takes `kl_value_and_grad` for a vocabulary of ``V`` with
  ``loss_kernel=kernel``: ``pallas`` (on a TPU compiled, elsewhere interpreted: slow, for numerics checks) where the
  program being traced splits nothing over a compiler-managed mesh axis (the kernel's sums need every column of a row
  on its device) and V is `kl_kernel_usable` with the gradient in the dtype the chunk loop has it written in for a
  head of ``head_dtype``; ``auto`` (the default) likewise where that program is compiled for a TPU (``platform``;
  None: `target_platform`), else not; ``xla`` never."""
  if kernel not in LOSS_KERNELS:
    raise ValueError(f"ChunkedLogitKD.loss_kernel={kernel!r}; choose one of {LOSS_KERNELS}")
  if kernel == "xla" or (kernel == "auto" and (platform or target_platform()) != "tpu"):
    return False
  mesh, free = compiler_axes()
  return all(mesh.shape[axis] == 1 for axis in free) and kl_kernel_usable(V, _grad_dtype(head_dtype).itemsize)


def _grad_dtype(head_dtype) -> jnp.dtype:
  """The dtype a chunk's logits gradient is written in for a head of ``head_dtype``: bfloat16 where a TPU's
  default-precision matmuls would round a float32 one to it before reading it (half the bytes, the same products),
  else the head's."""
  if target_platform() == "tpu" and jax.config.jax_default_matmul_precision in (None, "default", "bfloat16", "fastest"):
    return jnp.dtype(jnp.bfloat16)
  return jnp.dtype(head_dtype)


def kl_token_value_and_grad(params, student_CxV, teacher_CxV, targets_C, mask_C, *, grad_dtype, metrics=True):
  """`kl_value_and_grad` as the chunk loop calls a token function's fused form (``params``: the recipe's
  ``temperature`` and ``alpha``; interpreted off a TPU), the gradient written in `_grad_dtype` of ``grad_dtype``
  (the head's)."""
  return kl_value_and_grad(student_CxV, teacher_CxV, targets_C, mask_C, params["temperature"], params["alpha"],
                           grad_dtype=_grad_dtype(grad_dtype), metrics=metrics)


def _kernel(scalars_ref, rows_ref, s_ref, t_ref, terms_ref, d_ref, *, unroll, metrics):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  tau, inv_tau, alpha = scalars_ref[0], scalars_ref[1], scalars_ref[2]
  R, V = s_ref.shape
  rows = rows_ref[...]  # [R, 8]: max s, max t, mean s, mean t, target, keep, s and t at the target less their max
  wide = lambda x: jnp.broadcast_to(x, (R, LANES))  # noqa: E731  (a row's number over a lane tile, formed once)
  m_s, m_t, mean_s, mean_t = (wide(rows[:, i:i + 1]) for i in range(4))
  target, keep = rows[:, 4:5].astype(jnp.int32), rows[:, 5:6]
  lane = jax.lax.broadcasted_iota(jnp.int32, (R, LANES), 1)
  steps = V // LANES

  def columns(j):
    start = pl.multiple_of(j * LANES, LANES)
    s, t = s_ref[:, pl.ds(start, LANES)], t_ref[:, pl.ds(start, LANES)]
    return start, s, t, s - m_s, t - m_t  # the logits shifted by their row's maximum (<= 0)

  def sums(j, acc):
    _, s, t, a_1, b_1 = columns(j)
    a_tau, b_tau = a_1 * inv_tau, b_1 * inv_tau
    e_t_tau = jnp.exp(b_tau)
    terms = (jnp.exp(a_tau), e_t_tau, jnp.where(e_t_tau > 0, e_t_tau * (b_tau - a_tau), 0.0), jnp.exp(a_1))
    if metrics:
      a_c, b_c = s - mean_s, t - mean_t
      top = jnp.where(jnp.logical_and(a_1 >= 0, b_1 >= 0), 1.0, 0.0)  # both at their row's maximum
      terms += (jnp.exp(b_1), top, a_c * b_c, a_c * a_c, b_c * b_c)
    return tuple(x + y for x, y in zip(acc, terms))

  zero = jnp.zeros((R, LANES), jnp.float32)
  acc = jax.lax.fori_loop(0, steps, sums, (zero,) * (9 if metrics else 4), unroll=unroll)
  z_s_tau, z_t_tau, kl_num, z_s_1, *rest = (jnp.sum(x, axis=1, keepdims=True) for x in acc)

  s_target, t_target = rows[:, 6:7], rows[:, 7:8]  # 0 for a target outside V
  in_vocab = jnp.logical_and(target >= 0, target < V)
  kl = kl_num / z_t_tau + (jnp.log(z_s_tau) - jnp.log(z_t_tau))
  ce = jnp.where(in_vocab, jnp.log(z_s_1) - s_target, 0.0)
  values = [kl, ce, alpha * tau * tau * kl + (1.0 - alpha) * ce]
  if metrics:
    z_t_1, n_top, cov, var_a, var_b = rest
    values += [jnp.where(in_vocab, jnp.log(z_t_1) - t_target, 0.0),
               cov / jnp.maximum(jnp.sqrt(var_a * var_b), 1e-12), jnp.where(n_top > 0, 1.0, 0.0)]
  out = zero
  for i, value in enumerate(values):
    out = jnp.where(lane == i, value, out)
  terms_ref[...] = jnp.where(keep > 0, out, 0.0)

  # the gradient of the loss sum, w_tau (p_s,tau - p_t,tau) + w_1 (p_s - onehot) (0 on masked tokens), with each
  # softmax's normaliser folded into its row's weight
  w_tau = jnp.where(keep > 0, alpha * tau, 0.0)
  w_1 = jnp.where(keep > 0, 1.0 - alpha, 0.0)
  c_s, c_t, c_1 = wide(w_tau / z_s_tau), wide(w_tau / z_t_tau), wide(w_1 / z_s_1)
  w_1, target = wide(w_1), wide(target)

  def gradient(j, carry):
    start, _, _, a_1, b_1 = columns(j)
    d = c_s * jnp.exp(a_1 * inv_tau) - c_t * jnp.exp(b_1 * inv_tau) + c_1 * jnp.exp(a_1)
    d_ref[:, pl.ds(start, LANES)] = (d - jnp.where(lane + start == target, w_1, 0.0)).astype(d_ref.dtype)
    return carry

  jax.lax.fori_loop(0, steps, gradient, 0, unroll=unroll)


@functools.partial(jax.jit, static_argnames=("grad_dtype", "interpret", "unroll", "metrics"))
def kl_value_and_grad(s_CxV, t_CxV, targets_C, keep_C, tau, alpha, *, grad_dtype=jnp.bfloat16,
                      interpret: bool | None = None, unroll: int = 4, metrics: bool = True):
  """`forward_kl_terms`'s per-token values (``{name: [C]}``, float32, 0 where ``keep_C`` is False) and the gradient
  of their ``loss`` sum with respect to the student logits (``[C, V]`` in ``grad_dtype``), from float32 logits
  ``s_CxV`` (student) and ``t_CxV`` (teacher) read once. ``C`` is padded to whole blocks of `ROWS` (padded rows are
  masked); ``V`` must be `kl_kernel_usable`. ``tau``, ``alpha``: scalars (traced or not); no gradient flows through
  this function (it IS the gradient). ``metrics``: False forms ``loss``, ``kl`` and ``ce`` only (`LOSS_NAMES`: what a
  metrics-light step reads; fewer vector operations a logit). ``interpret``: Pallas interpret mode (slow: for
  numerics checks off a TPU); None follows `target_platform`."""
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
  m_s, m_t = jnp.max(s_CxV, axis=1), jnp.max(t_CxV, axis=1)
  # per row, reduced by XLA beside the maxima (in the fusion that forms the logits): the logit means and the logits
  # at the target id (a sum of one term; 0 for an id outside V, as `jax.nn.one_hot` has it)
  is_target = jax.lax.broadcasted_iota(jnp.int32, (C, V), 1) == targets_C[:, None]
  at_target = lambda x: jnp.sum(jnp.where(is_target, x, 0.0), axis=1)  # noqa: E731
  in_vocab = jnp.logical_and(targets_C >= 0, targets_C < V)
  rows = jnp.stack([m_s, m_t, jnp.sum(s_CxV, axis=1) / V, jnp.sum(t_CxV, axis=1) / V,
                    targets_C.astype(jnp.float32),  # exact in float32 below 2**24
                    keep_C.astype(jnp.float32),
                    jnp.where(in_vocab, at_target(s_CxV) - m_s, 0.0), jnp.where(in_vocab, at_target(t_CxV) - m_t, 0.0)],
                   axis=1)
  pad = -C % ROWS
  if pad:  # padded rows: keep 0, logits 0 (their values and gradient are written as 0 and dropped)
    s_CxV, t_CxV = (jnp.pad(x, ((0, pad), (0, 0))) for x in (s_CxV, t_CxV))
    rows = jnp.pad(rows, ((0, pad), (0, 0)))
  tau = jnp.asarray(tau, jnp.float32)
  scalars = jnp.stack([tau, 1.0 / tau, jnp.asarray(alpha, jnp.float32)])
  n = (C + pad) // ROWS
  call = pl.pallas_call(
      functools.partial(_kernel, unroll=unroll, metrics=metrics),
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
  names = NAMES if metrics else LOSS_NAMES
  return {name: terms[:C, i] for i, name in enumerate(names)}, d[:C]


__all__ = [
    "LOSS_KERNELS", "LOSS_NAMES", "kl_kernel_applies", "kl_value_and_grad", "kl_token_value_and_grad",
    "kl_kernel_usable",
]
