"""Schedules: values, specs from configs, and a step that never recompiles as they change."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, make_batch

import meshdistill as md
from meshdistill.losses import schedules


def values(schedule, steps):
  return [float(schedule(jnp.int32(s))) for s in steps]


def test_constant_linear_cosine_and_step_values():
  np.testing.assert_allclose(values(schedules.constant(0.3), [0, 7, 10**6]), [0.3] * 3, rtol=1e-6)
  linear = schedules.linear(3.0, 1.0, 100)
  np.testing.assert_allclose(values(linear, [0, 25, 50, 100, 500]), [3, 2.5, 2, 1, 1], rtol=1e-6)
  np.testing.assert_allclose(values(schedules.linear(0.0, 1.0, 10, begin=5), [0, 5, 10, 15, 99]), [0, 0, 0.5, 1, 1])
  np.testing.assert_allclose(
      values(schedules.cosine(1.0, 0.2, 100), [0, 50, 100, 300]), [1.0, 0.6, 0.2, 0.2], rtol=1e-6, atol=1e-7
  )
  # rising from 0 (optax's multiplicative cosine cannot start at 0; the affine map can)
  np.testing.assert_allclose(values(schedules.cosine(0.0, 1.0, 10, begin=4), [0, 4, 9, 14, 20]), [0, 0, 0.5, 1, 1],
                             atol=1e-6)
  np.testing.assert_allclose(
      values(schedules.step([0.0, 0.5, 1.0], [10, 20]), [0, 9, 10, 19, 20, 1000]), [0, 0, 0.5, 0.5, 1, 1]
  )


def test_schedules_evaluate_on_a_traced_step_inside_jit():
  scheds = [schedules.linear(3.0, 1.0, 8), schedules.cosine(0.5, 0.0, 8), schedules.step([0.1, 0.9], [4])]
  jitted = jax.jit(lambda step: jnp.stack([jnp.asarray(f(step), jnp.float32) for f in scheds]))
  for step in range(10):
    np.testing.assert_allclose(jitted(jnp.int32(step)), [float(f(step)) for f in scheds], rtol=1e-6, atol=1e-7)
  if hasattr(jitted, "_cache_size"):
    assert jitted._cache_size() == 1


def test_from_spec_builds_every_kind_and_passes_numbers_and_callables():
  np.testing.assert_allclose(values(schedules.from_spec(2.0), [0, 99]), [2.0, 2.0])
  np.testing.assert_allclose(values(schedules.from_spec({"kind": "constant", "value": 4}), [3]), [4.0])
  tau = schedules.from_spec({"kind": "linear", "start": 3.0, "end": 1.0, "steps": 1000})
  np.testing.assert_allclose(values(tau, [0, 500, 1000]), [3.0, 2.0, 1.0], rtol=1e-6)
  cos = schedules.from_spec({"kind": "cosine", "start": 1.0, "end": 0.0, "steps": 10, "begin": 2})
  np.testing.assert_allclose(values(cos, [0, 2, 7, 12]), [1.0, 1.0, 0.5, 0.0], atol=1e-6)
  stp = schedules.from_spec({"kind": "step", "values": [1, 2, 3], "boundaries": [5, 8]})
  np.testing.assert_allclose(values(stp, [4, 5, 8]), [1, 2, 3])
  assert schedules.from_spec(jnp.cos) is jnp.cos
  assert schedules.value_range({"kind": "step", "values": [0.2, 0.9, 0.5], "boundaries": [1, 2]}) == (0.2, 0.9)
  assert schedules.value_range({"kind": "linear", "start": 3, "end": 1, "steps": 5}) == (1.0, 3.0)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("fast", r"give a number or a dict with 'kind' in \('constant', 'linear', 'cosine', 'step'\)"),
        (True, "give a number"),
        ({"start": 1.0}, r"kind=None; choose one of \('constant', 'linear', 'cosine', 'step'\)"),
        ({"kind": "exponential"}, r"kind='exponential'; choose one of"),
        ({"kind": "linear", "start": 3.0, "end": 1.0}, r"needs keys \['start', 'end', 'steps'\]; missing \['steps'\]"),
        ({"kind": "linear", "start": 3.0, "end": 1.0, "steps": 10, "warmup": 5}, r"unknown key\(s\) \['warmup'\]"),
        ({"kind": "cosine", "start": 1.0, "end": 0.0, "steps": 0}, "steps=0 must be an integer >= 1"),
        ({"kind": "cosine", "start": 1.0, "end": 0.0, "steps": 2.5}, "steps=2.5 must be an integer"),
        ({"kind": "linear", "start": "3", "end": 1.0, "steps": 10}, "start='3' must be a finite number"),
        ({"kind": "constant", "value": float("nan")}, "value=nan must be a finite number"),
        ({"kind": "step", "values": [1.0, 2.0], "boundaries": []}, "boundaries=.* must be a list of len"),
        ({"kind": "step", "values": [1.0, 2.0, 3.0], "boundaries": [5, 5]}, "must be strictly increasing"),
        ({"kind": "step", "values": [], "boundaries": []}, "values=.* must be a non-empty list"),
    ],
)
def test_from_spec_rejects_bad_specs_naming_the_key(spec, message):
  with pytest.raises(ValueError, match=message):
    schedules.from_spec(spec, "temperature")
  with pytest.raises(ValueError, match="schedule temperature"):
    schedules.from_spec(spec, "temperature")


def test_logitkd_takes_spec_dicts_and_checks_their_range():
  kd = md.LogitKD(temperature={"kind": "linear", "start": 3.0, "end": 1.0, "steps": 10})
  assert callable(kd.temperature)
  np.testing.assert_allclose(float(md.strategies.value_at(kd.temperature, jnp.int32(5))), 2.0)
  with pytest.raises(ValueError, match=r"LogitKD.alpha=.*takes values in \[0.5, 1.5\].*must be in \[0.0, 1.0\]"):
    md.LogitKD(alpha={"kind": "cosine", "start": 0.5, "end": 1.5, "steps": 10})
  with pytest.raises(ValueError, match=r"LogitKD.beta.*must be in \[0.0, 1.0\]"):
    md.LogitKD(divergence="jsd", beta={"kind": "step", "values": [0.5, -0.1], "boundaries": [3]})
  with pytest.raises(ValueError, match="schedule LogitKD.temperature: kind='lin'"):
    md.LogitKD(temperature={"kind": "lin"})


class _CompileLog(logging.Handler):
  """Collects JAX's "Compiling ..." log records (emitted under ``jax.log_compiles``)."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.messages = []

  def emit(self, record):
    msg = record.getMessage()
    if msg.startswith("Compiling"):
      self.messages.append(msg)


def test_the_step_compiles_once_while_tau_alpha_and_beta_all_change():
  n_steps = 50
  tau = schedules.linear(3.0, 1.0, n_steps)
  alpha = schedules.cosine(0.9, 0.1, n_steps)
  beta = schedules.step([0.2, 0.5, 0.8], [15, 30])
  kd = md.LogitKD(divergence="jsd", temperature=tau, alpha=alpha, beta=beta)
  for sched in (tau, alpha, beta):  # every schedule really changes over the run
    assert float(sched(0)) != float(sched(n_steps - 1))
  mesh = md.make_mesh(data=2, tensor=4)
  d = md.Distiller(md.init_model(STUDENT_CFG, 1, mesh), md.init_model(TEACHER_CFG, 0, mesh), strategy=kd, mesh=mesh)
  state = d.init_state()
  step_name = f"jit({d.compiled_step(state).__name__})"
  log = _CompileLog()
  logger = logging.getLogger("jax")
  logger.addHandler(log)
  # Other code (e.g. the CLI, run in-process by other tests) may quieten JAX's loggers.
  levels = {name: logging.getLogger(name).level for name in ("jax", "jax._src")}
  for name in levels:
    logging.getLogger(name).setLevel(logging.DEBUG)
  batch = make_batch(seed=0)
  losses, after_first = [], None
  try:
    with jax.log_compiles(True):
      for i in range(n_steps):
        state, metrics = d.step(state, batch)
        losses.append(float(metrics["loss"]))
        if i == 0:
          after_first = len(log.messages)
  finally:
    logger.removeHandler(log)
    for name, level in levels.items():
      logging.getLogger(name).setLevel(level)
  assert int(state.step) == n_steps
  assert sum(step_name in m for m in log.messages) == 1, [m[:80] for m in log.messages]
  assert log.messages[after_first:] == []  # nothing at all compiles after the first step
  compiled = d.compiled_step(state)
  if hasattr(compiled, "_cache_size"):  # private jit API: a second witness where it exists
    assert compiled._cache_size() == 1
  # The loss follows the schedules: its weights change every step while the batch is fixed.
  assert np.all(np.isfinite(losses)) and len(set(losses)) == n_steps
