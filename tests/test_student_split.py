"""The student over the batch (`mesh.student_split: batch`): the teacher split over `tensor`, the student replicated
and run on rows split over `data` x `tensor`. Same numbers as one device, whole student weights on every device,
fewer all-reduces than the tensor split, no teacher gradient, checkpoints across the two splits, clear errors."""

import functools
import re

import jax
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, assert_trees_close, make_batch

import meshdistill as md
from meshdistill.parallel import backends as layout_lib
from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.parallel.collectives import all_reduce_census
from meshdistill.config import ConfigError, load_config
from meshdistill.train.step import step_halves

STUDENT = STUDENT_CFG.replace(tie_embeddings=False)  # an untied head: the chunked loss reads both heads
ODD = 62  # a vocabulary `tensor`=4 does not divide: both models padded, logits sliced back
STRATEGIES = {
    "LogitKD": (md.strategies.LogitKD(), TEACHER_CFG.vocab_size),
    "ChunkedLogitKD": (md.strategies.ChunkedLogitKD(chunk_size=16), TEACHER_CFG.vocab_size),
    "LogitKD, uneven vocabulary": (md.strategies.LogitKD(), ODD),
}
# rows 6-7 of every sequence masked, and one row masked from its 2nd token: masked tokens must not count
BATCHES = [make_batch(seed=s, vocab=ODD) for s in range(2)]  # token ids of every vocabulary here
for b in BATCHES:
  b["mask"] = b["mask"].copy()
  b["mask"][3, 1:] = 0.0


def distiller(name, shape, split, seed=1, **kw):
  strategy, vocab = STRATEGIES[name]
  mesh = None if shape is None else md.make_mesh(*shape)
  teacher, student = TEACHER_CFG.replace(vocab_size=vocab), STUDENT.replace(vocab_size=vocab)
  return md.Distiller(md.init_model(student, seed=seed, mesh=mesh), md.init_model(teacher, seed=0, mesh=mesh),
                      strategy=strategy, mesh=mesh, student_split=split, **kw)


def two_steps(d):
  state = d.init_state()
  for batch in BATCHES:
    state, metrics = d.step(state, batch)
  return state, jax.device_get(metrics)


def unpadded(tree, like):
  """``tree`` (a mesh run's) with each leaf cut to the shape of its leaf in ``like`` (one unpadded device): the
  vocabulary padding rows of the uneven case, checked to be zero."""
  def cut(x, ref):
    x = np.array(x)
    if x.shape == np.shape(ref):
      return x
    real = tuple(slice(0, n) for n in np.shape(ref))
    rest = x.copy()
    rest[real] = 0.0
    np.testing.assert_array_equal(rest, 0.0)
    return x[real]
  flat = lambda t: {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(jax.device_get(t))}  # noqa: E731
  want = flat(like)
  return {k: cut(v, want[k]) for k, v in flat(tree).items()}


@pytest.fixture(scope="module")
def runs():
  out = {}
  for name in STRATEGIES:
    for key, shape, split in (("one device", None, "tensor"), ("batch", (2, 4), "batch")):
      d = distiller(name, shape, split)
      out[(name, key)] = (d, *two_steps(d))
  return out


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_student_over_the_batch_equals_one_device(runs, name):
  _, ref_state, ref_metrics = runs[(name, "one device")]
  d, state, metrics = runs[(name, "batch")]
  assert d.layout.student_rows
  assert metrics.keys() == ref_metrics.keys()
  assert_trees_close(metrics, ref_metrics, rtol=2e-5, atol=1e-6)
  for tree, ref in ((state.params, ref_state.params), (state.opt_state, ref_state.opt_state)):
    got, want = unpadded(tree, ref), unpadded(ref, ref)
    assert got.keys() == want.keys()
    assert_trees_close(got, want, rtol=2e-5, atol=1e-6)
  # 8 x 8 tokens, 2 masked per row, row 3 from its 2nd token
  assert float(metrics["tokens"]) == 8 * 6 - 5


def test_student_weights_and_moments_are_whole_and_identical_on_every_device(runs):
  _, state, _ = runs[("ChunkedLogitKD", "batch")]
  for x in jax.tree.leaves((state.params["student"], state.opt_state)):
    assert x.sharding.is_fully_replicated
    first = np.asarray(x.addressable_shards[0].data)
    for shard in x.addressable_shards[1:]:
      np.testing.assert_array_equal(np.asarray(shard.data), first)


def test_the_teacher_stays_split_over_tensor(runs):
  d, _, _ = runs[("ChunkedLogitKD", "batch")]
  kernel = d.teacher_params["blocks"][0]["mlp"]["up"]["kernel"][...]
  assert kernel.sharding.spec[-1] == "tensor"


@pytest.mark.parametrize("name", ["LogitKD", "ChunkedLogitKD"])
def test_fewer_than_half_the_all_reduces_of_the_tensor_split(runs, name):
  d, _, _ = runs[(name, "batch")]
  tensor = distiller(name, (2, 4), "tensor")
  count = lambda x: all_reduce_census(x.lower(x.init_state(), BATCHES[0]).compile().as_text(), x.mesh)  # noqa: E731
  got, before = count(d), count(tensor)
  assert got["total"] * 2 <= before["total"], (got, before)
  # the student's gradients and sums: over both axes at once, never over `data` alone
  assert got["data+tensor"] >= 1 and got["data"] == 0, got


@pytest.mark.parametrize("name", ["LogitKD", "ChunkedLogitKD"])
def test_the_teacher_runs_split_over_tensor_without_gathering_its_weights(runs, name):
  """The student's rows split over `tensor` must not carry that split back into the teacher: split over rows and
  `tensor` at once, it would gather its weights every step (the whole teacher, on a large one). Floating-point
  all-gathers: none for LogitKD (its logits reach the student's rows by an all-to-all), the teacher's LM head
  for ChunkedLogitKD (its loss forms the logits on the student's rows)."""
  d, _, _ = runs[(name, "batch")]
  hlo = d.lower(d.init_state(), BATCHES[0]).compile().as_text()
  gathers = [line for line in hlo.splitlines()
             if re.search(r"= \(?(bf16|f16|f32|f64)\[.*\ball-gather(-start)?\(", line)]
  assert len(gathers) <= (1 if name == "ChunkedLogitKD" else 0), "\n".join(g[:160] for g in gathers)
  assert name == "ChunkedLogitKD" or re.search(r"\ball-to-all(-start)?\(", hlo)


def test_teacher_receives_no_gradient(runs):
  d, state, _ = runs[("ChunkedLogitKD", "batch")]
  gradients, _ = step_halves(d._step_fn)
  gradients = functools.partial(gradients, data_axis="data", student_axis="tensor")
  inputs = md.TrainState(state.step, state.params, None)
  body = jax.shard_map(lambda s, t, b: gradients(s, t, b)[1]["loss"], mesh=d.mesh, in_specs=(jax.P(), jax.P(),
                       jax.P("data")), out_specs=jax.P(), axis_names={"data"}, check_vma=False)
  batch = d.layout.place_batch(BATCHES[0])
  grads = jax.jit(jax.grad(lambda t: body(inputs, t, batch)))(d.teacher_params)
  assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))


def test_checkpoint_restores_across_the_two_splits(runs, tmp_path):
  d, state, _ = runs[("ChunkedLogitKD", "batch")]
  ckpt = Checkpointer(str(tmp_path), every=1)
  ckpt.save(2, d, state, {"next_batch": 2}, {"kind": "distill"})
  ckpt.close()
  other = distiller("ChunkedLogitKD", (2, 4), "tensor", seed=7)  # another init: every value from the checkpoint
  restored, data_state, _ = Checkpointer(str(tmp_path)).restore(other, other.init_state())
  assert data_state == {"next_batch": 2}
  assert_trees_close(restored, state, rtol=0, atol=0)
  kernel = restored.params["student"]["blocks"][0]["mlp"]["up"]["kernel"][...]
  assert kernel.sharding.spec[-1] == "tensor"


def test_a_batch_the_devices_do_not_divide_names_the_settings(runs):
  d, state, _ = runs[("LogitKD", "batch")]
  with pytest.raises(ValueError, match=r"train.batch_size=4 .*mesh.data=2 x mesh.tensor=4.*multiple of 8"):
    d.step(state, make_batch(batch=4))


def test_settings_that_do_not_combine_are_refused():
  mesh = md.make_mesh(2, 4)
  with pytest.raises(ValueError, match=r"mesh.student_split='rows'; choose one of \['tensor', 'batch'\]"):
    layout_lib.make_layout("shard_map", mesh, student_split="rows")
  with pytest.raises(ValueError, match=r"mesh.fsdp=true with mesh.student_split='batch'"):
    layout_lib.make_layout("shard_map", mesh, fsdp=True, student_split="batch")
  with pytest.raises(ConfigError, match=r"mesh.student_split='rows'"):
    load_config("tiny", ["mesh.student_split=rows"])
  assert load_config("tiny", ["mesh.student_split=batch"]).mesh.student_split == "batch"
  step = lambda state, teacher, batch, data_axis: (state, {})  # noqa: E731
  halves = r"mesh.student_split='batch' needs a step given as its gradient and update halves"
  with pytest.raises(ValueError, match=halves):
    layout_lib.make_layout("shard_map", mesh, student_split="batch").compile(step)
  # without a `tensor` axis both splits are one layout
  assert not layout_lib.make_layout("shard_map", md.make_mesh(8, 1), student_split="batch").student_rows


def test_planner_counts_the_whole_student_on_every_chip():
  teacher = md.ModelConfig(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden=256,
                           max_len=16, tie_embeddings=False)
  student = teacher.replace(d_model=64, mlp_hidden=128)
  split = md.plan(teacher, student, topology="v5e:2x2", mesh="1x4", batch=4, seq=16)
  rows = md.plan(teacher, student, topology="v5e:2x2", mesh="1x4", batch=4, seq=16,
                 overrides=["mesh.student_split=batch"])
  assert rows.student_split == "batch" and "student over batch" in rows.describe()
  assert rows.memory["teacher_weights"] == split.memory["teacher_weights"]
  for key in ("student_weights", "optimizer_state"):
    ratio = rows.memory[key] / split.memory[key]
    assert 3.9 < ratio <= 4.0, (key, ratio)  # tensor=4: a whole copy instead of a quarter (norms were whole)
  with pytest.raises(ValueError, match=r"batch 2 is not divisible by mesh data x tensor=4"):
    md.plan(teacher, student, topology="v5e:2x2", mesh="1x4", batch=2, seq=16,
            overrides=["mesh.student_split=batch"])
