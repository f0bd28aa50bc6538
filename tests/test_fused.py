"""The fused forward-KL recipe (`losses.forward_kl_terms`) against the term-by-term functions."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import kd_logits

import meshdistill as md
from meshdistill import losses
from meshdistill.parallel.collectives import all_reduce_census
from meshdistill.strategies import LogitKD

T, V = 12, 96


def unfused(s, t, y, m, tau, alpha):
  out = {
      "kl": losses.forward_kl(s, t, m, tau),
      "ce": losses.cross_entropy(s, y, m),
      "teacher_ce": losses.cross_entropy(t, y, m),
      "corr": losses.pearson(s, t, m),
      "agree": losses.top1_agreement(s, t, m),
  }
  out["loss"] = alpha * tau**2 * out["kl"] + (1.0 - alpha) * out["ce"]
  return out


def fused(s, t, y, m, tau, alpha):
  return losses.forward_kl_terms(s, t, y, m, tau, alpha)


def logits(seed, scale=3.0, offset=0.0):
  return kd_logits(T, V, seed, scale, offset)


@pytest.mark.parametrize("tau,alpha", [(1.0, 0.5), (2.5, 0.0), (0.7, 1.0), (2.0, 0.5)])
@pytest.mark.parametrize("scale,offset", [(3.0, 0.0), (300.0, 0.0), (2.0, 1e3)])  # large magnitudes, large offsets
def test_fused_values_and_gradients_equal_the_unfused_formulas(tau, alpha, scale, offset):
  s, t, y, m = logits(0, scale, offset)
  want, got = unfused(s, t, y, m, tau, alpha), fused(s, t, y, m, tau, alpha)
  assert set(got) == set(want)
  for k in want:
    assert got[k].dtype == jnp.float32
    np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=2e-6 * max(1.0, float(jnp.max(jnp.abs(want[k])))),
                               err_msg=k)
    np.testing.assert_array_equal(np.asarray(got[k])[np.asarray(m) == 0], 0.0)  # masked tokens exactly 0
  np.testing.assert_array_equal(got["agree"], want["agree"])  # ties and arg-max: exactly the same
  w = jnp.linspace(0.5, 1.5, T)  # a cotangent that differs per token
  for k in ("loss", "kl", "ce"):
    g_want = jax.grad(lambda s: jnp.sum(w * unfused(s, t, y, m, tau, alpha)[k]))(s)
    g_got = jax.grad(lambda s: jnp.sum(w * fused(s, t, y, m, tau, alpha)[k]))(s)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(g_want))), err_msg=k)
    np.testing.assert_array_equal(np.asarray(g_got)[np.asarray(m) == 0], 0.0)


def test_fused_metrics_carry_no_gradient_and_the_teacher_none():
  s, t, y, m = logits(1)
  for k in ("teacher_ce", "agree", "corr"):
    np.testing.assert_array_equal(jax.grad(lambda s: jnp.sum(fused(s, t, y, m, 2.0, 0.5)[k]))(s), 0.0)
  np.testing.assert_array_equal(jax.grad(lambda t: jnp.sum(fused(s, t, y, m, 2.0, 0.5)["loss"]))(t), 0.0)


def test_fused_widens_bfloat16_and_counts_minus_inf_teacher_logits_as_zero():
  s, t, y, m = logits(2)
  sb, tb = s.astype(jnp.bfloat16), t.astype(jnp.bfloat16)
  got, want = fused(sb, tb, y, m, 2.0, 0.5), unfused(sb, tb, y, m, 2.0, 0.5)
  for k in want:
    assert got[k].dtype == jnp.float32
    np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=2e-6, err_msg=k)
  g = jax.grad(lambda s: jnp.sum(fused(s, tb, y, m, 2.0, 0.5)["loss"]))(sb)
  assert g.dtype == jnp.bfloat16
  # a teacher with -inf logits (a vocabulary padded with -inf): those terms count 0, no NaN
  t_inf = t.at[:, 50:].set(-jnp.inf)
  kl = fused(s, t_inf, y, m, 2.0, 0.5)["kl"]
  np.testing.assert_allclose(kl, losses.forward_kl(s, t_inf, m, 2.0), rtol=2e-6, atol=2e-6)
  assert np.isfinite(np.asarray(jax.grad(lambda s: jnp.sum(fused(s, t_inf, y, m, 2.0, 0.5)["loss"]))(s))).all()


def test_fused_with_the_vocabulary_split_over_tensor_equals_one_device():
  mesh = md.make_mesh(2, 4)
  s, t, y, m = logits(3, scale=30.0)
  y = y % 90

  def value_and_grad(s, t):  # 96 columns split over `tensor`, cut to 90 inside (uneven shards, as the models do)
    def loss(s):
      out = fused(s[:, :90], t[:, :90], y, m, 2.0, 0.5)
      return jnp.sum(out["loss"]), out

    return jax.value_and_grad(loss, has_aux=True)(s)

  (_, want), g_want = jax.jit(value_and_grad)(s, t)
  split = NamedSharding(mesh, P(None, "tensor"))
  s, t = jax.device_put(s, split), jax.device_put(t, split)
  jitted = jax.jit(value_and_grad, out_shardings=(NamedSharding(mesh, P()), split))
  with jax.set_mesh(mesh):  # `tensor` an auto axis in scope, as in the train step: the stacked reductions
    stacked = jitted.lower(s, t).compile()
  separate = jitted.lower(s, t).compile()  # no mesh in scope: the one-device form, on split inputs
  for compiled in (stacked, separate):
    (_, got), g_got = compiled(s, t)
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-7)
    assert "all-gather" not in compiled.as_text()
  census = [all_reduce_census(c.as_text(), mesh)["tensor"] for c in (stacked, separate)]
  # stacked: the max, the sums (the loss's and the metrics' in one), the correlation's sums; separate ones
  # leave the grouping to XLA's combiner (here it finds the same; inside the chunked loop it kept one more)
  assert 0 < census[0] <= min(3, census[1]), census


_STACK = re.compile(r"\b(stack|concatenate)\[")  # how a jaxpr writes `jnp.stack`


def test_fused_stacks_its_reductions_only_where_the_vocabulary_may_be_split():
  """One device (and a manual ``tensor`` axis, as with the student over the batch): separate reductions, no
  stacked ``[k, T, V]`` copy written; a mesh with ``tensor`` auto: stacked. Both forms give the same numbers."""
  s, t, y, m = logits(5)
  mesh = md.make_mesh(2, 4)
  grad = jax.grad(lambda s: jnp.sum(fused(s, t, y, m, 2.0, 0.5)["loss"]))

  def has_stack(fn, mesh=None):
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
      return _STACK.search(str(jax.make_jaxpr(fn)(s))) is not None

  assert not has_stack(grad)
  assert not has_stack(grad, md.make_mesh(8, 1))  # `tensor` of size 1: nothing to split
  assert has_stack(grad, mesh)
  # every device holds all of V
  assert not has_stack(jax.shard_map(grad, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
  want = fused(s, t, y, m, 2.0, 0.5)
  with jax.set_mesh(mesh):
    got = jax.jit(fused)(s, t, y, m, 2.0, 0.5)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=2e-6, err_msg=k)


def test_logit_recipe_fuses_the_forward_kl_only():
  s, t, y, m = logits(4)
  params = {"temperature": jnp.float32(2.0), "alpha": jnp.float32(0.5)}
  got = LogitKD().token_terms(params, s, t, y, m)
  want = unfused(s, t, y, m, 2.0, 0.5)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=2e-6, err_msg=k)
  # another divergence keeps the term-by-term path (and reports its own term)
  assert "reverse_kl" in LogitKD(divergence="reverse_kl").token_terms(params, s, t, y, m)
