"""The mixture-of-experts block: a router picks ``top_k`` of ``n_experts`` SwiGLU experts per token.

`MoeConfig` holds the settings (``ModelConfig.moe``); `MoE` is the block the decoder's `Block` runs in place of
its dense MLP on the layers `MoeConfig.sparse` names.

==========================  ================  ===========================================================
weight                      shape             split over ``tensor`` (and ``expert``, ``mesh.axes: {expert: n}``)
==========================  ================  ===========================================================
router                      [D, E]            replicated (every token scores every expert)
experts gate / up           [E, D, F]         F (each expert's hidden units, as the dense MLP); E over ``expert``
experts down                [E, F, D]         F; E over ``expert``
==========================  ================  ===========================================================

Routing (`route`): scores are ``softmax`` (Mixtral, Qwen3-MoE) or ``sigmoid`` of the float32 router logits; the
``top_k`` highest per token are chosen (equal scores: the lower expert index first, `jax.lax.top_k`'s rule), their
scores are the combine weights, renormalised to sum to 1 with ``norm_topk_prob``. Routing is a function of the
logits only, so it is the same on every layout.

The experts run as one grouped matmul (`grouped_experts`): the ``N * top_k`` (token, expert) assignments sorted by
expert (a stable sort: ties keep token order), `jax.lax.ragged_dot` over the groups, the results put back in
assignment order and summed per token with their weights. Nothing loops over experts.

Dropless by default. With ``capacity_factor`` each expert takes at most
``ceil(capacity_factor * T * top_k / E)`` assignments of each sequence (a sequence is the group: the rule does not
depend on how rows are spread over devices); first choices come before second choices, earlier tokens before later
ones; the overflow is dropped (sorted past the last group, so `ragged_dot` computes nothing for it, and weighted 0;
the token keeps its residual). `Routing.dropped_BxT` counts each token's dropped assignments. Where the block knows
which tokens are padding (``valid_BxT``: a decoding call's prompt padding, the ids of packed documents) padding takes
no capacity and ``T`` counts a sequence's real tokens, so a left-padded prompt routes as it would alone.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

# The experts run per device in a shard_map over `expert` and `tensor` (`experts_on_mesh`): the one place here that
# names axes.
from meshdistill.parallel.mesh import DATA, EXPERT, TENSOR, context_ways
from meshdistill.parallel.rules import annotate
from meshdistill.models._output import BlockOutput

SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
  """Mixture-of-experts settings of a decoder (``ModelConfig.moe``).

  ``dense_layers``: layer indices that keep the dense MLP (``ModelConfig.mlp_hidden``); every other layer is an
  `MoE` block of ``n_experts`` experts with ``expert_hidden`` hidden units each. ``aux_loss_weight`` and
  ``z_loss_weight`` weigh a student's load-balancing and router z-losses in the train step
  (`meshdistill.train.router_losses`); they change nothing in the forward pass.
  """

  n_experts: int = 8
  top_k: int = 2
  expert_hidden: int = 64
  score: str = "softmax"  # "softmax" (Mixtral, Qwen3-MoE) or "sigmoid"
  norm_topk_prob: bool = True  # renormalise the top_k weights to sum to 1
  capacity_factor: float | None = None  # None: dropless; else per-sequence expert capacity (see the module doc)
  dense_layers: tuple[int, ...] = ()  # layers with the dense MLP (Qwen3-MoE mlp_only_layers / decoder_sparse_step)
  aux_loss_weight: float = 0.0  # weight of the load-balancing loss of a student (Hugging Face router_aux_loss_coef)
  z_loss_weight: float = 0.0  # weight of the router z-loss of a student (mean squared log-sum-exp of the logits)

  def __post_init__(self):
    object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
    for name in ("n_experts", "top_k", "expert_hidden"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"MoeConfig.{name}={v!r} must be a positive integer")
    if self.top_k > self.n_experts:
      raise ValueError(f"MoeConfig.top_k={self.top_k} exceeds n_experts={self.n_experts}; choose top_k <= n_experts")
    if self.score not in SCORES:
      raise ValueError(f"MoeConfig.score={self.score!r}; choose one of {SCORES}")
    if self.capacity_factor is not None and not self.capacity_factor > 0:
      raise ValueError(f"MoeConfig.capacity_factor={self.capacity_factor!r} must be > 0 (e.g. 1.25), or null for "
                       "dropless routing")
    for name in ("aux_loss_weight", "z_loss_weight"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"MoeConfig.{name}={getattr(self, name)!r} must be >= 0")
    if any(i < 0 for i in self.dense_layers):
      raise ValueError(f"MoeConfig.dense_layers={list(self.dense_layers)} must hold layer indices >= 0")

  def sparse(self, layer: int) -> bool:
    """Whether layer ``layer`` is an `MoE` block (not one of ``dense_layers``)."""
    return layer not in self.dense_layers

  def capacity(self, tokens: int) -> int | None:
    """Assignments each expert takes from a sequence of ``tokens`` tokens (None: dropless)."""
    if self.capacity_factor is None:
      return None
    return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts))


def inactive_params(cfg) -> int:
  """Expert weights a token does NOT use in a decoder of ``cfg`` (a `ModelConfig`): ``E - top_k`` experts' gate, up
  and down in every expert layer (0 without ``moe``). Parameters minus these are the active ones, whose matmuls a
  token runs (the planner's analytic FLOPs)."""
  moe = cfg.moe
  if moe is None:
    return 0
  layers = sum(moe.sparse(i) for i in range(cfg.n_layers))
  return layers * (moe.n_experts - moe.top_k) * 3 * cfg.d_model * moe.expert_hidden


class Routing(NamedTuple):
  """What an `MoE` block reports besides its output: ``logits_BxTxE`` float32 router logits and
  ``dropped_BxT`` the number of each token's assignments dropped by the capacity (0 when dropless)."""

  logits_BxTxE: jax.Array
  dropped_BxT: jax.Array


def route(logits_NxE: jax.Array, moe: MoeConfig) -> tuple[jax.Array, jax.Array]:
  """``(weights [N, k] float32, experts [N, k] int32)`` of float32 router logits (see the module doc)."""
  scores_NxE = jax.nn.softmax(logits_NxE, axis=-1) if moe.score == "softmax" else jax.nn.sigmoid(logits_NxE)
  weights_Nxk, experts_Nxk = jax.lax.top_k(scores_NxE, moe.top_k)
  if moe.norm_topk_prob:
    weights_Nxk = weights_Nxk / jnp.sum(weights_Nxk, axis=-1, keepdims=True)
  return weights_Nxk, experts_Nxk


def capacity_keep(experts_BxTxk: jax.Array, n_experts: int, capacity, valid_BxT: jax.Array | None = None) -> jax.Array:
  """bool ``[B, T, k]``: the assignments each expert takes within its sequence's ``capacity`` (one for all, or one
  per sequence ``[B]``), first choices of all tokens before second choices, earlier tokens first. A token
  ``valid_BxT`` marks False (padding) takes none and is counted by none."""
  B, T, k = experts_BxTxk.shape
  order_BxKT = jnp.swapaxes(experts_BxTxk, 1, 2).reshape(B, k * T)  # choice-major priority
  onehot = jax.nn.one_hot(order_BxKT, n_experts, dtype=jnp.int32)  # [B, kT, E]
  valid_BxKT = None if valid_BxT is None else jnp.tile(valid_BxT, (1, k))  # the same order: choice c of token t
  if valid_BxKT is not None:
    onehot = onehot * valid_BxKT[..., None]
  position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)  # rank within its expert
  keep_BxKT = position < jnp.reshape(jnp.asarray(capacity), (-1, 1))
  if valid_BxKT is not None:
    keep_BxKT = keep_BxKT & valid_BxKT
  return jnp.swapaxes(keep_BxKT.reshape(B, k, T), 1, 2)


def grouped_experts(x_NxD, experts_Nxk, weights_Nxk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, keep_Nxk=None):
  """``sum_j weights[n, j] * expert_{experts[n, j]}(x[n])`` for every token ``n``: one `jax.lax.ragged_dot` per
  projection over the assignments sorted by expert (dropped ones, ``keep_Nxk`` false, sorted past the groups)."""
  N, k = experts_Nxk.shape
  E = w_gate_ExDxF.shape[0]
  group_NK = experts_Nxk.reshape(-1) if keep_Nxk is None else jnp.where(keep_Nxk, experts_Nxk, E).reshape(-1)
  order_NK = jnp.argsort(group_NK, stable=True)
  sizes_E = jnp.bincount(group_NK, length=E + 1)[:E].astype(jnp.int32)
  x_sorted = x_NxD[order_NK // k]
  kept_NK = None if keep_Nxk is None else jnp.arange(group_NK.shape[0]) < jnp.sum(sizes_E)
  if kept_NK is not None:
    # `ragged_dot` leaves the rows past its last group unspecified (zeros on the CPU, whatever HBM held on a TPU),
    # in its output and in its gradients: the dropped assignments' rows are selected away on the way in (their
    # gradient) and on the way out (their value; NaN times a dropped assignment's weight 0 would still be NaN)
    x_sorted = jnp.where(kept_NK[:, None], x_sorted, jnp.zeros((), x_sorted.dtype))
  h = jax.nn.silu(jax.lax.ragged_dot(x_sorted, w_gate_ExDxF, sizes_E)) * jax.lax.ragged_dot(x_sorted, w_up_ExDxF, sizes_E)
  y_sorted = jax.lax.ragged_dot(h, w_down_ExFxD, sizes_E)
  if kept_NK is not None:
    y_sorted = jnp.where(kept_NK[:, None], y_sorted, jnp.zeros((), y_sorted.dtype))
  y_NKxD = jnp.zeros_like(y_sorted).at[order_NK].set(y_sorted, unique_indices=True)
  weights_Nxk = weights_Nxk if keep_Nxk is None else jnp.where(keep_Nxk, weights_Nxk, 0.0)
  y_NxkxD = y_NKxD.reshape(N, k, -1) * weights_Nxk[..., None].astype(y_NKxD.dtype)
  return jnp.sum(y_NxkxD, axis=1)


def dense_experts(x_NxD, experts_Nxk, weights_Nxk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, keep_Nxk=None):
  """The same as `grouped_experts` by a Python loop running every expert on every token (a reference and the
  benchmark's baseline, never used by the model)."""
  weights_Nxk = weights_Nxk if keep_Nxk is None else jnp.where(keep_Nxk, weights_Nxk, 0.0)
  out = jnp.zeros(x_NxD.shape, jnp.float32)
  for e in range(w_gate_ExDxF.shape[0]):
    y = (jax.nn.silu(x_NxD @ w_gate_ExDxF[e]) * (x_NxD @ w_up_ExDxF[e])) @ w_down_ExFxD[e]
    gate_N = jnp.sum(jnp.where(experts_Nxk == e, weights_Nxk, 0.0), axis=-1)
    out = out + gate_N[:, None] * y
  return out.astype(x_NxD.dtype)


def experts_on_mesh(x_NxD, experts_Nxk, weights_Nxk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, keep_Nxk=None):
  """`grouped_experts` placed for the mesh in context: the experts split over ``expert``, their hidden units over
  ``tensor``.

  Left to the compiler, the sort, gather and ``ragged_dot`` of the grouped matmul with F split over ``tensor`` are
  not kept split: compiled for a TPU (v5e:2x2, tensor=4) the step gathered the sorted activations around every
  expert projection (dozens of all-gathers; none in the same step with dense MLPs). So the experts run in a nested
  ``shard_map`` manual over the compiler-managed axes, as the dense MLP is split by hand in Megatron: every device
  routes its rows (the same on every ``tensor`` device), runs gate / up on its ``F / tensor`` hidden units and down
  from them, giving a partial ``[N, D]``; the partials are summed outside (one all-reduce over ``tensor``).

  With an ``expert`` axis (``mesh.axes: {expert: n}``; the rules split ``experts`` over it) each device holds
  ``E / n`` experts, and the rows are split over ``expert`` as well (and over a compiler-managed ``data``): the
  tokens go to their experts' devices and back by `exchanged_experts`. Rows are padded (weight 0, dropped) to a
  multiple of the devices they are split over. Without a mesh in context (one device, a plain ``jit``) or with
  every axis manual already, it is `grouped_experts` itself.
  """
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()))
  free = {a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1}
  E, ways = w_gate_ExDxF.shape[0], mesh.shape[EXPERT] if EXPERT in free else 1
  if E % ways:
    ok = [d for d in range(1, E + 1) if E % d == 0]
    raise ValueError(f"mesh.axes.expert={ways} does not divide the {E} experts of a mixture-of-experts model; choose "
                     f"expert in {ok} (or leave the axis out)")
  if TENSOR not in free and ways == 1:
    return grouped_experts(x_NxD, experts_Nxk, weights_Nxk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, keep_Nxk)
  rows = tuple(a for a in (DATA, EXPERT) if a in free)
  N, split = x_NxD.shape[0], math.prod(mesh.shape[a] for a in rows)
  pad = -N % split
  if pad:  # padded rows: no expert's work (dropped), weight 0
    keep_Nxk = jnp.ones(experts_Nxk.shape, bool) if keep_Nxk is None else keep_Nxk
    x_NxD, experts_Nxk, weights_Nxk, keep_Nxk = (
        jnp.pad(a, ((0, pad), (0, 0))) for a in (x_NxD, experts_Nxk, weights_Nxk, keep_Nxk))
  row_spec = P(rows or None, None)
  keep_spec = None if keep_Nxk is None else row_spec
  e_axis, f_axis = (EXPERT if ways > 1 else None), (TENSOR if TENSOR in free else None)

  def local(x, e, g, wg, wu, wd, keep):  # this device's partial sum over its hidden units
    if ways == 1:
      return grouped_experts(x, e, g, wg, wu, wd, keep)[None]
    return exchanged_experts(x, e, g, wg, wu, wd, keep, n_experts=E)[None]

  partial_TxNxD = jax.shard_map(
      local, in_specs=(row_spec, row_spec, row_spec, P(e_axis, None, f_axis), P(e_axis, None, f_axis),
                       P(e_axis, f_axis, None), keep_spec),
      out_specs=P(f_axis, rows or None, None), axis_names=free, check_vma=False,
  )(x_NxD, experts_Nxk, weights_Nxk, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, keep_Nxk)
  return jnp.sum(partial_TxNxD, axis=0)[:N]


def exchanged_experts(x_nxD, experts_nxk, weights_nxk, w_gate_LxDxF, w_up_LxDxF, w_down_LxFxD, keep_nxk=None, *,
                      n_experts: int):
  """`grouped_experts` of this device's rows with the experts split over the manual ``expert`` axis: device ``d``
  of ``W`` holds experts ``[d * L, (d + 1) * L)`` (``L = E / W``, weights ``[L, ...]``).

  1. The ``n * k`` assignments are sorted by expert (as `grouped_experts`), so each destination device's share is
     one contiguous run; the per-expert counts ``[W, L]`` are exchanged with one `jax.lax.all_to_all`.
  2. The tokens travel in one `jax.lax.all_to_all` of a ``[W, C, D]`` buffer, ``C = n * min(k, L)`` rows per
     destination: a token's ``k`` experts are distinct, so at most ``min(k, L)`` of them live on one device and the
     buffer cannot overflow (dropless stays exact). `jax.lax.ragged_all_to_all` would send only the filled rows, but
     XLA:CPU does not implement it (jax 0.10.2: "HLO opcode ragged-all-to-all is not supported") and its receive
     buffer needs the same worst-case size, so the fixed-capacity exchange is the one used on every platform.
  3. The received rows are sorted by local expert (stable: by source device, then the source's order) and run
     through one `jax.lax.ragged_dot` per projection; the results return by the reverse `jax.lax.all_to_all` to the
     slots they came from and are summed per token with their weights. Dropped assignments (``keep_nxk`` false)
     are never sent.
  """
  n, k = experts_nxk.shape
  L, D = w_gate_LxDxF.shape[0], x_nxD.shape[1]
  W, C = n_experts // L, n * min(k, L)
  group_A = experts_nxk.reshape(-1) if keep_nxk is None else jnp.where(keep_nxk, experts_nxk, n_experts).reshape(-1)
  order_A = jnp.argsort(group_A, stable=True)
  dest_A = group_A[order_A] // L  # destination device of each sorted assignment (W: dropped)
  sizes_WxL = jnp.bincount(group_A, length=n_experts + 1)[:n_experts].astype(jnp.int32).reshape(W, L)
  send_W = jnp.sum(sizes_WxL, axis=1)
  slot_A = jnp.arange(n * k) - jnp.take(jnp.cumsum(send_W) - send_W, dest_A, mode="clip")
  send_WxCxD = jnp.zeros((W, C, D), x_nxD.dtype).at[dest_A, slot_A].set(x_nxD[order_A // k], mode="drop")
  recv_WxL = jax.lax.all_to_all(sizes_WxL, EXPERT, 0, 0)  # [source, local expert]: rows each source sends me
  recv_WxCxD = jax.lax.all_to_all(send_WxCxD, EXPERT, 0, 0)
  # each received row's local expert (L: an unfilled slot), from its source's counts
  local_WxC = jax.vmap(lambda c: jnp.searchsorted(c, jnp.arange(C), side="right"))(jnp.cumsum(recv_WxL, axis=1))
  order_R = jnp.argsort(local_WxC.reshape(-1), stable=True)
  sizes_L = jnp.sum(recv_WxL, axis=0)
  x_sorted = recv_WxCxD.reshape(W * C, D)[order_R]
  h = jax.nn.silu(jax.lax.ragged_dot(x_sorted, w_gate_LxDxF, sizes_L))
  h = h * jax.lax.ragged_dot(x_sorted, w_up_LxDxF, sizes_L)
  y_sorted = jax.lax.ragged_dot(h, w_down_LxFxD, sizes_L)
  y_WxCxD = jnp.zeros_like(y_sorted).at[order_R].set(y_sorted, unique_indices=True).reshape(W, C, -1)
  back_WxCxD = jax.lax.all_to_all(y_WxCxD, EXPERT, 0, 0)  # back_WxCxD[d]: my rows' results from device d
  y_AxD = back_WxCxD.at[dest_A, slot_A].get(mode="fill", fill_value=0)
  y_AxD = jnp.zeros_like(y_AxD).at[order_A].set(y_AxD, unique_indices=True)
  weights_nxk = weights_nxk if keep_nxk is None else jnp.where(keep_nxk, weights_nxk, 0.0)
  return jnp.sum(y_AxD.reshape(n, k, -1) * weights_nxk[..., None].astype(y_AxD.dtype), axis=1)


class MoE(nnx.Module):
  """``moe(x_BxTxD) -> BlockOutput(y_BxTxD, aux=Routing)``: the routed SwiGLU experts of one layer (see the module
  doc)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):  # cfg: the decoder's ModelConfig, with cfg.moe set
    self.moe: MoeConfig = cfg.moe
    self.dtype = cfg.compute_dtype
    D, E, F = cfg.d_model, self.moe.n_experts, self.moe.expert_hidden
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    param = lambda init, shape, *names: nnx.Param(  # noqa: E731  (logical names: `meshdistill.parallel.rules`)
        annotate(init, *names)(rngs.params(), shape, cfg.weight_dtype))
    self.router = param(nnx.initializers.lecun_normal(), (D, E), "embed", None)  # whole: every token scores all
    self.gate = param(init, (E, D, F), "experts", "embed", "mlp")
    self.up = param(init, (E, D, F), "experts", "embed", "mlp")
    self.down = param(init, (E, F, D), "experts", "mlp", "embed")

  def __call__(self, x_BxTxD: jax.Array, valid_BxT: jax.Array | None = None) -> BlockOutput:
    """``valid_BxT``: the tokens that are not padding, where known (None: all are); with a capacity, padding takes
    none and a sequence's capacity counts its real tokens (see the module doc)."""
    B, T, D = x_BxTxD.shape
    x_NxD = x_BxTxD.reshape(-1, D)
    logits_NxE = jnp.dot(x_NxD.astype(jnp.float32), self.router[...].astype(jnp.float32))
    weights_Nxk, experts_Nxk = route(logits_NxE, self.moe)
    k = self.moe.top_k
    capacity = self.moe.capacity(T)
    if capacity is not None and context_ways() > 1:  # a device holds a slice of each sequence: not its group
      raise ValueError(
          f"MoeConfig.capacity_factor={self.moe.capacity_factor} caps each expert per sequence, but the sequence is "
          f"split over mesh.axes.context={context_ways()} and a device sees a slice of it; use capacity_factor=null "
          "(dropless, exact under context parallelism) or mesh.axes.context=1")
    keep_Nxk = None
    dropped_BxT = jnp.zeros((B, T), jnp.float32)
    if capacity is not None:
      if valid_BxT is not None:  # per sequence, of its real tokens: the same rule, read from a table of T + 1 counts
        table = jnp.asarray([self.moe.capacity(n) for n in range(T + 1)], jnp.int32)
        capacity = table[jnp.sum(valid_BxT, axis=1, dtype=jnp.int32)]
      keep_BxTxk = capacity_keep(experts_Nxk.reshape(B, T, k), self.moe.n_experts, capacity, valid_BxT)
      keep_Nxk = keep_BxTxk.reshape(-1, k)
      dropped_BxTxk = ~keep_BxTxk if valid_BxT is None else ~keep_BxTxk & valid_BxT[..., None]  # padding: none
      dropped_BxT = jnp.sum(dropped_BxTxk, axis=-1).astype(jnp.float32)
    w = [v[...].astype(self.dtype) for v in (self.gate, self.up, self.down)]
    y_NxD = experts_on_mesh(x_NxD.astype(self.dtype), experts_Nxk, weights_Nxk, *w, keep_Nxk)
    return BlockOutput(y_NxD.reshape(B, T, D), aux=Routing(logits_NxE.reshape(B, T, -1), dropped_BxT))
