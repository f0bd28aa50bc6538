"""`md.load_run`: a run directory's student in Python, from its newest intact checkpoint or a given step."""

import os

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import write_corpus

import meshdistill as md
from meshdistill import jobs
from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.config import load_config
from meshdistill.train.loop.evaluate import Evaluator


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 3-step tiny distillation run (checkpoints at steps 2 and 3) on the 2x4 mesh, and its summary."""
  root = tmp_path_factory.mktemp("load_run")
  sets = [
    f"data.source={write_corpus(root / 'c')}",
    "data.seq_len=16",
    "data.val_fraction=0.25",
    "data.max_chars=null",
    "teacher.max_len=16",
    "student.max_len=16",
    "train.steps=3",
    "train.warmup=1",
    "train.eval_every=0",
    "pretrain.steps=2",
    "pretrain.warmup=1",
    "pretrain.eval_every=0",
    f"pretrain.cache_dir={root / 'cache'}",
    "checkpoint.every=2",
    f"run.run_dir={root / 'run'}",
  ]
  cfg = load_config("tiny", sets)
  return cfg, jobs.distill(cfg)


def test_load_run_gives_the_trained_students_logits_on_one_device(run):
  cfg, summary = run
  loaded = md.load_run(cfg.run.run_dir)
  student, config, step = loaded
  assert step == 3 and loaded.student is student and config.student == cfg.student
  assert {d.id for x in jax.tree.leaves(nnx.state(student)) for d in x.devices()} == {jax.devices()[0].id}
  # the student the job trained, restored with its whole train state as `meshdistill eval` restores it
  mesh = jobs.build_mesh(cfg)
  data = jobs.load_data(cfg, mesh=mesh)
  _, teacher = jobs.run_teacher(cfg, {"teacher_dir": summary["teacher_dir"]}, mesh, data.tokenizer)
  distiller = jobs.make_distiller(cfg, teacher, mesh)
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0, read_only=True)
  state, _, _ = ckpt.restore(distiller, distiller.init_state())
  ckpt.close()
  batch = data.val_batches(max_batches=1)[0]
  want = jax.device_get(distiller.student(state)(batch["inputs"]).logits)
  got = jax.device_get(student(batch["inputs"]).logits)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # one device vs the 2x4 mesh: summation order
  # and the validation loss the job reported for its in-memory student at the end of training
  ev = Evaluator(nnx.graphdef(student))(nnx.state(student), data.val_batches(max_batches=cfg.train.eval_batches))
  np.testing.assert_allclose(ev["loss"], summary["student"]["loss"], rtol=1e-5)


def test_load_run_reads_an_earlier_step_and_names_the_steps_it_has(run):
  cfg, _ = run
  early, last = md.load_run(cfg.run.run_dir, step=2), md.load_run(cfg.run.run_dir)
  assert early.step == 2
  w2, w3 = (np.asarray(jax.device_get(r.student.embed.embedding[...])) for r in (early, last))
  assert not np.array_equal(w2, w3)  # a step later, other weights
  with pytest.raises(ValueError, match=r"step=7 is not a checkpoint .*\[2, 3\]"):
    md.load_run(cfg.run.run_dir, step=7)


def test_load_run_onto_a_mesh_splits_the_student_over_tensor(run):
  cfg, _ = run
  student = md.load_run(cfg.run.run_dir, mesh=md.make_mesh(data=2, tensor=4)).student
  leaves = jax.tree.leaves(nnx.state(student))
  assert max(len(x.sharding.device_set) for x in leaves) == 8
  assert any(x.addressable_shards[0].data.size < x.size for x in leaves)  # some weight is split


def test_load_run_of_a_missing_empty_or_checkpointless_directory_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    md.load_run(str(tmp_path / "nowhere"))
  with pytest.raises(FileNotFoundError, match="holds no config.yaml"):
    md.load_run(str(tmp_path))
  run_dir = tmp_path / "fresh"
  cfg = load_config("tiny", [f"run.run_dir={run_dir}"])
  os.makedirs(run_dir)
  (run_dir / "config.yaml").write_text(open(os.path.join(os.path.dirname(md.__file__), "config", "presets", "tiny.yaml")).read())
  with pytest.raises(FileNotFoundError, match="no finished checkpoint") as e:
    md.load_run(str(run_dir))
  assert cfg.checkpoint_dir in str(e.value)
  assert sorted(os.listdir(run_dir)) == ["config.yaml"]  # nothing created


def test_load_run_of_a_run_with_a_padded_vocabulary_gives_its_logits(tmp_path):
  """A vocabulary the run's `tensor` does not divide (265 on tensor=4) is stored padded to 268 rows."""
  from meshdistill.jobs._setup import _write_config

  run_dir = tmp_path / "run"
  cfg = load_config("tiny", [f"run.run_dir={run_dir}", "teacher.vocab_size=265", "student.vocab_size=265"])
  mesh = jobs.build_mesh(cfg)
  distiller = jobs.make_distiller(cfg, md.init_model(cfg.teacher, seed=0, mesh=mesh), mesh)
  state = distiller.init_state()
  _write_config(cfg, str(run_dir))
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0)
  ckpt.save(1, distiller, state, {}, {"kind": "distill"})
  ckpt.close()
  tokens = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % 265
  want = np.asarray(jax.device_get(distiller.student(state)(tokens).logits))
  assert want.shape[-1] == 265
  for mesh in (None, md.make_mesh(data=2, tensor=4), md.make_mesh(data=4, tensor=2)):
    got = md.load_run(str(run_dir), mesh=mesh).student(tokens).logits
    np.testing.assert_allclose(np.asarray(jax.device_get(got)), want, rtol=1e-5, atol=1e-6)
  # `meshdistill export` reads the student the same way: the export holds the 265 real rows
  from meshdistill.jobs.export import export_run

  export_run(str(run_dir), str(tmp_path / "hf"))
  reloaded = md.load_hf(str(tmp_path / "hf"))
  assert reloaded.cfg.vocab_size == 265
  np.testing.assert_allclose(np.asarray(jax.device_get(reloaded(tokens).logits)), want, rtol=1e-5, atol=1e-6)
