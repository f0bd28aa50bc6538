"""On the chip: the TPU's own kernels and the model's fast paths against their reference forms, values and gradients.

Run on a TPU machine, in one process (see tests/tpu/conftest.py; skipped with the reason elsewhere):

  python -m pytest -o addopts= -m tpu tests/tpu -q -ra
  MESHDISTILL_TPU_TESTS_ON=cpu python -m pytest -n 0 tests/tpu -q   # the same tests on the CPU (splash interpreted)

Both sides of every comparison run on the chip; tests/tpu/test_tpu_training.py compares the chip with the CPU. Shapes
are the chip's: head_dim 128 (the MXU and the kernel's lane width), sequences a multiple of 128 (the splash kernel's
blocks), vocabularies and hidden sizes multiples of 128.

Tolerances (errors are `helpers.rel_err`, one Frobenius-norm ratio per array, unless said otherwise):

==========================================  ==============  ====================================================
comparison                                  bound           why
==========================================  ==============  ====================================================
float32 under ``default_matmul_precision``  1e-4            'highest' makes every float32 product (XLA's and the
('highest'): splash vs explicit scores,                     Pallas kernel's: Mosaic's fp32 contract precision) a
chunked vs full logits, scanned vs                          float32 one; what is left is summation order (blocks,
unrolled, ragged_dot vs the loop, cached                    chunks, groups: ~sqrt(n) * 6e-8) and the TPU's own
vs full forward                                             exp / log / tanh, which agree with the CPU's to 4-5
                                                            digits only (10x the suite's CPU bound of 1e-5)
splash kernel in bfloat16 vs explicit       1e-2 values,    the kernel rounds the scaled queries, the
float32 scores on the same inputs           2e-2 grads      probabilities before their product with the values
                                                            and its outputs to bfloat16 (8 bits: 2^-9 = 2e-3
                                                            each); the backward pass rounds twice more and
                                                            subtracts (dS = P (dP - delta)). Seen in interpret
                                                            mode, the same roundings: 2.4-3.4e-3 values,
                                                            3.7-5.3e-3 grads; the bounds are 3-4x that
ragged_dot vs the loop over experts in      2e-2            each of the three products and the gate's activation
bfloat16                                                    round to bfloat16 (2^-9), in other orders on the two
                                                            paths: 3-6e-3 seen on the CPU (each 6-9e-3 from float32)
query/key kernel (`_head_prep`) vs          1e-2            the XLA form rounds the rotation's two gradient terms
`head_norm` + `rope` in bfloat16                            to bfloat16 apart and adds them there, the kernel adds
                                                            in float32 and rounds once: 2.7-3.3e-3 seen on the CPU
==========================================  ==============  ====================================================

At the TPU's default precision a float32 matrix product runs as one bfloat16 pass (about 3 digits), which would hide
any real error under rounding; so the float32 comparisons set 'highest' and the bfloat16 ones state bfloat16's
bound. Where an option could silently do nothing, the test also checks that it matters here (a window or a soft-cap
changes the output, a dropped assignment changes the experts' sum).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rel_err, token_major

import meshdistill as md
from meshdistill.models._attention import _explicit_attention, splash_attention
from meshdistill.models.generate import SamplingConfig, decode_stages, generate, left_pad
from meshdistill.models.moe import MoeConfig, dense_experts, grouped_experts, route
from meshdistill.models.stacking import to_scanned
from meshdistill.strategies import LogitKD
from meshdistill.strategies import ChunkedLogitKD

pytestmark = pytest.mark.tpu

F32_TOL = 1e-4  # float32 at 'highest' precision: see the table above
HIGHEST = "highest"

# A decoder of chip-friendly shapes: 2 query heads of 128 sharing one key/value head, every block option of the
# Gemma 2 family that changes attention (local and global layers, soft-capped scores and logits, a query scale).
CHIP_CFG = md.ModelConfig(
    vocab_size=512, d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=128, mlp_hidden=512, max_len=256,
    sliding_window=96, layer_types=("sliding_attention", "full_attention"), attn_softcap=20.0, final_softcap=30.0,
    query_scale=0.1, attention="xla", dtype="float32", param_dtype="float32",
    scan_layers=False)  # named: the defaults differ on a TPU


def _tokens(shape, vocab, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def _qkv(dtype, T=1024, seed=0):
  """Queries (scaled up: scores of a few units, so a soft-cap of 5 bends them), keys, values ``[1, T, H|G, 128]`` and a
  random cotangent ``w`` for a scalar loss ``sum(out * w)``."""
  rng = np.random.default_rng(seed)
  q, k, v = (rng.normal(size=(1, T, h, 128)) for h in (4, 2, 2))
  w = jnp.asarray(rng.normal(size=(1, T, 4, 128)), jnp.float32)
  return (jnp.asarray(3.0 * q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype)), w


def _attention_and_grads(attn, qkv, w):
  """``(out, (dq, dk, dv))`` of ``sum(attn(q, k, v) * w)``, compiled."""
  def loss(q, k, v):
    out = attn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * w), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*qkv)
  return out, grads


@pytest.mark.parametrize("window, cap", [(None, None), (384, None), (None, 5.0), (384, 5.0)],
                         ids=["causal", "window", "softcap", "window+softcap"])
def test_splash_kernel_in_bfloat16_gives_the_explicit_attention_and_its_gradients(window, cap):
  """T = 1024: blocks of 512, so the causal and local masks skip whole blocks and cut others."""
  qkv, w = _qkv(jnp.bfloat16)
  out, grads = _attention_and_grads(lambda *a: token_major(splash_attention)(*a, window=window, cap=cap), qkv, w)
  with jax.default_matmul_precision(HIGHEST):  # the reference: float32 scores of the same bfloat16 inputs
    want, want_grads = _attention_and_grads(
        lambda *a: _explicit_attention(*(x.astype(jnp.float32) for x in a), window=window, cap=cap)[0], qkv, w)
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, want) < 1e-2, rel_err(out, want)
  for name, g, r in zip("qkv", grads, want_grads):
    assert rel_err(g, r) < 2e-2, (name, rel_err(g, r))
  if window or cap:  # the option is not a no-op at these shapes: the plain causal reference is far from it
    with jax.default_matmul_precision(HIGHEST):
      plain, _ = _attention_and_grads(lambda *a: _explicit_attention(*(x.astype(jnp.float32) for x in a))[0], qkv, w)
    assert rel_err(plain, want) > 0.1


def test_splash_kernel_in_float32_at_highest_precision_equals_the_explicit_attention():
  qkv, w = _qkv(jnp.float32, seed=1)
  with jax.default_matmul_precision(HIGHEST):
    out, grads = _attention_and_grads(lambda *a: token_major(splash_attention)(*a, window=384, cap=5.0, scale=0.05), qkv, w)
    want, want_grads = _attention_and_grads(
        lambda *a: _explicit_attention(*a, window=384, cap=5.0, scale=0.05)[0], qkv, w)
  assert rel_err(out, want) < F32_TOL, rel_err(out, want)
  for name, g, r in zip("qkv", grads, want_grads):
    assert rel_err(g, r) < F32_TOL, (name, rel_err(g, r))


def _nll_and_grads(model, tokens):
  """Mean next-token loss of ``model`` on ``tokens`` and its gradients (a pure dict), compiled."""
  graphdef, params = nnx.split(model)

  def loss(params):
    logp = jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens[:, :-1]).logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return value, nnx.to_pure_dict(grads)


def _trees_rel_err(got, want) -> dict:
  flat = lambda tree: {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}  # noqa: E731
  g, w = flat(jax.device_get(got)), flat(jax.device_get(want))
  assert g.keys() == w.keys(), sorted(set(g) ^ set(w))
  return {k: rel_err(g[k], w[k]) for k in w}


def test_splash_decoder_with_local_layers_and_softcaps_equals_explicit_attention():
  """The whole decoder (a local and a global layer, soft-caps, query scale, grouped heads) with attention='splash'
  and with 'explicit': loss and every weight's gradient, float32 at 'highest'."""
  tokens = _tokens((2, 257), CHIP_CFG.vocab_size)  # 256 positions after the shift
  with jax.default_matmul_precision(HIGHEST):
    got, got_grads = _nll_and_grads(md.init_model(CHIP_CFG.replace(attention="splash"), seed=0), tokens)
    want, want_grads = _nll_and_grads(md.init_model(CHIP_CFG.replace(attention="explicit"), seed=0), tokens)
  assert abs(float(got) / float(want) - 1) < F32_TOL, (float(got), float(want))
  errors = _trees_rel_err(got_grads, want_grads)
  assert max(errors.values()) < F32_TOL, {k: e for k, e in errors.items() if e >= F32_TOL}


@pytest.mark.parametrize("loss_kernel", ["pallas", "xla"], ids=["loss-kernel", "xla-loss"])
def test_chunked_logit_kd_loss_metrics_and_grads_equal_full_logit_kd(loss_kernel):
  """`ChunkedLogitKD` (vocabulary projections chunk by chunk from the final hidden states, never the [N, V] logits)
  against `LogitKD` on the full logits: every reported sum and the gradients of the student's hidden states and head.
  4 x 256 tokens, D 256, V 2048, chunks of 384 (the last one padded); each chunk's values and logits gradient from
  the Pallas kernel (``loss_kernel="pallas"``) and from XLA (the default)."""
  B, T, D, E, V = 4, 256, 256, 384, 2048
  k = jax.random.split(jax.random.key(0), 6)
  s, t = jax.random.normal(k[0], (B, T, D)), jax.random.normal(k[1], (B, T, E))
  w, wt = 0.1 * jax.random.normal(k[2], (D, V)), 0.1 * jax.random.normal(k[3], (E, V))
  targets, mask = jax.random.randint(k[4], (B, T), 0, V), (jax.random.uniform(k[5], (B, T)) > 0.2).astype(jnp.float32)
  recipe = {"temperature": 2.0, "alpha": 0.5}
  plain, chunked = LogitKD(**recipe), ChunkedLogitKD(chunk_size=384, loss_kernel=loss_kernel, **recipe)

  def full(s, w, t, wt, targets, mask):
    per_seq = jax.vmap(plain.per_sequence, in_axes=(None, 0, 0, 0, 0, None))
    sums = per_seq({}, md.ModelOutput(logits=s @ w), md.ModelOutput(logits=t @ wt), targets, mask, 0)
    sums = {name: jnp.sum(v) for name, v in sums.items()}
    return sums["loss"], sums

  def by_chunks(s, w, t, wt, targets, mask):
    sums = chunked.per_batch({}, md.ModelOutput(logits=None, final=s), md.ModelOutput(logits=None, final=t),
                             (w, wt), targets, mask, 0)
    return sums["loss"], sums

  inputs = (s, w, t, wt, targets, mask)  # arguments, not constants of the program (XLA would fold them)
  with jax.default_matmul_precision(HIGHEST):
    (_, want), want_grads = jax.jit(jax.value_and_grad(full, argnums=(0, 1), has_aux=True))(*inputs)
    step = jax.jit(jax.value_and_grad(by_chunks, argnums=(0, 1), has_aux=True))
    (_, got), grads = step(*inputs)
    assert ("kl_value_and_grad" in str(jax.make_jaxpr(step)(*inputs))) == (loss_kernel == "pallas")
  assert set(got) == set(want) >= {"loss", "kl", "ce", "teacher_ce", "agree"}
  for name in want:
    if name == "corr":  # a correlation near 0: its rounding is absolute
      assert abs(float(got[name]) - float(want[name])) < F32_TOL * float(jnp.sum(mask)), name
    else:
      assert rel_err(got[name], want[name]) < F32_TOL, (name, float(got[name]), float(want[name]))
  for name, g, r in zip(("hidden", "head"), grads, want_grads):
    assert rel_err(g, r) < F32_TOL, (name, rel_err(g, r))


@pytest.mark.parametrize("vocab", [151936, 262144], ids=["qwen3-vocab", "gemma3-vocab"])
def test_loss_kernel_gives_the_fused_recipes_values_and_logits_gradient_at_a_models_vocabulary(vocab):
  """`kl_value_and_grad` (one read of both chunks' float32 logits) against `forward_kl_terms` and the autodiff
  gradient of its loss sum, both on the chip, on a chunk of 256 tokens of a real vocabulary (the kernel's rows hold
  every column on chip): the values within the float32 bound (summation order over V), the gradient in float32
  likewise and in bfloat16 within one rounding of it; masked tokens exactly 0, the arg-max agreement seen."""
  from meshdistill.losses import forward_kl_terms, kl_value_and_grad

  C = 256
  k = jax.random.split(jax.random.key(1), 4)
  s = 3.0 * jax.random.normal(k[0], (C, vocab))
  t = (s + 2.0 * jax.random.normal(k[1], (C, vocab))).at[: C // 2].set(s[: C // 2])  # half the rows agree
  targets = jax.random.randint(k[2], (C,), 0, vocab).at[5].set(-100)
  keep = jax.random.bernoulli(k[3], 0.8, (C,))

  def reference(s, t, targets, keep):
    out = forward_kl_terms(s, t, targets, keep, 2.0, 0.5)
    return jnp.sum(out["loss"]), out

  (_, want), want_grad = jax.jit(jax.value_and_grad(reference, has_aux=True))(s, t, targets, keep)
  got, grad = kl_value_and_grad(s, t, targets, keep, 2.0, 0.5, grad_dtype=jnp.float32)
  _, grad_bf16 = kl_value_and_grad(s, t, targets, keep, 2.0, 0.5)
  for name in want:
    assert rel_err(got[name], want[name]) < F32_TOL, (name, rel_err(got[name], want[name]))
    assert not jnp.any(jnp.where(keep, 0.0, got[name])), name
  assert float(jnp.sum(got["agree"])) >= float(jnp.sum(keep[: C // 2]))
  assert rel_err(grad, want_grad) < F32_TOL
  assert rel_err(grad_bf16.astype(jnp.float32), want_grad) < 2 ** -8
  assert not jnp.any(jnp.where(keep[:, None], 0.0, grad))


def test_scanned_blocks_equal_unrolled_blocks_with_the_same_weights():
  """`to_scanned` of a decoder (local and global layers scanned in groups, remat full) against the unrolled
  decoder: loss and gradients, float32 at 'highest'."""
  cfg = CHIP_CFG.replace(n_layers=5, layer_types=("sliding_attention", "full_attention") * 2 + ("sliding_attention",),
                         remat="full")
  unrolled = md.init_model(cfg, seed=2)
  scanned = to_scanned(unrolled)
  assert scanned.cfg.scan_layers and scanned.blocks.attn.q.kernel.shape[0] == cfg.n_layers
  tokens = _tokens((2, 257), cfg.vocab_size, seed=1)
  with jax.default_matmul_precision(HIGHEST):
    want, want_grads = _nll_and_grads(unrolled, tokens)
    got, got_grads = _nll_and_grads(scanned, tokens)
  assert abs(float(got) / float(want) - 1) < F32_TOL, (float(got), float(want))
  stacked = {k: np.stack([want_grads["blocks"][i][part][name]["kernel"] for i in range(cfg.n_layers)])
             for k, (part, name) in {"q": ("attn", "q"), "down": ("mlp", "down")}.items()}
  for k, (part, name) in {"q": ("attn", "q"), "down": ("mlp", "down")}.items():
    got_k = got_grads["blocks"][part][name]["kernel"]
    assert rel_err(got_k, stacked[k]) < F32_TOL, (k, rel_err(got_k, stacked[k]))
  assert rel_err(got_grads["embed"]["embedding"], want_grads["embed"]["embedding"]) < F32_TOL


@pytest.mark.parametrize("dtype, drop", [("float32", False), ("float32", True), ("bfloat16", False)],
                         ids=["float32", "float32-capacity-drops", "bfloat16"])
def test_moe_ragged_dot_experts_equal_a_loop_over_experts(dtype, drop):
  """`grouped_experts` (one `jax.lax.ragged_dot` per projection: the TPU's grouped matmul) against `dense_experts`
  (every expert on every token, the routed outputs kept): outputs and the gradients of the tokens and of the three
  stacked expert weights. 1024 tokens, D 256, F 512, 8 experts, top 2; with drops a third of the assignments
  carry no weight. float32 at 'highest'; bfloat16 (tokens and weights, as an MoE model computing in bfloat16 feeds
  them) at the default precision."""
  N, D, F, E = 1024, 256, 512, 8
  keys = jax.random.split(jax.random.key(3), 5)
  x = jax.random.normal(keys[0], (N, D), dtype)
  weights, experts = route(jax.random.normal(keys[1], (N, E)), MoeConfig(n_experts=E, top_k=2))
  w = [(jax.random.normal(kk, s) / s[1] ** 0.5).astype(dtype)
       for kk, s in zip(keys[2:], [(E, D, F), (E, D, F), (E, F, D)])]
  keep = (jnp.arange(2 * N).reshape(N, 2) % 3 != 0) if drop else None
  tol = F32_TOL if dtype == "float32" else 2e-2  # bfloat16: see the table above

  def loss(fn):
    def f(x, w):
      y = fn(x, experts, weights, *w, keep)
      return jnp.sum(y.astype(jnp.float32) ** 2), y
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

  with jax.default_matmul_precision(HIGHEST if dtype == "float32" else None):
    (_, got), (gx, gw) = loss(grouped_experts)(x, w)
    (_, want), (wx, ww) = loss(dense_experts)(x, w)
  assert got.dtype == want.dtype == gx.dtype == jnp.dtype(dtype)
  assert rel_err(got, want) < tol, rel_err(got, want)
  assert rel_err(gx, wx) < tol, rel_err(gx, wx)
  for name, g, r in zip(("gate", "up", "down"), gw, ww):
    assert rel_err(g, r) < tol, (name, rel_err(g, r))
  if drop:  # the dropped assignments are really left out: the dropless sum differs
    with jax.default_matmul_precision(HIGHEST):
      everything = jax.jit(lambda x: grouped_experts(x, experts, weights, *w))(x)
    assert rel_err(everything, want) > 0.1


@pytest.mark.parametrize("scanned", [False, True], ids=["per-layer", "scanned"])
def test_cached_generation_logits_equal_the_full_forward_at_every_generated_position(scanned):
  """Greedy decoding with the KV cache (left-padded prompts of 7 and 12 tokens, 70 new tokens decoded in two loops,
  each attending to the prefix of the cache filled so far (`generate.decode_stages`), a sliding window of 6 that the
  cache must apply)
  against one full forward pass per row over its prompt and generated tokens; per-layer caches, and stacked caches
  written in place through the layer scan."""
  cfg = CHIP_CFG.replace(sliding_window=6, attn_softcap=None, qk_norm=True, scan_layers=scanned)
  model = md.init_model(cfg, seed=4)
  rng = np.random.default_rng(5)
  prompts = [list(rng.integers(1, cfg.vocab_size, n)) for n in (7, 12)]
  tokens, mask = left_pad(prompts)
  N = 70
  assert len(decode_stages(tokens.shape[1], N)) == 2
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x).logits)
  with jax.default_matmul_precision(HIGHEST):
    gen = generate(model, tokens, mask, None, SamplingConfig(max_new_tokens=N, temperature=0.0), return_logits=True)
    for r, prompt in enumerate(prompts):
      new = [int(t) for t in np.asarray(gen.tokens_BxN[r])]
      seq = jnp.asarray([prompt + new[:-1]], jnp.int32)
      want = np.asarray(forward(params, seq)[0, len(prompt) - 1:])  # the logits each new token was drawn from
      got = np.asarray(gen.logits_BxNxV[r])
      assert got.shape == want.shape == (N, cfg.vocab_size)
      assert rel_err(got, want) < F32_TOL, (r, rel_err(got, want))
      top2 = np.sort(want, -1)[:, -2:]
      clear = top2[:, 1] - top2[:, 0] > 1e-3 * np.abs(want).max()  # no near-tie the rounding could flip
      np.testing.assert_array_equal(np.asarray(new)[clear], want.argmax(-1)[clear])
  assert np.asarray(gen.mask_BxN).all()


def test_the_cache_bound_program_generates_what_the_default_program_generates(monkeypatch):
  """The program `decoding_program` picks where the caches outweigh the weights (`SELECTIVE_MSA`, up to
  `CACHE_BOUND_STAGES` loops: 8 here, the default 4) against the default program on the same prompts: greedy tokens
  and the logits they were drawn from, on this chip (the option is libtpu's: no other platform compiles it)."""
  from meshdistill.models import generate as gen_mod

  monkeypatch.setattr(gen_mod, "MIN_STAGE_TOKENS", 8)  # 70 new tokens: 8 loops in the one program, 4 in the other
  cfg = CHIP_CFG.replace(qk_norm=True)
  model = md.init_model(cfg, seed=6)
  rng = np.random.default_rng(7)
  tokens, mask = left_pad([list(rng.integers(1, cfg.vocab_size, n)) for n in (9, 4, 13)])
  N = 70
  runs, loops = {}, {}
  for bound in (False, True):
    monkeypatch.setattr(gen_mod, "cache_bound", lambda *a, bound=bound: bound)
    loops[bound] = len(decode_stages(tokens.shape[1], N, gen_mod.CACHE_BOUND_STAGES if bound else None))
    program = gen_mod.decoding_program(nnx.state(model), cfg, tokens.shape[0], tokens.shape[1] + N - 1)
    assert (program is gen_mod._generate_jit_cache_bound) == (bound and jax.default_backend() == "tpu")
    with jax.default_matmul_precision(HIGHEST):
      runs[bound] = generate(model, tokens, mask, None, SamplingConfig(max_new_tokens=N, temperature=0.0),
                             return_logits=True)
  assert loops == {False: 4, True: 8}, loops
  want, got = np.asarray(runs[False].logits_BxNxV), np.asarray(runs[True].logits_BxNxV)
  assert rel_err(got, want) < F32_TOL, rel_err(got, want)
  top2 = np.sort(want, -1)[..., -2:]
  clear = (top2[..., 1] - top2[..., 0] > 1e-3 * np.abs(want).max()).all(-1)  # rows no near-tie could fork
  assert clear.any()
  np.testing.assert_array_equal(np.asarray(runs[True].tokens_BxN)[clear], np.asarray(runs[False].tokens_BxN)[clear])


@pytest.mark.parametrize("window,cap,shape", [(None, None, (16, 4, 2, 128, 256)), (40, 30.0, (16, 4, 2, 128, 256)),
                                              (None, None, (2, 2, 2, 128, 8192))],
                         ids=["full", "window-softcap", "longest-cache"])
def test_decoding_kernel_writes_the_new_slot_and_attends_as_the_explicit_scores_do(window, cap, shape):
  """`_decode_attention.decode_attention` compiled on the chip against `_explicit_attention` (float32 scores) on the
  same bfloat16 inputs, the new key and value written into the reference's caches first: slots at a tile's first and
  last row, a prefix that ends inside a tile, left padding; blocks of several rows and heads, and the longest cache
  the kernel takes (`usable`: one row and head a grid step). Values: both round the probabilities and the output to
  bfloat16 and differ in summation order only (1e-2, the splash row of the table); the caches: bit for bit, the new
  slot written and no other slot changed."""
  from meshdistill.models._decode_attention import STEP_BYTES, decode_attention, usable

  B, G, R, K, S = shape
  assert usable(S, 2, K) and (S == 256 or not usable(S + 16, 2, K)), STEP_BYTES  # "longest-cache": no longer one
  rng = np.random.default_rng(11)
  bf = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
  interpret = jax.default_backend() != "tpu"  # (MESHDISTILL_TPU_TESTS_ON=cpu)
  run = jax.jit(lambda *a, index: decode_attention(*a, index, scale=K**-0.5, cap=cap, window=window,
                                                   interpret=interpret))
  cases = ((0, 16), (127, 128), (128, 201), (200, 201), (255, 256)) if S == 256 else ((4000, 4001), (S - 1, S))
  for index, N in cases:
    q, kn, vn, k, v = bf(B, G, R, K), bf(B, G, K), bf(B, G, K), bf(B, G, S, K), bf(B, G, S, K)
    valid = np.ones((B, N), bool)
    valid[:, : min(index, 5)] = False  # left padding
    out, k2, v2 = run(q, kn, vn, k, v, jnp.asarray(valid), index=jnp.int32(index))
    want_k, want_v = k.at[:, :, index].set(kn), v.at[:, :, index].set(vn)
    np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(want_k, np.float32))
    np.testing.assert_array_equal(np.asarray(v2, np.float32), np.asarray(want_v, np.float32))
    cols = np.arange(N)
    visible = valid & (cols <= index) & ((cols > index - window) if window else True)
    want, _ = _explicit_attention(q.reshape(B, 1, G * R, K), jnp.swapaxes(want_k[:, :, :N], 1, 2),
                                  jnp.swapaxes(want_v[:, :, :N], 1, 2), jnp.asarray(visible)[:, None, None],
                                  scale=K**-0.5, cap=cap)
    got = np.asarray(out, np.float32).reshape(B, 1, G * R, K)
    assert rel_err(got, np.asarray(want, np.float32)) < 1e-2, (index, N, rel_err(got, want))


def test_generation_through_the_decoding_kernel_equals_the_xla_path(chip):
  """A bfloat16 decoder generating with ``attention: auto`` on the chip decodes through the kernel (one call per layer
  and decoding loop, traced) and gives the logits and greedy tokens of the same model with ``attention: xla``
  (bfloat16 roundings in other orders: 1e-2; tokens on rows no near-tie could fork), a sliding window, a final soft
  cap and left-padded prompts of 9, 4 and 13 tokens; every token an id of the vocabulary, every logit finite (with
  the soft cap in bfloat16 the greedy pick was once the id ``V`` on this chip, then NaN: `vocab_argmax`). On a mesh of
  the chip (as the on-policy path passes its run's mesh) the kernel runs in a ``shard_map`` and gives the same."""
  from meshdistill.models import _decode_attention

  cfg = CHIP_CFG.replace(dtype="bfloat16", attn_softcap=None, qk_norm=True, sliding_window=24)
  rng = np.random.default_rng(8)
  tokens, mask = left_pad([list(rng.integers(1, cfg.vocab_size, n)) for n in (9, 4, 13)])
  N, runs, calls = 70, {}, []
  real = _decode_attention.decode_attention
  spy = lambda *a, **kw: calls.append(1) or real(*a, **kw)  # noqa: E731
  fast = "auto" if jax.default_backend() == "tpu" else "splash"  # (the kernel interpreted: MESHDISTILL_TPU_TESTS_ON)
  for attention in ("xla", fast):
    model = md.init_model(cfg.replace(attention=attention), seed=6)
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(_decode_attention, "decode_attention", spy)
      runs[attention] = generate(model, tokens, mask, None, SamplingConfig(max_new_tokens=N, temperature=0.0),
                                 return_logits=True)
    if attention == "xla":
      assert not calls
  assert len(calls) == cfg.n_layers * len(decode_stages(tokens.shape[1], N)), len(calls)
  for run in runs.values():
    assert np.isfinite(np.asarray(run.logits_BxNxV)).all() and (np.asarray(run.tokens_BxN) < cfg.vocab_size).all()
  want, got = np.asarray(runs["xla"].logits_BxNxV), np.asarray(runs[fast].logits_BxNxV)
  tokens_want, tokens_got = np.asarray(runs["xla"].tokens_BxN), np.asarray(runs[fast].tokens_BxN)
  compared = 0
  for r in range(len(tokens_want)):  # logits of one context: up to and with the first token the two runs differ in
    fork = next((n for n in range(N) if tokens_want[r, n] != tokens_got[r, n]), N - 1)
    err = rel_err(got[r, : fork + 1], want[r, : fork + 1])
    assert err < 1e-2, (r, fork, err)
    if tokens_want[r, fork] != tokens_got[r, fork]:  # a fork only where the two best logits nearly tie
      top2 = np.sort(want[r, fork])[-2:]
      assert top2[1] - top2[0] < 2e-2 * np.abs(want[r, fork]).max(), (r, fork, top2)
    compared += fork + 1
  assert compared >= N, compared  # (at least one row's worth of positions)
  # on a mesh of the chip (the on-policy path passes the run's mesh): the kernel in a shard_map, the same numbers
  calls.clear()
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(_decode_attention, "decode_attention", spy)
    meshed = generate(model, tokens, mask, None, SamplingConfig(max_new_tokens=N, temperature=0.0), return_logits=True,
                      mesh=jax.sharding.Mesh(np.array([chip]).reshape(1, 1), ("data", "tensor")))
  assert len(calls) == cfg.n_layers * len(decode_stages(tokens.shape[1], N)), len(calls)
  np.testing.assert_array_equal(np.asarray(meshed.tokens_BxN), tokens_got)
  np.testing.assert_allclose(np.asarray(meshed.logits_BxNxV), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_head_prep_kernel_gives_the_norm_and_rope_of_each_head_and_their_gradients(dtype):
  """`_head_prep.norm_rope_heads` compiled against `head_norm` + `rope` in XLA on the same chip (float32 at 'highest';
  bfloat16: the XLA form rounds the rotation's two gradient terms apart, the kernel once: 1e-2)."""
  from meshdistill.models._attention import rope, rope_tables
  from meshdistill.models._head_prep import norm_rope_heads
  from meshdistill.models._variants import head_norm

  B, T, H, K = 2, 1024, 4, 128
  rng = np.random.default_rng(3)
  y = jnp.asarray(2 * rng.normal(size=(B, T, H * K)), dtype)
  g = jnp.asarray(rng.normal(size=(B, H, T, K)), jnp.float32)
  w0 = jnp.asarray(rng.normal(size=K) + 1, jnp.float32)

  class Norm:  # nnx.RMSNorm's attributes as head_norm reads them
    epsilon, dtype = 1e-6, None

    def __init__(self, w):
      self.scale = w

  def xla(y, w):
    x = head_norm(Norm(w), y.reshape(B, T, H, K).transpose(0, 2, 1, 3))
    return rope(x, 1e6, None, None, token_axis=2) * jnp.asarray(0.088, dtype)

  post = float(np.asarray(0.088, np.dtype(dtype)))  # the query scale as the splash path rounds it

  def kernel(y, w):
    cos, sin = rope_tables(jnp.arange(T), K, 1e6)
    return norm_rope_heads(y, H, cos, sin, w.astype(dtype).astype(jnp.float32), 1e-6, post,
                           interpret=jax.default_backend() != "tpu")

  def run(fn):
    return jax.jit(jax.value_and_grad(lambda y, w: jnp.sum(fn(y, w).astype(jnp.float32) * g), argnums=(0, 1)))(y, w0)

  with jax.default_matmul_precision(HIGHEST):
    (want, want_grads), (got, got_grads) = run(xla), run(kernel)
  tol = F32_TOL if dtype == jnp.float32 else 1e-2
  assert abs(float(got) - float(want)) <= tol * abs(float(want)) + 1e-3, (got, want)
  for name, a, b in zip(("y", "scale"), got_grads, want_grads):
    assert rel_err(a, b) < tol, (name, rel_err(a, b))


def _segment_ids(B: int, T: int, seed: int) -> np.ndarray:
  """``[B, T]`` int32 ids of rows packed from documents (``data.packing: documents``): documents of 5-400 tokens
  numbered 1, 2, ... and the last 0-99 positions padding (0)."""
  rng = np.random.default_rng(seed)
  out = np.zeros((B, T), np.int32)
  for b in range(B):
    end, t, s = T - int(rng.integers(0, 100)), 0, 1
    while t < end:
      n = int(rng.integers(5, 400))
      out[b, t:min(t + n, end)] = s
      t, s = t + n, s + 1
  return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_splash_kernel_with_segment_ids_gives_the_xla_attention_within_each_document(dtype):
  """Packed documents: the splash kernel with its segment ids against `jax.nn.dot_product_attention` (xla) given the
  same documents as a mask, on the same chip, values and gradients. T = 1024 with documents of 5-400 tokens: they cut
  the kernel's 512-token blocks. Float32 at 'highest' (1e-4); bfloat16 against float32 scores of the same inputs
  (1e-2 values, 2e-2 grads: the kernel's roundings, as for the causal mask alone)."""
  from meshdistill.models._visible import segment_mask

  qkv, w = _qkv(dtype, seed=2)
  ids = jnp.asarray(_segment_ids(1, 1024, 0))
  with jax.default_matmul_precision(HIGHEST if dtype == jnp.float32 else None):  # f32 at 'highest', as docstring says
    out, grads = _attention_and_grads(lambda *a: token_major(splash_attention)(*a, segment_ids_BxT=ids), qkv, w)

  def xla(q, k, v, mask=segment_mask(ids)):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")

  with jax.default_matmul_precision(HIGHEST):
    want, want_grads = _attention_and_grads(xla, qkv, w)
    across, _ = _attention_and_grads(lambda q, k, v: xla(q, k, v, mask=None), qkv, w)
  value_tol, grad_tol = (F32_TOL, F32_TOL) if dtype == jnp.float32 else (1e-2, 2e-2)
  assert rel_err(out, want) < value_tol, rel_err(out, want)
  for name, g, r in zip("qkv", grads, want_grads):
    assert rel_err(g, r) < grad_tol, (name, rel_err(g, r))
  assert rel_err(across, want) > 0.1  # the documents matter at these shapes


def test_splash_decoder_on_packed_rows_equals_the_xla_decoder():
  """The whole decoder on rows packed from documents (segment ids and positions as the data pipeline writes them):
  attention='splash' (on the chip its queries and keys take the `_head_prep` kernel with each row's RoPE positions)
  against 'xla': loss and every weight's gradient, float32 at 'highest'."""
  from meshdistill.models._visible import segment_positions

  cfg = CHIP_CFG.replace(attn_softcap=None, qk_norm=True, dtype="float32", param_dtype="float32")
  tokens = _tokens((2, 257), cfg.vocab_size, seed=4)  # 256 positions after the shift
  ids = jnp.asarray(_segment_ids(2, 256, 1))
  segments = {"segment_ids": ids, "positions": segment_positions(ids)}

  def nll_and_grads(attention):
    graphdef, params = nnx.split(md.init_model(cfg.replace(attention=attention), seed=0))

    def loss(params):
      logits = nnx.merge(graphdef, params)(tokens[:, :-1], **segments).logits.astype(jnp.float32)
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
      return jnp.sum(jnp.where(ids > 0, nll, 0.0)) / jnp.sum(ids > 0)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return value, nnx.to_pure_dict(grads)

  with jax.default_matmul_precision(HIGHEST):
    (got, got_grads), (want, want_grads) = nll_and_grads("splash"), nll_and_grads("xla")
  assert abs(float(got) / float(want) - 1) < F32_TOL, (float(got), float(want))
  errors = _trees_rel_err(got_grads, want_grads)
  assert max(errors.values()) < F32_TOL, {k: e for k, e in errors.items() if e >= F32_TOL}
