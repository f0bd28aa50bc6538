"""The sharded distillation step: layout parity, replication, masking, reference formula, HLO."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, all_gather_shapes, assert_trees_close, make_batch

import meshdistill as md

LAYOUTS = {
    "single": (None, "single"),
    "1x8": ((1, 8), "shard_map"),
    "2x4": ((2, 4), "shard_map"),
    "4x2": ((4, 2), "shard_map"),
    "8x1": ((8, 1), "shard_map"),
    "pmap": ((8, 1), "pmap"),
}


def build(layout, teacher_cfg=TEACHER_CFG, student_cfg=STUDENT_CFG, **kw):
  shape, backend = LAYOUTS[layout]
  mesh = None if shape is None else md.make_mesh(*shape)
  place = mesh if backend == "shard_map" else None
  teacher = md.init_model(teacher_cfg, seed=0, mesh=place)
  student = md.init_model(student_cfg, seed=1, mesh=place)
  return md.Distiller(student, teacher, mesh=mesh, backend=backend, **kw)


@pytest.fixture(scope="module")
def runs():
  """Three steps on every layout from the same initial weights and batches."""
  batches = [make_batch(seed=s) for s in range(3)]
  out = {}
  for layout in LAYOUTS:
    d = build(layout)
    state = d.init_state()
    losses = []
    for b in batches:
      state, metrics = d.step(state, b)
      losses.append(float(metrics["loss"]))
    out[layout] = (d, state, losses, {k: float(v) for k, v in metrics.items()})
  return out


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "single"])
def test_every_layout_matches_one_device(runs, layout):
  _, ref_state, ref_losses, _ = runs["single"]
  d, state, losses, _ = runs[layout]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  got = jax.device_get(d.unreplicate(state.params))
  want = jax.device_get(ref_state.params)
  assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  assert int(d.unreplicate(state.step)) == 3


def test_training_reduces_loss_and_reports_all_metrics(runs):
  _, _, _, metrics = runs["2x4"]
  assert set(metrics) >= {"loss", "kl", "ce", "teacher_ce", "corr", "agree", "grad_norm", "tokens"}
  assert metrics["tokens"] == 8 * 6  # 6 of 8 positions unmasked in each of 8 rows
  assert 0.0 <= metrics["agree"] <= 1.0 and -1.0 <= metrics["corr"] <= 1.0
  assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("layout", ["2x4", "4x2", "pmap"])
def test_replicated_params_bitwise_identical_on_every_device(runs, layout):
  d, state, _, _ = runs[layout]
  for leaf in jax.tree.leaves(state.params):
    if layout == "pmap":
      copies = np.asarray(leaf)
      assert all(np.array_equal(copies[0], c) for c in copies[1:])
      continue
    by_index = {}
    for shard in leaf.addressable_shards:
      by_index.setdefault(str(shard.index), []).append(np.asarray(shard.data))
    assert len(by_index) < len(leaf.addressable_shards)  # something is replicated
    for copies in by_index.values():
      assert all(np.array_equal(copies[0], c) for c in copies[1:])


@pytest.mark.parametrize("layout", ["single", "2x4", "pmap"])
def test_the_trainer_keeps_no_device_copy_of_the_initial_student(layout):
  """Once a state holds the student on the devices, the trainer's own reference to the initial student is in host
  memory: the state and the trainer do not both hold its float32 weights there (on one chip that copy is what stops
  a pair that fits), and a second ``init_state()`` still starts from the same weights."""
  import gc

  before = {id(x) for x in jax.live_arrays()}
  d = build(layout)  # the models built here are dropped: the trainer holds the only references
  state = d.init_state()
  gc.collect()
  held = {id(x) for x in jax.tree.leaves((state, d.teacher_params))}
  stray = [x for x in jax.live_arrays() if id(x) not in before and id(x) not in held]
  student_bytes = sum(x.nbytes for x in jax.tree.leaves(d.unreplicate(state.params)))
  assert sum(x.nbytes for x in stray) < student_bytes / 10, [(x.shape, x.dtype) for x in stray]
  again = d.init_state()
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert getattr(x, "sharding", None) == getattr(y, "sharding", None)


def test_masked_tokens_change_nothing():
  a = make_batch(seed=3, pad_from=5)
  b = {k: v.copy() for k, v in a.items()}
  rng = np.random.default_rng(7)
  b["targets"][:, 5:] = rng.integers(0, TEACHER_CFG.vocab_size, b["targets"][:, 5:].shape)
  b["inputs"][:, 5:] = rng.integers(0, TEACHER_CFG.vocab_size, b["inputs"][:, 5:].shape)
  assert not np.array_equal(a["inputs"], b["inputs"])
  results = []
  d = build("2x4")
  for batch in (a, b):
    state, metrics = d.step(d.init_state(), batch)
    results.append((jax.device_get(metrics), jax.device_get(state.params)))
  for k in results[0][0]:
    assert results[0][0][k] == results[1][0][k], k
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), results[0][1], results[1][1])


def test_kl_and_its_gradient_vanish_when_student_equals_teacher():
  teacher = md.init_model(TEACHER_CFG, seed=0)
  student = md.init_model(TEACHER_CFG, seed=0)
  d = md.Distiller(student, teacher, strategy=md.LogitKD(alpha=1.0), optimizer=__import__("optax").sgd(0.0))
  _, metrics = d.step(d.init_state(), make_batch())
  assert abs(float(metrics["kl"])) < 1e-6
  assert float(metrics["grad_norm"]) < 1e-5
  assert float(metrics["agree"]) == 1.0
  np.testing.assert_allclose(float(metrics["corr"]), 1.0, rtol=1e-5)


def reference_loss(teacher, student, batch, tau=2.0, alpha=0.5):
  """The KD loss written directly on the whole unsharded batch."""
  x, y, m = (jnp.asarray(batch[k]) for k in ("inputs", "targets", "mask"))
  t = teacher(x).logits / tau
  s = student(x).logits / tau
  pt = jax.nn.softmax(t, -1)
  kl = jnp.sum(pt * (jax.nn.log_softmax(t, -1) - jax.nn.log_softmax(s, -1)), -1)
  logp = jax.nn.log_softmax(student(x).logits, -1)
  ce = -jnp.take_along_axis(logp, y[..., None], -1)[..., 0]
  per_token = alpha * tau**2 * kl + (1 - alpha) * ce
  return float(jnp.sum(per_token * m) / jnp.sum(m))


def test_loss_equals_plain_unsharded_formula():
  batch = make_batch(seed=5, pad_from=4)
  teacher = md.init_model(TEACHER_CFG, seed=0)
  student = md.init_model(STUDENT_CFG, seed=1)
  want = reference_loss(teacher, student, batch, tau=3.0, alpha=0.3)
  mesh = md.make_mesh(2, 4)
  d = md.Distiller(
      md.shard_model(student, mesh), md.shard_model(teacher, mesh), mesh=mesh,
      strategy=md.LogitKD(temperature=3.0, alpha=0.3),
  )
  _, metrics = d.step(d.init_state(), batch)
  np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)


def test_teacher_receives_no_gradient():
  d = build("single")
  state = d.init_state()
  batch = jax.device_put({k: jnp.asarray(v) for k, v in make_batch().items()})

  def loss_of_teacher(teacher_params):
    _, metrics = md.per_device_step(
        state, teacher_params, batch, student_def=d.student_def, teacher_def=d.teacher_def,
        strategy=d.strategy, optimizer=d.optimizer, data_axis=None,
    )
    return metrics["loss"]

  grads = jax.jit(jax.grad(loss_of_teacher))(d.teacher_params)
  assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(grads))
  assert jax.tree.structure(d.teacher_params) != jax.tree.structure(state.opt_state)


@pytest.mark.parametrize("strategy", [md.LogitKD(), md.LogitKD(top_k=8)], ids=["full", "top_k"])
def test_2x4_step_never_gathers_the_vocabulary(strategy):
  vocab = 200  # distinct from every other dimension in the step
  tcfg = TEACHER_CFG.replace(vocab_size=vocab, tie_embeddings=False)
  scfg = STUDENT_CFG.replace(vocab_size=vocab)
  d = build("2x4", teacher_cfg=tcfg, student_cfg=scfg, strategy=strategy)
  state = d.init_state()
  hlo = d.lower(state, make_batch(vocab=vocab)).compile().as_text()
  gathers = all_gather_shapes(hlo)
  assert "all-reduce" in hlo  # the data-axis gradient sum is there
  assert not [s for s in gathers if vocab in s], gathers
  # the same parser does find a vocabulary all-gather when one exists
  probe = jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(d.mesh, jax.sharding.PartitionSpec()))
  x = jax.device_put(jnp.zeros((8, vocab)), jax.sharding.NamedSharding(d.mesh, jax.sharding.PartitionSpec(None, "tensor")))
  assert any(vocab in s for s in all_gather_shapes(probe.lower(x).compile().as_text()))


def test_teacher_weights_are_split_over_tensor():
  mesh = md.make_mesh(2, 4)
  teacher = md.init_model(TEACHER_CFG.replace(tie_embeddings=False), seed=0, mesh=mesh)
  d = md.Distiller(md.init_model(STUDENT_CFG, seed=1, mesh=mesh), teacher, mesh=mesh)
  params = d.teacher_params
  cases = {
      ("embed", "embedding"): 0,
      ("head", "kernel"): 1,
      ("blocks", 0, "attn", "q", "kernel"): 1,
      ("blocks", 0, "attn", "o", "kernel"): 0,
      ("blocks", 1, "mlp", "gate", "kernel"): 1,
      ("blocks", 1, "mlp", "down", "kernel"): 0,
  }
  for path, axis in cases.items():
    leaf = params
    for p in path:
      leaf = leaf[p]
    arr = leaf[...]
    for shard in arr.addressable_shards:
      want = list(arr.shape)
      want[axis] //= 4
      assert shard.data.shape == tuple(want), path
      assert shard.data.nbytes * 4 == arr.nbytes
  norm = params["final_norm"]["scale"][...]
  assert all(s.data.shape == norm.shape for s in norm.addressable_shards)  # replicated


def test_pmap_rejects_tensor_parallel_mesh():
  mesh = md.make_mesh(2, 4)
  with pytest.raises(ValueError, match="tensor=4"):
    md.Distiller(md.init_model(STUDENT_CFG, 1), md.init_model(TEACHER_CFG, 0), mesh=mesh, backend="pmap")


def test_bad_inputs_name_the_setting():
  mesh = md.make_mesh(4, 2)
  d = md.Distiller(md.init_model(STUDENT_CFG, 1, mesh), md.init_model(TEACHER_CFG, 0, mesh), mesh=mesh)
  with pytest.raises(ValueError, match=r"batch size 6 is not divisible by mesh data=4"):
    d.check_batch(make_batch(batch=6))
  with pytest.raises(ValueError, match=r"sequence length 17 exceeds max_len=16"):
    d.check_batch(make_batch(seq=17))
  with pytest.raises(ValueError, match=r"teacher vocab_size=64 != student vocab_size=128"):
    md.Distiller(md.init_model(STUDENT_CFG.replace(vocab_size=128), 1), md.init_model(TEACHER_CFG, 0))
  with pytest.raises(ValueError, match=r"mesh data=3 x tensor=2 needs 6 devices but 8 are available"):
    md.make_mesh(3, 2)
  with pytest.raises(ValueError, match="mesh tensor=8 does not divide mlp_hidden=100"):  # vocabularies are padded
    md.init_model(TEACHER_CFG.replace(mlp_hidden=100), 0, md.make_mesh(1, 8))
  with pytest.raises(RuntimeError, match="called after JAX started with 8"):
    md.simulate_cpu_devices(4)
  md.simulate_cpu_devices(8)  # same count: a no-op
  with pytest.raises(ValueError, match="missing"):
    d.check_batch({"inputs": np.zeros((4, 8), np.int32)})
