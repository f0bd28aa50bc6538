"""Safeguards: non-finite updates skipped and counted, divergence recovery, bf16 compute, loss scaling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, make_batch

import meshdistill as md
from meshdistill.train.freezing import Stage, freeze_status, progressive_freeze
from meshdistill.models import ModelOutput
from meshdistill.train.step import scale_gradient
from meshdistill.strategies import ChunkedLogitKD
from meshdistill.train.loop.safeguards import (
    DivergenceGuard,
    LogitMSE,
    copy_state,
    fallback_strategy,
    fit_guarded,
    safeguarded,
    skipped_updates,
)

STAGES = [Stage(start_step=0, freeze=0.5, lr=1e-3), Stage(start_step=5, lr=1e-3)]


def poisoned_batch(seed=0):
  """A corrupted batch: one NaN in the mask makes the loss and every gradient NaN."""
  batch = make_batch(seed=seed)
  batch["mask"][0, 0] = np.nan
  return batch


def _bits(tree):
  return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.fixture(scope="module")
def guarded_distiller():
  """2x4 mesh; LogitKD; freezing (2 stages) behind the non-finite skip."""
  mesh = md.make_mesh(data=2, tensor=4)
  student = md.init_model(STUDENT_CFG.replace(n_layers=2), seed=1, mesh=mesh)
  teacher = md.init_model(TEACHER_CFG, seed=0, mesh=mesh)
  tx = safeguarded(progressive_freeze(STAGES, 2, optax.adamw(1.0, weight_decay=0.01)), clip=None)
  d = md.Distiller(student, teacher, optimizer=tx, mesh=mesh)
  return d, d.init_state()


def fresh(guarded):
  d, state = guarded
  return d, copy_state(state)


def test_nonfinite_gradients_skip_the_update_and_are_counted(guarded_distiller):
  d, state = fresh(guarded_distiller)
  state, _ = d.step(state, make_batch(seed=0))
  before = _bits((state.params, state.opt_state.inner_state))
  state, metrics = d.step(state, poisoned_batch())
  assert not np.isfinite(float(metrics["loss"]))
  assert all(np.array_equal(a, b) for a, b in zip(before, _bits((state.params, state.opt_state.inner_state))))
  assert skipped_updates(state.opt_state) == 1
  assert int(state.step) == 2 and freeze_status(state.opt_state)["count"] == 1  # the stage clock did not advance
  state, metrics = d.step(state, make_batch(seed=1))
  assert np.isfinite(float(metrics["loss"])) and skipped_updates(state.opt_state) == 1
  assert freeze_status(state.opt_state)["count"] == 2


def test_divergence_restores_last_good_state_and_falls_back_to_mse_for_the_rest_of_the_stage(guarded_distiller):
  d, state = fresh(guarded_distiller)
  batches = [make_batch(seed=i) for i in range(3)] + [poisoned_batch(3)] + [make_batch(seed=i) for i in range(4, 8)]
  guard = DivergenceGuard(window=10, min_history=2)
  state, records = fit_guarded(d, state, batches, guard)

  diverged = records[3]
  assert diverged["events"][0]["kind"] == "diverged" and "non-finite" in diverged["events"][0]["reason"]
  assert diverged["skipped"] == 1  # the NaN update itself was skipped, too
  assert diverged["events"][0]["restored_step"] == 2
  assert records[4]["step"] == 2  # training resumed from the restored state
  # the fallback (logit MSE) runs until stage 2 begins (stage clock 5), then the primary resumes
  assert [r["strategy"] for r in records] == ["primary"] * 4 + ["fallback"] * 3 + ["primary"]
  assert all("mse" in r for r in records[4:7]) and "mse" not in records[7]
  assert records[7]["events"][0]["kind"] == "fallback_end"
  assert [e.kind for e in guard.events] == ["diverged", "fallback_end"]
  assert all(np.isfinite(r["loss"]) for r in records[4:])
  assert freeze_status(state.opt_state)["stage"] == 1
  assert d.compiled_step(state)._cache_size() == 1  # restored states keep their layout: no recompilation


def test_a_chunked_loss_falls_back_to_chunked_logit_mse():
  d = md.Distiller(md.init_model(STUDENT_CFG, seed=1), md.init_model(TEACHER_CFG, seed=0),
                   strategy=ChunkedLogitKD(chunk_size=8), optimizer=safeguarded(optax.adamw(1e-3)))
  batches = [make_batch(seed=i) for i in range(2)] + [poisoned_batch(2)] + [make_batch(seed=i) for i in range(3, 5)]
  state, records = fit_guarded(d, d.init_state(), batches, DivergenceGuard(window=10, min_history=1))
  assert [r["strategy"] for r in records] == ["primary"] * 3 + ["fallback"] * 2
  assert records[2]["events"][0]["restored_step"] == 1
  assert all("mse" in r and np.isfinite(r["loss"]) for r in records[3:]) and "mse" not in records[1]
  assert int(state.step) == 3


def test_guard_flags_spikes_against_running_median_and_nonfinite_losses():
  guard = DivergenceGuard(window=4, factor=3.0, min_history=3)
  assert guard.observe(0, 100.0) is False  # no history yet: only non-finite counts
  assert guard.observe(1, float("inf")) is True
  for step, loss in enumerate([2.0, 1.0, 1.2], start=2):
    assert guard.observe(step, loss) is False
  assert guard.observe(5, 3.5) is False  # median of [100, 2, 1, 1.2] is 1.6; 3.5 < 4.8
  assert guard.observe(6, 9.0) is True  # median of [2, 1, 1.2, 3.5] is 1.6
  assert guard.observe(7, float("nan")) is True
  assert list(guard.history) == [2.0, 1.0, 1.2, 3.5]


def test_bf16_compute_keeps_float32_master_weights_optimizer_state_and_loss():
  student = md.init_model(STUDENT_CFG.replace(dtype="bfloat16"), seed=1)
  teacher = md.init_model(TEACHER_CFG.replace(dtype="bfloat16"), seed=0)
  d = md.Distiller(student, teacher, optimizer=safeguarded(optax.adamw(1e-3)))
  state = d.init_state()
  batch = make_batch(seed=0)
  assert "bf16" in d.lower(state, batch).as_text()  # activations really run in bfloat16
  for _ in range(2):
    state, metrics = d.step(state, batch)
  assert metrics["loss"].dtype == jnp.float32 and np.isfinite(float(metrics["loss"]))
  floats = [x for x in jax.tree.leaves((state.params, state.opt_state)) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and all(x.dtype == jnp.float32 for x in floats)
  assert skipped_updates(state.opt_state) == 0


def test_static_loss_scaling_scales_gradients_not_the_loss_and_unscaling_restores_the_update():
  scale = 2.0**12
  rng = np.random.default_rng(0)
  teacher = ModelOutput(jnp.asarray(rng.normal(size=(6, 8)), jnp.float32))
  targets, mask = jnp.asarray(rng.integers(0, 8, 6)), jnp.ones(6, jnp.float32)

  def loss(s, logits):  # the strategy's loss through the step's loss scaling (`Distiller(loss_scale=...)`)
    return scale_gradient(kd.per_sequence({}, ModelOutput(logits), teacher, targets, mask, 0)["loss"], s)

  logits = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
  kd = md.LogitKD()
  (l1, g1), (l2, g2) = (jax.value_and_grad(lambda z, s=s: loss(s, z))(logits) for s in (None, scale))
  assert float(l1) == float(l2)  # the reported loss is the true loss
  np.testing.assert_allclose(g2, scale * g1, rtol=1e-6)
  params = {"z": logits}
  u1, _ = safeguarded(optax.sgd(0.5)).update({"z": g1}, safeguarded(optax.sgd(0.5)).init(params), params)
  tx = safeguarded(optax.sgd(0.5), loss_scale=scale)
  u2, _ = tx.update({"z": g2}, tx.init(params), params)
  np.testing.assert_allclose(u1["z"], u2["z"], rtol=1e-6)
  with pytest.raises(AttributeError, match=r"meshdistill.ScaledLoss is gone: .*Distiller\(\.\.\., loss_scale=S\)"):
    md.ScaledLoss  # noqa: B018


def test_safeguarded_skips_nonfinite_and_clips_global_norm():
  params = {"w": jnp.ones(3)}
  tx = safeguarded(optax.sgd(1.0), clip=1.0)
  state = tx.init(params)
  u, state = tx.update({"w": jnp.array([1.0, jnp.inf, 0.0])}, state, params)
  assert np.all(np.asarray(u["w"]) == 0.0) and skipped_updates(state) == 1
  u, state = tx.update({"w": jnp.array([3.0, 4.0, 0.0])}, state, params)
  np.testing.assert_allclose(u["w"], [-0.6, -0.8, 0.0], rtol=1e-6)
  assert skipped_updates(state) == 1


def test_fallback_strategy_is_logit_mse_and_mse_is_zero_on_matching_logits():
  assert fallback_strategy(md.LogitKD(alpha=0.3, top_k=4)) == md.LogitKD(alpha=0.3, divergence="mse")
  chunked = fallback_strategy(ChunkedLogitKD(alpha=0.3, chunk_size=16))  # stays chunked: no full logits
  assert chunked == ChunkedLogitKD(alpha=0.3, chunk_size=16, divergence="mse")

  @dataclasses.dataclass(frozen=True)
  class Other:
    alpha: float = 0.7

  other = fallback_strategy(Other())
  assert isinstance(other, LogitMSE) and other.alpha == 0.7
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)
  mask = jnp.asarray([1, 1, 1, 0, 0], jnp.float32)
  targets = jnp.zeros(5, int)
  same = LogitMSE(alpha=1.0).per_sequence({}, ModelOutput(logits), ModelOutput(logits + 3.0), targets, mask, 0)
  assert float(same["mse"]) == pytest.approx(0.0, abs=1e-10)  # a per-token offset is not a difference
  shifted = logits.at[3:].add(100.0)  # changes on masked tokens only
  out = LogitMSE(alpha=1.0).per_sequence({}, ModelOutput(shifted), ModelOutput(logits), targets, mask, 0)
  assert float(out["loss"]) == pytest.approx(0.0, abs=1e-10)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DivergenceGuard(factor=0.5), "factor"),
        (lambda: DivergenceGuard(window=0), "window"),
        (lambda: safeguarded(optax.sgd(1.0), clip=0.0), "clip"),
        (lambda: md.Distiller(md.init_model(STUDENT_CFG), strategy=md.HardLabelCE(), loss_scale=-1.0), "loss_scale"),
        (lambda: safeguarded(optax.sgd(1.0), loss_scale=float("inf")), "loss_scale"),
        (lambda: LogitMSE(alpha=2.0), "alpha"),
    ],
)
def test_bad_safeguard_settings_raise_naming_the_setting(make, match):
  with pytest.raises(ValueError, match=match):
    make()
