"""The loss kernel (`losses._kl_kernel`: the default recipe's values and logits gradient in one read of a chunk's
logits) against `losses.forward_kl_terms` and its autodiff gradient, interpreted on the CPU; where the chunked loss
takes it; compiled for a v5e chip with libtpu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import kd_logits

import meshdistill as md
from meshdistill import losses
from meshdistill.losses import kl_kernel_applies, kl_kernel_usable, kl_value_and_grad
from meshdistill.planner import libtpu_available

C, V = 40, 256  # 40 rows: the kernel pads them to 48 (blocks of 16); V: two lane tiles


def logits(seed, scale=3.0, offset=0.0):
  """`helpers.kd_logits` with two target ids outside the vocabulary (no cross-entropy) and a padded row masked."""
  s, t, y, m = kd_logits(C, V, seed, scale, offset)
  return s, t, y.at[3].set(-100).at[4].set(V), (m > 0).at[39].set(False)


def reference(s, t, y, keep, tau, alpha):
  """`forward_kl_terms`'s values and the autodiff gradient of their loss sum (what the chunk loop took before)."""
  (_, out), grad = jax.value_and_grad(lambda s: (lambda o: (jnp.sum(o["loss"]), o))(
      losses.forward_kl_terms(s, t, y, keep, tau, alpha)), has_aux=True)(s)
  return out, grad


@pytest.mark.parametrize("tau,alpha", [(1.0, 0.5), (2.5, 0.0), (0.7, 1.0), (2.0, 0.5)])
@pytest.mark.parametrize("scale,offset", [(3.0, 0.0), (300.0, 0.0), (2.0, 1e3)])  # large magnitudes, large offsets
def test_the_kernel_gives_the_fused_recipes_values_and_the_gradient_of_its_loss_sum(tau, alpha, scale, offset):
  """The same formulas in float32, the sums over V in another order (per lane, then across lanes): the bounds of
  `tests/test_fused.py` (float32 rounding of sums of 256 terms), and the rounding of the shifted logits, which the
  XLA form forms as ``s / tau - m / tau`` and the kernel as ``(s - m) * (1 / tau)``: one float32 rounding of the
  largest logit over tau, a few times over (``shift``; it moves every exponent, so the values and the gradient by that
  much relatively). Masked and padded rows exactly 0; arg-max ties
  and agreement exactly as the XLA form counts them."""
  s, t, y, keep = logits(0, scale, offset)
  want, want_grad = reference(s, t, y, keep, tau, alpha)
  got, grad = kl_value_and_grad(s, t, y, keep, tau, alpha, grad_dtype=jnp.float32, interpret=True)
  shift = 4 * float(np.finfo(np.float32).eps) * float(jnp.maximum(jnp.max(jnp.abs(s)), jnp.max(jnp.abs(t)))) / tau
  assert set(got) == set(want)
  for k in want:
    assert got[k].shape == (C,) and got[k].dtype == jnp.float32
    top = max(1.0, float(jnp.max(jnp.abs(want[k]))))
    np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=max(2e-6, shift) * top, err_msg=k)
    np.testing.assert_array_equal(np.asarray(got[k])[~np.asarray(keep)], 0.0)
  np.testing.assert_array_equal(got["agree"], want["agree"])
  assert float(got["ce"][3]) == float(got["ce"][4]) == 0.0 and float(jnp.sum(got["agree"])) > 0
  assert grad.shape == (C, V)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=max(1e-6, shift) * float(jnp.max(jnp.abs(want_grad))))
  np.testing.assert_array_equal(np.asarray(grad)[~np.asarray(keep)], 0.0)


def test_the_bfloat16_gradient_is_the_float32_one_rounded_once():
  s, t, y, keep = logits(1)
  _, grad = kl_value_and_grad(s, t, y, keep, 2.0, 0.5, grad_dtype=jnp.float32, interpret=True)
  _, grad_bf16 = kl_value_and_grad(s, t, y, keep, 2.0, 0.5, interpret=True)
  assert grad_bf16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(grad_bf16, grad.astype(jnp.bfloat16))


def test_the_kernel_takes_whole_lane_tiles_of_float32_logits_only():
  s, t, y, keep = logits(2)
  with pytest.raises(ValueError, match=r"vocabulary of 200 is not usable .*multiple of 128.*forward_kl_terms"):
    kl_value_and_grad(s[:, :200], t[:, :200], y, keep, 2.0, 0.5, interpret=True)
  with pytest.raises(ValueError, match=r"float32 \[C, V\] logits"):
    kl_value_and_grad(s.astype(jnp.bfloat16), t, y, keep, 2.0, 0.5, interpret=True)
  assert kl_kernel_usable(151936) and kl_kernel_usable(262144) and not kl_kernel_usable(1 << 20)


def test_the_chunked_loss_takes_the_kernel_where_it_applies():
  """``pallas``: on any platform (this CPU: interpreted); ``auto`` (the default): where the step is compiled for a
  TPU, not here; ``xla``: never; none of them where a compiler-managed mesh axis has several devices (the rows' sums
  need all of V on one device), nor for a vocabulary of partial lane tiles; an unknown name is refused naming the
  choices."""
  assert md.ChunkedLogitKD().loss_kernel == "auto"
  assert kl_kernel_applies(V, "pallas") and not kl_kernel_applies(V, "xla")
  assert not kl_kernel_applies(V, "auto") and jax.default_backend() == "cpu"
  assert kl_kernel_applies(V, "auto", platform="tpu") and not kl_kernel_applies(V, "auto", platform="gpu")
  assert not kl_kernel_applies(200, "pallas") and not kl_kernel_applies(200, "auto", platform="tpu")
  with jax.set_mesh(md.make_mesh(data=1, tensor=1, devices=jax.devices()[:1])):
    assert kl_kernel_applies(V, "pallas") and kl_kernel_applies(V, "auto", platform="tpu")
  with jax.set_mesh(md.make_mesh(data=2, tensor=4)):
    assert not kl_kernel_applies(V, "pallas") and not kl_kernel_applies(V, "auto", platform="tpu")
  with pytest.raises(ValueError, match=r"loss_kernel='fast'; choose one of \('auto', 'xla', 'pallas'\)"):
    md.ChunkedLogitKD(loss_kernel="fast")


def test_the_kernel_applies_only_where_the_gradient_it_would_write_fits():
  """A float32 head's gradient is written in float32 where the matmuls do not round it (here, off a TPU): for a
  vocabulary of 300,032 its block would not fit the kernel's on-chip memory (a bfloat16 one does), so the loss stays
  in XLA rather than fail; at Gemma 3's 262,144 both fit."""
  assert kl_kernel_applies(300032, "pallas") and kl_kernel_applies(300032, "pallas", head_dtype=jnp.bfloat16)
  assert not kl_kernel_applies(300032, "pallas", head_dtype=jnp.float32)
  assert kl_kernel_applies(262144, "pallas", head_dtype=jnp.float32)


@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
def test_auto_takes_the_kernel_in_a_step_compiled_for_a_tpu():
  """The choice `auto` makes for a TPU target, seen on this CPU as the planner sees it: the chunked loss traced under
  a mesh of a v5e topology's abstract devices (`target_platform` reads ``tpu`` from it) calls the kernel, and the
  same loss under this CPU's mesh does not."""
  from meshdistill.planner._hardware import tpu_target

  strategy = md.ChunkedLogitKD(chunk_size=16)
  hs, w = jnp.ones((2, 24, 32), jnp.bfloat16), jnp.ones((32, V), jnp.bfloat16)

  def loss(hs, w):
    out = md.ModelOutput(logits=None, final=hs)
    return strategy.per_batch({}, out, out, (w, w), jnp.zeros((2, 24), jnp.int32), jnp.ones((2, 24)), 0)["loss"]

  for devices, want in ((tpu_target("v5e:2x2").devices[:1], True), (jax.devices()[:1], False)):
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(1, 1), ("data", "tensor"))
    with jax.set_mesh(mesh):
      jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hs, w))
    assert ("kl_value_and_grad" in jaxpr) == want, devices


@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied-table"])
def test_chunked_logit_kd_through_the_kernel_equals_the_xla_passes(tied):
  """The whole chunked loss on a 1x1 mesh (the kernel inside its ``shard_map``), chunks of 16 of 48 tokens: every
  sum and the gradients of the student's hidden states and head as with ``loss_kernel="xla"`` (each chunk's
  logits gradient is rounded to the head's bfloat16 on both paths: equal here bit for bit or within one rounding)."""
  B, T, D, E = 2, 24, 32, 64
  k = jax.random.split(jax.random.key(0), 6)
  hs, ht = jax.random.normal(k[0], (B, T, D), jnp.bfloat16), jax.random.normal(k[1], (B, T, E), jnp.bfloat16)
  w = (0.3 * jax.random.normal(k[2], (V, D) if tied else (D, V))).astype(jnp.bfloat16)
  wt = (0.3 * jax.random.normal(k[3], (E, V))).astype(jnp.bfloat16)
  y, mask = jax.random.randint(k[4], (B, T), 0, V), jax.random.bernoulli(k[5], 0.8, (B, T)).astype(jnp.float32)

  def run(kernel):
    strategy = md.ChunkedLogitKD(temperature=2.0, alpha=0.5, chunk_size=16, loss_kernel=kernel)

    def loss(hs, w):
      sums = strategy.per_batch({}, md.ModelOutput(logits=None, final=hs), md.ModelOutput(logits=None, final=ht),
                                (w.T if tied else w, wt), y, mask, 0, tied_heads=(tied, False))
      return sums["loss"], sums

    step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    with jax.set_mesh(md.make_mesh(data=1, tensor=1, devices=jax.devices()[:1])):
      assert ("kl_value_and_grad" in str(jax.make_jaxpr(step)(hs, w))) == (kernel == "pallas")
      return jax.jit(step)(hs, w)

  (_, want), want_grads = run("xla")
  (_, got), grads = run("pallas")
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=2e-6, atol=2e-6, err_msg=name)
  for g, r in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2 ** -8,
                               atol=2 ** -8 * float(jnp.max(jnp.abs(r.astype(jnp.float32)))))


@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
@pytest.mark.parametrize("vocab", [151936, 262144], ids=["qwen3", "gemma3"])
def test_the_kernel_fits_a_v5e_chip_at_a_models_vocabulary(vocab):
  """Compiled for one v5e chip (libtpu here, nothing runs) on a 1024-token chunk: a block of 16 rows of both
  models' float32 logits and the gradient, double-buffered, within the kernel's on-chip memory; one Mosaic call,
  whose bytes (both chunks read, the gradient and the per-token values written) the planner's estimate counts at
  the chip's bandwidth (`train.cost.estimated_cycles`' ``kernel_bytes``)."""
  from jax.sharding import SingleDeviceSharding

  from meshdistill.planner._hardware import tpu_target

  device = SingleDeviceSharding(tpu_target("v5e:2x2").devices[0])
  f32 = jax.ShapeDtypeStruct((1024, vocab), jnp.float32, sharding=device)
  ids = jax.ShapeDtypeStruct((1024,), jnp.int32, sharding=device)
  keep = jax.ShapeDtypeStruct((1024,), jnp.bool_, sharding=device)
  call = jax.jit(lambda s, t, y, k: kl_value_and_grad(s, t, y, k, 2.0, 0.5, interpret=False))
  hlo = call.lower(f32, f32, ids, keep).compile().as_text()
  assert sum("tpu_custom_call" in line and "custom-call" in line for line in hlo.splitlines()) == 1
  from meshdistill.train import cost

  cycles = cost.estimated_cycles(cost.parse(hlo))
  per_row = vocab * (4 + 4 + 2) + 8 * 4 + 128 * 4  # both logits, the gradient, a row's 8 inputs and 128 outputs
  assert cycles["kernel_calls"] == 1 and cycles["kernel_bytes"] == 1024 * per_row + 3 * 4  # and tau, 1 / tau, alpha


def test_without_metrics_the_kernel_gives_the_same_loss_terms_and_gradient():
  """``metrics=False`` (a metrics-light step's form) sums the same four terms in the same order: ``loss``, ``kl`` and
  ``ce`` and the gradient equal bit for bit; the metrics are not formed."""
  s, t, y, keep = logits(3)
  full, grad = kl_value_and_grad(s, t, y, keep, 1.5, 0.5, grad_dtype=jnp.float32, interpret=True)
  light, grad_light = kl_value_and_grad(s, t, y, keep, 1.5, 0.5, grad_dtype=jnp.float32, interpret=True,
                                        metrics=False)
  assert set(light) == set(losses.LOSS_NAMES) == {"loss", "kl", "ce"} and set(full) > set(light)
  for k in light:
    np.testing.assert_array_equal(light[k], full[k], err_msg=k)
  np.testing.assert_array_equal(grad_light, grad)


def test_the_metrics_light_step_runs_the_kernel_without_its_metrics(monkeypatch):
  """A `Distiller` with the loss kernel on one device: its step forms the metrics in the kernel, its metrics-light
  step (`Distiller.metrics_light`, what the training loop runs between logs) does not, and both give the same loss
  and the same new parameters (the same terms, summed alike)."""
  from helpers import STUDENT_CFG, TEACHER_CFG, make_batch
  import optax

  from meshdistill.losses import _kl_kernel

  seen = []
  real = _kl_kernel.kl_value_and_grad

  def spy(*args, metrics=True, **kw):
    seen.append(metrics)
    return real(*args, metrics=metrics, **kw)

  monkeypatch.setattr(_kl_kernel, "kl_value_and_grad", spy)
  mesh = md.make_mesh(data=1, tensor=1, devices=jax.devices()[:1])
  teacher = md.init_model(TEACHER_CFG.replace(vocab_size=V), seed=0, mesh=mesh)
  student = md.init_model(STUDENT_CFG.replace(vocab_size=V), seed=1, mesh=mesh)
  d = md.Distiller(student, teacher, mesh=mesh, optimizer=optax.sgd(1.0),
                   strategy=md.ChunkedLogitKD(chunk_size=32, loss_kernel="pallas"))
  batch = make_batch(seed=0, vocab=V)
  state_full, full = d.step(d.init_state(), batch)
  assert seen == [True] and {"corr", "agree", "teacher_ce"} <= set(full)
  state_light, light = d.metrics_light().step(d.init_state(), batch)
  assert seen == [True, False] and "corr" not in light
  np.testing.assert_allclose(light["loss"], full["loss"], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(state_light.params), jax.tree.leaves(state_full.params)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape, backend, applies", [
    ((8, 1), "pmap", True),  # the classic path: every device holds all of V
    ((8, 1), "shard_map", True),  # rows over data, tensor of size 1
    ((2, 4), "shard_map", False),  # V split over tensor (compiler-managed): XLA's passes
], ids=["pmap-8", "8x1", "2x4"])
def test_the_kernel_in_every_layout_gives_one_devices_numbers(monkeypatch, shape, backend, applies):
  """The step with ``loss_kernel="pallas"`` on the mesh layouts and the ``pmap`` path: the kernel where it applies,
  XLA's passes where the vocabulary is split, and the loss and metrics of one device within float32 summation
  bounds (the same tokens' sums in another order)."""
  from helpers import STUDENT_CFG, TEACHER_CFG, make_batch

  from meshdistill.losses import _kl_kernel

  calls = []
  real = _kl_kernel.kl_value_and_grad
  monkeypatch.setattr(_kl_kernel, "kl_value_and_grad", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  batch = make_batch(seed=0, vocab=V)

  def metrics(shape, backend):
    mesh = None if shape is None else md.make_mesh(*shape)
    place = mesh if backend == "shard_map" else None
    teacher = md.init_model(TEACHER_CFG.replace(vocab_size=V), seed=0, mesh=place)
    student = md.init_model(STUDENT_CFG.replace(vocab_size=V), seed=1, mesh=place)
    d = md.Distiller(student, teacher, mesh=mesh, backend=backend,
                     strategy=md.ChunkedLogitKD(chunk_size=16, loss_kernel="pallas"))
    return d.step(d.init_state(), batch)[1]

  want = metrics(None, "single")
  assert calls == [1]
  got = metrics(shape, backend)
  assert len(calls) == (2 if applies else 1)
  bound = 64 * float(np.finfo(np.float32).eps)  # a sum of the batch's 48 tokens' values, rounded in another order
  for k in ("loss", "kl", "ce", "teacher_ce", "corr", "agree"):
    np.testing.assert_allclose(got[k], want[k], rtol=bound, atol=bound, err_msg=k)
