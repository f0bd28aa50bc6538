"""Collectives of the step: bundled sums over `data`, one gradient-norm pass, the metrics-light step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, make_batch
from jax.sharding import PartitionSpec as P

import meshdistill as md
from meshdistill.parallel.collectives import all_reduce_census, mesh_axis_groups, psum_bundled, replica_groups
from meshdistill.train.loop.monitor import Monitor, read_metrics
from meshdistill.train.loop.trainer import fit


def _distiller(mesh, **kw):
  teacher = md.init_model(TEACHER_CFG, seed=0, mesh=mesh)
  student = md.init_model(STUDENT_CFG, seed=1, mesh=mesh)
  return md.Distiller(student, teacher, mesh=mesh, **kw)


@pytest.fixture(scope="module")
def mesh_step():
  """The 2x4 step: its distiller, a state, a batch, the compiled HLO, the lowered (pre-XLA) module and the
  compiled step."""
  d = _distiller(md.make_mesh(2, 4))
  state, batch = d.init_state(), make_batch()
  lowered = d.lower(state, batch)
  compiled = lowered.compile()
  return d, state, batch, compiled.as_text(), lowered.as_text(), compiled


def _run(d, compiled, seeds):
  """Steps of a compiled step (no second compilation through ``d.step``) from a fresh state."""
  state = d.init_state()
  for seed in seeds:
    state, metrics = compiled(state, d.teacher_params, d.layout.place_batch(make_batch(seed=seed)))
  return jax.device_get(state), jax.device_get(metrics)


def test_replica_groups_read_both_hlo_forms():
  assert replica_groups("{{0,4},{1,5},{2,6},{3,7}}") == [frozenset(g) for g in ({0, 4}, {1, 5}, {2, 6}, {3, 7})]
  assert replica_groups("[2,4]<=[8]") == [frozenset(range(4)), frozenset(range(4, 8))]
  assert replica_groups("[4,2]<=[2,2,2]T(0,2,1)") == [frozenset(g) for g in ({0, 2}, {1, 3}, {4, 6}, {5, 7})]
  # the mesh form of a program partitioned outside a shard_map (the jit-level optimizer of the 2x4 step)
  mesh_form = "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
  assert replica_groups(mesh_form) == [frozenset(range(4)), frozenset(range(4, 8))]
  both = "mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_1'}"
  assert replica_groups(both) == [frozenset(g) for g in ({0, 2}, {1, 3}, {4, 6}, {5, 7})]
  mesh = md.make_mesh(2, 4)
  assert mesh_axis_groups(mesh, ("data",)) == set(replica_groups("{{0,4},{1,5},{2,6},{3,7}}"))
  assert mesh_axis_groups(mesh, ("tensor",)) == set(replica_groups("[2,4]<=[8]"))


def test_the_planner_labels_collectives_by_every_axis_of_a_three_axis_mesh():
  """XLA:CPU's named form without device ids (devices in order), and the axes a group varies over, on
  data 2 x expert 2 x tensor 2 (device id = 4 * data + 2 * expert + tensor)."""
  from meshdistill.planner._compile import collectives

  assert replica_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}") == [frozenset({0, 2, 4, 6}), frozenset({1, 3, 5, 7})]
  shape = {"data": 2, "expert": 2, "tensor": 2}
  hlo = "\n".join([
      "%a = f32[8,4]{1,0} all-to-all(%x), replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}",
      "%b = f32[64,4]{1,0} all-gather(%y), replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1'}, "
      "dimensions={0}",
      "%c = f32[16]{0} all-reduce(%z), replica_groups=[2,4]<=[2,2,2]T(1,0,2), to_apply=%sum",
      "%d = f32[16]{0} all-reduce(%w), replica_groups=[4,2]<=[8], to_apply=%sum",
  ])
  got = {(c["kind"], c["axis"]): c["count"] for c in collectives(hlo, shape)}
  assert got == {("all-to-all", "expert"): 1, ("all-gather", "expert"): 1, ("all-reduce", "data+tensor"): 1,
                 ("all-reduce", "tensor"): 1}
  assert {c["axis"] for c in collectives(hlo, (4, 2))} == {"data", "data+tensor", "tensor"}  # (data, tensor) form


def test_psum_bundled_sums_like_psum_with_one_all_reduce_per_scalar_dtype():
  mesh = md.make_mesh(8, 1)

  def body(x_NxD):
    tree = {"s1": x_NxD.sum(), "s2": (2 * x_NxD).max(), "i": jnp.sum(x_NxD > 3, dtype=jnp.int32),
            "i2": jnp.int32(1), "w": x_NxD, "v": {"u": x_NxD[:, :1] * 3}}
    return psum_bundled(tree, "data"), jax.lax.psum(tree, "data")

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), axis_names={"data"},
                             check_vma=False))
  x = jnp.arange(32.0).reshape(16, 2)
  got, want = fn(x)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
  lowered = fn.lower(x).as_text()
  # plain psum: one all-reduce per leaf (6 + 6); bundled: f32 scalars 1, int32 scalars 1, arrays 2
  assert lowered.count("stablehlo.all_reduce") == 6 + 4
  assert psum_bundled({"a": x}, None)["a"] is x


def test_2x4_step_sums_over_data_in_at_most_two_all_reduces(mesh_step):
  d, state, _, hlo, lowered, compiled = mesh_step
  names = _run(d, compiled, [0])[1]
  census = all_reduce_census(hlo, d.mesh)
  n_grads = len(jax.tree.leaves(state.params))
  # one all-reduce per summed leaf: every gradient, every metric sum and the token count (all but grad_norm)
  per_leaf = n_grads + len([k for k in names if k != "grad_norm"])
  data_groups = "replica_groups={{0,4},{1,5},{2,6},{3,7}}"
  assert lowered.count("stablehlo.all_reduce") >= n_grads  # JAX emits one per gradient leaf ...
  assert census["data"] <= 2 <= per_leaf // 2, census  # ... XLA's combiner sends them as one
  assert census["data"] == sum(1 for line in hlo.splitlines() if "all-reduce(" in line and data_groups in line)
  assert not re.search(r"\ball-to-all\(", hlo)


def test_2x4_step_reduces_the_gradient_norm_once(mesh_step):
  """Clipping, the non-finite check and the ``grad_norm`` metric share one pass: no two scalar
  all-reduces over the same devices (optax's pair gave three: an ``and`` and two norms)."""
  hlo = mesh_step[3]
  scalar_groups = []
  for line in hlo.splitlines():
    m = re.search(r"=\s*(\(?[^=]*?\)?)\s+all-reduce\(.*replica_groups=(\S+?), use", line)
    if m and re.fullmatch(r"\(?((f32|pred)\[\](, (/\*index=\d+\*/)?)?)+\)?", m.group(1).strip()):
      scalar_groups.append(m.group(2))
  assert scalar_groups and len(scalar_groups) == len(set(scalar_groups)), scalar_groups


@pytest.mark.parametrize("clip", [0.5, None])
def test_the_nonfinite_skip_matches_optax_apply_if_finite(clip):
  """The safeguarded AdamW (with and without clipping) gives optax's ``apply_if_finite`` pair's updates and state bit
  for bit, on finite, NaN and Inf gradients, and the weights it moves stay finite."""
  adamw = optax.adamw(1e-2, weight_decay=0.1)
  tx = md.train.optimizers.safeguarded(adamw, clip=clip)
  ref = optax.apply_if_finite(adamw if clip is None else optax.chain(optax.clip_by_global_norm(clip), adamw), 2**30)
  params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}
  grads = [{"w": jnp.full((3, 4), g), "b": jnp.full(4, g)} for g in (0.01, 3.0, jnp.nan, jnp.inf, 0.2)]
  state, ref_state = tx.init(params), ref.init(params)
  assert jax.tree.structure(state) == jax.tree.structure(ref_state)
  for g in grads:
    u, state = jax.jit(tx.update)(g, state, params)
    r, ref_state = jax.jit(ref.update)(g, ref_state, params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), (u, state), (r, ref_state))
    params = optax.apply_updates(params, u)
  assert int(state.total_notfinite) == 2 and np.isfinite(np.asarray(params["w"])).all()


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
@pytest.mark.parametrize("clip", [1.0, None])
def test_the_skip_of_nonfinite_updates_keeps_no_second_copy_on_a_tpu(clip):
  """Compiled for one v5e chip (libtpu here, nothing runs), the safeguarded AdamW update applied to donated weights
  and moments needs almost no temporaries; a branch (optax's ``apply_if_finite``) returned new buffers for the
  updates and the state, a second copy as large as the gradients (what kept a 0.75 B-parameter student off the
  chip)."""
  from jax.sharding import SingleDeviceSharding

  from meshdistill.planner._hardware import tpu_target
  from meshdistill.train.memory import MemoryReport

  device = SingleDeviceSharding(tpu_target("v5e:2x2").devices[0])
  params = {k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=device)
            for k, shape in {"w": (4, 1024, 2048), "e": (8192, 1024)}.items()}
  grad_bytes = sum(4 * np.prod(p.shape) for p in params.values())

  def temp_bytes(tx):
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                         jax.eval_shape(tx.init, params))

    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    report = MemoryReport.of(jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile())
    assert report.peak_bytes is not None and report.peak_bytes > 0, report  # libtpu gives its own peak
    return report.temp_bytes

  ours = temp_bytes(md.train.optimizers.safeguarded(optax.adamw(1e-4), clip=clip))
  body = optax.adamw(1e-4) if clip is None else optax.chain(optax.clip_by_global_norm(clip), optax.adamw(1e-4))
  branch = temp_bytes(optax.apply_if_finite(body, 2**30))
  assert branch > 0.5 * grad_bytes, branch  # the branch's copy: what the test tells apart
  assert ours < 0.05 * grad_bytes, (ours, grad_bytes)


def test_metrics_light_step_gives_the_same_update_with_fewer_collectives(mesh_step):
  d, state, batch, hlo, _, compiled = mesh_step
  light = d.metrics_light()
  assert light.metrics_light() is light and d.metrics_light() is light
  light_compiled = light.lower(state, batch).compile()
  full_state, full_metrics = _run(d, compiled, range(2))
  light_state, light_metrics = _run(light, light_compiled, range(2))
  assert set(light_metrics) == {"loss", "grad_norm", "tokens"} < set(full_metrics)
  for k in light_metrics:
    np.testing.assert_allclose(float(light_metrics[k]), float(full_metrics[k]), rtol=1e-6, err_msg=k)
  # the same update from another program: the compiler may fuse (and so round) the two differently, by an ulp;
  # a resumed run never mixes them differently from the uninterrupted one (tests/test_trainer.py)
  for a, b in zip(jax.tree.leaves(full_state), jax.tree.leaves(light_state)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
  assert all_reduce_census(light_compiled.as_text())["total"] < all_reduce_census(hlo)["total"]


def test_fit_runs_metrics_light_steps_between_logs(tmp_path):
  batches = [make_batch(seed=s) for s in range(6)]
  d = _distiller(None)
  monitor = Monitor(str(tmp_path), 6)
  res = fit(d, md.data.BatchList(batches), steps=6, log_every=2, monitor=monitor)
  monitor.close()
  assert d._light is not None and d._light._compiled is not None  # the light step ran
  rows = [r for r in read_metrics(str(tmp_path)) if r["split"] == "train"]
  # the same run with the full step every step (already compiled by the fit)
  state, losses = d.init_state(), []
  for b in batches:
    state, metrics = d.step(state, b)
    losses.append(float(metrics["loss"]))
  for a, b in zip(jax.tree.leaves(jax.device_get(res.state)), jax.tree.leaves(jax.device_get(state))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)  # two programs' updates: equal up to rounding
  # steps 1-2 full (the first window), then light between the logged steps 4 and 6, which computed every metric;
  # the loss means are over every step
  assert [r["step"] for r in rows] == [2, 4, 6] and all("kl" in r and "agree" in r for r in rows)
  np.testing.assert_allclose([r["loss"] for r in rows], np.mean(np.reshape(losses, (3, 2)), axis=1), rtol=1e-6)

