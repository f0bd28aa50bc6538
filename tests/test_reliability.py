"""Reliability: no command loses a user's files, and damaged state is detected, not trained on.

Each test reproduces one case of ``benchmarks/results/reliability.md`` and checks what happens
now: the data is kept, and the command gives a clear error (a non-zero exit code when work was
refused) or falls back with a warning naming what was damaged.
"""

import errno
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_batch, write_corpus
from flax import nnx

import meshdistill as md
from meshdistill import cli, jobs
from meshdistill.storage.checkpoint import Checkpointer, CheckpointError
from meshdistill.teachers.checkpoint import TeacherDamagedError, load_teacher, save_teacher
from meshdistill.config import ConfigError, load_config
from meshdistill.data import DataConfig, build_data
from meshdistill.teachers.cache import TeacherCache
from meshdistill.core.fsutil import LOCK_FILE, OutputExistsError, RunLock, RunLockedError
from meshdistill.models import export_hf, load_hf
from meshdistill.train.loop.monitor import Monitor, plot_run, read_metrics
from meshdistill.core.ownership import MARKER, write_marker
from meshdistill.train.loop.safeguards import DivergenceGuard, fit_guarded, safeguarded, skipped_updates
from meshdistill.train.loop.trainer import fit

VOCAB = 264  # byte tokenizer
TEACHER = md.ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_len=16)
STUDENT = TEACHER.replace(d_model=16, n_layers=1, mlp_hidden=32)
FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def tiny_sets(tmp, corpus):
  """The tiny CLI config on a small corpus (the settings `test_trainer` uses for whole jobs)."""
  return [f"data.source={corpus}", "data.seq_len=16", "data.val_fraction=0.25", "data.max_chars=null",
          "teacher.max_len=16", "student.max_len=16", "train.warmup=1", "train.eval_every=0", "train.log_every=1",
          "pretrain.warmup=1", "pretrain.eval_every=0", "pretrain.log_every=1", "checkpoint.every=0",
          f"pretrain.cache_dir={tmp / 'cache'}", "mesh.backend=single", "mesh.data=1", "mesh.tensor=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("corpus") / "c")


@pytest.fixture(scope="module")
def data(corpus):
  return build_data(DataConfig(source=corpus, seq_len=16, val_fraction=0.25), batch_size=8)


@pytest.fixture(scope="module")
def kd():
  """One single-device distiller with the API's default optimizer, shared by the tests (its step compiles once)."""
  return md.Distiller(md.init_model(STUDENT, seed=1), md.init_model(TEACHER, seed=0), strategy=md.LogitKD(alpha=0.7))


@pytest.fixture(scope="module")
def saved_run(kd, data, tmp_path_factory):
  """A 4-step run with checkpoints at steps 2 and 4 (a pristine copy; tests damage copies of it)."""
  root = tmp_path_factory.mktemp("saved")
  ckpt = Checkpointer(str(root / "ckpt"), every=2, keep=3)
  monitor = Monitor(str(root), 4, tensorboard=False)
  try:
    result = fit(kd, data, steps=4, log_every=1, checkpointer=ckpt, monitor=monitor)
  finally:
    ckpt.close()
    monitor.close()
  assert sorted(Checkpointer(str(root / "ckpt"), read_only=True).all_steps()) == [2, 4]
  return root, result


def copy_run(saved_run, tmp_path) -> pathlib.Path:
  dst = tmp_path / "run"
  shutil.copytree(saved_run[0], dst)
  return dst


def biggest_file(root: pathlib.Path) -> pathlib.Path:
  files = [p for p in root.rglob("*") if p.is_file()]
  return max(files, key=lambda p: p.stat().st_size)


def flip_bit(path: pathlib.Path) -> None:
  raw = bytearray(path.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  path.write_bytes(bytes(raw))


def leaves_equal(a, b):
  la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def tree_of(root: pathlib.Path) -> dict:
  return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ 1. data loss
def test_pretrain_into_an_existing_directory_is_refused_and_its_files_kept(tmp_path, monkeypatch, capsys):
  mine = tmp_path / "project"
  mine.mkdir()
  (mine / "notes.txt").write_text("mine")
  old = tmp_path / "old_teacher"
  old.mkdir()
  (old / "teacher.json").write_text("{}")
  before = tree_of(tmp_path)
  assert cli.main(["pretrain", "--config", "tiny", "--out", str(mine)]) == 2
  assert "did not write (notes.txt); nothing was changed" in capsys.readouterr().err
  assert cli.main(["pretrain", "--config", "tiny", "--out", str(old)]) == 2
  assert "not empty; nothing was changed. Pass --overwrite" in capsys.readouterr().err
  # --out . (the working directory): refused, even with --overwrite, since it holds files meshdistill did not write
  monkeypatch.chdir(mine)
  assert cli.main(["pretrain", "--config", "tiny", "--out", ".", "--overwrite"]) == 2
  assert "did not write (notes.txt)" in capsys.readouterr().err
  assert tree_of(tmp_path) == before


def test_save_teacher_replaces_only_a_teacher_and_only_when_asked(tmp_path, data):
  model = md.init_model(STUDENT, seed=3)
  out = tmp_path / "teacher"
  save_teacher(str(out), model, data.tokenizer)
  with pytest.raises(OutputExistsError, match="already exists and is not empty"):
    save_teacher(str(out), model, data.tokenizer)
  save_teacher(str(out), md.init_model(STUDENT, seed=4), data.tokenizer, overwrite=True)  # a teacher: replaced
  assert sorted(os.listdir(out)) == [MARKER, "params", "teacher.json", "tokenizer"]
  assert not [n for n in os.listdir(tmp_path) if n.startswith((".tmp-", ".old-"))]  # nothing left behind
  (out / "mine.txt").write_text("x")
  with pytest.raises(OutputExistsError, match="did not write"):
    save_teacher(str(out), model, data.tokenizer, overwrite=True)
  assert (out / "mine.txt").read_text() == "x"


# ------------------------------------------------------------------ 2. export
def test_export_replaces_an_old_sharded_checkpoint_whole_and_never_writes_through_symlinks(tmp_path):
  model = load_hf(FIXTURES / "hf_llama")
  state = nnx.state(model, nnx.Param)
  new = nnx.merge(nnx.graphdef(model), jax.tree.map(lambda x: x * 2.0, state))
  out = tmp_path / "out"
  shutil.copytree(FIXTURES / "hf_llama", out, ignore=shutil.ignore_patterns("*.npz"))  # an older sharded export
  write_marker(str(out), "export")  # written by an export (a marker-less one is never replaced: round two)
  outside = tmp_path / "elsewhere.json"
  outside.write_text("{}")
  (out / "config.json").unlink()
  shutil.copyfile(FIXTURES / "hf_llama" / "config.json", outside)
  (out / "config.json").symlink_to(outside)
  before = tree_of(out)
  with pytest.raises(OutputExistsError, match="overwrite=True"):
    export_hf(new, out)
  assert tree_of(out) == before  # refused before anything was written
  export_hf(new, out, tokenizer=out, overwrite=True)  # the tokenizer is read from the directory being replaced
  assert not (out / "model.safetensors.index.json").exists() and not list(out.glob("model-*-of-*.safetensors"))
  assert (out / "generation_config.json").is_file() and not (out / "config.json").is_symlink()
  assert outside.read_text() == (FIXTURES / "hf_llama" / "config.json").read_text()  # the link's target untouched
  again = load_hf(out)
  assert leaves_equal(nnx.state(again, nnx.Param), nnx.state(new, nnx.Param))  # the NEW weights
  # `meshdistill export RUN_DIR OUT_DIR --overwrite` follows the same rule
  from meshdistill.jobs.export import check_out_dir

  (out / "notes.txt").write_text("mine")
  with pytest.raises(OutputExistsError, match="did not write \\(notes.txt\\)"):
    check_out_dir(str(out), overwrite=True)


# ------------------------------------------------------------------ 3. damaged checkpoints
@pytest.mark.parametrize("damage", ["flipped bit", "truncated", "deleted state", "garbled meta"])
def test_damaged_latest_step_falls_back_to_the_previous_intact_one_with_a_warning(
  damage, saved_run, kd, tmp_path, caplog
):
  run = copy_run(saved_run, tmp_path)
  step4 = run / "ckpt" / "4"
  if damage == "flipped bit":
    flip_bit(biggest_file(step4 / "state"))
  elif damage == "truncated":
    big = biggest_file(step4 / "state")
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
  elif damage == "deleted state":
    shutil.rmtree(step4 / "state")
  else:
    (step4 / "meta" / "metadata").write_text("{not json")
  ckpt = Checkpointer(str(run / "ckpt"), read_only=True)  # what `meshdistill eval` opens
  with caplog.at_level(logging.WARNING, logger="meshdistill.storage.checkpoint"):
    state, data_state, meta = ckpt.restore(kd, kd.init_state())
  assert meta["step"] == 2 and int(state.step) == 2 and data_state["next_batch"] == 2
  assert "checkpoint step 4" in caplog.text and "is damaged" in caplog.text
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
  assert (run / "ckpt" / "4").is_dir()  # read-only: the damaged step is reported, not moved
  if damage == "garbled meta":  # asked for explicitly, the damaged step is refused naming its file
    with pytest.raises(CheckpointError, match="checksum mismatch in meta/metadata"):
      ckpt.restore(kd, kd.init_state(), step=4)


def test_resume_sets_the_damaged_step_aside_and_trains_again_to_the_same_state(saved_run, kd, data, tmp_path):
  run = copy_run(saved_run, tmp_path)
  flip_bit(biggest_file(run / "ckpt" / "4" / "state"))
  ckpt = Checkpointer(str(run / "ckpt"), every=2, keep=3)
  monitor = Monitor(str(run), 4, tensorboard=False)
  try:
    result = fit(kd, data, steps=4, log_every=1, checkpointer=ckpt, monitor=monitor)
  finally:
    ckpt.close()
    monitor.close()
  assert result.resumed_from == 2 and result.step == 4
  assert leaves_equal(result.state.params, saved_run[1].state.params)  # the redone steps equal the lost ones
  assert [n for n in os.listdir(run / "ckpt") if n.startswith("damaged-4-")]
  assert Checkpointer(str(run / "ckpt"), read_only=True).verify(4) is None  # step 4 written anew, intact
  # 7. resumed runs do not duplicate metrics rows
  steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
  assert steps == [1, 2, 3, 4]


def test_no_intact_checkpoint_is_a_clear_error(saved_run, kd, data, tmp_path):
  run = copy_run(saved_run, tmp_path)
  for s in (2, 4):
    flip_bit(biggest_file(run / "ckpt" / str(s) / "state"))
  ckpt = Checkpointer(str(run / "ckpt"), every=2)
  with pytest.raises(CheckpointError, match=r"no intact checkpoint .*step 4: checksum mismatch.*step 2: checksum"):
    fit(kd, data, steps=4, checkpointer=ckpt)
  assert sorted(ckpt.all_steps()) == [2, 4]  # nothing restored, nothing moved or deleted


def test_checkpoints_from_before_checksums_restore_unverified_with_a_warning(saved_run, kd, tmp_path, caplog):
  run = copy_run(saved_run, tmp_path)
  for f in (run / "ckpt").glob("*/checksums.json"):
    f.unlink()
  with caplog.at_level(logging.WARNING, logger="meshdistill.storage.checkpoint"):
    _, _, meta = Checkpointer(str(run / "ckpt"), read_only=True).restore(kd, kd.init_state())
  assert meta["step"] == 4 and "records no checksums" in caplog.text


# ------------------------------------------------------------------ 4. concurrent runs
def test_one_run_per_run_directory_and_stale_locks_are_taken_over(tmp_path, corpus, caplog):
  run = tmp_path / "run"
  with RunLock(str(run)):
    with pytest.raises(RunLockedError, match=f"in use by another run \\(pid {os.getpid()}\\)"):
      RunLock(str(run)).acquire()
    cfg = load_config("tiny", tiny_sets(tmp_path, corpus) + [f"run.run_dir={run}"])
    with pytest.raises(RunLockedError):
      jobs.distill(cfg)
    assert sorted(os.listdir(run)) == [LOCK_FILE]  # the second run wrote nothing
  # a lock file left by a process that died (kill -9): the OS released its lock; it is taken over
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
  (run / LOCK_FILE).write_text(dead.stdout)
  with caplog.at_level(logging.WARNING, logger="meshdistill.core.fsutil"), RunLock(str(run)):
    pass
  assert f"stale lock of pid {int(dead.stdout)} (no longer running) taken over" in caplog.text


# ------------------------------------------------------------------ 5. rejected resume
def test_a_rejected_resume_leaves_config_yaml_as_it_was(saved_run, kd, tmp_path, corpus):
  run, teacher = tmp_path / "run", tmp_path / "teacher"
  cfg = load_config("tiny", tiny_sets(tmp_path, corpus) + [f"run.run_dir={run}", "train.steps=4",
                                                         f"pretrain.teacher={teacher}"])
  save_teacher(str(teacher), md.init_model(cfg.teacher, seed=0), jobs.load_data(cfg).tokenizer)
  ckpt = Checkpointer(str(run / "checkpoints"), every=0)
  other = {**cfg.to_dict()["student"], "d_model": 64}
  ckpt.save(2, kd, kd.init_state(), {"next_batch": 2}, {"kind": "distill", "student": other, "teacher_dir": str(teacher)})
  ckpt.close()
  (run / "config.yaml").write_text("# the run's own config\n")
  with pytest.raises(ValueError, match="written by another run \\(student"):
    jobs.distill(cfg)
  assert (run / "config.yaml").read_text() == "# the run's own config\n"


# ------------------------------------------------------------------ 6. guard blind spots
def test_default_distiller_optimizer_skips_a_nan_batch(kd):
  d = kd  # built without an optimizer: the API's default
  state = d.init_state()
  before = jax.device_get(state.params)
  bad = make_batch(0, seq=16, vocab=VOCAB)
  bad["mask"][0, 0] = np.nan  # one NaN batch
  state, metrics = d.step(state, bad)
  assert not np.isfinite(float(metrics["loss"])) and skipped_updates(state.opt_state) == 1
  assert leaves_equal(state.params, before)  # the weights are untouched, not NaN
  state, metrics = d.step(state, make_batch(1, seq=16, vocab=VOCAB))
  assert np.isfinite(float(metrics["loss"])) and not leaves_equal(state.params, before)  # and training goes on


def test_guard_fires_when_every_update_is_skipped_and_names_the_loss_scale(kd, data):
  # safeguards.loss_scale: 1.0e+38 (refused by the config now) made every gradient overflow while the loss
  # stayed finite and flat: the guard saw nothing.
  with pytest.raises(ConfigError, match="loss_scale=1e\\+38 overflows float32 gradients"):
    load_config("tiny", ["safeguards.loss_scale=1.0e+38"])
  with pytest.raises(ValueError, match="loss_scale=1e\\+38 overflows float32"):
    md.Distiller(md.init_model(STUDENT, seed=1), strategy=md.HardLabelCE(), loss_scale=1e38)
  d = kd._variant(loss_scale=1e38)  # the step's loss scale as an older config let through (the check bypassed)
  assert d.loss_scale == 1e38 and d.strategy == md.LogitKD(alpha=0.7)
  batches = [jax.tree.map(np.asarray, b) for b, _ in zip(data.train_iterator(), range(5))]
  guard = DivergenceGuard(max_skips=2, max_restores=1, min_history=2)
  with pytest.raises(RuntimeError) as e:
    fit_guarded(d, d.init_state(), batches, guard, fallback=d.strategy)  # the fallback keeps the step's scale
  msg = str(e.value)
  assert "updates stopped" in msg and "gradient norm was non-finite on the last 2 steps" in msg
  assert "No update has been applied since the run (re)started" in msg and "safeguards.loss_scale" in msg


def test_guard_names_the_learning_rate_when_updates_stop_after_good_ones():
  guard = DivergenceGuard(max_skips=4, min_history=2)
  for loss in (2.0, 2.0, 2.0):
    guard.observe(0, loss)
  opt = safeguarded(optax.sgd(1.0))
  update = jax.jit(opt.update)
  state = opt.init({"w": jnp.zeros(2)})
  for step in range(1, 15):  # 10 good updates, then 4 with non-finite gradients
    good = step <= 10
    state = update({"w": jnp.ones(2) if good else jnp.full(2, jnp.inf)}, state)[1]
    reason = guard.check_updates(step, state, 2.0, 1.0 if good else float("inf"))
    assert (reason is None) == (step < 14)
  assert "loss stayed finite (2 to 2)" in reason and "10 update(s) were applied first" in reason and "train.lr" in reason
  assert guard.check_updates(15, update({"w": jnp.ones(2)}, state)[1], 2.0) is None


# ------------------------------------------------------------------ 7. config numbers
def test_yaml_and_set_accept_exponent_floats(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("train: {lr: 3e-4}\npretrain: {lr: 1e-3}\nsafeguards: {loss_scale: 1.0e9}\n")
  cfg = load_config(str(path), ["distill.alpha=5e-1"])
  assert (cfg.train.lr, cfg.pretrain.lr, cfg.safeguards.loss_scale, cfg.distill.alpha) == (3e-4, 1e-3, 1e9, 0.5)
  assert load_config("tiny", ["train.lr=3e-3"]).train.lr == 3e-3  # the error hint's own example


# ------------------------------------------------------------------ 8. minor
def test_damaged_model_files_are_named_and_index_escapes_refused(tmp_path):
  path = tmp_path / "m"
  shutil.copytree(FIXTURES / "hf_llama", path)
  shard = path / "model-00002-of-00005.safetensors"
  shard.write_bytes(shard.read_bytes()[:40])
  with pytest.raises(ValueError, match="model-00002-of-00005.safetensors"):
    load_hf(path)
  shutil.copyfile(FIXTURES / "hf_llama" / shard.name, shard)
  (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
  with pytest.raises(ValueError, match=r"config.json .*is not valid JSON"):
    load_hf(path)
  shutil.copyfile(FIXTURES / "hf_llama" / "config.json", path / "config.json")
  index = json.loads((path / "model.safetensors.index.json").read_text())
  name = next(iter(index["weight_map"]))
  index["weight_map"][name] = "../../etc/passwd"
  (path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match="points outside"):
    load_hf(path)


def test_eval_of_a_missing_run_creates_nothing(tmp_path, capsys, corpus):
  missing = tmp_path / "nope"
  assert cli.main(["eval", str(missing)]) == 2
  assert "does not exist" in capsys.readouterr().err
  cfg = load_config("tiny", tiny_sets(tmp_path, corpus) + [f"run.run_dir={missing}"])
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    jobs.evaluate(cfg)
  assert not missing.exists()


def test_metrics_rewind_drops_redone_rows_and_plot_tolerates_a_torn_line(tmp_path):
  rows = [{"step": s, "split": "train", "loss": 1.0 / s} for s in (1, 2, 3, 4)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "spl')
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]  # the torn line is skipped
  assert [os.path.basename(p) for p in plot_run(str(tmp_path))] == ["loss.png"]
  monitor = Monitor(str(tmp_path), 4, tensorboard=False)
  assert monitor.rewind(2) == 3  # rows 3, 4 and the torn one
  monitor.write(3, "train", {"loss": 0.5})
  monitor.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]



def _tensorboard_scalars(logdir, tag: str) -> list[tuple[int, float]]:
  """``(step, value)`` of ``tag`` as TensorBoard shows it: event files in name order, records in file order,
  and a session-start marker at step s hides the earlier events of steps >= s (TensorBoard's purge rule)."""
  import struct  # pylint: disable=g-import-not-at-top

  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top

  shown: list[tuple[int, float]] = []
  for name in sorted(os.listdir(logdir)):
    data = (pathlib.Path(logdir) / name).read_bytes()
    at = 0
    while at < len(data):  # TFRecord: length u64, its crc u32, the record, its crc u32
      (length,) = struct.unpack("<Q", data[at : at + 8])
      event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
      at += 12 + length + 4
      if event.HasField("session_log") and event.session_log.status == event.session_log.START:
        shown = [(s, v) for s, v in shown if s < event.step]
      shown += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
  return shown


def test_metrics_rewind_hides_the_redone_steps_from_tensorboard_too(tmp_path):
  monitor = Monitor(str(tmp_path), 4)
  for s in (1, 2, 3, 4):
    monitor.write(s, "train", {"loss": float(s)})
  monitor.close()
  resumed = Monitor(str(tmp_path), 4)  # a resumed run: restored at step 2, steps 3 and 4 are redone
  assert resumed.rewind(2) == 2
  resumed.write(3, "train", {"loss": 30.0})
  resumed.close()
  assert _tensorboard_scalars(tmp_path / "tb", "train/loss") == [(1, 1.0), (2, 2.0), (3, 30.0)]
  first, again = sorted(os.listdir(tmp_path / "tb"))  # the first run's file is kept whole (append-only)
  assert again.endswith(".from_step_3")
  (tmp_path / "tb" / again).unlink()
  assert _tensorboard_scalars(tmp_path / "tb", "train/loss") == [(s, float(s)) for s in (1, 2, 3, 4)], first

# ------------------------------------------------------------------ own cases
def test_disk_full_during_a_save_keeps_the_last_checkpoint_and_says_so(saved_run, kd, tmp_path, monkeypatch):
  run = copy_run(saved_run, tmp_path)
  before = tree_of(run / "ckpt")
  from orbax.checkpoint._src.handlers import json_checkpoint_handler

  async def full(self, x, directory):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", full)
  ckpt = Checkpointer(str(run / "ckpt"), every=2, keep=3)
  state, data_state, _ = ckpt.restore(kd, kd.init_state())
  with pytest.raises(CheckpointError, match="could not write checkpoint step 6 .*No space left.*step 4 is the newest"):
    ckpt.save(6, kd, state, data_state, {"kind": "distill"})
  monkeypatch.undo()
  ckpt.close()
  again = Checkpointer(str(run / "ckpt"), read_only=True)
  assert again.intact_step() == 4 and again.all_steps() == [2, 4]
  assert {k: v for k, v in tree_of(run / "ckpt").items() if k.split("/")[0] in ("2", "4")} == before


def test_a_damaged_teacher_cache_is_rebuilt_and_a_damaged_given_teacher_refused(tmp_path, corpus, monkeypatch, caplog):
  cfg = load_config("tiny", tiny_sets(tmp_path, corpus) + [f"run.run_dir={tmp_path / 'run'}"])
  data = jobs.load_data(cfg)
  path = jobs.teacher_dir(cfg, data.tokenizer)
  save_teacher(path, md.init_model(cfg.teacher, seed=0), data.tokenizer)
  flip_bit(biggest_file(pathlib.Path(path) / "params"))
  with pytest.raises(TeacherDamagedError, match="checksum mismatch in params/"):
    load_teacher(path, cfg.teacher, None, data.tokenizer)
  given = load_config("tiny", tiny_sets(tmp_path, corpus) + [f"pretrain.teacher={path}"])
  with pytest.raises(TeacherDamagedError, match="is damaged"):  # a teacher the user named: refused, not rebuilt
    jobs.obtain_teacher(given, data, None)
  rebuilt = []

  def pretrain(cfg, *, data, mesh, out, stream, overwrite):  # stands in for the 20-step pretraining
    rebuilt.append(out)
    save_teacher(out, md.init_model(cfg.teacher, seed=1), data.tokenizer, overwrite=overwrite)

  monkeypatch.setattr(jobs._teacher, "pretrain", pretrain)  # the module obtain_teacher calls it from
  lines = []
  with caplog.at_level(logging.WARNING, logger="meshdistill.jobs"):
    teacher, got = jobs.obtain_teacher(cfg, data, None, report=lines.append)
  assert rebuilt == [path] and got == path and "rebuilding it" in caplog.text
  assert any("cached teacher is damaged (teacher" in x and "checksum mismatch" in x for x in lines)
  assert leaves_equal(nnx.state(teacher), nnx.state(md.init_model(cfg.teacher, seed=1)))


def test_sigterm_writes_a_final_checkpoint_and_exits_143(tmp_path, corpus):
  run = tmp_path / "run"
  cmd = [sys.executable, "-m", "meshdistill", "pretrain", "--config", "tiny", "--out", str(tmp_path / "teacher"),
         *[f"--set={s}" for s in tiny_sets(tmp_path, corpus)], f"--set=run.run_dir={run}", "--set=pretrain.steps=100000"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
  metrics = None
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    found = list(run.glob("teacher-*/metrics.jsonl"))
    if found and found[0].read_text().count("\n") >= 2:
      metrics = found[0]
      break
    time.sleep(0.5)
  assert metrics is not None, proc.communicate()[1][-2000:]
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err[-2000:]
  assert "stopped by SIGTERM after step" in err and "rerun the same command to resume" in err
  stopped_at = int(err.split("stopped by SIGTERM after step ")[1].split(";")[0])
  ckpt = Checkpointer(str(metrics.parent / "checkpoints"), read_only=True)
  assert ckpt.intact_step() == stopped_at >= 2
  assert not (tmp_path / "teacher").exists()  # the run stopped before its end: no teacher was written


# ---- round two: signals, processes, start-up
def _meshdistill(*args) -> list[str]:
  return [sys.executable, "-m", "meshdistill", *args]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_cache_teacher_stops_on_sigterm_with_143_and_a_rerun_finishes_the_same_cache(tmp_path, corpus):
  out = tmp_path / "cache"
  sets = [*tiny_sets(tmp_path, corpus), "pretrain.steps=2", f"run.run_dir={tmp_path / 'run'}", "data.max_chars=8000"]
  # one row per shard: a few hundred shards, so the loop is still writing when the signal comes
  cmd = _meshdistill("cache-teacher", "--config", "tiny", "--out", str(out), "--k", "4", "--rows-per-shard", "1",
                     *[f"--set={s}" for s in sets])
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  first = out / "shard-00000.safetensors"
  deadline = time.time() + 180
  while time.time() < deadline and proc.poll() is None and not first.exists():
    time.sleep(0.02)
  assert first.exists(), proc.communicate()[1][-2000:]
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err[-2000:]
  assert "stopped by SIGTERM after writing" in err and "rerun the same command to resume" in err, err[-2000:]
  assert not (out / "manifest.json").exists()
  progress = json.loads((out / "progress-0.json").read_text())["shards"]
  kept = {name: (out / name).stat().st_mtime_ns for name in progress}
  assert 1 <= len(kept)
  rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  cache = TeacherCache(str(out), verify=True)
  assert len(cache.manifest["shards"]) == cache.manifest["rows"] > len(kept)  # stopped before its end
  assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept  # the finished shards were kept, not redone


def test_launch_forwards_sigterm_and_leaves_no_process_behind(tmp_path):
  sleeper = "import os, time; print(os.getpid(), flush=True); time.sleep(300)"
  proc = subprocess.Popen(_meshdistill("launch", "--processes", "2", "--", sys.executable, "-c", sleeper),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  pids = []
  try:
    while len(pids) < 2:
      line = proc.stdout.readline()
      assert line, "the launcher ended before its processes started"
      if line.startswith("[p") and line.split()[-1].isdigit():
        pids.append(int(line.split()[-1]))
    assert all(_alive(p) for p in pids)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, rest  # the processes were ended by SIGTERM: 128 + 15
    assert "SIGTERM received: forwarded to the processes" in rest
    time.sleep(0.2)
    assert [p for p in pids if _alive(p)] == []
  finally:
    for p in pids:
      if _alive(p):
        os.kill(p, signal.SIGKILL)
    if proc.poll() is None:
      proc.kill()


def test_launch_exits_128_plus_the_signal_of_a_killed_process_and_names_a_missing_command():
  killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
  r = subprocess.run(_meshdistill("launch", "--processes", "2", "--", sys.executable, "-c", killed),
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 137, r.stdout + r.stderr
  assert "was stopped by SIGKILL" in r.stdout and "rerun the same command" in r.stdout
  r = subprocess.run(_meshdistill("launch", "--processes", "2", "--", "no-such-command-here"),
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert "launch cannot start 'no-such-command-here'" in r.stderr


def test_sigint_stops_training_at_a_step_with_a_checkpoint_every_time(tmp_path, corpus):
  """Ctrl-C is a stop request like SIGTERM: it is never lost in a callback (the run would go on) nor raised in
  the middle of a save; each of three interrupted runs saves its step, exits 130, and the next one resumes."""
  run = tmp_path / "run"
  cmd = _meshdistill("pretrain", "--config", "tiny", "--out", str(tmp_path / "teacher"),
                     *[f"--set={s}" for s in tiny_sets(tmp_path, corpus)], f"--set=run.run_dir={run}",
                     "--set=pretrain.steps=100000")
  stopped = []
  for attempt in range(3):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = (stopped[-1] if stopped else 0) + 2 + attempt  # a few more steps than the last run saved
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
      found = list(run.glob("teacher-*/metrics.jsonl"))
      if found and found[0].read_text().count("\n") >= lines:
        break
      time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "stopped by SIGINT after step" in err and "rerun the same command to resume" in err, err[-2000:]
    step = int(err.split("stopped by SIGINT after step ")[1].split(";")[0])
    ckpt = Checkpointer(str(found[0].parent / "checkpoints"), read_only=True)
    assert ckpt.intact_step() == step
    if stopped:
      assert step > stopped[-1] and f"resumed from step {stopped[-1]}" in err, err[-2000:]
    stopped.append(step)
  assert not (tmp_path / "teacher").exists()


def test_plan_shows_an_estimate_then_each_compilation_on_stderr():
  r = subprocess.run(_meshdistill("plan", "--devices", "cpu:8", "--json", "--hbm-gib", "0.5", "--set",
                                  "train.batch_size=8"), capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert json.loads(r.stdout)["fits"] is True
  err = r.stderr
  assert "planning for" in err and "1 compilation(s)" in err, err
  for phase in ("compilation 1 of up to", "lowering the step", "lowered in", "compiled in"):
    assert phase in err, (phase, err)
  assert err.index("planning for") < err.index("lowering the step") < err.index("compiled in")


def test_help_and_import_start_neither_jax_nor_grain():
  probe = ("import sys\nimport meshdistill\nfrom meshdistill.cli import main\n"
           "for argv in (['--help'], ['plot', '--help'], ['distill', '--help'], ['--version']):\n"
           "  try:\n    main(argv)\n  except SystemExit:\n    pass\n"
           "print('LOADED', sorted(m for m in ('jax', 'grain', 'flax', 'numpy') if m in sys.modules))\n")
  r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "LOADED []" in r.stdout, r.stdout[-500:]
  # every public name still resolves, and dir() lists them
  assert set(md.__all__) <= set(dir(md)) and all(getattr(md, n) is not None for n in md.__all__)
  assert md.Distiller.__module__ == "meshdistill.train.distiller" and md.teachers.__name__ == "meshdistill.teachers"


def test_version_flag(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["--version"])
  assert e.value.code == 0 and capsys.readouterr().out.strip() == f"meshdistill {md.__version__}"


def test_verbose_after_the_command_and_defaults_in_help(capsys):
  orbax = logging.getLogger("orbax")
  level = orbax.level
  try:
    for argv in (["config", "--config", "tiny", "-v"], ["-v", "config", "--config", "tiny"]):
      orbax.setLevel(logging.ERROR)
      assert cli.main(argv) == 0 and "teacher:" in capsys.readouterr().out
      assert orbax.level == logging.INFO, argv  # -v took effect (the CLI sets its libraries' loggers)
    assert cli.main(["config", "--config", "tiny"]) == 0 and orbax.level == logging.ERROR
  finally:
    orbax.setLevel(level)
  with pytest.raises(SystemExit):
    cli.main(["generate", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert "tokens to sample after each prompt (default: 64)" in text and "(default: 0)" in text


@pytest.mark.skipif(not __import__("importlib").util.find_spec("libtpu"), reason="libtpu (the tpu extra) not installed")
@pytest.mark.skipif(any(__import__("glob").glob(p) for p in ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")),
                    reason="this machine has an accelerator: JAX is left to choose it")
def test_a_cpu_command_prints_no_libtpu_lines(tmp_path, corpus):
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user's shell: nothing chosen
  r = subprocess.run(_meshdistill("pretrain", "--config", "tiny", "--out", str(tmp_path / "teacher"),
                                  *[f"--set={s}" for s in tiny_sets(tmp_path, corpus)], "--set=pretrain.steps=2",
                                  f"--set=run.run_dir={tmp_path / 'run'}"),
                     capture_output=True, text=True, env=env, timeout=240)
  assert r.returncode == 0, r.stderr[-2000:]
  for noise in ("Failed to find host bounds", "INVALID_ARGUMENT", "TPU_WORKER_HOSTNAMES", "libtpu"):
    assert noise not in r.stderr, r.stderr[-2000:]


# ---- round two: data loss and symlinks
def cli_sets(tmp, corpus, *extra):
  """``--set`` arguments of `tiny_sets` plus ``extra``, with a 2-step teacher and student (whole jobs in seconds)."""
  return [f"--set={s}" for s in (*tiny_sets(tmp, corpus), "pretrain.steps=2", "train.steps=2", *extra)]


def test_r2_distill_refuses_a_run_dir_of_the_users_files_and_keeps_them(tmp_path, corpus, monkeypatch, capsys):
  # 1. a user's config.yaml, metrics.jsonl (a CSV) and summary.json: were overwritten with rc 0
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "config.yaml").write_text("my: settings\n")
  (mine / "metrics.jsonl").write_text("step,loss\n1,0.5\n")
  (mine / "summary.json").write_text('{"mine": true}\n')
  before = tree_of(mine)
  assert cli.main(["distill", "--config", "tiny", *cli_sets(tmp_path, corpus, f"run.run_dir={mine}")]) == 2
  err = capsys.readouterr().err
  assert f"run directory {mine} is not empty and nothing proves meshdistill wrote it" in err
  assert "config.yaml, metrics.jsonl, summary.json" in err and "Choose a new or empty directory" in err
  assert tree_of(mine) == before and sorted(os.listdir(mine)) == ["config.yaml", "metrics.jsonl", "summary.json"]
  # run.run_dir=. in a directory of the user's (its config.yaml was replaced)
  monkeypatch.chdir(mine)
  assert cli.main(["distill", "--config", "tiny", *cli_sets(tmp_path, corpus, "run.run_dir=.")]) == 2
  assert "nothing was changed" in capsys.readouterr().err
  assert tree_of(mine) == before


def test_r2_symlinks_in_a_run_directory_are_refused_never_written_through(tmp_path, corpus, capsys):
  # 2. `ln -s ~/.bashrc RUN/.meshdistill.lock` truncated ~/.bashrc; RUN/summary.json -> FILE overwrote FILE
  precious = tmp_path / "bashrc"
  precious.write_text("export KEEP=1\n")
  run = tmp_path / "run"
  run.mkdir()
  (run / LOCK_FILE).symlink_to(precious)
  with pytest.raises(OutputExistsError, match=f"{run / LOCK_FILE} is a symbolic link"):
    RunLock(str(run)).acquire()  # the lock of a run directory and of pretrain's teacher-<key> directories
  assert precious.read_text() == "export KEEP=1\n"
  (run / LOCK_FILE).unlink()
  write_marker(str(run), "run")  # a run directory of this version: only the link is wrong
  (run / "summary.json").symlink_to(precious)
  assert cli.main(["distill", "--config", "tiny", *cli_sets(tmp_path, corpus, f"run.run_dir={run}")]) == 2
  assert f"{run / 'summary.json'} is a symbolic link (to {precious})" in capsys.readouterr().err
  (run / "summary.json").unlink()
  (run / "metrics.jsonl").symlink_to(precious)
  with pytest.raises(OutputExistsError, match="metrics.jsonl is a symbolic link"):
    Monitor(str(run), 4, tensorboard=False)
  assert precious.read_text() == "export KEEP=1\n"
  assert sorted(os.listdir(run)) == [MARKER, "metrics.jsonl"]  # nothing written beside


def test_r2_overwrite_replaces_only_what_an_owner_marker_proves_ours(tmp_path, corpus, data, capsys):
  # 3. `--overwrite` decided by names: d/params/mine.bin was deleted; a downloaded model was replaced by an export
  d = tmp_path / "d"
  (d / "params").mkdir(parents=True)
  (d / "params" / "mine.bin").write_text("mine")
  assert cli.main(["pretrain", "--config", "tiny", "--out", str(d), "--overwrite", *cli_sets(tmp_path, corpus)]) == 2
  err = capsys.readouterr().err
  assert f"teacher directory {d} is not empty and nothing proves meshdistill wrote it" in err
  assert "params/mine.bin" in err
  assert (d / "params" / "mine.bin").read_text() == "mine" and not (tmp_path / "cache").exists()  # before training
  downloaded = tmp_path / "model"
  shutil.copytree(FIXTURES / "hf_llama", downloaded, ignore=shutil.ignore_patterns("*.npz"))
  before = tree_of(downloaded)
  from meshdistill.jobs.export import check_out_dir

  with pytest.raises(OutputExistsError, match="looks like a downloaded model"):
    check_out_dir(str(downloaded), overwrite=True)  # `meshdistill export RUN model --overwrite`
  with pytest.raises(OutputExistsError, match="looks like a downloaded model"):
    export_hf(load_hf(FIXTURES / "hf_llama"), downloaded, overwrite=True)
  assert tree_of(downloaded) == before
  # a teacher saved by an earlier version (no marker): replaced, as its teacher.json lists every file
  teacher = tmp_path / "teacher"
  save_teacher(str(teacher), md.init_model(STUDENT, seed=3), data.tokenizer)
  (teacher / MARKER).unlink()
  (teacher / "params" / "mine.bin").write_text("mine")  # ... unless a file was added to it
  with pytest.raises(OutputExistsError, match="params/mine.bin is not a file teacher.json lists"):
    save_teacher(str(teacher), md.init_model(STUDENT, seed=4), data.tokenizer, overwrite=True)
  (teacher / "params" / "mine.bin").unlink()
  save_teacher(str(teacher), md.init_model(STUDENT, seed=4), data.tokenizer, overwrite=True)
  assert (teacher / MARKER).is_file()


def test_r2_plot_and_cache_teacher_keep_a_users_files(tmp_path, corpus, capsys):
  # 4. `plot --out DIR` overwrote loss.png; `cache-teacher --out DIR` wrote beside a user's files, checked --out
  # only after pretraining the teacher, and a stray progress-0.json crashed with KeyError: 'settings'
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "split": "train", "loss": 1 / s}) + "\n"
                                             for s in (1, 2, 3)))
  pics = tmp_path / "pics"
  pics.mkdir()
  (pics / "loss.png").write_bytes(b"my picture")
  assert cli.main(["plot", str(run), "--out", str(pics)]) == 2
  assert f"{pics / 'loss.png'} exists and meshdistill did not write it" in capsys.readouterr().err
  assert (pics / "loss.png").read_bytes() == b"my picture" and os.listdir(pics) == ["loss.png"]
  assert cli.main(["plot", str(run), "--out", str(tmp_path / "new")]) == 0  # a directory it makes: redrawn
  assert cli.main(["plot", str(run), "--out", str(tmp_path / "new")]) == 0
  assert (tmp_path / "new" / "loss.png").read_bytes()[:4] == b"\x89PNG"
  out = tmp_path / "out"
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  assert cli.main(["cache-teacher", "--config", "tiny", "--out", str(out), *cli_sets(tmp_path, corpus)]) == 2
  assert "did not write (notes.txt); nothing was changed" in capsys.readouterr().err
  (out / "notes.txt").unlink()
  (out / "progress-0.json").write_text('{"mine": 1}')
  assert cli.main(["cache-teacher", "--config", "tiny", "--out", str(out), *cli_sets(tmp_path, corpus)]) == 2
  assert "progress-0.json is not a teacher cache record" in capsys.readouterr().err
  assert os.listdir(out) == ["progress-0.json"] and not (tmp_path / "cache").exists()  # no teacher pretrained


def test_r2_a_finished_run_refuses_a_changed_training_setting(tmp_path, corpus, capsys):
  # 7. `distill --set distill.alpha=0.7` after the default job: rc 0, nothing trained, config.yaml said alpha 0.7
  run = tmp_path / "run"
  args = ["distill", "--config", "tiny", *cli_sets(tmp_path, corpus, f"run.run_dir={run}")]
  assert cli.main(args) == 0
  capsys.readouterr()
  before = tree_of(run)
  assert cli.main([*args, "--set=distill.alpha=0.7"]) == 2
  err = capsys.readouterr().err
  assert "distill.alpha: trained with 0.5, now 0.7" in err and f"run.run_dir={run}-2" in err
  assert tree_of(run) == before  # config.yaml still says what was trained
  # settings that do not change what is trained: more steps to continue, another log cadence
  assert cli.main([*args, "--set=train.steps=3", "--set=train.log_every=2"]) == 0
  assert json.loads((run / "summary.json").read_text())["step"] == 3
  saved = load_config(str(run / "config.yaml"))
  assert (saved.train.steps, saved.train.log_every, saved.distill.value("alpha")) == (3, 2, 0.5)


def test_r2_modes_honour_the_umask_home_is_expanded_and_interrupted_saves_are_cleaned(
    tmp_path, data, monkeypatch, caplog):
  # misc: 0700 / 0600 outputs whatever the umask; run.run_dir=~/x not expanded; *.orbax-checkpoint-tmp never cleaned
  from meshdistill.config import dump_config
  from meshdistill.jobs._setup import _run_lock

  old = os.umask(0o022)
  try:
    save_teacher(str(tmp_path / "teacher"), md.init_model(STUDENT, seed=3), data.tokenizer)
    cfg = load_config("tiny")
    dump_config(cfg, str(tmp_path / "config.yaml"))
    monitor = Monitor(str(tmp_path), 4, tensorboard=False)
    monitor.write(1, "train", {"loss": 1.0})
    monitor.rewind(0)  # rewritten through a temporary file
    monitor.close()
    from meshdistill.core.fsutil import write_file_atomic
    from meshdistill.teachers.cache import _format
    _format._write_json(str(tmp_path / "manifest.json"), {"k": 1})  # the teacher cache's files
    _format._save_shard(str(tmp_path / "shard.safetensors"), {"x": np.zeros(2, np.float32)})
    write_file_atomic(str(tmp_path / "tokens.npy"), lambda f: np.save(open(f, "wb"), np.zeros(2)))  # data cache
  finally:
    os.umask(old)
  for name in ("manifest.json", "shard.safetensors", "tokens.npy"):
    assert oct((tmp_path / name).stat().st_mode & 0o777) == oct(0o644), name
  assert oct((tmp_path / "teacher").stat().st_mode & 0o777) == oct(0o755)
  assert oct((tmp_path / "config.yaml").stat().st_mode & 0o777) == oct(0o644)
  assert oct((tmp_path / "metrics.jsonl").stat().st_mode & 0o777) == oct(0o644)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert load_config("tiny", ["run.run_dir=~/x"]).run.run_dir == str(tmp_path / "home" / "x")
  run = tmp_path / "run"
  left = run / "checkpoints" / "4.orbax-checkpoint-tmp-1700000000"
  (left / "state").mkdir(parents=True)
  write_marker(str(run), "run")
  with RunLock(str(run)):  # another run holds the directory: its save in progress is not touched
    with pytest.raises(RunLockedError):
      _run_lock(str(run), "distillation run").__enter__()
    assert left.is_dir()
  with caplog.at_level(logging.WARNING, logger="meshdistill.jobs"), _run_lock(str(run), "distillation run"):
    assert not left.exists()
  assert "removing 4.orbax-checkpoint-tmp-1700000000, a checkpoint save that was interrupted" in caplog.text


# ---- round two: silent corruption and named errors
def test_an_empty_checksums_list_is_damage_not_intact(saved_run, kd, tmp_path, caplog):
  run = copy_run(saved_run, tmp_path)
  step4 = run / "ckpt" / "4"
  (step4 / "checksums.json").write_text("{}")  # lists no file: nothing of the step would be checked
  flip_bit(biggest_file(step4 / "state"))
  ckpt = Checkpointer(str(run / "ckpt"), read_only=True)
  assert "checksums.json does not list" in ckpt.verify(4)
  with caplog.at_level(logging.WARNING, logger="meshdistill.storage.checkpoint"):
    state, _, meta = ckpt.restore(kd, kd.init_state())
  assert meta["step"] == 2 and "checkpoint step 4" in caplog.text and "is damaged" in caplog.text
  assert max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(state.params)) < 1e3


def test_an_unverified_step_that_fails_to_restore_falls_back_to_the_older_intact_one(saved_run, kd, data, tmp_path,
                                                                                    caplog):
  run = copy_run(saved_run, tmp_path)
  (run / "ckpt" / "4" / "checksums.json").unlink()  # written before checksums (or killed right after the save)
  big = biggest_file(run / "ckpt" / "4" / "state")
  big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])  # heavier damage: tensorstore cannot read it
  with caplog.at_level(logging.WARNING, logger="meshdistill.storage.checkpoint"):
    _, _, meta = Checkpointer(str(run / "ckpt"), read_only=True).restore(kd, kd.init_state())
  assert meta["step"] == 2 and "checkpoint step 4" in caplog.text and "is damaged (cannot be restored" in caplog.text
  ckpt = Checkpointer(str(run / "ckpt"), every=2, keep=3)  # a resumed run: trains steps 3, 4 again
  try:
    result = fit(kd, data, steps=4, log_every=1, checkpointer=ckpt)
  finally:
    ckpt.close()
  assert result.resumed_from == 2 and [n for n in os.listdir(run / "ckpt") if n.startswith("damaged-4-")]
  assert leaves_equal(result.state.params, saved_run[1].state.params)


@pytest.fixture(scope="module")
def cache_run(corpus, tmp_path_factory):
  """A tiny top-2 teacher cache of the tiny config (4 rows a shard) and the settings that distil from it; its
  teacher is saved where `distill` looks for it, so no pretraining runs."""
  tmp = tmp_path_factory.mktemp("cache_run")
  sets = tiny_sets(tmp, corpus) + ["distill.top_k=2", "distill.temperature=1.0", "train.steps=2"]
  cfg = load_config("tiny", sets)
  data = jobs.load_data(cfg)
  save_teacher(jobs.teacher_dir(cfg, data.tokenizer), md.init_model(cfg.teacher, seed=0), data.tokenizer)
  jobs.cache_teacher(cfg, str(tmp / "tc"), k=2, precision="float32", rows_per_shard=4)
  return tmp, sets


def test_distill_from_a_teacher_cache_with_overwritten_log_probs_is_refused_naming_the_shard(cache_run, tmp_path,
                                                                                             capsys):
  from safetensors.numpy import load_file, save_file

  cache = tmp_path / "tc"
  shutil.copytree(cache_run[0] / "tc", cache)
  for shard in sorted(cache.glob("shard-*.safetensors")):  # every shard's log-probs replaced (sizes unchanged)
    arrays = load_file(shard)
    save_file({**arrays, "logprobs": np.full_like(arrays["logprobs"], -0.5)}, shard, metadata={"format": "1"})
  sets = cache_run[1] + [f"teacher.cache={cache}", f"run.run_dir={tmp_path / 'run'}"]
  assert cli.main(["distill", "--config", "tiny", *[f"--set={s}" for s in sets]]) == 2
  err = capsys.readouterr().err
  named = f"teacher cache shard shard-\\d+.safetensors in {re.escape(str(cache))} does not match its SHA-256"
  assert re.search(named, err)  # the first shard read (rows are shuffled), before any step trains on it
  assert "nothing was trained on it" in err and "meshdistill cache-teacher" in err
  assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("damage", ["absolute shard name", "shard name with ..", "not JSON", "no shards"])
def test_a_teacher_cache_manifest_that_escapes_or_is_malformed_is_refused_naming_it(damage, cache_run, tmp_path):
  from meshdistill.teachers import cache as tc

  cache = tmp_path / "tc"
  shutil.copytree(cache_run[0] / "tc", cache)
  outside = tmp_path / "outside.safetensors"  # what an escaping name would open
  shutil.copyfile(cache / "shard-00000.safetensors", outside)
  manifest = json.loads((cache / tc.MANIFEST).read_text())
  want = "not a file name inside"
  if damage == "absolute shard name":
    manifest["shards"][0]["name"] = str(outside)
  elif damage == "shard name with ..":
    manifest["shards"][0]["name"] = "../outside.safetensors"
  elif damage == "no shards":
    del manifest["shards"]
    want = "has no 'shards' entry"
  (cache / tc.MANIFEST).write_text("{not json" if damage == "not JSON" else json.dumps(manifest))
  want = "cannot be read as JSON" if damage == "not JSON" else want
  with pytest.raises(tc.CacheError, match=f"{want}.*cache-teacher"):
    tc.TeacherCache(str(cache))


def test_a_binary_or_directory_config_is_an_error_naming_the_file(tmp_path, capsys):
  binary = tmp_path / "weights.yaml"
  binary.write_bytes(bytes(range(128, 256)) * 4)  # not UTF-8
  (tmp_path / "configs.d").mkdir()
  for path, want in ((binary, "is not UTF-8 text"), (tmp_path / "configs.d", "is a directory")):
    assert cli.main(["distill", "--config", str(path)]) == 2
    assert f"config {path} {want}" in capsys.readouterr().err


def test_non_utf8_jsonl_data_and_prompts_files_are_errors_naming_file_and_line(tmp_path):
  from meshdistill.data.prompts import read_prompts

  data_file, prompts_file = tmp_path / "data.jsonl", tmp_path / "prompts.jsonl"
  data_file.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')  # latin-1, not UTF-8
  prompts_file.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n')
  with pytest.raises(ValueError, match=f"data.source: {re.escape(str(data_file))}:2 is not UTF-8 text"):
    build_data(DataConfig(source=str(data_file), seq_len=16), batch_size=8)
  with pytest.raises(ValueError, match=f"prompts file '{re.escape(str(prompts_file))}' is not UTF-8 text \\(line 2"):
    read_prompts(str(prompts_file), need_completion=True)


def test_a_vanishing_distill_temperature_is_refused_naming_the_setting_and_what_works():
  with pytest.raises(ConfigError, match=r"distill.temperature=1e-30 must be >= 0.01 \(e.g. 2.0; below 0.01"):
    load_config("tiny", ["distill.temperature=1e-30"])
  with pytest.raises(ConfigError, match=r"takes values in \[0.001, 3.0\]\) must be >= 0.01"):  # a schedule too
    load_config("tiny", ["distill.temperature={kind: linear, start: 3.0, end: 0.001, steps: 10}"])
  assert load_config("tiny", ["distill.temperature=0.01"]).distill.temperature == 0.01


def test_a_guard_that_gives_up_before_any_checkpoint_does_not_claim_one_is_kept(kd, data, tmp_path):
  d = kd._variant(loss_scale=1e38)  # every update overflows: the guard gives up at step 2, before the first checkpoint
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every=100)
  guard = DivergenceGuard(max_skips=2, max_restores=0, min_history=2)
  with pytest.raises(RuntimeError, match="max_restores") as e:
    fit(d, data, steps=6, checkpointer=ckpt, guard=guard, fallback=d.strategy)
  ckpt.close()
  assert "no checkpoint was written before it diverged" in str(e.value) and "checkpoint is kept" not in str(e.value)
  assert ckpt.all_steps() == []


def test_generate_names_the_step_it_fell_back_to(cache_run, tmp_path, capsys):
  import io

  from meshdistill.models.generate import SamplingConfig

  run = tmp_path / "run"
  sets = cache_run[1] + [f"run.run_dir={run}", "train.steps=4", "checkpoint.every=2", "checkpoint.keep=2"]
  assert cli.main(["distill", "--config", "tiny", *[f"--set={s}" for s in sets]]) == 0
  flip_bit(biggest_file(run / "checkpoints" / "4" / "state"))
  said = io.StringIO()
  out = jobs.generate(load_config("tiny", sets), ["ab"], sampling=SamplingConfig(max_new_tokens=2), stream=said)
  assert len(out) == 1 and "(step 2)" in said.getvalue() and "(step 4)" not in said.getvalue()


def test_a_sharded_model_in_the_hugging_face_hub_cache_layout_loads_and_an_escaping_name_stays_refused(tmp_path):
  import hashlib

  repo = tmp_path / "models--tiny--llama"
  snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
  snapshot.mkdir(parents=True)
  blobs.mkdir()
  for f in sorted((FIXTURES / "hf_llama").iterdir()):  # each file a blob, linked from the snapshot as the hub does
    blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
    shutil.copyfile(f, blob)
    (snapshot / f.name).symlink_to(pathlib.Path("../..") / "blobs" / blob.name)
  got = load_hf(snapshot)
  assert leaves_equal(nnx.state(got, nnx.Param), nnx.state(load_hf(FIXTURES / "hf_llama"), nnx.Param))
  index = json.loads((snapshot / "model.safetensors.index.json").read_text())
  name = next(iter(index["weight_map"]))
  index["weight_map"][name] = os.readlink(snapshot / index["weight_map"][name])  # its blob: named outside the dir
  (snapshot / "model.safetensors.index.json").unlink()
  (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match="points outside"):
    load_hf(snapshot)


def test_a_restore_that_runs_out_of_memory_keeps_the_step_instead_of_calling_it_damaged(saved_run, kd, tmp_path,
                                                                                         monkeypatch):
  # noticed after round two: any exception of a verified step's restore (e.g. out of memory) made it "damaged",
  # so the loop fell back to an older step and a resume moved the newest one aside
  run = copy_run(saved_run, tmp_path)
  ckpt = Checkpointer(str(run / "ckpt"), every=2, keep=3)
  real = ckpt._mgr.restore
  monkeypatch.setattr(ckpt._mgr, "restore", lambda *a, **k: (_ for _ in ()).throw(
      MemoryError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB")))
  with pytest.raises(CheckpointError, match="step 4 .* verified but could not be restored on this machine"):
    ckpt.restore(kd, kd.init_state())
  assert sorted(p.name for p in (run / "ckpt").iterdir() if not p.name.startswith(".")) == ["2", "4"]
  monkeypatch.setattr(ckpt._mgr, "restore", real)
  ckpt.restore(kd, kd.init_state())
  assert ckpt.restored_step == 4
  ckpt.close()
