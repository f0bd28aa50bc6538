"""The divergence family, top-k teachers and `LogitKD` built on them."""

import dataclasses
import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, all_gather_shapes, make_batch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import meshdistill as md
from meshdistill import losses

NAMES = sorted(losses.DIVERGENCES)
DIST_NAMES = sorted(losses.DISTRIBUTION_DIVERGENCES)
HYPER = {"jsd": {"beta": 0.3}, "skew_kl": {"skew": 0.2}, "skew_reverse_kl": {"skew": 0.2}}
PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)
SMALL = settings(max_examples=10, deadline=None, derandomize=True)
# [T, V] shapes (T in 1..4, V in 5..11). Every shape costs compilations, so the property
# tests evaluate all divergences in one jitted function per shape.
SHAPES = [(1, 5), (4, 11)]
shapes = st.sampled_from(SHAPES)


@jax.jit
def every(s, t, mask, tau):
  """``{name: [T] values}`` of every registered divergence (test hyper-parameters)."""
  return {n: f(s, t, mask, tau, **HYPER.get(n, {})) for n, f in losses.DIVERGENCES.items()}


@jax.jit
def every_with_grads(s, t, mask, tau):
  """``{name: ([T] values, (d sum / d student, d sum / d teacher))}`` of every divergence."""
  out = {}
  for name, f in losses.DIVERGENCES.items():
    hyper = HYPER.get(name, {})
    values, vjp = jax.vjp(lambda a, b, f=f, hyper=hyper: f(a, b, mask, tau, **hyper), s, t)
    out[name] = (values, vjp(jnp.ones_like(values)))
  return out


def ones(s):
  return np.ones(np.shape(s)[:1], np.float32)


@st.composite
def logit_pairs(draw, low=-20.0, high=20.0):
  """Student and teacher logits [T, V] (float32) of one of `SHAPES`."""
  T, V = draw(shapes)
  elems = st.floats(low, high, width=32, allow_nan=False, allow_infinity=False)
  s = draw(hnp.arrays(np.float32, (T, V), elements=elems))
  t = draw(hnp.arrays(np.float32, (T, V), elements=elems))
  return s, t


def seeded_pair(seed, T, V, scale=3.0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(T, V)) * scale).astype(dtype), (rng.normal(size=(T, V)) * scale).astype(dtype)


# --------------------------------------------------------------- float64 reference
def _np_logsoftmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def reference(name, s, t, tau):
  """Straightforward float64 numpy formulas, written independently of the library."""
  s, t = np.asarray(s, np.float64) / tau, np.asarray(t, np.float64) / tau
  ps, pt = np.exp(_np_logsoftmax(s)), np.exp(_np_logsoftmax(t))

  def kl(p, q):
    with np.errstate(divide="ignore", invalid="ignore"):
      return np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0).sum(-1)

  h = HYPER.get(name, {})
  if name == "forward_kl":
    return kl(pt, ps)
  if name == "reverse_kl":
    return kl(ps, pt)
  if name == "jsd":
    b = h["beta"]
    m = b * pt + (1 - b) * ps
    return b * kl(pt, m) + (1 - b) * kl(ps, m)
  if name == "skew_kl":
    return kl(pt, h["skew"] * pt + (1 - h["skew"]) * ps)
  if name == "skew_reverse_kl":
    return kl(ps, h["skew"] * ps + (1 - h["skew"]) * pt)
  if name == "tvd":
    return 0.5 * np.abs(ps - pt).sum(-1)
  if name == "mse":
    d = (s - s.mean(-1, keepdims=True)) - (t - t.mean(-1, keepdims=True))
    return (d * d).mean(-1)
  raise KeyError(name)


def test_registry_covers_the_family_and_unknown_names_list_the_choices():
  assert set(NAMES) == {"forward_kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd", "mse"}
  assert set(DIST_NAMES) == set(NAMES) - {"mse"}
  with pytest.raises(ValueError, match="unknown divergence 'kl'.*forward_kl"):
    losses.get_divergence("kl")
  with pytest.raises(ValueError, match="mse.*forward_kl|forward_kl"):
    losses.get_distribution_divergence("mse")


@PROPERTY
@given(pair=logit_pairs(-8.0, 8.0), tau=st.sampled_from([0.5, 1.0, 2.5]))
def test_every_divergence_matches_its_float64_reference_formula(pair, tau):
  s, t = pair
  for name, got in every(s, t, ones(s), tau).items():
    np.testing.assert_allclose(got, reference(name, s, t, tau), rtol=2e-4, atol=2e-5, err_msg=name)


@PROPERTY
@given(pair=logit_pairs(), shift=st.floats(-30.0, 30.0, width=32))
def test_every_divergence_is_nonnegative_and_zero_for_equal_distributions(pair, shift):
  s, t = pair
  for name, got in every(s, t, ones(s), 1.0).items():
    # float32 rounding of sum p (log p - log q) can land a few ulps below 0.
    assert np.all(np.asarray(got) >= -1e-6), name
  for name, got in every(s, s, ones(s), 1.0).items():
    np.testing.assert_allclose(got, 0.0, atol=1e-6, err_msg=name)
  # The same distribution written with shifted logits is still "equal".
  for name, got in every(s, s + shift, ones(s), 1.0).items():
    np.testing.assert_allclose(got, 0.0, atol=2e-5, err_msg=name)


@PROPERTY
@given(pair=logit_pairs(), data=st.data())
def test_every_divergence_is_invariant_to_a_per_token_logit_shift(pair, data):
  s, t = pair
  T = s.shape[0]
  shift = st.floats(-50.0, 50.0, width=32)
  cs = data.draw(hnp.arrays(np.float32, (T, 1), elements=shift))
  ct = data.draw(hnp.arrays(np.float32, (T, 1), elements=shift))
  base = every(s, t, ones(s), 1.0)
  for name, got in every(s + cs, t + ct, ones(s), 1.0).items():
    # |logit| <= 70 in float32: log-probs carry ~1e-5 absolute rounding.
    np.testing.assert_allclose(got, base[name], rtol=1e-4, atol=1e-4, err_msg=name)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), bf16=st.booleans())
def test_every_divergence_and_its_gradient_are_finite_for_logits_of_1e4_and_bfloat16(seed, bf16):
  T, V = SHAPES[-1]
  rng = np.random.default_rng(seed)
  s = rng.choice([-1e4, 1e4, 0.0], size=(T, V)) + rng.normal(size=(T, V))
  t = rng.choice([-1e4, 1e4, 0.0], size=(T, V)) + rng.normal(size=(T, V))
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  s, t = jnp.asarray(s, dtype), jnp.asarray(t, dtype)
  for name, (value, (ds, dt)) in every_with_grads(s, t, ones(s), 1.0).items():
    assert value.dtype == jnp.float32, name
    assert np.all(np.isfinite(value)), name
    assert np.all(np.isfinite(np.asarray(ds, np.float32))) and np.all(np.isfinite(np.asarray(dt, np.float32))), name


@SMALL
@given(seed=st.integers(0, 2**31 - 1))
def test_bfloat16_logits_are_widened_to_float32_not_computed_in_bfloat16(seed):
  s, t = seeded_pair(seed, *SHAPES[-1])
  sb, tb = jnp.asarray(s, jnp.bfloat16), jnp.asarray(t, jnp.bfloat16)
  low = every_with_grads(sb, tb, ones(s), 1.0)
  wide = every_with_grads(sb.astype(jnp.float32), tb.astype(jnp.float32), ones(s), 1.0)
  for name in NAMES:
    np.testing.assert_array_equal(low[name][0], wide[name][0], err_msg=name)


@SMALL
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), tau=st.sampled_from([0.7, 2.0]))
def test_every_divergence_gradient_matches_finite_differences_in_float64(shape, seed, tau):
  T, V = shape
  s, t = seeded_pair(seed, T, V, dtype=np.float64)
  ps, pt = np.exp(_np_logsoftmax(s / tau)), np.exp(_np_logsoftmax(t / tau))
  assume(np.min(np.abs(ps - pt)) > 1e-3)  # tvd's |.| has a kink where p_s == p_t; stay away from it
  mask = (np.arange(T) % 3 != 2).astype(np.float64)
  with jax.enable_x64(True):
    f = functools.partial(every, mask=jnp.asarray(mask), tau=tau)
    args = (jnp.asarray(s), jnp.asarray(t))
    assert all(v.dtype == jnp.float64 for v in f(*args).values())
    check_grads(f, args, order=1, modes=("rev",), eps=1e-5, atol=1e-6, rtol=1e-5)


def test_masked_tokens_give_zero_value_and_zero_gradient():
  s, t = seeded_pair(0, *SHAPES[-1])
  mask = np.asarray([1.0, 0.0, 1.0, 0.0], np.float32)
  for name, (value, (ds, dt)) in every_with_grads(s, t, mask, 1.5).items():
    np.testing.assert_array_equal(np.asarray(value)[[1, 3]], 0.0, err_msg=name)
    assert np.all(np.asarray(value)[[0, 2]] > 0), name
    for g in (ds, dt):
      np.testing.assert_array_equal(np.asarray(g)[[1, 3]], 0.0, err_msg=name)
      assert np.any(np.asarray(g)[[0, 2]] != 0), name


_jsd = _jsd64 = jax.jit(lambda s, t, beta: losses.jsd(s, t, beta=beta))


@PROPERTY
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_jsd_scaled_by_its_weight_tends_to_forward_kl_at_beta_0_and_reverse_kl_at_beta_1(shape, seed):
  # The error is of order beta times a constant that grows with the probability ratios,
  # so moderate logits and weights down to 1e-6 (float64 keeps JSD ~ 1e-6 exact enough).
  s, t = seeded_pair(seed, *shape, scale=1.5, dtype=np.float64)
  weights = (1e-2, 1e-4, 1e-6)
  with jax.enable_x64(True):
    s, t = jnp.asarray(s), jnp.asarray(t)
    fwd, rev = np.asarray(losses.forward_kl(s, t)), np.asarray(losses.reverse_kl(s, t))
    errs_fwd = [np.max(np.abs(np.asarray(_jsd64(s, t, b)) / b - fwd) / fwd) for b in weights]
    errs_rev = [np.max(np.abs(np.asarray(_jsd64(s, t, 1.0 - b)) / b - rev) / rev) for b in weights]
    np.testing.assert_array_equal(_jsd64(s, t, 0.0), 0.0)  # continuous: exactly 0 at the ends
    np.testing.assert_allclose(_jsd64(s, t, 1.0), 0.0, atol=1e-15)
  for errs in (errs_fwd, errs_rev):
    assert errs[-1] < 1e-3
    assert errs[2] < errs[1] < errs[0]  # the error shrinks with the weight (order beta)


@SMALL
@given(pair=logit_pairs(-8.0, 8.0), beta=st.floats(0.05, 0.95))
def test_jsd_swaps_sides_with_one_minus_beta(pair, beta):
  s, t = pair
  np.testing.assert_allclose(_jsd(s, t, beta), _jsd(t, s, 1 - beta), rtol=1e-5, atol=1e-6)


def test_skew_zero_is_the_plain_kl():
  s, t = seeded_pair(1, 4, 11)
  skewed = jax.jit(lambda a, b: (losses.skew_kl(a, b, skew=0.0), losses.skew_reverse_kl(a, b, skew=0.0)))(s, t)
  np.testing.assert_allclose(skewed[0], reference("forward_kl", s, t, 1.0), rtol=1e-5)
  np.testing.assert_allclose(skewed[1], reference("reverse_kl", s, t, 1.0), rtol=1e-5)


# ------------------------------------------------------------------------------ top-k
@jax.jit
def topk_at_several_k(s, t, tau):
  """``{k: (student bins, teacher bins, {name: top-k divergence})}`` for k in 1, V//2, V-1, V."""
  V = s.shape[-1]
  out = {}
  for k in sorted({1, V // 2, V - 1, V}):
    idx, lp = losses.teacher_topk(t, k, tau)
    tail = losses.topk_tail(t, idx, tau)
    divs = {n: losses.topk_divergence(s, idx, lp, None, tau, n, tail, **HYPER.get(n, {})) for n in DIST_NAMES}
    out[k] = (*losses.topk_bins(s, idx, lp, tau), divs)
  return out


@PROPERTY
@given(pair=logit_pairs(-8.0, 8.0))
def test_topk_bins_are_distributions_and_the_tail_holds_the_rest_of_the_teacher_mass(pair):
  s, t = pair
  pt = np.exp(_np_logsoftmax(np.asarray(t, np.float64) / 1.3))
  for k, (bins_s, bins_t, _) in topk_at_several_k(s, t, 1.3).items():
    assert bins_s.shape == bins_t.shape == (s.shape[0], k + 1)
    np.testing.assert_allclose(np.exp(bins_s).sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.exp(bins_t).sum(-1), 1.0, rtol=1e-5)
    top = np.sort(pt, -1)[:, ::-1][:, :k]
    np.testing.assert_allclose(np.exp(bins_t[:, :k]), top, atol=1e-6)
    np.testing.assert_allclose(np.exp(bins_t[:, k]), 1.0 - top.sum(-1), atol=1e-5)


@PROPERTY
@given(pair=logit_pairs(-8.0, 8.0))
def test_topk_divergence_is_a_lower_bound_and_exact_once_k_covers_the_vocabulary(pair):
  s, t = pair
  V = s.shape[-1]
  full = every(s, t, ones(s), 1.5)
  for k, (*_, divs) in topk_at_several_k(s, t, 1.5).items():
    for name, got in divs.items():
      if k >= V - 1:  # every bin is one token (k = V - 1 leaves a one-token tail)
        np.testing.assert_allclose(got, full[name], rtol=1e-4, atol=1e-5, err_msg=f"{name} k={k}")
      # Merging tokens into one tail bin never increases an f-divergence.
      assert np.all(np.asarray(got) <= np.asarray(full[name]) * (1 + 1e-5) + 1e-5), (name, k)
      assert np.all(np.asarray(got) >= -1e-6), (name, k)


def test_topk_accepts_a_cached_teacher_and_masks_tokens():
  s, t = seeded_pair(3, 4, 11)
  mask = np.asarray([1.0, 1.0, 0.0, 1.0], np.float32)

  @jax.jit
  def run(s, t):
    idx, lp = losses.teacher_topk(t, 4, 2.0)
    tail = losses.topk_tail(t, idx, 2.0)
    live = losses.topk_divergence(s, idx, lp, mask, 2.0, "forward_kl", tail)
    no_tail = losses.topk_divergence(s, idx, lp, mask, 2.0)  # tail = log(1 - sum_k p_t)
    cached = losses.topk_divergence(s, idx, lp.astype(jnp.bfloat16), mask, 2.0)
    grad = jax.grad(lambda a: jnp.sum(losses.topk_divergence(a, idx, lp, mask, 2.0, "jsd", tail, beta=0.4)))(s)
    return live, no_tail, cached, grad

  live, no_tail, cached, g = run(s, t)
  assert live[2] == 0.0 and no_tail[2] == 0.0 and cached[2] == 0.0
  np.testing.assert_allclose(no_tail, live, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(cached, live, rtol=2e-2, atol=1e-3)  # bfloat16 cache: ~3 significant digits
  assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[2] == 0.0) and np.any(np.asarray(g)[0] != 0)
  with pytest.raises(ValueError, match="k=12.*V=11"):
    losses.topk_bins(s, jnp.zeros((4, 12), jnp.int32), jnp.zeros((4, 12)), 1.0)


# ---------------------------------------------------------------------------- LogitKD
def _outputs(seed, T=6, V=11):
  s, t = seeded_pair(seed, T, V)
  rng = np.random.default_rng(seed + 1)
  targets = rng.integers(0, V, T)
  mask = (np.arange(T) < T - 2).astype(np.float32)
  return _wrap(s), _wrap(t), jnp.asarray(targets), jnp.asarray(mask)


def _wrap(logits):
  return md.ModelOutput(jnp.asarray(logits), (), (), None)


def _per_sequence(kd, seed, step=0):
  s, t, y, m = _outputs(seed)
  out = jax.jit(kd.per_sequence)({}, s, t, y, m, jnp.int32(step))
  return out, s, t, m


def test_default_logitkd_loss_and_metrics_are_unchanged():
  out, s, t, m = _per_sequence(md.LogitKD(), 0)
  assert set(out) == {"loss", "kl", "ce", "teacher_ce", "corr", "agree"}
  kl = np.sum(reference("forward_kl", s.logits, t.logits, 2.0) * np.asarray(m))
  np.testing.assert_allclose(out["kl"], kl, rtol=1e-5)
  np.testing.assert_allclose(out["loss"], 0.5 * 4.0 * out["kl"] + 0.5 * out["ce"], rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_logitkd_optimises_the_chosen_divergence_and_still_reports_forward_kl(name):
  kd = md.LogitKD(divergence=name, temperature=1.5, alpha=0.7, **HYPER.get(name, {}))
  out, s, t, m = _per_sequence(kd, 1, step=3)
  term = np.sum(reference(name, s.logits, t.logits, 1.5) * np.asarray(m))
  np.testing.assert_allclose(out[name if name != "forward_kl" else "kl"], term, rtol=1e-4)
  kl = np.sum(reference("forward_kl", s.logits, t.logits, 1.5) * np.asarray(m))
  np.testing.assert_allclose(out["kl"], kl, rtol=1e-4)
  np.testing.assert_allclose(out["loss"], 0.7 * 1.5**2 * term + 0.3 * out["ce"], rtol=1e-4)


def test_logitkd_top_k_reports_the_top_k_term_below_the_full_one():
  out, s, t, m = _per_sequence(md.LogitKD(top_k=3, divergence="reverse_kl"), 2)
  full = np.sum(reference("reverse_kl", s.logits, t.logits, 2.0) * np.asarray(m))
  assert set(out) == {"loss", "kl", "ce", "teacher_ce", "corr", "agree", "topk_reverse_kl"}
  assert 0 < out["topk_reverse_kl"] < full
  out_all, *_ = _per_sequence(md.LogitKD(top_k=11, divergence="reverse_kl"), 2)
  np.testing.assert_allclose(out_all["topk_reverse_kl"], full, rtol=1e-4)


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": {"kind": "linear", "start": 3.0, "end": 0.0, "steps": 10}}, "temperature"),
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": -0.1}, "alpha"),
        ({"beta": 1.2, "divergence": "jsd"}, "beta"),
        ({"beta": 0.0, "divergence": "jsd"}, "beta"),
        ({"beta": {"kind": "constant", "value": 1.0}, "divergence": "jsd"}, "beta"),
        ({"skew": 1.0, "divergence": "skew_kl"}, "skew"),
        ({"divergence": "kl"}, "divergence"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 4, "divergence": "mse"}, "top_k"),
    ],
)
def test_logitkd_rejects_bad_settings_naming_them(kwargs, setting):
  with pytest.raises(ValueError, match=f"LogitKD.{setting}"):
    md.LogitKD(**kwargs)


def test_logitkd_rejects_top_k_larger_than_the_vocabulary():
  md.LogitKD(top_k=TEACHER_CFG.vocab_size).init_params(STUDENT_CFG, TEACHER_CFG, None)
  with pytest.raises(ValueError, match=f"top_k=65 exceeds the vocabulary size {TEACHER_CFG.vocab_size}"):
    md.LogitKD(top_k=65).init_params(STUDENT_CFG, TEACHER_CFG, None)


# ---------------------------------------------------------------- through the mesh step
@dataclasses.dataclass(frozen=True)
class _EveryDivergence(md.strategies.SequenceStrategy):
  """Optimises the sum of several LogitKD losses; reports each one (one compile for all)."""

  terms: tuple
  capture: tuple = ()

  def init_params(self, student_cfg, teacher_cfg, key):
    for _, kd in self.terms:
      kd.init_params(student_cfg, teacher_cfg, key)
    return {}

  def per_sequence(self, params, student, teacher, targets_T, mask_T, step):
    out = {f"loss_{label}": kd.per_sequence(params, student, teacher, targets_T, mask_T, step)["loss"]
           for label, kd in self.terms}
    out["loss"] = sum(out.values())
    return out


def test_every_divergence_gives_the_same_loss_on_a_2x4_mesh_as_on_one_device():
  terms = tuple((n, md.LogitKD(divergence=n, **HYPER.get(n, {}))) for n in NAMES)
  terms += (("topk_jsd", md.LogitKD(top_k=8, divergence="jsd", beta=0.3)),)
  strategy = _EveryDivergence(terms)
  mesh = md.make_mesh(data=2, tensor=4)
  runs = {}
  for backend, m in (("shard_map", mesh), ("single", None)):
    d = md.Distiller(md.init_model(STUDENT_CFG, 1, m), md.init_model(TEACHER_CFG, 0, m), strategy=strategy, mesh=m)
    state = d.init_state()
    history = []
    for i in range(2):
      state, metrics = d.step(state, make_batch(seed=i))
      history.append(jax.device_get(metrics))
    runs[backend] = history
  for i, (sharded, single) in enumerate(zip(runs["shard_map"], runs["single"])):
    for label, _ in terms:
      key = f"loss_{label}"
      assert np.isfinite(single[key]) and single[key] > 0, (i, key)
      np.testing.assert_allclose(sharded[key], single[key], rtol=1e-5, err_msg=f"step {i} {key}")


def test_divergences_and_a_cached_top_k_teacher_never_gather_a_vocabulary_split_over_tensor():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = md.make_mesh(data=2, tensor=4)
  split_vocab = NamedSharding(mesh, P("data", None, "tensor"))
  rng = np.random.default_rng(0)
  s, t = (jax.device_put(rng.normal(size=(4, 8, 64)).astype(np.float32), split_vocab) for _ in range(2))
  idx, lp = jax.vmap(lambda x: losses.teacher_topk(x, 8, 1.0))(jax.device_get(t))
  tail = jax.vmap(lambda x, i: losses.topk_tail(x, i, 1.0))(jax.device_get(t), idx)
  idx, lp, tail = jax.device_put((idx, lp, tail), NamedSharding(mesh, P("data")))

  def total(s, t, idx, lp, tail):
    every_T = [f(s, t, None, 2.0, **HYPER.get(n, {})) for n, f in losses.DIVERGENCES.items()]
    every_T += [losses.topk_divergence(s, idx, lp, None, 1.0, n, tail, **HYPER.get(n, {})) for n in DIST_NAMES]
    return jnp.sum(jnp.stack(every_T))

  step = jax.jit(jax.value_and_grad(lambda s, *rest: jnp.sum(jax.vmap(total)(s, *rest))))
  hlo = step.lower(s, t, idx, lp, tail).compile().as_text()
  assert "all-reduce(" in hlo  # the vocabulary reductions do cross `tensor` ...
  assert "all-gather(" not in hlo and "all-to-all(" not in hlo  # ... as partial sums, never as gathered logits
  value, _ = step(s, t, idx, lp, tail)
  assert np.isfinite(value)


def test_live_teacher_top_k_is_vocabulary_parallel_and_picks_the_same_tokens_as_one_device():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = md.make_mesh(data=2, tensor=4)  # 64 tokens: 16 per slice
  rng = np.random.default_rng(0)
  t = rng.normal(size=(4, 8, 64)).astype(np.float32)
  t[:, :, 10:20] = 3.0  # ties across the boundary of slices 0 and 1: the lower ids must win
  t[0, 0] = 0.0  # a row of 64 ties
  select = jax.vmap(lambda x: losses.teacher_topk(x, 12, 1.5))
  one_idx, one_lp = jax.jit(select)(t)  # no mesh: jax.lax.top_k over V
  with jax.set_mesh(mesh):
    x = jax.device_put(t, NamedSharding(mesh, P(None, None, "tensor")))  # rows stay whole, as in the step
    compiled = jax.jit(select).lower(x).compile()
    idx, lp = compiled(x)
  gathers = all_gather_shapes(compiled.as_text())
  assert gathers and not [g for g in gathers if 64 in g], gathers  # only the 4 x 12 candidates per token move
  assert all(g[-1] == 4 * 12 for g in gathers), gathers
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(one_idx))
  np.testing.assert_allclose(np.asarray(lp), np.asarray(one_lp), rtol=1e-6)
  assert list(np.asarray(idx)[1, 0, :10]) == list(range(10, 20))


def test_a_new_divergence_is_one_entry_and_every_setting_then_takes_its_name(monkeypatch):
  """CONTRIBUTING's recipe "A divergence": its two functions and one entry in `DIVERGENCES` and in
  `DISTRIBUTION_DIVERGENCES`; `LogitKD` (full and top-k), ``distill.divergence`` and the guard's fallback then take
  the name, and the strategy optimises it."""
  from meshdistill.config import load_config
  from meshdistill.losses import _divergences
  from meshdistill.models import ModelOutput

  def half_kl_logprobs(logp_s_TxN, logp_t_TxN):
    return 0.5 * _divergences.forward_kl_logprobs(logp_s_TxN, logp_t_TxN)

  def half_kl(student_TxV, teacher_TxV, mask_T=None, temperature=1.0):
    return _divergences._on_logits(half_kl_logprobs, student_TxV, teacher_TxV, mask_T, temperature)

  monkeypatch.setitem(losses.DIVERGENCES, "half_kl", half_kl)
  monkeypatch.setitem(losses.DISTRIBUTION_DIVERGENCES, "half_kl", half_kl_logprobs)
  cfg = load_config("tiny", ["distill.divergence=half_kl", "distill.top_k=4", "safeguards.guard.fallback=half_kl"])
  chosen = cfg.distill.strategy()
  assert (type(chosen), chosen.divergence, chosen.top_k) == (md.LogitKD, "half_kl", 4)
  assert cfg.safeguards.guard.fallback == "half_kl"
  rng = np.random.default_rng(0)
  s, t = (jnp.asarray(rng.normal(size=(6, 8)), jnp.float32) for _ in range(2))
  targets, mask = jnp.asarray(rng.integers(0, 8, 6)), jnp.asarray([1, 1, 1, 1, 0, 0], jnp.float32)
  loss = lambda kd: float(kd.per_sequence({}, ModelOutput(s), ModelOutput(t), targets, mask, 0)["loss"])  # noqa: E731
  half, full = (loss(md.LogitKD(divergence=d, alpha=1.0)) for d in ("half_kl", "forward_kl"))
  assert full > 0 and half == pytest.approx(0.5 * full, rel=1e-6)
