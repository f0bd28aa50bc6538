"""Token-chunked, vocabulary-parallel logit losses computed from final hidden states and LM heads.

A distillation step on a large vocabulary is dominated by ``[N, V]`` logit tensors (student
and teacher, their log-softmaxes, probabilities and gradients). Here the logits are never
formed for more than ``chunk_size`` tokens at once:

* the N tokens are cut into chunks of C tokens (the tail is padded and masked);
* for each chunk, ``student_CxV = student_CxD @ head_DxV`` and ``teacher_CxV = teacher_CxE @
  head_ExV`` are formed, a per-token function turns them into ``[C]`` values, and the token
  sums are accumulated;
* the gradient of the ``"loss"`` sum with respect to the student's hidden states and head is
  computed chunk by chunk IN THE SAME PASS (a `jax.custom_vjp` whose forward rule takes, with
  `jax.value_and_grad`, each chunk's gradient with respect to its student logits, forms it once in
  the head's dtype and feeds it to the two matmuls): ``d hidden`` is stacked per chunk (``[N, D]``),
  ``d head`` is accumulated in float32 (``[D, V]``, or ``[V, D]`` for a head tied to its embedding table:
  ``tied_heads``). The backward pass only scales these by the
  incoming cotangent, so nothing is recomputed and no ``[N, V]`` residual is kept.

Vocabulary parallelism: the heads are split over the mesh axis ``tensor`` along V. Every
per-token function in `meshdistill.losses` reduces over V only with max and sum (log-sum-exp
subtracts a stop-gradient max), so each device forms ``[C, V / tensor]`` logits and the compiler
all-reduces ``[C]`` partial maxima and sums; ``d hidden`` is a sum over V (an all-reduce of
``[C, D]``) and ``d head`` stays split like the head. The vocabulary is never gathered (the
tests audit the compiled HLO).

Chunking is exact because every term is per token: the token sum over chunks equals the sum
over all tokens (up to float summation order).

Why a fused custom VJP rather than ``lax.scan`` + `jax.checkpoint`: rematerialisation runs the
head matmuls of both models and every softmax twice (forward, then again in the backward
pass); the fused form costs the same matmuls as the unchunked loss. The price is that only
the output named ``grad_key`` is differentiable: the other outputs (metrics) are constants
for differentiation.

Why all local tokens are flattened instead of `jax.vmap`-ing one sequence: a vmapped custom
VJP gives every sequence its own ``[D, V]`` head-gradient accumulator (``b * D * V / tensor``
floats per device: 1 GiB at b=4, D=2048, V=128k, tensor=4); one flat token axis keeps one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from meshdistill.losses._logits import cross_entropy

# token_fn(params, student_CxV, teacher_CxV, targets_C, mask_C) -> {name: [C]}
TokenFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], dict[str, jax.Array]]


def head_logits(hidden_NxD: jax.Array, head_DxV: jax.Array) -> jax.Array:
  """``hidden @ head`` in float32 (accumulated in float32 whatever the input dtypes).

  With ``head`` split over ``tensor`` along V the result is split the same way.
  """
  return jnp.einsum("nd,dv->nv", hidden_NxD, head_DxV, preferred_element_type=jnp.float32)


def _check(student_NxD, student_head_DxV, teacher_NxE, teacher_head_ExV, targets_N, mask_N, chunk_size):
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 0:
    raise ValueError(
        f"chunk_size={chunk_size!r} must be a non-negative integer: tokens per chunk (e.g. 1024), or 0 to "
        "form the full [tokens, vocab] logits at once"
    )
  n, d = student_NxD.shape
  if student_head_DxV.shape[0] != d:
    raise ValueError(
        f"student hidden [N, D]={student_NxD.shape} does not match student head [D, V]={student_head_DxV.shape}"
    )
  if teacher_head_ExV.shape[0] != teacher_NxE.shape[1]:
    raise ValueError(
        f"teacher hidden [N, E]={teacher_NxE.shape} does not match teacher head [E, V]={teacher_head_ExV.shape}"
    )
  if teacher_head_ExV.shape[1] != student_head_DxV.shape[1]:
    raise ValueError(
        f"student vocabulary {student_head_DxV.shape[1]} != teacher vocabulary {teacher_head_ExV.shape[1]}; "
        "per-token divergences need one shared vocabulary"
    )
  if teacher_NxE.shape[0] != n or targets_N.shape != (n,) or mask_N.shape != (n,):
    raise ValueError(
        f"token counts differ: student {student_NxD.shape}, teacher {teacher_NxE.shape}, targets {targets_N.shape}, "
        f"mask {mask_N.shape}; all need the same N"
    )


def _sums(out: dict[str, jax.Array]) -> dict[str, jax.Array]:
  return {k: jnp.sum(v.astype(jnp.float32)) for k, v in out.items()}


def _naive(token_fn, params, student_NxD, student_head_DxV, teacher_NxE, teacher_head_ExV, targets_N, mask_N):
  student_NxV = head_logits(student_NxD, student_head_DxV)
  teacher_NxV = head_logits(teacher_NxE, teacher_head_ExV)
  return _sums(token_fn(params, student_NxV, teacher_NxV, targets_N, mask_N))


def _chunks(x, n_chunks: int, chunk: int):
  """[N, ...] -> [n_chunks, chunk, ...], zero-padding the tail."""
  pad = n_chunks * chunk - x.shape[0]
  if pad:
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  return x.reshape(n_chunks, chunk, *x.shape[1:])


def _scan(token_fn, chunk, grad_key, tied, with_grad, params, s_NxD, s_head_DxV, t_NxE, t_head_ExV, targets_N, mask_N,
          fused=None):
  """Sums of ``token_fn`` over chunks; with ``with_grad`` also d sums[grad_key] / d (s_NxD, s_head_DxV).

  ``tied``: (student, teacher), whether each head is the transpose of a ``[V, D]`` table (`chunked_token_sums`'s
  ``tied_heads``). The loop reads each head as the model stores it: the table of a tied head, transposed inside the
  loop (where the transpose is the matmuls' own operand order), and the student's head gradient is accumulated in
  that shape. A head transposed before the loop enters it as a copy made once per step (the loop's operands keep
  their own layout), and the gradient leaves it as another: on a TPU v5e, the Qwen3 pair's 4 x 2048 step spent 9.8
  ms of the compiler's estimate and 1.45 GiB of its memory on them (`benchmarks/step_cycles.py`). ``fused``:
  ``token_fn``'s values and the gradient of its ``grad_key`` sum with respect to the student logits in one call
  (``fused(params, s_CxV, t_CxV, targets_C, mask_C, grad_dtype=...) -> ({name: [C]}, d_CxV)``), used in the gradient
  pass instead of autodiff of ``token_fn``."""
  n = s_NxD.shape[0]
  s_tab = s_head_DxV.T if tied[0] else s_head_DxV  # the tables as stored: transposes of transposes cancel
  t_tab = t_head_ExV.T if tied[1] else t_head_ExV
  n_chunks = -(-n // chunk)
  xs = (
      _chunks(s_NxD, n_chunks, chunk),
      _chunks(t_NxE, n_chunks, chunk),
      _chunks(targets_N, n_chunks, chunk),
      _chunks(mask_N, n_chunks, chunk),  # padded tokens carry mask 0: every term is 0 there
  )

  def logit_sums(s_CxV, t_CxV, targets_C, mask_C):
    sums = _sums(token_fn(params, s_CxV, t_CxV, targets_C, mask_C))
    if grad_key not in sums:
      raise ValueError(f"token_fn returned {sorted(sums)}; the differentiated output {grad_key!r} is missing")
    return sums[grad_key], sums

  def chunk_sums(s_CxD, s_head, t_CxV, targets_C, mask_C):
    return logit_sums(head_logits(s_CxD, s_head), t_CxV, targets_C, mask_C)

  def body(carry, x):
    s_CxD, t_CxE, targets_C, mask_C = x
    s_head, t_head = (s_tab.T if tied[0] else s_tab), (t_tab.T if tied[1] else t_tab)  # [D, V], [E, V]
    # The teacher chunk is a constant here: no gradient flows to the teacher.
    t_CxV = head_logits(t_CxE, t_head)
    if not with_grad:
      _, sums = chunk_sums(s_CxD, s_head, t_CxV, targets_C, mask_C)
      return jax.tree.map(jnp.add, carry, sums), None
    acc, d_head = carry
    s_CxV = head_logits(s_CxD, s_head)
    if fused is not None:  # values and logits gradient in one call (one read of both chunks)
      out, d_CxV = fused(params, s_CxV, t_CxV, targets_C, mask_C, grad_dtype=s_head_DxV.dtype)
      sums = _sums(out)
    else:
      (_, sums), d_CxV = jax.value_and_grad(logit_sums, has_aux=True)(s_CxV, t_CxV, targets_C, mask_C)
    # The logits' gradient, formed once in the head's dtype (what the matrix unit reads: a float32 operand of a
    # default-precision TPU matmul is rounded to bfloat16 all the same), feeds both matmuls below; left in float32,
    # each matmul recomputes it from both chunks' float32 logits.
    d_CxV = jax.lax.optimization_barrier(d_CxV.astype(s_head_DxV.dtype))
    d_CxD = jnp.einsum("cv,dv->cd", d_CxV, s_head, preferred_element_type=jnp.float32).astype(s_CxD.dtype)
    d_head_c = (jnp.einsum("cv,cd->vd", d_CxV, s_CxD, preferred_element_type=jnp.float32) if tied[0]
                else jnp.einsum("cd,cv->dv", s_CxD, d_CxV, preferred_element_type=jnp.float32))  # as s_tab
    return (jax.tree.map(jnp.add, acc, sums), d_head + d_head_c), d_CxD

  # Abstract evaluation of one chunk gives the output names without running anything.
  names = jax.eval_shape(
      lambda: chunk_sums(
          xs[0][0], s_head_DxV, jnp.zeros((chunk, t_head_ExV.shape[1]), jnp.float32), xs[2][0], xs[3][0]
      )[1]
  )
  zeros = {k: jnp.zeros((), jnp.float32) for k in names}
  if not with_grad:
    sums, _ = jax.lax.scan(body, zeros, xs)
    return sums, None
  init = (zeros, jnp.zeros(s_tab.shape, jnp.float32))
  (sums, d_tab), d_xCxD = jax.lax.scan(body, init, xs)
  d_NxD = d_xCxD.reshape(n_chunks * chunk, -1)[:n].astype(s_NxD.dtype)
  return sums, (d_NxD, (d_tab.T if tied[0] else d_tab).astype(s_head_DxV.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _fused(token_fn, chunk, grad_key, tied, fused, params, s_NxD, s_head_DxV, t_NxE, t_head_ExV, targets_N, mask_N):
  sums, _ = _scan(token_fn, chunk, grad_key, tied, False, params, s_NxD, s_head_DxV, t_NxE, t_head_ExV, targets_N,
                  mask_N)
  return sums


def _fused_fwd(token_fn, chunk, grad_key, tied, fused, params, s_NxD, s_head_DxV, t_NxE, t_head_ExV, targets_N,
               mask_N):
  sums, grads = _scan(token_fn, chunk, grad_key, tied, True, params, s_NxD, s_head_DxV, t_NxE, t_head_ExV, targets_N,
                      mask_N, fused)
  zero_like = lambda x: jnp.zeros(x.shape, x.dtype)  # noqa: E731
  zeros = (jax.tree.map(zero_like, params), zero_like(t_NxE), zero_like(t_head_ExV), zero_like(mask_N))
  return sums, (grads, zeros, targets_N)


def _fused_bwd(token_fn, chunk, grad_key, tied, fused, res, g):
  del token_fn, chunk, tied, fused
  (d_NxD, d_head_DxV), (d_params, d_teacher, d_teacher_head, d_mask), targets_N = res
  scale = g[grad_key]
  d_targets = jnp.zeros(targets_N.shape, jax.dtypes.float0)
  return (
      d_params,
      (scale * d_NxD).astype(d_NxD.dtype),
      (scale * d_head_DxV).astype(d_head_DxV.dtype),
      d_teacher,
      d_teacher_head,
      d_targets,
      d_mask,
  )


_fused.defvjp(_fused_fwd, _fused_bwd)


def chunked_token_sums(
    token_fn: TokenFn,
    params: Any,
    student_NxD: jax.Array,
    student_head_DxV: jax.Array,
    teacher_NxE: jax.Array,
    teacher_head_ExV: jax.Array,
    targets_N: jax.Array,
    mask_N: jax.Array,
    *,
    chunk_size: int,
    grad_key: str = "loss",
    tied_heads: tuple[bool, bool] = (False, False),
    value_and_grad: Callable | None = None,
) -> dict[str, jax.Array]:
  """Token sums of ``token_fn`` on logits formed ``chunk_size`` tokens at a time.

  Args:
    token_fn: ``token_fn(params, student_CxV, teacher_CxV, targets_C, mask_C) -> {name: [C]}``,
      per-token values (masked tokens 0). It must be per token (no reduction across tokens) and
      reduce over V only with sums and maxima, so that chunking is exact and V may be split.
    params: a pytree passed to ``token_fn`` unchanged (e.g. temperature and weights; may be traced).
    student_NxD: student final hidden states (input of its LM head), N tokens.
    student_head_DxV: student LM head ([D, V], V may be split over ``tensor``).
    teacher_NxE, teacher_head_ExV: the same for the teacher (no gradient flows to them).
    targets_N: int target token ids; mask_N: 1.0 for tokens that count, 0.0 for padding.
    chunk_size: tokens per chunk; ``0`` forms the full ``[N, V]`` logits (the naive loss, plain
      autodiff). A size that does not divide N pads the last chunk with masked tokens.
    grad_key: the output whose gradient flows to ``student_NxD`` and ``student_head_DxV`` when
      ``chunk_size > 0``; the other outputs are metrics and carry no gradient.
    tied_heads: (student, teacher): True where that head is the transpose of a ``[V, D]`` table as the model
      stores it (an LM head tied to the embedding, ``ModelConfig.tie_embeddings``). Where the loss does not know it,
      the chunk loop carries the transposed table as a copy made once per step (and the student head's gradient is
      transposed back); the values are the same either way.
    value_and_grad: ``token_fn``'s fused form where it has one: ``value_and_grad(params, student_CxV,
      teacher_CxV, targets_C, mask_C, grad_dtype=...) -> ({name: [C]}, d_CxV)``, the per-token values and the gradient
      of their ``grad_key`` sum with respect to the student logits (in ``grad_dtype``, the head's), e.g. a kernel
      that reads both chunks once (`meshdistill.losses._kl_kernel`). The gradient pass calls it instead of
      differentiating ``token_fn``; the values are ``token_fn``'s.

  Returns:
    ``{name: scalar}``: the sum over the N tokens of each output of ``token_fn`` (float32).
  """
  _check(student_NxD, student_head_DxV, teacher_NxE, teacher_head_ExV, targets_N, mask_N, chunk_size)
  mask_N = mask_N.astype(jnp.float32)
  params = jax.tree.map(jnp.asarray, params)
  if chunk_size == 0:
    return _naive(token_fn, params, student_NxD, student_head_DxV, teacher_NxE, teacher_head_ExV, targets_N, mask_N)
  chunk = min(chunk_size, student_NxD.shape[0])
  tied = tuple(bool(t) for t in tied_heads)
  return _fused(token_fn, chunk, grad_key, tied, value_and_grad, params, student_NxD, student_head_DxV, teacher_NxE,
                teacher_head_ExV, targets_N, mask_N)


def divergence_token_fn(divergence: Callable[..., jax.Array]) -> TokenFn:
  """The token function ``{"loss": divergence(s, t, mask, params["temperature"])}`` of a divergence.

  ``divergence(student_CxV, teacher_CxV, mask_C, temperature) -> [C]`` is any per-token divergence
  of `meshdistill.losses` (forward KL, ...). Useful for tests and for composing losses.
  """

  def fn(params, student_CxV, teacher_CxV, targets_C, mask_C):
    del targets_C
    return {"loss": divergence(student_CxV, teacher_CxV, mask_C, params["temperature"])}

  return fn


def cross_entropy_token_fn(params, student_CxV, teacher_CxV, targets_C, mask_C):
  """The token function ``{"loss": CE(student, targets)}`` (hard-label cross-entropy)."""
  del params, teacher_CxV
  return {"loss": cross_entropy(student_CxV, targets_C, mask_C)}


__all__ = [
    "TokenFn",
    "chunked_token_sums",
    "cross_entropy_token_fn",
    "divergence_token_fn",
    "head_logits",
]
