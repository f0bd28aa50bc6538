"""Fully sharded data parallelism (`mesh.fsdp`): parity with the replicated run, bytes per device, checkpoints
across fsdp on/off and meshes, the teacher, the planner, and errors on layouts that cannot split over data."""

import jax
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, assert_trees_close, make_batch

import meshdistill as md
from meshdistill.parallel import fsdp as fsdp_lib
from meshdistill import planner
from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.models.lora import LoraConfig, apply_lora
from meshdistill.config import ConfigError, load_config
from meshdistill.planner._compile import collectives
from meshdistill.train.loop.safeguards import DivergenceGuard, fit_guarded
from meshdistill.train.step import step_halves
from meshdistill.train.loop.trainer import make_optimizer

# Two blocks (the bottom one frozen in the first stage), an untied head (gathered for the chunked loss), remat
# full (the per-block gathers run inside the remat region and again in the backward pass).
STUDENT = STUDENT_CFG.replace(n_layers=2, tie_embeddings=False, remat="full")
FREEZE = "train.freeze=[{start_step: 0, freeze: [0], lr: 0.001}, {start_step: 2, lr: 0.001}]"
MESHES = {"2x4": (2, 4), "4x2": (4, 2), "8x1": (8, 1)}
# batch 3 (the 4th step) carries a NaN: the guard restores the state of step 2 and falls back to the MSE loss
BATCHES = [make_batch(seed=s) for s in range(5)]
BATCHES[3]["mask"] = BATCHES[3]["mask"].copy()
BATCHES[3]["mask"][0, 0] = np.nan


def distiller(shape, fsdp, seed=1):
  mesh = None if shape is None else md.make_mesh(*shape)
  return md.Distiller(
      md.init_model(STUDENT, seed=seed, mesh=mesh),
      md.init_model(TEACHER_CFG, seed=0, mesh=mesh),
      strategy=md.strategies.ChunkedLogitKD(chunk_size=16),
      optimizer=make_optimizer(load_config("tiny", ["train.warmup=1", FREEZE]).train, STUDENT.n_layers),
      mesh=mesh,
      fsdp=fsdp,
  )


def run(d, guarded):
  """Guarded: three clean steps, a poisoned one (restored), one on the fallback loss. Else three plain steps
  (the freezing stage changes at the third)."""
  if guarded:
    return fit_guarded(d, d.init_state(), BATCHES, DivergenceGuard(window=4, min_history=2))
  state, records = d.init_state(), []
  for i, batch in enumerate(BATCHES[:3]):
    state, metrics = d.step(state, batch)
    records.append({"step": i, "loss": float(metrics["loss"])})
  return state, records


@pytest.fixture(scope="module")
def runs():
  """The replicated single-device run (guarded and plain, one compiled step); fsdp guarded on 2x4, plain on 4x2
  and 8x1 (the guarded path compiles a second step for the fallback loss)."""
  ref = distiller(None, False)
  out = {("replicated", True): (ref, *run(ref, True)), ("replicated", False): (ref, *run(ref, False))}
  for name, shape in MESHES.items():
    d = distiller(shape, True)
    guarded = name == "2x4"
    out[(name, guarded)] = (d, *run(d, guarded))
  return out


def device_bytes(tree, device=None) -> int:
  """Bytes ``device`` (default: the first) holds of the arrays of ``tree``, from their addressable shards."""
  device = device or jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_fsdp_equals_the_replicated_run_with_freezing_chunked_loss_and_a_divergence_restore(runs, mesh):
  guarded = mesh == "2x4"
  d, state, got = runs[(mesh, guarded)]
  _, want_state, want = runs[("replicated", guarded)]
  def events(rs):
    return [(r["step"], r.get("strategy"), [e["kind"] for e in r.get("events", [])]) for r in rs]
  assert events(got) == events(want)
  if guarded:
    assert [e for r in got for e in r.get("events", [])][0]["restored_step"] == 2
  losses = lambda rs: [r["loss"] for r in rs if np.isfinite(r["loss"])]  # noqa: E731
  assert len(losses(got)) >= 3
  np.testing.assert_allclose(losses(got), losses(want), rtol=1e-5)
  assert_trees_close(state.params, want_state.params, rtol=1e-5, atol=1e-6)
  assert int(state.step) == int(want_state.step)
  q = state.params["student"]["blocks"][0]["attn"]["q"]["kernel"][...]
  assert q.sharding.spec[0] == "data"  # split over data, as the layout said


@pytest.mark.parametrize("mesh", ["2x4", "8x1"])
def test_student_weights_and_optimizer_state_per_device_shrink_by_the_data_factor(runs, mesh):
  shape = MESHES[mesh]
  on, s_on, _ = runs[(mesh, mesh == "2x4")]
  off = distiller(shape, False)
  s_off = off.init_state()
  for part in ("params", "opt_state"):
    pairs = list(zip(jax.tree.leaves(getattr(s_on, part)), jax.tree.leaves(getattr(s_off, part))))
    split = [(a, b) for a, b in pairs if "data" in a.sharding.spec]
    whole = [(a, b) for a, b in pairs if "data" not in a.sharding.spec]
    got, ref = device_bytes([a for a, _ in split]), device_bytes([b for _, b in split])
    assert got * shape[0] == ref, (part, got, ref)
    # what stays whole: step counters and the freezing schedule's stage table, never a weight or a moment
    assert all(a.size <= 4 for a, _ in whole), [a.shape for a, _ in whole]
    assert device_bytes([a for a, _ in whole]) < 0.01 * ref
  assert device_bytes(on.teacher_params) * shape[0] == device_bytes(off.teacher_params)


def test_the_step_gathers_per_block_and_reduce_scatters_gradients():
  """The FSDP step gathers weights and reduce-scatters their gradients over ``data``; the replicated step on the
  same mesh does neither (it all-reduces whole gradients over ``data``), so the check tells the two apart."""
  kinds = {}
  for fsdp in (True, False):
    d = distiller(MESHES["2x4"], fsdp)
    hlo = d.lower(d.init_state(), BATCHES[0]).compile().as_text()
    kinds[fsdp] = {(c["kind"], c["axis"]) for c in collectives(hlo, (2, 4))}
  assert ("all-gather", "data") in kinds[True]  # weights gathered over data
  assert ("reduce-scatter", "data") in kinds[True], kinds[True]  # each device keeps its shard of the gradients
  assert ("reduce-scatter", "data") not in kinds[False] and ("all-gather", "data") not in kinds[False], kinds[False]
  assert ("all-reduce", "data") in kinds[False]


def test_teacher_receives_no_gradient_under_fsdp(runs):
  d, state, _ = runs[("2x4", True)]
  halves = step_halves(d._step_fn)
  assert halves is not None
  gradients, _ = halves
  inputs = md.TrainState(state.step, state.params, None)
  body = jax.shard_map(
      lambda s, t, b: gradients(s, t, b, data_axis="data")[1]["loss"], mesh=d.mesh,
      in_specs=(fsdp_lib.data_specs(inputs), fsdp_lib.data_specs(d.teacher_params), jax.P("data")),
      out_specs=jax.P(), axis_names={"data"}, check_vma=False)
  batch = d.layout.place_batch(BATCHES[0])
  grads = jax.jit(jax.grad(lambda t: body(inputs, t, batch)))(d.teacher_params)
  assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, runs):
  """The fsdp 2x4 and replicated single-device states after the guarded run, each saved at step 5."""
  out = {}
  for name in ("2x4", "replicated"):
    d, state, _ = runs[(name, True)]
    directory = str(tmp_path_factory.mktemp(f"ckpt-{name}"))
    ckpt = Checkpointer(directory, every=1)
    ckpt.save(5, d, state, {"next_batch": 5}, {"kind": "distill"})
    ckpt.close()
    out[name] = directory, jax.device_get(state)
  return out


@pytest.mark.parametrize("source, shape, fsdp", [("2x4", (4, 2), False), ("2x4", (8, 1), True),
                                                 ("replicated", (2, 4), True)])
def test_checkpoint_restores_across_fsdp_on_off_and_meshes(saved, source, shape, fsdp):
  directory, want = saved[source]
  d = distiller(shape, fsdp, seed=7)  # another init: every value must come from the checkpoint
  state, data_state, _ = Checkpointer(directory).restore(d, d.init_state())
  assert data_state == {"next_batch": 5}
  for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  kernel = state.params["student"]["blocks"][0]["mlp"]["up"]["kernel"][...]
  assert kernel.sharding.mesh.shape == {"data": shape[0], "tensor": shape[1]}
  assert (kernel.sharding.spec[0] == "data") == fsdp


def two_steps(d):
  """(state, loss) after two steps of ``d`` from its initial state."""
  state = d.init_state()
  for batch in BATCHES[:2]:
    state, metrics = d.step(state, batch)
  return state, float(metrics["loss"])


def test_scanned_layers_under_fsdp_equal_one_device():
  def scanned_run(shape, fsdp):
    mesh = None if shape is None else md.make_mesh(*shape)
    return two_steps(md.Distiller(md.init_model(STUDENT.replace(scan_layers=True), seed=1, mesh=mesh),
                                  md.init_model(TEACHER_CFG.replace(scan_layers=True), seed=0, mesh=mesh),
                                  mesh=mesh, fsdp=fsdp))
  (want, want_loss), (got, got_loss) = scanned_run(None, False), scanned_run((4, 2), True)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  assert_trees_close(got.params, want.params, rtol=1e-5, atol=1e-6)
  q = got.params["student"]["blocks"]["attn"]["q"]["kernel"][...]  # [L, D, H*K]: the layer axis is never split
  assert q.sharding.spec == jax.P(None, "data", "tensor")


@pytest.mark.parametrize("quantize", [None])
def test_lora_student_under_fsdp_equals_one_device(quantize):
  def lora_run(shape, fsdp):
    mesh = None if shape is None else md.make_mesh(*shape)
    # remat none: a LoRA student under nnx.remat fails on one device already (qwix mutates its variables there)
    base = md.init_model(STUDENT.replace(remat="none"), seed=1, mesh=mesh)
    student = apply_lora(base, LoraConfig(rank=4, quantize=quantize), mesh=mesh)
    return two_steps(md.Distiller(student, md.init_model(TEACHER_CFG, seed=0, mesh=mesh), mesh=mesh, fsdp=fsdp))
  (want, want_loss), (got, got_loss) = lora_run(None, False), lora_run((2, 4), True)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  assert_trees_close(got.params, want.params, rtol=1e-5, atol=1e-6)


def test_fsdp_on_a_layout_without_a_data_split_names_the_setting():
  with pytest.raises(ValueError, match=r"mesh\.fsdp.*shard_map"):
    md.Distiller(md.init_model(STUDENT_CFG, seed=1), md.init_model(TEACHER_CFG), backend="pmap", fsdp=True)
  with pytest.raises(ConfigError, match=r"mesh\.fsdp.*mesh\.backend='single'.*shard_map"):
    load_config("tiny", ["mesh.fsdp=true", "mesh.backend=single", "mesh.data=1", "mesh.tensor=1"])
  assert load_config("tiny", ["mesh.fsdp=true"]).mesh.fsdp is True


needs_libtpu = pytest.mark.skipif(not planner.libtpu_available(),
                                  reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")


@needs_libtpu
def test_planner_with_fsdp_lowers_per_chip_student_and_optimizer_bytes():
  teacher = md.ModelConfig(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden=256,
                           max_len=16, tie_embeddings=False)
  student = teacher.replace(d_model=64, mlp_hidden=128)
  off = md.plan(teacher, student, topology="v5e:2x2", mesh="2x2", batch=4, seq=16)
  on = md.plan(teacher, student, topology="v5e:2x2", mesh="2x2", batch=4, seq=16, overrides=["mesh.fsdp=true"])
  assert on.fsdp and not off.fsdp and "fsdp" in on.table()
  for key in ("teacher_weights", "student_weights", "optimizer_state"):
    ratio = on.memory[key] / off.memory[key]
    assert 0.5 <= ratio < 0.51, (key, ratio)  # data=2 halves every weight (a few scalars stay whole)
  def gathered(p, axis):
    return sum(c["bytes"] for c in p.collectives if c["kind"] == "all-gather" and c["axis"] == axis)
  assert gathered(on, "data") > 0
  # the gathers run on each device's tensor block: nothing is gathered over tensor that was not before
  assert gathered(on, "tensor") <= gathered(off, "tensor")
