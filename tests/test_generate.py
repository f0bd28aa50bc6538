"""KV-cache generation: cached logits equal full forwards, sampling is layout-independent and
vocabulary-parallel, filters hold, rows are independent, bad settings are named."""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TEACHER_CFG, VOCAB, all_gather_shapes
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import meshdistill as md
from meshdistill.models._decode_attention import TILE
from meshdistill.models.generate import (SamplingConfig, _generate_jit, allowed_tokens, decode_stages, generate,
                                         left_pad, sample_tokens)
from meshdistill.parallel.mesh import batch_sharding
from meshdistill.train.cost import _split  # the compiled text split into its computations

CFG = TEACHER_CFG.replace(qk_norm=True, qkv_bias=True)  # every attention branch of the decoder
PROMPTS = [[5, 9, 2, 7, 1], [3, 8], [11, 4, 6], [60]]
N = 6
SAMPLED = SamplingConfig(max_new_tokens=N, temperature=0.9, top_k=12, top_p=0.9)


@pytest.fixture(scope="module")
def model():
  return md.init_model(CFG, seed=3)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens_1xT):
  return nnx.merge(graphdef, params)(tokens_1xT).logits[0]


def _full_logits(model, seq):
  """Full forward logits at the last token of ``seq`` (right-padded to max_len: causal, so the padding is unseen)."""
  padded = np.zeros((1, CFG.max_len), np.int32)
  padded[0, : len(seq)] = seq
  return np.asarray(_forward(*nnx.split(model), padded)[len(seq) - 1])


def test_cached_decode_logits_equal_full_forward_and_greedy_equals_argmax_rollout(model):
  tokens, mask = left_pad(PROMPTS)
  gen = generate(model, tokens, mask, None, SamplingConfig(max_new_tokens=N, temperature=0.0), return_logits=True)
  for r, prompt in enumerate(PROMPTS):
    seq = list(prompt)
    for n in range(N):
      want = _full_logits(model, seq)  # the unpadded row, positions from 0
      np.testing.assert_allclose(gen.logits_BxNxV[r, n], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
      seq.append(int(np.argmax(want)))
    assert list(np.asarray(gen.tokens_BxN[r])) == seq[len(prompt):]
  assert np.asarray(gen.mask_BxN).all() and list(np.asarray(gen.lengths_B)) == [N] * len(PROMPTS)


def test_the_arg_max_of_a_row_is_its_first_maximum_and_always_a_vocabulary_index():
  """`vocab_argmax`: the first index of the row's maximum (ties included), and an index in ``[0, V)`` for every row,
  a row holding NaN too (a max then a min of the indices equal to it gave ``V``, an id outside the vocabulary, where
  no value compared equal to the max: on a TPU, when the two reductions computed the logits' soft cap apart)."""
  from meshdistill.models.generate import vocab_argmax

  x = jnp.asarray([[1.0, 3.0, 3.0, -2.0], [-jnp.inf, -jnp.inf, 0.5, 0.5], [0.0, jnp.nan, 1.0, 2.0]], jnp.float32)
  got = np.asarray(vocab_argmax(x))
  np.testing.assert_array_equal(got[:2], [1, 2])
  assert got.dtype == np.int32 and ((0 <= got) & (got < x.shape[-1])).all(), got


def test_the_decoding_kernel_runs_per_device_where_the_caches_are_placed_for_it_and_decodes_what_xla_decodes(
    monkeypatch):
  """With ``attention: splash`` (the decoding kernel, `_decode_attention`, interpreted off a TPU) a decoded token's
  layer is one kernel call (layers x loops of them, traced) on one device and on a 4x2 mesh (each device its row and
  its key/value head), none on 2x4 (``tensor`` 4 does not divide the 2 key/value heads: the projections replicate
  them) nor where the parameters were placed over several devices without a mesh (a Mosaic kernel cannot be
  partitioned: XLA splits such caches as it sees fit); the greedy tokens and logits are those of ``attention: xla`` in
  every case (bfloat16, left padding)."""
  from meshdistill.models import _decode_attention
  from meshdistill.models import generate as gen_mod

  calls = []
  real = _decode_attention.decode_attention
  monkeypatch.setattr(_decode_attention, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  cfg = CFG.replace(dtype="bfloat16", max_len=48, head_dim=64)  # heads of 64 lanes at least (`usable`)
  tokens, mask = left_pad(PROMPTS)
  greedy = SamplingConfig(max_new_tokens=40, temperature=0.0)
  want = generate(md.init_model(cfg.replace(attention="xla"), seed=3), tokens, mask, None, greedy, return_logits=True)
  assert not calls
  model = md.init_model(cfg.replace(attention="splash"), seed=3)
  mesh, mesh_4x2 = md.make_mesh(data=2, tensor=4), md.make_mesh(data=4, tensor=2)
  found = {}
  for name, m, kw in (("one device", model, {}), ("4x2", md.shard_model(model, mesh_4x2), {"mesh": mesh_4x2}),
                      ("2x4", md.shard_model(model, mesh), {"mesh": mesh}),
                      ("placed, no mesh", md.shard_model(model, mesh), {})):
    calls.clear()
    gen_mod._generate_jit.clear_cache()
    got = generate(m, tokens, mask, None, greedy, return_logits=True, **kw)
    found[name] = len(calls)
    np.testing.assert_array_equal(got.tokens_BxN, want.tokens_BxN)
    np.testing.assert_allclose(got.logits_BxNxV, want.logits_BxNxV, atol=1e-5, rtol=1e-5)
  loops = len(decode_stages(tokens.shape[1], greedy.max_new_tokens))
  per_device = cfg.n_layers * loops
  assert found == {"one device": per_device, "4x2": per_device, "2x4": 0, "placed, no mesh": 0}, found


def test_same_key_gives_the_same_samples_on_one_device_2x4_and_4x2(model):
  tokens, mask = left_pad(PROMPTS)
  key = jax.random.key(7)
  one = generate(model, tokens, mask, key, SAMPLED)
  for data, tensor in ((2, 4), (4, 2)):
    mesh = md.make_mesh(data=data, tensor=tensor)
    got = generate(md.shard_model(model, mesh), tokens, mask, key, SAMPLED, mesh=mesh)
    np.testing.assert_array_equal(got.tokens_BxN, one.tokens_BxN, err_msg=f"{data}x{tensor}")
  compiled = _generate_jit._cache_size()
  other = generate(model, tokens, mask, jax.random.key(8), SAMPLED)
  assert not np.array_equal(other.tokens_BxN, one.tokens_BxN)  # the key matters
  assert _generate_jit._cache_size() == compiled  # another key, same shapes: no recompilation


def test_decode_program_on_2x4_gathers_no_vocabulary(model):
  mesh = md.make_mesh(data=2, tensor=4)
  sharded = md.shard_model(model, mesh)
  tokens, mask = left_pad(PROMPTS)
  graphdef, params = nnx.split(sharded)
  placed = jax.device_put((jnp.asarray(tokens), jnp.asarray(mask)), batch_sharding(mesh))
  hlo = _generate_jit.lower(
      params, *placed, jax.random.key(0), graphdef=graphdef, cfg=SAMPLED, return_logits=False, mesh=mesh
  ).compile().as_text()
  shapes = all_gather_shapes(hlo)
  assert not [s for s in shapes if VOCAB in s], f"vocabulary-sized all-gathers: {shapes}"


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    top_k=st.sampled_from([0, 1, 3, 7]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    scale=st.sampled_from([0.5, 4.0]),
)
def test_top_k_and_top_p_never_pick_outside_the_allowed_set(seed, top_k, top_p, scale):
  rng = np.random.default_rng(seed)
  logits = (rng.normal(size=(32, 16)) * scale).astype(np.float32)
  logits[:, 3] = logits[:, 5]  # a tie somewhere
  cfg = SamplingConfig(max_new_tokens=1, temperature=1.0, top_k=top_k, top_p=top_p)
  keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(seed), r))(jnp.arange(32))
  picks = np.asarray(jax.jit(lambda l, k: sample_tokens(l, k, 0, cfg))(logits, keys))
  ok = np.asarray(allowed_tokens(jnp.asarray(logits), top_k, top_p))
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  for b, i in enumerate(picks):
    above = logits[b] > logits[b, i]
    if top_k:
      assert above.sum() < top_k, (b, i)
    kept = logits[b] >= np.sort(logits[b])[-top_k] if top_k else np.ones(16, bool)
    p = np.where(kept, probs[b], 0) / np.where(kept, probs[b], 0).sum()
    assert p[above].sum() < top_p + 1e-5, (b, i)
    assert ok[b, i]
  assert ok.any(-1).all()  # never an empty set


def test_padding_rows_and_finished_rows_do_not_change_other_rows(model):
  tokens, mask = left_pad(PROMPTS)
  key = jax.random.key(1)
  base = generate(model, tokens, mask, key, SAMPLED)
  # Wider padding and extra rows appended: the original rows decode the same tokens.
  wide_t, wide_m = left_pad(PROMPTS + [[1, 2, 3, 4, 5, 6, 7], [9]] + [[2]] * 2, width=11)  # 11 + N - 1 = max_len
  wide = generate(model, wide_t, wide_m, key, SAMPLED)
  np.testing.assert_array_equal(wide.tokens_BxN[: len(PROMPTS)], base.tokens_BxN)
  # A token some row emits at its 2nd step becomes EOS: that row stops there, the others do not change.
  eos = int(base.tokens_BxN[1, 1])
  stopped = generate(model, tokens, mask, key, SamplingConfig(**{**SAMPLED.__dict__, "eos_id": eos, "pad_id": 63}))
  t, m = np.asarray(stopped.tokens_BxN), np.asarray(stopped.mask_BxN)
  for r in range(len(PROMPTS)):
    row = list(np.asarray(base.tokens_BxN[r]))
    n = row.index(eos) + 1 if eos in row else N
    assert list(t[r, :n]) == row[:n] and (t[r, n:] == 63).all()
    assert m[r, :n].all() and not m[r, n:].any() and stopped.lengths_B[r] == n


def test_decoding_in_loops_over_prefixes_gives_what_one_loop_over_the_whole_cache_gives(model, monkeypatch):
  """`decode_stages` splits the new tokens into loops that attend to the slots filled so far only: the logits,
  samples and EOS stops equal those of one loop over the whole cache (both programs compiled here), on one device
  and on a 2x4 mesh."""
  from meshdistill.models import generate as gen_mod

  n = 10  # 5 + 10 - 1 = 14 slots of max_len 16
  tokens, mask = left_pad(PROMPTS)
  cfg = SamplingConfig(max_new_tokens=n, temperature=0.9, top_k=12)
  runs = {}
  for stages, shortest in ((1, 32), (4, 2)):
    monkeypatch.setattr(gen_mod, "DECODE_STAGES", stages)
    monkeypatch.setattr(gen_mod, "MIN_STAGE_TOKENS", shortest)
    assert len(gen_mod.decode_stages(tokens.shape[1], n)) == stages
    _generate_jit.clear_cache()
    runs[stages] = generate(model, tokens, mask, jax.random.key(5), cfg, return_logits=True)
    stop_at = dataclasses.replace(cfg, eos_id=int(runs[stages].tokens_BxN[2, 4]))  # row 2 stops in the 2nd loop
    runs[(stages, "eos")] = generate(model, tokens, mask, jax.random.key(5), stop_at)
  mesh = md.make_mesh(data=2, tensor=4)  # the four loops with rows over data and the weights over tensor
  sharded = generate(md.shard_model(model, mesh), tokens, mask, jax.random.key(5), cfg, mesh=mesh)
  _generate_jit.clear_cache()  # no program of these loops left for the tests after this one
  assert gen_mod.decode_stages(tokens.shape[1], n) == ((3, 7), (5, 9), (8, 12), (10, 14))  # (stop, slots)
  one, four = runs[1], runs[4]
  want = np.asarray(one.logits_BxNxV)
  np.testing.assert_allclose(np.asarray(four.logits_BxNxV), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  np.testing.assert_array_equal(four.tokens_BxN, one.tokens_BxN)
  for field in ("tokens_BxN", "mask_BxN", "lengths_B"):
    np.testing.assert_array_equal(getattr(runs[(4, "eos")], field), getattr(runs[(1, "eos")], field))
  np.testing.assert_array_equal(sharded.tokens_BxN, one.tokens_BxN)
  row = list(np.asarray(one.tokens_BxN[2]))
  assert int(runs[(4, "eos")].lengths_B[2]) == row.index(row[4]) + 1 < n


def test_bad_sampling_settings_and_long_prompts_are_named(model):
  with pytest.raises(ValueError, match="top_p=1.5"):
    SamplingConfig(top_p=1.5)
  with pytest.raises(ValueError, match="top_p=0"):
    SamplingConfig(top_p=0)
  with pytest.raises(ValueError, match="temperature=-1"):
    SamplingConfig(temperature=-1)
  tokens, mask = left_pad([[1] * 12])
  with pytest.raises(ValueError, match=r"max_new_tokens=6 needs 17 positions, more than the model's max_len=16.* = 11"):
    generate(model, tokens, mask, jax.random.key(0), SAMPLED)
  with pytest.raises(ValueError, match="PRNG key"):
    generate(model, *left_pad([[1]]), None, SAMPLED)
  with pytest.raises(ValueError, match="at least one token"):
    left_pad([[1], []])


def test_a_vocabulary_padded_for_the_tensor_axis_is_never_sampled_and_its_logits_are_cut():
  """Vocabulary 10 on a 2x4 mesh is padded to 12 rows (zero at init, so logit 0: often the largest); the
  cached decoding must cut them as the full forward pass does: no id >= 10 in many samples, logits [B, N, 10]."""
  mesh = md.make_mesh(data=2, tensor=4)
  cfg = CFG.replace(vocab_size=10)
  model = md.init_model(cfg, seed=5, mesh=mesh)
  assert model.cfg.padded_vocab == 12
  tokens, mask = left_pad([[1, 2, 3], [4], [5, 6], [7, 8, 9, 1]] * 2)
  flat = SamplingConfig(max_new_tokens=N, temperature=2.0)
  ids = np.concatenate([np.asarray(generate(model, tokens, mask, jax.random.key(s), flat, mesh=mesh).tokens_BxN)
                        for s in range(40)])
  assert ids.size == 40 * 8 * N and ids.max() < 10, np.unique(ids)
  assert len(np.unique(ids)) == 10  # every real id is reachable: the cut took the padding only
  gen = generate(model, tokens, mask, None, SamplingConfig(max_new_tokens=N, temperature=0.0), mesh=mesh,
                 return_logits=True)
  assert gen.logits_BxNxV.shape == (8, N, 10)
  for r, prompt in enumerate([[1, 2, 3], [4]]):  # the cached logits are the full forward's, position by position
    seq = list(prompt) + [int(t) for t in np.asarray(gen.tokens_BxN[r])]
    full = np.asarray(jax.jit(lambda m, t: m(t).logits)(model, jnp.asarray([seq[:-1]], jnp.int32)))[0]
    np.testing.assert_allclose(gen.logits_BxNxV[r], full[len(prompt) - 1:], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
def test_decoding_over_scanned_blocks_stages_no_cache_on_a_tpu():
  """Compiled for one v5e chip (libtpu here, nothing runs), the decoding loops over stacked blocks keep one cache
  per layer and attend to it in place: no stacked cache anywhere; one cache of every slot per layer, made once (no
  cache of the first loop's length exists outside a fusion); and no loop copies or slices a cache itself: the first
  loop reads its prefix (`decode_stages`: 39 of 71 slots) inside the fusions that attend to it. Through the layer scan
  each layer staged its slice of the stacked caches on every token."""
  import re

  from jax.sharding import SingleDeviceSharding

  from meshdistill.models import abstract_params
  from meshdistill.planner._hardware import tpu_target

  N = 64
  cfg = CFG.replace(scan_layers=True, n_layers=3, max_len=8 + N)
  device = SingleDeviceSharding(tpu_target("v5e:1x1").devices[0])
  graphdef, state, _ = abstract_params(cfg)
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), state)
  B, P = 8, 8
  args = (jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=device), jax.ShapeDtypeStruct((B, P), bool, sharding=device),
          jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=device))
  hlo = _generate_jit.lower(state, *args, graphdef=graphdef, cfg=SamplingConfig(max_new_tokens=N), return_logits=False,
                            mesh=None).compile().as_text()
  stages = decode_stages(P, N)
  (_, first), (_, every) = stages
  assert (first, every) == (P + 32 - 1, P + N - 1)
  computations = {name: [line.strip() for line in text.splitlines()[1:]] for name, text in _split(hlo)[1].items()}
  fused = {c for lines in computations.values() for line in lines if " fusion(" in line
           for c in re.findall(r"calls=%([\w.\-]+)", line)}
  bodies = {b for lines in computations.values() for line in lines if " while(" in line
            for b in re.findall(r"body=%([\w.\-]+)", line)}
  assert len(bodies) == len(stages) and not bodies & fused, (bodies, len(stages))
  G, K = cfg.n_kv_heads, cfg.hd
  slots = -(-every // TILE) * TILE  # the cache holds whole tiles of slots
  assert not re.search(rf"\[{cfg.n_layers},{B},{G},\d+,{K}\]", hlo), "a stacked cache [L, B, G, S, K] in the program"
  unfused = "\n".join(line for c, lines in computations.items() if c not in fused for line in lines)
  assert re.search(rf"\[{B},{G},{slots},{K}\]", unfused), "no per-layer cache of every slot: the test reads nothing"
  assert not re.search(rf"\[{B},{G},{first},{K}\]", unfused), "a cache of the first loop's length was made"
  staged = [line[:120] for b in bodies for line in computations[b]  # (a new slot's [B, G, 1, K] may be relaid)
            for S in re.findall(rf"= [a-z]+[0-9]+\[{B},{G},(\d+),{K}\]\S* (?:copy|dynamic-slice|slice)\(", line)
            if int(S) >= first]
  assert not staged, staged
  prefix = [line for c in fused for line in computations[c]
            if re.search(rf"= [a-z]+[0-9]+\[{B},{G},{first},{K}\]\S* slice\(", line)]
  assert prefix, "the first loop's prefix is not read inside a fusion"


def test_with_an_expert_capacity_a_left_padded_prompt_generates_what_it_would_alone():
  """A mixture of experts with a capacity (assignments dropped past it): a prompt's left padding takes no expert's
  places in the prompt's pass and the prompt's capacity counts its real tokens, so a padded row's logits and tokens
  are those of the row decoded alone, unpadded (before, its padding ranked first for every expert)."""
  from meshdistill.models.moe import MoeConfig

  cfg = CFG.replace(moe=MoeConfig(n_experts=4, top_k=2, expert_hidden=16, capacity_factor=1.0))
  model = md.init_model(cfg, seed=2)
  prompts = [[5, 9, 2, 7, 1, 8, 3], [3, 8, 12]]
  tokens, mask = left_pad(prompts)
  sc = SamplingConfig(max_new_tokens=6, temperature=0)
  batch = generate(model, tokens, mask, None, sc, return_logits=True)
  alone = generate(model, np.asarray([prompts[1]], np.int32), np.ones((1, 3), bool), None, sc, return_logits=True)
  np.testing.assert_array_equal(batch.tokens_BxN[1], alone.tokens_BxN[0])
  np.testing.assert_allclose(batch.logits_BxNxV[1], alone.logits_BxNxV[0], rtol=1e-5, atol=1e-5)


def test_a_cache_attends_to_the_slots_its_mask_covers_and_refuses_a_mask_longer_than_itself():
  """`KVCache.attended`: the first ``valid_BxS.shape[1]`` slots of a longer cache (a decoding loop's prefix), the
  whole cache where the mask covers it, and a clear error where the mask covers more slots than the cache holds."""
  from meshdistill.models.decoder import KVCache

  k = jnp.arange(2 * 1 * 6 * 2, dtype=jnp.float32).reshape(2, 1, 6, 2)  # [B, G, S, K]
  for S in (4, 6):
    cache = KVCache(k, -k, jnp.ones((2, S), bool), 0, jnp.zeros((2, 1), jnp.int32))
    got_k, got_v = cache.attended()  # [B, S, G, K], the attention's layout
    np.testing.assert_array_equal(got_k, jnp.swapaxes(k[:, :, :S], 1, 2))
    np.testing.assert_array_equal(got_v, -jnp.swapaxes(k[:, :, :S], 1, 2))
  with pytest.raises(ValueError, match="covers 7 slots but the cache holds 6"):
    KVCache(k, k, jnp.ones((2, 7), bool), 0, jnp.zeros((2, 1), jnp.int32)).attended()


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
def test_loops_over_prefixes_of_the_cache_need_no_more_memory_than_one_loop_on_a_tpu(monkeypatch):
  """Compiled for one v5e chip (nothing runs): the compiler's peak of four loops, each attending to a longer prefix
  of the caches, is not above that of one loop over the whole caches, where the caches are most of the memory (64
  rows, 8 + 128 tokens): no loop copies the prefix it reads."""
  from jax.sharding import SingleDeviceSharding

  from meshdistill.models import abstract_params
  from meshdistill.models import generate as gen_mod
  from meshdistill.planner._hardware import tpu_target

  B, P, N = 64, 8, 128
  cfg = CFG.replace(n_layers=3, max_len=P + N)
  device = SingleDeviceSharding(tpu_target("v5e:2x2").devices[0])
  graphdef, state, _ = abstract_params(cfg)
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), state)
  args = (jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=device), jax.ShapeDtypeStruct((B, P), bool, sharding=device),
          jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=device))
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  cache = 2 * cfg.n_layers * B * (P + N - 1) * cfg.n_kv_heads * cfg.hd * jnp.dtype(cfg.compute_dtype).itemsize
  assert cache > weights  # the caches are what the loops could hold twice
  peak = {}
  for stages in (1, 4):
    monkeypatch.setattr(gen_mod, "DECODE_STAGES", stages)
    assert len(gen_mod.decode_stages(P, N)) == stages
    _generate_jit.clear_cache()
    compiled = _generate_jit.lower(state, *args, graphdef=graphdef, cfg=SamplingConfig(max_new_tokens=N),
                                   return_logits=False, mesh=None).compile()
    peak[stages] = compiled.memory_analysis().peak_memory_in_bytes
  _generate_jit.clear_cache()
  (_, first), *_ = gen_mod.decode_stages(P, N)
  prefix_copy = B * first * cfg.n_kv_heads * cfg.hd * jnp.dtype(cfg.compute_dtype).itemsize  # one layer's keys
  assert peak[4] - peak[1] < prefix_copy, (peak, prefix_copy)  # (the loops' own masks and counters aside)


def test_the_cache_bound_program_decodes_in_more_loops_than_the_default(model, monkeypatch):
  """`_generate` traced as the cache-bound program (`decoding_program`'s choice on a TPU where the caches outweigh the
  weights) holds `CACHE_BOUND_STAGES` decoding loops, the default program `DECODE_STAGES` (here 8 and 4, loops of
  one token at least); traced only, nothing compiles."""
  from meshdistill.models import generate as gen_mod

  monkeypatch.setattr(gen_mod, "MIN_STAGE_TOKENS", 1)
  tokens, mask = left_pad(PROMPTS)
  graphdef, params = nnx.split(model)
  loops = {}
  for bound in (False, True):
    run = functools.partial(gen_mod._generate, graphdef=graphdef, cfg=SamplingConfig(max_new_tokens=10),
                            return_logits=False, mesh=None, caches_dominate=bound)
    jaxpr = jax.make_jaxpr(run)(params, tokens, mask, jax.random.key(0))
    loops[bound] = sum(e.primitive.name == "while" for e in jaxpr.jaxpr.eqns)
  assert (gen_mod.DECODE_STAGES, gen_mod.CACHE_BOUND_STAGES) == (4, 8)
  assert loops == {False: 4, True: 8}, loops


def test_decoding_is_cache_bound_where_the_caches_outweigh_the_weights_and_the_cpu_keeps_the_default_program():
  """`cache_bound` at the sampling benchmark's shapes (a 14-layer Qwen3-0.6B-shaped student, bfloat16, 128 + 256
  tokens: 0.75 GB of weights): batch 64 reads 1.4 GB of cache a token, batch 8 0.18 GB. Off a TPU the program is the
  default one whatever the shapes (`SELECTIVE_MSA` is a libtpu option)."""
  from meshdistill.models import generate as gen_mod

  qwen = md.ModelConfig(vocab_size=151936, d_model=1024, n_layers=14, n_heads=16, n_kv_heads=8, head_dim=128,
                        mlp_hidden=3072, max_len=384, dtype="bfloat16")
  weights = 375_000_000 * 2
  assert gen_mod.cache_bound(qwen, 64, 383, weights) and not gen_mod.cache_bound(qwen, 8, 383, weights)
  model = md.init_model(CFG, seed=0)
  params = nnx.state(model)
  assert gen_mod.decoding_program(params, CFG, 10_000, 10_000) is gen_mod._generate_jit


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
def test_cache_bound_decoding_on_a_tpu_keeps_the_caches_in_hbm(monkeypatch):
  """Compiled for one v5e chip (nothing runs), an 8-layer decoder with caches of the benchmark's shape (64 rows, 8
  key/value heads of 128, bfloat16, 128 + 256 tokens): the program `decoding_program` picks there (`SELECTIVE_MSA`)
  copies no cache into on-chip memory inside the decoding loops, compiled in two loops (its loops are alike; it
  decodes in `CACHE_BOUND_STAGES`). (libtpu's default memory-space assignment staged 10 of the 16 caches so, copies of
  whole caches each token, when this program was compiled with it at 3db1e63 in four loops, and 5 in two loops at
  7f474cc; the default program is not compiled here, to keep the suite's time.)"""
  import re

  from jax.sharding import SingleDeviceSharding

  from meshdistill.models import abstract_params
  from meshdistill.models import generate as gen_mod
  from meshdistill.planner._hardware import tpu_target

  B, P, N = 64, 128, 256
  cfg = CFG.replace(n_layers=8, max_len=P + N, d_model=256, n_heads=16, n_kv_heads=8, head_dim=128, mlp_hidden=512,
                    dtype="bfloat16")
  device = SingleDeviceSharding(tpu_target("v5e:1x1").devices[0])
  graphdef, state, _ = abstract_params(cfg)
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), state)
  args = (jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=device), jax.ShapeDtypeStruct((B, P), bool, sharding=device),
          jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=device))
  program = gen_mod.decoding_program(state, cfg, B, P + N - 1)
  assert program is gen_mod._generate_jit_cache_bound
  monkeypatch.setattr(gen_mod, "CACHE_BOUND_STAGES", 2)  # the loops are alike: two of them to keep the suite's time
  program.clear_cache()

  hlo = program.lower(state, *args, graphdef=graphdef, cfg=SamplingConfig(max_new_tokens=N), return_logits=False,
                      mesh=None).compile().as_text()
  program.clear_cache()
  cache = rf"\[\d+,{cfg.n_kv_heads},\d+,{cfg.hd}\]"  # a cache [B, G, S, K], or a block of its rows
  _, computations, entry = _split(hlo)
  found, reads = [], 0
  slots = -(-(P + N - 1) // TILE) * TILE  # whole tiles of slots
  for line in (ln for name, text in computations.items() if name != entry for ln in text.splitlines()[1:]):
    reads += bool(re.search(rf"{B},{cfg.n_kv_heads},({slots}|{P + N - 1}),{cfg.hd}\]", line))
    if re.search(rf"= \(\w+{cache}.*(copy-start|slice-start)\(", line):
      found.append(line.strip()[:100])
  assert reads, "no instruction outside the entry touches a whole cache: the test reads nothing"
  assert found == []


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
@pytest.mark.parametrize("layout", ["one chip", "2x2 mesh"])
def test_on_a_tpu_a_decoded_token_writes_and_attends_in_one_kernel_per_layer_and_no_cache_is_copied(
    monkeypatch, layout):
  """Compiled for v5e chips (nothing runs; on one chip its mesh in context, as on the chip, where the default backend
  names the platform) with the benchmark's cache shape (64 rows, 8 key/value heads of 128, bfloat16, 128 + 256
  tokens): every decoded token's layer is one Mosaic call (`_decode_attention`, layers x loops of them) whose output
  caches are its input ones, and no instruction copies, slices or updates a whole cache: its new slot is written by
  the kernel, in place. On a 2x2 mesh (parameters placed by their partitioning) each device holds its rows and
  key/value heads ([32, 4, S, 128]) and runs the kernel on them: no collective moves a cache."""
  import re

  from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

  from meshdistill.models import abstract_params
  from meshdistill.models import generate as gen_mod
  from meshdistill.parallel.rules import fitted_shardings
  from meshdistill.planner._hardware import tpu_target

  B, P, N = 64, 128, 256
  cfg = CFG.replace(n_layers=2, max_len=P + N, d_model=256, n_heads=16, n_kv_heads=8, head_dim=128, mlp_hidden=512,
                    dtype="bfloat16")
  graphdef, state, _ = abstract_params(cfg)
  if layout == "one chip":
    chip = tpu_target("v5e:1x1").devices[0]
    mesh, rows, kv_heads = None, B, 8
    chip_mesh = Mesh(np.array([chip]).reshape(1, 1), ("data", "tensor"))
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(chip), state)
    inputs = replicated = SingleDeviceSharding(chip)
  else:
    mesh = Mesh(np.array(tpu_target("v5e:2x2").devices).reshape(2, 2), ("data", "tensor"))
    rows, kv_heads = B // 2, 4
    shardings = fitted_shardings(state, mesh)
    inputs, replicated = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
  args = (jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=inputs), jax.ShapeDtypeStruct((B, P), bool, sharding=inputs),
          jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated))
  program = gen_mod.decoding_program(state, cfg, B, P + N - 1, mesh)
  monkeypatch.setattr(gen_mod, "CACHE_BOUND_STAGES", 2)  # the loops are alike: two of them to keep the suite's time
  monkeypatch.setattr(gen_mod, "DECODE_STAGES", 2)
  program.clear_cache()
  with jax.set_mesh(chip_mesh) if mesh is None else contextlib.nullcontext():  # (a mesh: `generate` places the caches)
    hlo = program.lower(state, *args, graphdef=graphdef, cfg=SamplingConfig(max_new_tokens=N), return_logits=False,
                        mesh=mesh, kernel=gen_mod.caches_per_device(state, mesh)).compile().as_text()
  program.clear_cache()
  calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  assert len(calls) == cfg.n_layers * 2, len(calls)
  assert all("output_to_operand_aliasing={{1}: (5, {}), {2}: (6, {})}" in line for line in calls), calls[0][:400]
  assert all(f"bf16[{rows},{kv_heads},384,128]" in line for line in calls), calls[0][:400]  # this device's caches
  moves = "copy|copy-start|slice|dynamic-slice|dynamic-update-slice|all-gather|all-to-all|collective-permute|all-reduce"
  cache = rf"= \w+\[\d+,\d+,(\d+),{cfg.hd}\]\S* ({moves})(-start)?\("
  _, computations, entry = _split(hlo)
  lines = [line for name, text in computations.items() if name != entry for line in text.splitlines()[1:]]
  moved = [line.strip()[:120] for line in lines for S, *_ in re.findall(cache, line) if int(S) >= P]  # (not queries)
  assert moved == []


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
def test_the_decoding_kernel_fits_a_chip_at_the_longest_caches_it_takes_and_longer_ones_keep_xla():
  """Compiled for one v5e chip (nothing runs): the kernel at the longest caches `usable` admits (a grid step reads
  every slot of its rows and heads) fits the chip's scoped on-chip memory, for 128- and 256-wide heads and for the
  benchmark's batch; a cache twice as long is not usable (it would overflow that memory: a long reasoning trace
  decodes through XLA), and `decode_attention` refuses it naming what it needs."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from meshdistill.models._decode_attention import STEP_BYTES, decode_attention, usable
  from meshdistill.planner._hardware import tpu_target

  mesh = Mesh(np.array(tpu_target("v5e:1x1").devices[:1]), ("x",))
  on_chip = NamedSharding(mesh, PartitionSpec())
  for B, G, R, K in ((1, 8, 2, 128), (1, 1, 4, 256), (64, 8, 2, 128)):
    S = STEP_BYTES // (2 * K * 2)  # the longest usable cache of bfloat16 values
    assert usable(S, 2, K) and not usable(2 * S, 2, K)
    sd = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)  # noqa: E731
    fn = jax.jit(lambda q, kn, vn, k, v, valid, i: decode_attention(q, kn, vn, k, v, valid, i, scale=K**-0.5),
                 donate_argnums=(3, 4))
    fn.lower(sd((B, G, R, K)), sd((B, G, K)), sd((B, G, K)), sd((B, G, S, K)), sd((B, G, S, K)),
             sd((B, S), jnp.bool_), sd((), jnp.int32)).compile()  # raises where the blocks do not fit
  k = jnp.zeros((1, 1, 2 * S, K), jnp.bfloat16)
  with pytest.raises(ValueError, match=rf"a \(row, head\)'s keys and values within {STEP_BYTES} bytes"):
    decode_attention(jnp.zeros((1, 1, R, K), jnp.bfloat16), k[:, :, 0], k[:, :, 0], k, k,
                     jnp.ones((1, 2 * S), bool), 0, scale=1.0, interpret=True)


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
def test_on_a_mesh_decoding_is_cache_bound_by_the_rows_each_device_decodes():
  """The benchmark's student (abstract, placed on TPU devices of a libtpu topology; nothing compiles): 64 rows on one
  chip read more cache than weights a token, so they get `SELECTIVE_MSA`; split four ways over ``data`` each device
  decodes 16 and keeps the default program."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

  from meshdistill.models import abstract_params
  from meshdistill.models import generate as gen_mod
  from meshdistill.planner._hardware import tpu_target

  qwen = md.ModelConfig(vocab_size=151936, d_model=1024, n_layers=14, n_heads=16, n_kv_heads=8, head_dim=128,
                        mlp_hidden=3072, max_len=384, dtype="bfloat16")
  _, state, _ = abstract_params(qwen)
  one = SingleDeviceSharding(tpu_target("v5e:1x1").devices[0])
  on_one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), state)
  assert gen_mod.decoding_program(on_one, qwen, 64, 383) is gen_mod._generate_jit_cache_bound
  mesh = Mesh(np.array(tpu_target("v5e:2x2").devices).reshape(4, 1), ("data", "tensor"))
  on_mesh = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())),
                         state)
  assert gen_mod.decoding_program(on_mesh, qwen, 64, 383, mesh) is gen_mod._generate_jit
  assert gen_mod.decoding_program(on_mesh, qwen, 256, 383, mesh) is gen_mod._generate_jit_cache_bound
