"""Attention kernels: `xla` (jax.nn.dot_product_attention) and the Pallas splash kernel (interpreted on CPU) agree
with the grouped explicit path, values and grads, alone and inside the Distiller's step on every layout."""

import einops
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import STUDENT_CFG, TEACHER_CFG, assert_trees_close, jaxpr_equations, make_batch, token_major
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import PartitionSpec as P

import meshdistill as md
from meshdistill.config import ConfigError, load_config
from meshdistill.models._attention import _explicit_attention, _splash_attention, rope, splash_attention
from meshdistill.models._variants import OffsetRMSNorm, head_norm

CFG = TEACHER_CFG.replace(n_heads=4, n_kv_heads=2)


def _repeated_reference(q, k, v):
  """Causal attention with key/value heads copied per query head (the textbook form)."""
  r = q.shape[2] // k.shape[2]
  k, v = (einops.repeat(a, "b s g k -> b s (g r) k", r=r) for a in (k, v))
  scores = jnp.einsum("bthk,bshk->bhts", q, k) / jnp.sqrt(q.shape[-1])
  T = q.shape[1]
  scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
  return jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, -1), v)


def test_grouped_explicit_and_xla_equal_the_repeated_reference():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 8, 6, 4), (2, 8, 2, 4), (2, 8, 2, 4)))
  want = _repeated_reference(q, k, v)
  got_explicit, probs = jax.jit(_explicit_attention)(q, k, v)
  got_xla = jax.jit(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True, implementation="xla"))(q, k, v)
  np.testing.assert_allclose(got_explicit, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_xla, want, rtol=1e-5, atol=1e-6)
  assert probs.shape == (2, 6, 8, 8)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def _loss_and_grads(attention):
  graphdef, params = nnx.split(md.init_model(CFG.replace(attention=attention), 0))
  batch = make_batch()

  def loss(params):
    m = nnx.merge(graphdef, params)
    logp = jax.nn.log_softmax(m(jnp.asarray(batch["inputs"])).logits)
    nll = -jnp.take_along_axis(logp, jnp.asarray(batch["targets"])[..., None], -1)[..., 0]
    return jnp.sum(nll * batch["mask"]) / batch["mask"].sum()

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return value, nnx.to_pure_dict(grads)


def test_xla_attention_values_and_grads_equal_explicit():
  ref_value, ref_grads = _loss_and_grads("explicit")
  value, grads = _loss_and_grads("xla")  # also what "auto" runs when nothing is captured
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, ref_grads)


def test_captured_probabilities_use_explicit_scores_under_any_kernel():
  tokens = jnp.asarray(make_batch()["inputs"])
  ref = md.init_model(CFG.replace(attention="explicit"), 0)(tokens, capture=("attn",))
  out = md.init_model(CFG.replace(attention="xla"), 0)(tokens, capture=("attn",))
  assert len(out.attn) == CFG.n_layers and out.attn[0].shape == (8, 4, 8, 8)
  np.testing.assert_allclose(out.attn[0], ref.attn[0], rtol=1e-6)
  np.testing.assert_allclose(out.logits, ref.logits, rtol=1e-5, atol=1e-6)


def test_unknown_attention_names_the_choices():
  with pytest.raises(ValueError, match=r"ModelConfig.attention='flash'.*'explicit', 'xla'"):
    CFG.replace(attention="flash")


def test_splash_interpreted_values_and_grads_equal_explicit():
  """The Pallas splash kernel in interpret mode (T = 128, its lane width) against the explicit path."""
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((1, 128, 4, 8), (1, 128, 2, 8), (1, 128, 2, 8)))
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  def run(attn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)

  want, want_grads = run(lambda *a: _explicit_attention(*a)[0])
  got, got_grads = run(token_major(_splash_attention))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, r in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="attention='splash' needs a sequence length that is a multiple of 128"):
    _splash_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8])


def test_bfloat16_splash_under_a_higher_default_precision_runs_at_default_with_the_same_numbers():
  """Mosaic refuses a bfloat16 product at 'highest' ("Bad lhs type"; compiled for v5e in test_on_chip_support), so
  the kernel on bfloat16 inputs is traced at the default precision, forward and backward, whatever the context says:
  the same values and gradients as without the context (interpret mode here)."""
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in ((1, 128, 4, 8), (1, 128, 2, 8), (1, 128, 2, 8)))
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  def run():
    f = lambda q, k, v: jnp.sum(token_major(_splash_attention)(q, k, v).astype(jnp.float32) * w)  # noqa: E731
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)

  want, want_grads = run()
  with jax.default_matmul_precision("highest"):
    got, got_grads = run()
  np.testing.assert_array_equal(got, want)
  for g, r in zip(got_grads, want_grads):
    np.testing.assert_array_equal(g, r)


def test_splash_runs_head_major_with_no_transposes_forward_and_backward():
  """The splash kernel reads and writes ``[B, H, T, K]``: the decoder projects into that layout (XLA writes the
  projection's matmul so), and nothing in the kernel's wrapper swaps heads and tokens, forward or backward (a
  transpose there was a copy of q, k, v and the output per layer on a TPU: `benchmarks/results/tpu_step.md`)."""
  q, k = jnp.zeros((1, 4, 128, 8), jnp.float32), jnp.zeros((1, 2, 128, 8), jnp.float32)
  f = lambda q, k, v: jnp.sum(_splash_attention(q, k, v))  # noqa: E731
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, k).jaxpr
  swaps = [e for e in jaxpr_equations(jaxpr) if e.primitive.name == "transpose" and e.invars[0].aval.ndim > 2]
  assert not swaps, [(e.invars[0].aval.shape, e.params) for e in swaps]
  assert sum(e.primitive.name == "pallas_call" for e in jaxpr_equations(jaxpr)) >= 2  # the kernel ran, both ways


def _projections(bias: bool):
  """A value projection [D, G * K] (with a bias or not) and an output projection [H * K, D] of float32 weights
  computing in bfloat16, as the decoder builds them (`nnx.Linear`)."""
  rngs = nnx.Rngs(0)
  lin = lambda i, o, b: nnx.Linear(i, o, use_bias=b, dtype=jnp.bfloat16, param_dtype=jnp.float32,  # noqa: E731
                                   bias_init=nnx.initializers.normal(1.0), rngs=rngs)
  return lin(32, 2 * 8, bias), lin(4 * 8, 32, False)


@pytest.mark.parametrize("bias", [False, True])
def test_head_major_projections_give_the_rearranged_values_and_grads(bias):
  """On the splash path the value projection writes ``[B, G, T, K]`` and the output projection reads ``[B, H, T, K]``
  in ONE einsum each (the weight seen as ``[D, G, K]`` / ``[H, K, D]``), which the TPU compiler writes and reads
  head-major in place (the rearranged form cost copies of a layer's values and output and of their gradients:
  `benchmarks/step_cycles.py`; at these sizes both compile alike, so the check is there), with the rearranged form's
  numbers (one ``[N, D]`` matmul, then a transpose): the
  same bfloat16 products summed in float32, rounded to bfloat16 once (a bias added before or after that rounding:
  one bfloat16 ulp), and gradients up to the float32 accumulator's rounding (32-term sums: 32 float32 ulps)."""
  from meshdistill.models._block import _heads_in, _heads_out, _per_token

  graphdef, params = nnx.split(_projections(bias))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.bfloat16)
  out = jnp.asarray(rng.normal(size=(2, 4, 16, 8)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(2, 2, 16, 8)), jnp.float32)

  def project(params, x, out, rearranged):
    v_proj, o_proj = nnx.merge(graphdef, params)
    if rearranged:
      return (einops.rearrange(_per_token(v_proj, x), "b t (h k) -> b h t k", k=8),
              _per_token(o_proj, einops.rearrange(out, "b h t k -> b t (h k)")))
    return _heads_in(v_proj, x, "b h t k", 8), _heads_out(o_proj, out, "b h t k")

  def loss(params, x, out, rearranged):
    v, y = project(params, x, out, rearranged)
    return jnp.sum(v.astype(jnp.float32) * w) + jnp.sum(y.astype(jnp.float32) ** 2)

  bf16_ulp = float(jnp.finfo(jnp.bfloat16).eps)
  for got, want in zip(*(jax.jit(project, static_argnums=3)(params, x, out, r) for r in (False, True))):
    assert got.shape == want.shape and got.dtype == want.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=bf16_ulp, atol=bf16_ulp * float(np.max(np.abs(want))))
  grad = jax.grad(loss, argnums=(0, 1, 2))
  tol = 32 * float(jnp.finfo(jnp.float32).eps)
  got_grads, want_grads = (jax.jit(grad, static_argnums=3)(params, x, out, r) for r in (False, True))
  for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * float(np.max(np.abs(r))))


def test_a_projection_qwix_rewrote_keeps_its_own_call():
  """A projection qwix rewrote (LoRA adapters, quantized weights: it marks the module with ``qwix_path``) computes
  through its own call, a ``[N, D]`` matmul on the rearranged heads, where qwix intercepts it: the head-major einsum
  (one dot_general contracting two dimensions of ``[B, H, T, K]``) would bypass it."""
  from meshdistill.models._block import _heads_in, _heads_out

  def dots(rewritten):
    v_proj, o_proj = _projections(False)
    if rewritten:
      v_proj.qwix_path, o_proj.qwix_path = ("blocks", 0, "attn", "v"), ("blocks", 0, "attn", "o")
    x, out = jnp.zeros((1, 16, 32), jnp.bfloat16), jnp.zeros((1, 4, 16, 8), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, out: (_heads_in(v_proj, x, "b h t k", 8), _heads_out(o_proj, out, "b h t k")))
    return sorted(tuple(e.invars[0].aval.ndim for e in (eqn,)) + (len(eqn.params["dimension_numbers"][0][0]),)
                  for eqn in jaxpr_equations(jaxpr(x, out).jaxpr) if eqn.primitive.name == "dot_general")

  assert dots(False) == [(3, 1), (4, 2)]  # x [B, T, D] by [D, G, K]; out [B, H, T, K] by [H, K, D]
  assert dots(True) == [(2, 1), (2, 1)]  # the Linear's own [N, D] matmuls


@pytest.mark.parametrize("heads, kv_heads", [(8, 4), (4, 2), (12, 6)])
def test_splash_per_device_heads_on_a_tensor_split_mesh_equal_explicit(heads, kv_heads):
  """`splash_attention` in a step manual over ``data`` on 2x4: key/value heads split with the query heads (8/4),
  replicated with each device's heads in one group (4/2: G < tensor), or groups cut by the split (12/6)."""
  rng = np.random.default_rng(2)
  shapes = ((4, 128, heads, 8), (4, 128, kv_heads, 8), (4, 128, kv_heads, 8))
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  mesh = md.make_mesh(2, 4)

  def run(attn):
    def loss(q, k, v):  # the step's form: per device over `data`, `tensor` left to the compiler
      per_device = lambda q, k, v, w: jax.lax.psum(jnp.sum(attn(q, k, v) * w), "data")  # noqa: E731
      return jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P(), axis_names={"data"},
                           check_vma=False)(q, k, v, w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

  want, want_grads = run(lambda *a: _explicit_attention(*a)[0])
  got, got_grads = run(token_major(splash_attention))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, r in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


SPLASH_TEACHER = TEACHER_CFG.replace(max_len=128)
SPLASH_STUDENT = STUDENT_CFG.replace(max_len=128, n_layers=2, remat="full")
SPLASH_BATCHES = [make_batch(seed=s, seq=128, pad_from=100) for s in range(2)]


def _distill(attention, shape=None, backend=None, fsdp=False, scan=False):
  """Two Distiller steps with SGD (lr 1: the first step's parameter change is minus the gradient): per-step loss
  and gradient norm, the first step's gradient and the final state."""
  mesh = None if shape is None else md.make_mesh(*shape)
  d = md.Distiller(
      md.init_model(SPLASH_STUDENT.replace(attention=attention, scan_layers=scan), seed=1, mesh=mesh),
      md.init_model(SPLASH_TEACHER.replace(attention=attention, scan_layers=scan), seed=0, mesh=mesh),
      optimizer=optax.sgd(1.0), mesh=mesh, backend=backend, fsdp=fsdp)
  state = d.init_state()
  before = jax.device_get(d.unreplicate(state.params))
  records, grads = [], None
  for batch in SPLASH_BATCHES:
    state, metrics = d.step(state, batch)
    records.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    if grads is None:
      grads = jax.tree.map(lambda a, b: a - b, before, jax.device_get(d.unreplicate(state.params)))
  return records, grads


@pytest.fixture(scope="module")
def explicit_runs():
  """The one-device references with explicit scores: unrolled and scanned blocks."""
  return {scan: _distill("explicit", scan=scan) for scan in (False, True)}


@pytest.mark.parametrize("shape, backend, fsdp, scan", [
    ((2, 4), None, False, False), ((2, 4), None, True, False), ((4, 2), None, True, True), (None, None, False, False),
    ((8, 1), "pmap", False, False)])
def test_splash_distiller_steps_equal_explicit_on_one_device(explicit_runs, shape, backend, fsdp, scan):
  """Loss, gradient norm and gradient of Distiller steps with splash (interpreted) on a layout, student under remat
  full, equal the explicit path on one device."""
  want_records, want_grads = explicit_runs[scan]
  records, grads = _distill("splash", shape, backend, fsdp, scan)
  np.testing.assert_allclose(records, want_records, rtol=1e-5)
  assert_trees_close(grads, want_grads, rtol=1e-5, atol=1e-6)


def test_splash_settings_are_checked_with_the_setting_named():
  with pytest.raises(ConfigError, match=r"student.attention=splash needs data.seq_len a multiple of 128.*got 64"):
    load_config("tiny", ["student.attention=splash", "data.seq_len=64", "teacher.max_len=64", "student.max_len=64"])
  with pytest.raises(ValueError, match=r"attention='splash'.*tensor=4 does not divide n_heads=6"):
    TEACHER_CFG.replace(n_heads=6, n_kv_heads=2, d_model=48, attention="splash").for_tensor(4)
  cfg = load_config("tiny", ["teacher.attention=splash", "student.attention=xla", "data.seq_len=128",
                             "teacher.max_len=128", "student.max_len=128"])
  assert (cfg.teacher.attention, cfg.student.attention) == ("splash", "xla")


def test_splash_evaluation_on_a_mesh_equals_explicit_on_one_device():
  """Evaluation runs its plain jit under the mesh (`jax.set_mesh`): the kernel then goes in a shard_map manual over
  both axes (rows over data, heads over tensor), as the TPU compiler requires of a Mosaic kernel."""
  from meshdistill.train.loop.evaluate import Evaluator  # pylint: disable=g-import-not-at-top

  def metrics(attention, mesh):
    (gs, ps), (gt, pt) = (nnx.split(md.init_model(cfg.replace(attention=attention), seed=seed, mesh=mesh))
                          for cfg, seed in ((SPLASH_STUDENT, 1), (SPLASH_TEACHER, 0)))
    return Evaluator(gs, teacher_def=gt, teacher_params=pt, mesh=mesh)(ps, SPLASH_BATCHES[:1])

  want, got = metrics("explicit", None), metrics("splash", md.make_mesh(2, 4))
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


def _rotate_half_rope(x, theta, positions=None, token_axis=1):
  """RoPE as transformers writes it: the halves of the head sliced, rotated and concatenated, in float32."""
  T, K = x.shape[token_axis], x.shape[-1]
  inv = theta ** (-np.arange(0, K, 2, dtype=np.float32) / K)
  pos = np.arange(T, dtype=np.float32)[None] if positions is None else np.asarray(positions, np.float32)
  ang = np.concatenate([pos[..., None] * inv] * 2, -1)  # [1 or B, T, K]
  ang = np.expand_dims(ang, 2 if token_axis == 1 else 1)
  x32 = np.asarray(x.astype(jnp.float32))
  x1, x2 = np.split(x32, 2, axis=-1)
  return x32 * np.cos(ang) + np.concatenate([-x2, x1], -1) * np.sin(ang)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("token_axis", [1, 2])
def test_rope_as_a_signed_permutation_matmul_equals_rotate_half(dtype, token_axis):
  """`rope` forms rotate-half as a [K, K] matmul (lane-aligned on a TPU); it is the sliced form's value in either
  layout, with each row's own positions too: exactly so from bfloat16 inputs (one +-1 per column, float32
  accumulation, the output rounded once), to float32 rounding from float32 ones."""
  rng = np.random.default_rng(0)
  shape = (2, 16, 4, 8) if token_axis == 1 else (2, 4, 16, 8)
  x = jnp.asarray(rng.normal(size=shape) * 3, dtype)
  positions = rng.integers(0, 100, (2, 16))
  for pos in (None, positions):
    got = rope(x, 1e4, None, None if pos is None else jnp.asarray(pos), token_axis=token_axis)
    want = _rotate_half_rope(x, 1e4, pos, token_axis)
    assert got.dtype == dtype
    if dtype == jnp.bfloat16:
      np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(want).astype(dtype)))
    else:
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("offset", [False, True], ids=["RMSNorm", "OffsetRMSNorm"])
def test_head_norm_by_matmul_equals_the_norm_module(offset):
  """`head_norm` takes the mean square over a head from a [K, K] matmul at HIGH precision: the module's own value
  to float32 rounding, and in a bfloat16 model (the module's input and output dtype) the same bfloat16 output."""
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 4, 16, 8)) * 5, jnp.float32)
  for dtype in (jnp.float32, jnp.bfloat16):
    cfg = md.ModelConfig(vocab_size=32, d_model=16, n_layers=1, head_dim=8, qk_norm=True, norm_offset=offset,
                         scan_layers=False, dtype=jnp.dtype(dtype).name)
    module = md.init_model(cfg, seed=0).blocks[0].attn.q_norm
    assert isinstance(module, OffsetRMSNorm) == offset
    module.scale[...] = jnp.asarray(np.random.default_rng(1).normal(size=8), module.scale[...].dtype)
    got, want = head_norm(module, x.astype(dtype)), module(x.astype(dtype))
    assert got.dtype == want.dtype == dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.float32:
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:  # the same float32 statistics rounded once: equal bfloat16 outputs
      np.testing.assert_array_equal(got, want)


def test_head_norm_and_rope_matmuls_are_formed_again_under_dots_no_batch(capsys):
  """The remat policy ``dots_no_batch`` saves matmul outputs; the head norm's and RoPE's [K, K] matmuls are cheap to
  form again and as large as q and k in float32, so they are written as dots with a unit batch axis, which the policy
  leaves out: only the block's projections are saved."""
  cfg = md.ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm=True,
                       remat="dots_no_batch", attention="xla")
  graphdef, state = nnx.split(md.init_model(cfg, seed=0))
  tokens = jnp.zeros((2, 16), jnp.int32)
  print_saved_residuals(lambda s: jnp.sum(nnx.merge(graphdef, s)(tokens).logits), state)
  dots = [line for line in capsys.readouterr().out.splitlines() if "output of dot_general" in line]
  assert len(dots) == 6, dots  # q, k, v, o; gate, up
  assert all("Linear.__call__" in line for line in dots), dots
