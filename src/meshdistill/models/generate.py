"""Generation with a key/value cache: prefill the prompts, then decode one token per step.

  gen = generate(model, prompts_BxP, prompt_mask_BxP, jax.random.key(0), SamplingConfig(max_new_tokens=32))
  gen.tokens_BxN, gen.mask_BxN                     # completions; mask marks tokens up to and with EOS

Prompts are LEFT-padded (`left_pad`): every row's last prompt token sits in slot ``P - 1``, so all
rows decode in lockstep. Each row's RoPE positions count its own tokens only (``0`` at its first
real token) and padding slots are never attended, so a row generates exactly what it would alone.

The whole generation is ONE jitted program per (model, shapes, sampling settings): the prompt
pass, then `jax.lax.while_loop`s that decode one token for every row per iteration and stop
when every row has emitted EOS or ``max_new_tokens`` tokens. No per-token recompilation. The new
tokens are split over up to `DECODE_STAGES` loops (`decode_stages`; `CACHE_BOUND_STAGES` where the
caches outweigh the weights on a TPU, `decoding_program`), each attending to the first
slots of the cache, those filled by its last token, so a decoded token reads about the slots filled
so far rather than the whole preallocated cache (the cache is made once; a loop reads its prefix in
place). A decoded token's cache write and attention may run as one Pallas kernel per layer and device
(`Decoder.decode_step`'s ``kernel``; on a TPU with attention ``auto``: `meshdistill.models._decode_attention`): on one
device, or on a mesh where each device holds its rows (over ``data``) and key/value heads (over ``tensor``).

Sampling (`sample_tokens`) is vocabulary-parallel: logits ``[B, V]`` stay split over ``tensor``
along V and every vocabulary reduction is a max, min or sum (XLA reduces partial results over
``tensor``), with no sort or gather over V:

* greedy (``temperature=0``): the first index holding the row maximum (`vocab_argmax`: a max, then a min of
  indices);
* otherwise Gumbel-max: the arg-max of ``logits / temperature + Gumbel noise`` is an exact sample
  of the softmax; the noise of row ``r`` at step ``n`` comes from
  ``fold_in(fold_in(key, r), n)``, so the same key gives the same text on every layout and batch;
* ``top_k`` / ``top_p`` restrict the candidates with a threshold on the logits found by bisection
  over their 32-bit order keys: 32 counts (top-k) or probability sums (top-p) over V. Ties at the
  threshold are all kept (top-k can then keep more than k tokens of exactly equal logit).

Runs on one device or on a ``(data, tensor)`` mesh (pass ``mesh``: rows split over ``data``,
parameters where they already are). The model's own cached pass (`Decoder.decode_step`) computes the
logits, so a vocabulary padded for the ``tensor`` axis is cut exactly as in its full forward pass: ids
``>= vocab_size`` are never sampled and the logits are ``[B, N, vocab_size]``. The built-in `Decoder` (and
Hugging Face checkpoints loaded into it) is supported; tunix's model zoo is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshdistill.parallel.mesh import check_batch, platform_of
from meshdistill.parallel.rules import spec, split_ways
from meshdistill.models._attention import decodes_with_kernel
from meshdistill.models._decode_attention import TILE
from meshdistill.models.decoder import Decoder
from meshdistill.models.contract import DecodingModel, check_model


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How to pick tokens. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` switch those filters off.

  ``eos_id``: a row stops after emitting it (None: rows run ``max_new_tokens``); ``pad_id`` fills the
  slots after a row stopped.
  """

  max_new_tokens: int = 32
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  eos_id: int | None = None
  pad_id: int = 0

  def __post_init__(self):
    owner = type(self).__name__
    if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f"{owner}.max_new_tokens={self.max_new_tokens!r} must be a positive integer (e.g. 64)")
    if not _is_number(self.temperature) or not self.temperature >= 0:
      raise ValueError(f"{owner}.temperature={self.temperature!r} must be a number >= 0 (0 = greedy, 1 = the "
                       "model's distribution)")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"{owner}.top_k={self.top_k!r} must be an integer >= 0 (0 = no top-k filter)")
    if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
      raise ValueError(f"{owner}.top_p={self.top_p!r} must be a number in (0, 1] (1 = no nucleus filter, e.g. 0.9)")


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


class Generation(NamedTuple):
  """Result of `generate`: ``tokens_BxN`` (``pad_id`` after a row stopped), ``mask_BxN`` (True for
  generated tokens, EOS included), ``lengths_B`` (tokens per row), ``logits_BxNxV`` (the logits each
  token was drawn from, ``return_logits=True`` only; V split over ``tensor``)."""

  tokens_BxN: jax.Array
  mask_BxN: jax.Array
  lengths_B: jax.Array
  logits_BxNxV: jax.Array | None = None


def left_pad(prompts: Sequence[Sequence[int]], width: int | None = None, pad_id: int = 0):
  """Host arrays ``(tokens_BxP, mask_BxP)`` with each prompt right-aligned in ``width`` (default: the longest).

  Raises:
    ValueError: an empty prompt, or one longer than ``width``.
  """
  lengths = [len(p) for p in prompts]
  if not prompts or min(lengths) < 1:
    raise ValueError("every prompt needs at least one token (got an empty prompt or no prompts)")
  width = max(lengths) if width is None else width
  if max(lengths) > width:
    raise ValueError(f"a prompt has {max(lengths)} tokens, more than the {width} available")
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  mask = np.zeros((len(prompts), width), bool)
  for i, p in enumerate(prompts):
    tokens[i, width - len(p):] = np.asarray(p, np.int32)
    mask[i, width - len(p):] = True
  return tokens, mask


# ----------------------------------------------------------------------------- sampling
def vocab_argmax(x_BxV: jax.Array) -> jax.Array:
  """The first index of each row's maximum, in ``[0, V)``: a max, then a min of the indices where ``x`` equals it
  (vocabulary-parallel: each reduction runs on every ``tensor`` shard, then over the shards' results).

  XLA may fuse ``x``'s producers into each of the two reductions and compute them twice, and on a TPU a
  transcendental computed in two fusions need not give the same bits: then no index matches and the min is ``V``
  (decoding a bfloat16 model with a final soft cap on a v5e chip, every row's second token: an id outside the
  vocabulary, then NaN). Where that happens (a scalar test per step) the rows take ``jnp.argmax``, one reduction of
  (value, index) pairs that cannot disagree with itself; elsewhere the two reductions stand (the sampling rows of
  benchmarks/results/tpu_step.md measure them)."""
  V = x_BxV.shape[-1]
  m_Bx1 = jnp.max(x_BxV, axis=-1, keepdims=True)
  iota = jax.lax.broadcasted_iota(jnp.int32, x_BxV.shape, x_BxV.ndim - 1)
  first_B = jnp.min(jnp.where(x_BxV == m_Bx1, iota, V), axis=-1)
  return jax.lax.cond(jnp.any(first_B >= V), lambda: jnp.argmax(x_BxV, axis=-1).astype(jnp.int32), lambda: first_B)


def _order_keys(x: jax.Array) -> jax.Array:
  """uint32 keys ordered like the float32 values (``a < b`` iff ``key(a) < key(b)``, +-0 aside)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys_BxV: jax.Array, holds) -> jax.Array:
  """Per row the largest uint32 ``tau`` with ``holds(keys >= tau)`` (monotone: true at 0), by 32 bit steps."""

  def bit(i, tau_B):
    cand_B = tau_B | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    return jnp.where(holds(keys_BxV >= cand_B[:, None]), cand_B, tau_B)

  return jax.lax.fori_loop(0, 32, bit, jnp.zeros(keys_BxV.shape[:1], jnp.uint32))


def allowed_tokens(logits_BxV: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """``[B, V]`` bool: the tokens top-k then top-p (nucleus) sampling may pick.

  top-k keeps tokens whose logit is at least the k-th largest; top-p then keeps the smallest set of
  most likely remaining tokens whose probability reaches ``top_p`` (token ``i`` is kept iff the
  probability of the tokens strictly above it is below ``top_p``). Both thresholds are found by
  bisection with counts / sums over V, so V may stay split over ``tensor``.
  """
  keys_BxV = _order_keys(logits_BxV)
  ok_BxV = jnp.ones(logits_BxV.shape, bool)
  if 0 < top_k < logits_BxV.shape[-1]:
    tau = _largest_threshold(keys_BxV, lambda sel: jnp.sum(sel, axis=-1, dtype=jnp.int32) >= top_k)
    ok_BxV = keys_BxV >= tau[:, None]
  if top_p < 1.0:
    masked = jnp.where(ok_BxV, logits_BxV, -jnp.inf)
    probs_BxV = jax.nn.softmax(masked, axis=-1)
    tau = _largest_threshold(keys_BxV, lambda sel: jnp.sum(jnp.where(sel, probs_BxV, 0.0), axis=-1) >= top_p)
    ok_BxV = ok_BxV & (keys_BxV >= tau[:, None])
  return ok_BxV


def sample_tokens(logits_BxV, row_keys_B, step, cfg: SamplingConfig, sharding=None) -> jax.Array:
  """One token per row from ``logits_BxV`` (float32) under ``cfg``; ``row_keys_B`` are per-row keys."""
  if cfg.temperature == 0:
    return vocab_argmax(logits_BxV)
  scaled_BxV = logits_BxV / cfg.temperature
  ok_BxV = allowed_tokens(scaled_BxV, cfg.top_k, cfg.top_p)
  V = logits_BxV.shape[-1]
  gumbel_BxV = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, step), (V,), jnp.float32))(row_keys_B)
  if sharding is not None:
    gumbel_BxV = jax.lax.with_sharding_constraint(gumbel_BxV, sharding)
  return vocab_argmax(jnp.where(ok_BxV, scaled_BxV + gumbel_BxV, -jnp.inf))


# Decoding runs in up to `DECODE_STAGES` loops, each attending to the prefix of the cache filled by its last token,
# so a token reads the slots filled so far and not the whole preallocated cache; a loop decodes at least
# `MIN_STAGE_TOKENS` tokens. Each loop compiles the decoding step once more, so more loops pay only where the caches
# are most of what a token reads: there (`cache_bound`, on a TPU) decoding runs in up to `CACHE_BOUND_STAGES`
# (the sampling table of benchmarks/results/tpu_step.md has the measured choice).
DECODE_STAGES = 4
CACHE_BOUND_STAGES = 8
MIN_STAGE_TOKENS = 32


def decode_stages(prompt_len: int, max_new_tokens: int, loops: int | None = None) -> tuple[tuple[int, int], ...]:
  """``(stop, slots)`` per decoding loop: it decodes tokens ``n < stop`` (after the previous loop's) attending to the
  first ``slots`` slots of the cache, the ones filled when its last token is fed; the last loop's are every slot
  (``prompt_len + max_new_tokens - 1``: the last new token is never fed back). ``loops``: at most this many (None:
  `DECODE_STAGES`)."""
  N = max_new_tokens
  loops = max(1, min(DECODE_STAGES if loops is None else loops, N // MIN_STAGE_TOKENS))
  stops = sorted({-(-(j + 1) * N // loops) for j in range(loops)})
  return tuple((stop, prompt_len + stop - 1) for stop in stops)


def _generate(params, prompts_BxP, prompt_mask_BxP, key, *, graphdef, cfg: SamplingConfig, return_logits, mesh,
              caches_dominate: bool = False, kernel: bool = False):
  # the decoding kernel runs per device in a shard_map over the mesh in context (`_attention.decode_in_kernel`)
  with contextlib.nullcontext() if mesh is None or not kernel else jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return _decode(params, prompts_BxP, prompt_mask_BxP, key, graphdef=graphdef, cfg=cfg, return_logits=return_logits,
                   mesh=mesh, caches_dominate=caches_dominate, kernel=kernel)


def _decode(params, prompts_BxP, prompt_mask_BxP, key, *, graphdef, cfg: SamplingConfig, return_logits, mesh,
            caches_dominate: bool, kernel: bool):
  model = nnx.merge(graphdef, params)
  mcfg = model.cfg
  B, Pn = prompts_BxP.shape
  N = cfg.max_new_tokens
  stages = decode_stages(Pn, N, CACHE_BOUND_STAGES if caches_dominate else DECODE_STAGES)
  S = stages[-1][1]  # every slot; each loop attends to its first `slots`
  V = mcfg.vocab_size
  logit_sharding = None if mesh is None else NamedSharding(mesh, spec(("batch", "vocab"), mesh=mesh))
  # rows over `data`; for the kernel the key/value heads over `tensor` too, as it reads them per device (where
  # `tensor` does not divide them the projections replicate them and XLA's attention decodes: `_decode_split`)
  heads = "kv_heads" if kernel and mcfg.n_kv_heads % split_ways(mesh, "kv_heads") == 0 else None
  kv_sharding = None if mesh is None else NamedSharding(mesh, spec(("batch", heads), mesh=mesh))
  # whole on-chip tiles of slots (`_decode_attention.TILE`): a decoded slot's write in the decoding kernel rewrites
  # its tile; the slots past S are never valid, so never attended to
  kv = model.empty_cache(B, -(-S // TILE) * TILE, kv_sharding)
  lengths_B = jnp.sum(prompt_mask_BxP, axis=-1, dtype=jnp.int32)
  positions_BxP = jnp.maximum(jnp.cumsum(prompt_mask_BxP, axis=-1, dtype=jnp.int32) - 1, 0)
  valid_BxS = jnp.zeros((B, S), bool).at[:, :Pn].set(prompt_mask_BxP)
  row_keys_B = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(B))

  def pick(logits_BxV, n):
    if logit_sharding is not None:
      logits_BxV = jax.lax.with_sharding_constraint(logits_BxV, logit_sharding)
    return sample_tokens(logits_BxV, row_keys_B, n, cfg, logit_sharding).astype(jnp.int32)

  logits_Bx1xV, kv = model.decode_step(prompts_BxP, kv, valid_BxS[:, :Pn], 0, positions_BxP, last_only=True,
                                       kernel=kernel)
  first_B = pick(logits_Bx1xV[:, 0], 0)
  tokens_BxN = jnp.full((B, N), cfg.pad_id, jnp.int32).at[:, 0].set(first_B)
  mask_BxN = jnp.zeros((B, N), bool).at[:, 0].set(True)
  out_logits = jnp.zeros((B, N, V), jnp.float32).at[:, 0].set(logits_Bx1xV[:, 0]) if return_logits else None
  done_B = first_B == cfg.eos_id if cfg.eos_id is not None else jnp.zeros((B,), bool)

  def body(carry, slots: int):
    n, kv, valid_BxS, last_B, done_B, tokens_BxN, mask_BxN, out_logits = carry
    slot = Pn + n - 1  # the slot of the token fed in (the previous step's)
    valid_BxS = jax.lax.dynamic_update_slice(valid_BxS, jnp.ones((B, 1), bool), (0, slot))
    positions_Bx1 = (lengths_B + n - 1)[:, None]
    logits_Bx1xV, kv = model.decode_step(last_B[:, None], kv, valid_BxS[:, :slots], slot, positions_Bx1,
                                         kernel=kernel)
    new_B = jnp.where(done_B, cfg.pad_id, pick(logits_Bx1xV[:, 0], n))
    tokens_BxN = jax.lax.dynamic_update_slice(tokens_BxN, new_B[:, None], (0, n))
    mask_BxN = jax.lax.dynamic_update_slice(mask_BxN, ~done_B[:, None], (0, n))
    if return_logits:
      out_logits = jax.lax.dynamic_update_slice(out_logits, logits_Bx1xV, (0, n, 0))
    if cfg.eos_id is not None:
      done_B = done_B | (new_B == cfg.eos_id)
    return n + 1, kv, valid_BxS, new_B, done_B, tokens_BxN, mask_BxN, out_logits

  carry = (jnp.int32(1), kv, valid_BxS, first_B, done_B, tokens_BxN, mask_BxN, out_logits)
  for stop, slots in stages:
    cond = lambda c, stop=stop: (c[0] < stop) & ~jnp.all(c[4])  # noqa: E731
    carry = jax.lax.while_loop(cond, functools.partial(body, slots=slots), carry)
  _, _, _, _, _, tokens_BxN, mask_BxN, out_logits = carry
  return Generation(tokens_BxN, mask_BxN, jnp.sum(mask_BxN, axis=-1, dtype=jnp.int32), out_logits)


_STATIC = ("graphdef", "cfg", "return_logits", "mesh", "kernel")
_generate_jit = jax.jit(_generate, static_argnames=_STATIC)

# Inside the decoding loops libtpu's memory-space assignment stages some layers' key/value caches in on-chip memory
# and copies each one back to HBM after the token's slot is written: a whole cache moved per layer and token where
# the loop needs one slot of it. Asked to skip placements whose uses are small against their copies, it leaves the
# caches in HBM. Where the weights outweigh the caches (small batches, short sequences) the default assignment,
# whose prefetches are then mostly of weights, is kept. The cache-bound program also decodes in up to
# `CACHE_BOUND_STAGES` loops. Measurements: benchmarks/results/tpu_step.md (sampling).
SELECTIVE_MSA = {"xla_tpu_msa_inefficient_use_to_copy_ratio": 2.0}
_generate_jit_cache_bound = jax.jit(functools.partial(_generate, caches_dominate=True), static_argnames=_STATIC,
                                    compiler_options=SELECTIVE_MSA)


def cache_bound(mcfg, batch: int, slots: int, weight_bytes: int) -> bool:
  """Whether decoding ``batch`` rows against ``slots`` cached positions reads more cache than weights per token:
  keys and values of every layer in the compute dtype against ``weight_bytes`` (the parameters in that dtype)."""
  itemsize = jnp.dtype(mcfg.compute_dtype).itemsize
  return batch * slots * mcfg.n_layers * 2 * mcfg.n_kv_heads * mcfg.hd * itemsize > weight_bytes


def decoding_program(params, mcfg, batch: int, slots: int, mesh: Mesh | None = None):
  """The jitted `_generate` for these parameters: on a TPU where decoding is `cache_bound`, compiled with
  `SELECTIVE_MSA` and decoding in up to `CACHE_BOUND_STAGES` loops, else the default compilation and loops. On a
  mesh each device decodes its rows (``batch`` split as `generate` splits it) against its share of the weights and
  key/value heads (both split over ``tensor``, so that split cancels)."""
  leaves = jax.tree.leaves(params)
  if _platform(params, mesh) != "tpu":
    return _generate_jit
  itemsize = jnp.dtype(mcfg.compute_dtype).itemsize
  weight_bytes = sum(int(np.prod(x.shape)) for x in leaves) * itemsize
  rows = -(-batch // split_ways(mesh, "batch"))
  return _generate_jit_cache_bound if cache_bound(mcfg, rows, slots, weight_bytes) else _generate_jit


def check_prompts(prompts_BxP, max_len: int, cfg: SamplingConfig, mesh: Mesh | None = None) -> None:
  """Raises a clear error when the prompts cannot be decoded with ``cfg`` within ``max_len``."""
  if np.ndim(prompts_BxP) != 2:
    raise ValueError(f"prompts must be [batch, prompt_len] (left-padded, see left_pad), got {np.shape(prompts_BxP)}")
  B, Pn = np.shape(prompts_BxP)
  if Pn + cfg.max_new_tokens - 1 > max_len:  # the last new token is never fed back
    raise ValueError(
        f"prompt length {Pn} + max_new_tokens={cfg.max_new_tokens} needs {Pn + cfg.max_new_tokens - 1} positions, more "
        f"than the model's max_len={max_len}: keep prompts to at most max_len + 1 - max_new_tokens = "
        f"{max_len + 1 - cfg.max_new_tokens} tokens"
        + ("" if max_len >= cfg.max_new_tokens else f", and lower max_new_tokens to at most {max_len}")
    )
  check_batch(B, mesh, "prompt batch")


def generate(
    model: Decoder | tuple[nnx.GraphDef, nnx.State],
    prompts_BxP,
    prompt_mask_BxP,
    key: jax.Array | None,
    cfg: SamplingConfig,
    *,
    mesh: Mesh | None = None,
    return_logits: bool = False,
) -> Generation:
  """Completes left-padded prompts with ``model`` (a `Decoder`, or its ``(graphdef, params)``).

  Args:
    prompts_BxP, prompt_mask_BxP: int tokens and bool mask, each row's prompt right-aligned (`left_pad`).
    key: a PRNG key (unused when greedy: ``cfg.temperature == 0``).
    mesh: rows are split over its ``data`` axis; parameters stay where they are (placed on this mesh).
    return_logits: also return the logits of every decoded position (for tests; ``[B, N, V]``).
  """
  graphdef, params = nnx.split(model) if isinstance(model, nnx.Module) else model
  merged = nnx.merge(graphdef, params)
  check_model(merged, DecodingModel, "generate's model")  # e.g. a tunix adapter: no cached decode step
  check_prompts(prompts_BxP, merged.cfg.max_len, cfg, mesh)
  if key is None:
    if cfg.temperature != 0:
      raise ValueError(f"temperature={cfg.temperature} samples: pass a PRNG key (jax.random.key(seed))")
    key = jax.random.key(0)
  tokens = jnp.asarray(prompts_BxP, jnp.int32)
  mask = jnp.asarray(prompt_mask_BxP, bool)
  if mesh is not None:
    tokens, mask = jax.device_put((tokens, mask), NamedSharding(mesh, spec(("batch",), mesh=mesh)))
  program = decoding_program(params, merged.cfg, tokens.shape[0], tokens.shape[1] + cfg.max_new_tokens - 1, mesh)
  attention = getattr(merged.cfg, "attention", "xla")  # (a model without the choice: no decoding kernel)
  kernel = decodes_with_kernel(attention, _platform(params, mesh)) and caches_per_device(params, mesh)
  return program(params, tokens, mask, key, graphdef=graphdef, cfg=cfg, return_logits=return_logits, mesh=mesh,
                 kernel=kernel)


def _platform(params, mesh: Mesh | None) -> str:
  """The platform decoding runs on: the mesh's, or without one where the parameters are (the default backend's)."""
  leaves = jax.tree.leaves(params)
  sharding = getattr(leaves[0], "sharding", None) if leaves else None
  if mesh is None and sharding is not None:
    return next(iter(sharding.device_set)).platform
  return platform_of(mesh)


def caches_per_device(params, mesh: Mesh | None) -> bool:
  """Whether the caches `_generate` makes are placed where a decoded token may write and attend in one Mosaic kernel
  per device (`Decoder.decode_step`'s ``kernel``): on a mesh (rows over ``data``, key/value heads over ``tensor``,
  the kernel in a ``shard_map`` over it), or without one on a single device: parameters placed over several devices
  without a mesh let XLA split the caches as it splits them, which no kernel can follow."""
  devices = {d for x in jax.tree.leaves(params) for d in getattr(getattr(x, "sharding", None), "device_set", ())}
  return mesh is not None or len(devices) <= 1
