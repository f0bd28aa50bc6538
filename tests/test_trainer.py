"""The training loop: exact resume, hard-label pretraining, evaluation, monitoring, clear errors."""

import io
import json
import os

import jax
import numpy as np
import optax
import pytest
from helpers import make_batch, write_corpus
from flax import nnx

import meshdistill as md
from meshdistill import jobs
from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.config import ConfigError, load_config
from meshdistill.data import DataConfig, build_data
from meshdistill.train.loop.evaluate import Evaluator
from meshdistill.train.hardlabel import HardLabelTrainer
from meshdistill.train.loop.monitor import Monitor, ProfileWindow, plot_run
from meshdistill.train.loop import run as run_lib
from meshdistill.train.loop.stopping import Stopped
from meshdistill.train.loop.trainer import fit, lr_schedule, make_optimizer

VOCAB = 264  # byte tokenizer
TEACHER = md.ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_len=16)
STUDENT = TEACHER.replace(d_model=16, n_layers=1, mlp_hidden=32)


def tiny_settings(steps=6, **kw):
  return load_config(
    "tiny", [f"train.steps={steps}", "train.warmup=1", *[f"train.{k}={v}" for k, v in kw.items()]]
  ).train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  src = write_corpus(tmp_path_factory.mktemp("corpus") / "c")
  bundle = build_data(DataConfig(source=src, seq_len=16, val_fraction=0.25), batch_size=8)
  assert bundle.val is not None and len(bundle.val_batches()) >= 1
  return bundle


@pytest.fixture(scope="module")
def mesh():
  return md.make_mesh(data=2, tensor=4)


def new_distiller(mesh, settings):
  teacher = md.init_model(TEACHER, seed=0, mesh=mesh)
  student = md.init_model(STUDENT, seed=1, mesh=mesh)
  return md.Distiller(student, teacher, optimizer=make_optimizer(settings), mesh=mesh, strategy=md.LogitKD(alpha=0.7))


def leaves_equal(a, b):
  la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
  assert len(la) == len(lb)
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def settings():
  return tiny_settings(steps=6)


@pytest.fixture(scope="module")
def kd(mesh, settings):
  """A distiller shared by the tests below (its step compiles once)."""
  return new_distiller(mesh, settings)


@pytest.fixture(scope="module")
def hard(mesh, settings):
  return HardLabelTrainer(md.init_model(STUDENT, seed=1, mesh=mesh), optimizer=make_optimizer(settings), mesh=mesh)


def test_interrupted_and_resumed_run_is_bitwise_identical_to_uninterrupted(data, mesh, settings, kd, tmp_path):
  full_ckpt = Checkpointer(str(tmp_path / "full"), every=6)
  full = fit(kd, data, steps=6, eval_every=0, checkpointer=full_ckpt, log_every=2)

  ckpt = Checkpointer(str(tmp_path / "split"), every=3)
  first = fit(kd, data, steps=6, eval_every=0, checkpointer=ckpt, stop_after=3, log_every=2)
  assert first.step == 3 and ckpt.latest_step() == 3
  ckpt.close()
  # A new process rebuilds everything: a new distiller (fresh compile) and checkpointer.
  resumed_ckpt = Checkpointer(str(tmp_path / "split"), every=3)
  second = fit(new_distiller(mesh, settings), data, steps=6, eval_every=0, checkpointer=resumed_ckpt, log_every=2)
  assert second.resumed_from == 3 and second.step == 6

  assert int(jax.device_get(second.state.step)) == int(jax.device_get(full.state.step)) == 6
  assert leaves_equal(second.state.params, full.state.params)
  assert leaves_equal(second.state.opt_state, full.state.opt_state)
  # the data position saved with the final checkpoints is the same
  _, data_full, _ = full_ckpt.restore(kd, kd.init_state())
  _, data_resumed, _ = resumed_ckpt.restore(kd, kd.init_state())
  assert data_full == data_resumed and data_full["next_batch"] == 6
  # and the resumed run did not simply skip training: the interrupted state differs
  assert not leaves_equal(first.state.params, full.state.params)
  # a checkpoint past the run's last step is refused, not silently reported as that step
  with pytest.raises(ValueError, match="at step 6, past this run's 4 steps"):
    fit(kd, data, steps=4, checkpointer=full_ckpt)


def test_hard_label_step_equals_distillation_with_alpha_zero(mesh, settings, hard):
  kd0 = md.Distiller(
    md.init_model(STUDENT, seed=1, mesh=mesh),
    md.init_model(TEACHER, seed=0, mesh=mesh),
    strategy=md.LogitKD(alpha=0.0),
    optimizer=make_optimizer(settings),
    mesh=mesh,
  )
  batch = make_batch(batch=8, seq=16, vocab=VOCAB, pad_from=12)
  s_hard, m_hard = hard.step(hard.init_state(), batch)
  s_kd, m_kd = kd0.step(kd0.init_state(), batch)
  np.testing.assert_allclose(float(m_hard["loss"]), float(m_kd["ce"]), rtol=1e-6)
  np.testing.assert_allclose(float(m_hard["loss"]), float(m_kd["loss"]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(s_hard.params), jax.tree.leaves(s_kd.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_hard_label_pretraining_lowers_validation_loss(data, hard):
  evaluator = Evaluator.for_trainer(hard)
  before = evaluator(hard.init_state().params["student"], data.val_batches())
  result = fit(hard, data, steps=12, kind="pretrain", eval_every=0, evaluator=evaluator)
  assert result.eval["loss"] < before["loss"] - 0.5
  assert set(before) == {"loss", "ppl", "tokens"}


def test_evaluation_is_a_token_mean_that_ignores_padding(mesh):
  model = md.init_model(STUDENT, seed=3, mesh=mesh)
  graphdef, params = nnx.split(model)
  ev = Evaluator(graphdef, mesh=mesh)
  batch = make_batch(seed=1, batch=8, seq=16, vocab=VOCAB, pad_from=10)
  got = ev(params, [batch])
  logits = np.asarray(model(batch["inputs"]).logits, np.float64)
  logp = (
    logits
    - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
  want = (nll * batch["mask"]).sum() / batch["mask"].sum()
  np.testing.assert_allclose(got["loss"], want, rtol=1e-5)
  assert got["tokens"] == batch["mask"].sum() == 8 * 10
  # garbage in the padded positions changes nothing
  noisy = dict(batch, targets=np.where(batch["mask"] > 0, batch["targets"], 7).astype(np.int32))
  np.testing.assert_allclose(ev(params, [noisy])["loss"], got["loss"], rtol=1e-6)
  np.testing.assert_allclose(got["ppl"], np.exp(got["loss"]), rtol=1e-6)


class _FirstBatches:
  """``bundle`` with its training data cut after ``n`` batches: a finite dataset that ends before the run's steps."""

  def __init__(self, bundle, n):
    self.bundle, self.n = bundle, n

  def train_iterator(self, position):
    return _Cut(self.bundle.train_iterator(position), self.n)

  def val_batches(self, max_batches):
    return self.bundle.val_batches(max_batches)


class _Cut:
  def __init__(self, it, n):
    self.it, self.left = it, n - it.get_state()["next_batch"]

  def __next__(self):
    if self.left <= 0:
      raise StopIteration
    self.left -= 1
    return next(self.it)

  def get_state(self):
    return self.it.get_state()

  def close(self):
    self.it.close()


def test_a_run_whose_data_ends_early_logs_evaluates_and_checkpoints_its_last_step(data, kd, tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every=4)
  stream = io.StringIO()
  monitor = Monitor(str(tmp_path / "run"), 10, stream=stream)
  res = fit(kd, _FirstBatches(data, 5), steps=10, eval_every=4, log_every=4, checkpointer=ckpt, monitor=monitor)
  monitor.close()
  assert res.step == 5 and int(jax.device_get(res.state.step)) == 5
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  # step 5 is logged, evaluated and saved as a run's last step is (before: the rows and checkpoint of step 4 only)
  assert [r["step"] for r in rows if r["split"] == "train"] == [4, 5]
  assert [r["step"] for r in rows if r["split"] == "val"] == [4, 5] and res.eval
  assert sorted(ckpt.all_steps()) == [4, 5]
  _, position, _ = ckpt.restore(kd, kd.init_state())
  assert position["next_batch"] == 5
  assert "the data ran out after step 5 of 10" in stream.getvalue()


def test_monitor_writes_jsonl_tensorboard_plots_and_a_profile(data, settings, kd, tmp_path):
  run = tmp_path / "run"
  stream = io.StringIO()
  monitor = Monitor(str(run), 4, stream=stream, name="distill")
  profile = ProfileWindow.parse("2:3", str(run / "profile"))
  fit(kd, data, steps=4, eval_every=2, log_every=2, monitor=monitor, profile=profile, lr=lr_schedule(settings))
  monitor.close()
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in rows if r["split"] == "train"]
  val = [r for r in rows if r["split"] == "val"]
  assert [r["step"] for r in train] == [2, 4] and [r["step"] for r in val] == [2, 4]
  assert {"loss", "kl", "ce", "corr", "agree", "lr", "tokens_per_s", "step_s"} <= set(train[0])
  assert {"loss", "ppl", "kl", "agree", "corr", "teacher_loss"} <= set(val[0])
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(run / "tb"))
  assert any(f.endswith((".xplane.pb", ".trace.json.gz")) for _, _, fs in os.walk(run / "profile") for f in fs)
  shown = stream.getvalue()
  assert "4/4" in shown and "tok/s" in shown and "ETA" in shown and "eval @ step 2" in shown
  pngs = plot_run(str(run))
  assert sorted(os.path.basename(p) for p in pngs) == ["ce.png", "corr.png", "kl.png", "loss.png"]
  assert all(os.path.getsize(p) > 1000 for p in pngs)


def test_bad_profile_window_is_rejected():
  with pytest.raises(ValueError, match="START:STOP"):
    ProfileWindow.parse("5", "/tmp/x")
  with pytest.raises(ValueError, match="1 <= START <= STOP"):
    ProfileWindow.parse("4:2", "/tmp/x")


def test_empty_corpus_and_missing_file_give_clear_errors(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "a.txt").write_text("")
  with pytest.raises(ValueError, match="corpus is empty"):
    jobs.load_data(load_config("tiny", [f"data.source={empty}"]))
  with pytest.raises(FileNotFoundError, match="no file or directory"):
    jobs.load_data(load_config("tiny", [f"data.source={tmp_path / 'missing.txt'}"]))


def test_model_vocabulary_smaller_than_the_tokenizer_is_named(tmp_path):
  src = write_corpus(tmp_path / "c", n_docs=4)
  cfg = load_config("tiny", [f"data.source={src}", "teacher.vocab_size=128", "student.vocab_size=128"])
  with pytest.raises(ConfigError, match="teacher.vocab_size=128 is smaller than the tokenizer's vocabulary \\(264"):
    jobs.load_data(cfg)


def test_distill_job_pretrains_caches_and_reuses_the_teacher(tmp_path):
  src = write_corpus(tmp_path / "c")
  sets = [
    f"data.source={src}",
    "data.seq_len=16",
    "data.val_fraction=0.25",
    "data.max_chars=null",
    "teacher.max_len=16",
    "student.max_len=16",
    "train.steps=3",
    "train.warmup=1",
    "train.eval_every=0",
    "train.log_every=1",
    "pretrain.steps=3",
    "pretrain.warmup=1",
    "pretrain.eval_every=0",
    "pretrain.log_every=1",
    f"pretrain.cache_dir={tmp_path / 'cache'}",
    "checkpoint.every=0",
  ]
  cfg = load_config("tiny", sets + [f"run.run_dir={tmp_path / 'run1'}"])
  summary = jobs.distill(cfg)
  tdir = summary["teacher_dir"]
  assert tdir.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(tdir, "teacher.json"))
  assert summary["step"] == 3 and 0 < summary["param_ratio"] < 1
  assert summary["safeguards"] == {"remat": "none", "divergences": 0, "events": []}  # the guard ran, quietly
  assert np.isfinite(summary["student"]["loss"]) and summary["teacher"]["ppl"] > 1
  assert json.loads((tmp_path / "run1" / "summary.json").read_text())["student"]["loss"] == summary["student"]["loss"]
  stamp = os.path.getmtime(os.path.join(tdir, "teacher.json"))
  # a second run with the same settings finds the cached teacher (no pretraining)
  cfg2 = load_config("tiny", sets + [f"run.run_dir={tmp_path / 'run2'}"])
  lines = []
  data = jobs.load_data(cfg2)
  teacher, path = jobs.obtain_teacher(cfg2, data, jobs.build_mesh(cfg2), report=lines.append)
  assert path == tdir and lines == [f"teacher: cached {tdir}"]
  assert os.path.getmtime(os.path.join(tdir, "teacher.json")) == stamp
  assert not (tmp_path / "run2").exists()  # nothing was trained
  evaluator = Evaluator(nnx.graphdef(teacher), mesh=jobs.build_mesh(cfg2))
  ev = evaluator(nnx.state(teacher), data.val_batches(cfg2.train.eval_batches))
  np.testing.assert_allclose(ev["loss"], summary["teacher"]["loss"], rtol=1e-6)


def test_freezing_schedule_from_the_config_holds_frozen_blocks_bit_for_bit(data, mesh):
  settings = load_config("tiny", ["train.warmup=1", "train.freeze=[{start_step: 0, freeze: [0], lr: 0.01}]"]).train
  student_cfg = STUDENT.replace(n_layers=2)
  d = md.Distiller(
    md.init_model(student_cfg, seed=1, mesh=mesh),
    md.init_model(TEACHER, seed=0, mesh=mesh),
    optimizer=make_optimizer(settings, student_cfg.n_layers),
    mesh=mesh,
  )
  before = jax.device_get(d.init_state().params["student"])
  monitor = Monitor(None, 3)
  after = jax.device_get(fit(d, data, steps=3, eval_every=0, log_every=3, monitor=monitor).state.params["student"])
  assert leaves_equal(before["blocks"][0], after["blocks"][0]) and leaves_equal(before["embed"], after["embed"])
  assert not leaves_equal(before["blocks"][1], after["blocks"][1])


def test_fresh_state_moments_take_their_parameters_sharding_on_every_trainer(kd, hard):
  for trainer in (kd, hard):  # with a teacher and without one: one code path (`Layout.fresh_state`)
    state = trainer.init_state()
    want = jax.tree.map(lambda x: x.sharding, state.params)
    for moment in ("mu", "nu"):
      got = jax.tree.map(lambda x: x.sharding, optax.tree_utils.tree_get(state.opt_state, moment))
      assert got == want
    assert any(not s.is_fully_replicated for s in jax.tree.leaves(want))  # some weights really are split


def test_tokens_per_s_keeps_the_flushs_wait_and_drops_the_time_set_aside(monkeypatch):
  """A flush waits for its window's steps (step time); evaluation after it is set aside (not step time)."""
  import meshdistill.train.loop.monitor as monitor_lib

  clock = [0.0]
  monkeypatch.setattr(monitor_lib.time, "perf_counter", lambda: clock[0])
  m = Monitor(None, 10)
  m.start(0)
  m.step(1, {"loss": 1.0}, 100.0)
  clock[0] = 2.0  # the flush began at 1.5 and waited for the step until 2.0
  assert m.flush_train(1)["tokens_per_s"] == 50.0
  clock[0] = 5.0  # an evaluation until 5.0: the hooks took 5.0 - 1.5 s, of which 3 s after the flush
  m.exclude(3.5)
  m.step(2, {"loss": 1.0}, 100.0)
  clock[0] = 6.0
  assert m.flush_train(2)["tokens_per_s"] == 100.0
  clock[0] = 8.0  # 1 s set aside inside a window
  m.exclude(1.0)
  m.step(3, {"loss": 1.0}, 100.0)
  clock[0] = 9.0
  assert m.flush_train(3)["tokens_per_s"] == 50.0


def test_several_processes_stop_together_on_a_request_that_reached_only_another(data, kd, monkeypatch):
  """With several processes the loop asks `any_process` whether a stop was requested, at the same steps on all
  (where a hook is due; here the log every 2 steps): a signal that reached one host stops every process after
  the same step. Here no signal reached this process; the (simulated) others report one from the 2nd question."""
  asked = []

  def any_process(flag, what):
    asked.append(flag)
    return len(asked) >= 2

  monkeypatch.setattr(run_lib, "process_count", lambda: 2)
  monkeypatch.setattr(run_lib, "any_process", any_process)
  with pytest.raises(Stopped, match="stopped by SIGTERM after step 4") as stop:
    fit(kd, data, steps=10, eval_every=0, log_every=2)
  assert stop.value.step == 4 and asked == [False, False]  # asked at steps 2 and 4 only, never with a local flag
