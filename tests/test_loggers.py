"""``run.loggers``: TensorBoard by default, Weights & Biases as an option (offline here: ``WANDB_MODE=offline``), the
run's config, metrics rows and final summary logged, a resumed run logging into the same W&B run."""

import importlib.util
import pathlib
import sys

import pytest
from flax import nnx

import meshdistill as md
from meshdistill import jobs
from meshdistill.config import ConfigError, load_config
from meshdistill.teachers.checkpoint import save_teacher
from meshdistill.train.loop.loggers import WANDB_ID_FILE
from meshdistill.train.loop.monitor import Monitor

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
needs_wandb = pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (pip install 'meshdistill[wandb]')")


def test_run_loggers_default_to_tensorboard_and_refuse_what_they_do_not_know():
  assert load_config("tiny").run.loggers == ("tensorboard",)
  assert load_config("tiny", ["run.loggers=[tensorboard, wandb]"]).run.loggers == ("tensorboard", "wandb")
  assert load_config("tiny", ["run.loggers=[]"]).run.loggers == ()
  with pytest.raises(ConfigError, match=r"run.loggers=\['mlflow'\]: 'mlflow' is not a logger; choose from"):
    load_config("tiny", ["run.loggers=[mlflow]"])
  with pytest.raises(ConfigError, match="names a logger twice"):
    load_config("tiny", ["run.loggers=[wandb, wandb]"])
  with pytest.raises(ConfigError, match=r"run.loggers='wandb' has the wrong type"):
    load_config("tiny", ["run.loggers=wandb"])


def test_wandb_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
  with pytest.raises(ConfigError, match=r"wandb package is not installed: pip install 'meshdistill\[wandb\]'"):
    Monitor(str(tmp_path), 4, loggers=("tensorboard", "wandb"))


@pytest.fixture()
def wandb_spy(monkeypatch, tmp_path):
  """W&B offline, with what reaches it recorded: each ``wandb.init``'s id and config, each logged row, each summary
  key set."""
  import wandb
  from wandb.sdk import wandb_run, wandb_summary

  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
  seen = {"inits": [], "rows": [], "summary": {}}
  init, log, setitem = wandb.init, wandb_run.Run.log, wandb_summary.Summary.__setitem__

  def spy_init(**kw):
    run = init(**kw)
    seen["inits"].append({"id": run.id, "config": dict(run.config), "dir": kw["dir"]})
    return run

  def spy_log(self, data, step=None, **kw):
    seen["rows"].append((step, dict(data)))
    return log(self, data, step=step, **kw)

  def spy_setitem(self, key, value):
    seen["summary"][key] = value
    return setitem(self, key, value)

  monkeypatch.setattr(wandb, "init", spy_init)
  monkeypatch.setattr(wandb_run.Run, "log", spy_log)
  monkeypatch.setattr(wandb_summary.Summary, "__setitem__", spy_setitem)
  return seen


@needs_wandb
def test_a_distill_run_logs_config_rows_and_summary_to_wandb_and_resumes_the_same_run(tmp_path, wandb_spy):
  sets = ["data.max_chars=20000", "data.seq_len=16", "teacher.max_len=16", "student.max_len=16", "train.batch_size=4",
          "train.steps=2", "train.warmup=0", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
          "checkpoint.every=0", "mesh.backend=single", "mesh.data=1", "mesh.tensor=1",
          f"pretrain.cache_dir={tmp_path / 'cache'}", f"run.run_dir={tmp_path / 'run'}",
          "run.loggers=[tensorboard, wandb]"]
  plain = load_config("tiny", sets)
  graphdef, params = nnx.split(md.init_model(plain.teacher, seed=0))
  teacher = save_teacher(str(tmp_path / "teacher"), nnx.merge(graphdef, params), jobs.load_data(plain).tokenizer)
  cfg = load_config("tiny", [*sets, f"pretrain.teacher={teacher}"])
  summary = jobs.distill(cfg)

  (first,) = wandb_spy["inits"]
  run = pathlib.Path(tmp_path / "run")
  assert (run / WANDB_ID_FILE).read_text().strip() == first["id"] and first["dir"] == str(run)
  assert first["config"]["train"]["steps"] == 2 and first["config"]["run"]["loggers"] == ["tensorboard", "wandb"]
  steps = {step for step, _ in wandb_spy["rows"]}
  assert steps == {1, 2} and any("val/loss" in row for _, row in wandb_spy["rows"])
  assert all(k.startswith(("train/", "val/")) for _, row in wandb_spy["rows"] for k in row)
  assert wandb_spy["summary"]["student/loss"] == pytest.approx(summary["student"]["loss"])
  assert wandb_spy["summary"]["step"] == 2 and (run / "tb").is_dir()  # TensorBoard too

  again = load_config("tiny", [*sets, f"pretrain.teacher={teacher}", "train.steps=3"])
  jobs.distill(again)  # resumes from step 2's checkpoint
  assert [i["id"] for i in wandb_spy["inits"]] == [first["id"]] * 2
  assert max(step for step, _ in wandb_spy["rows"]) == 3 and wandb_spy["summary"]["step"] == 3
  offline = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
  assert len(offline) == 2 and all(name.split("-", 3)[-1].startswith(first["id"]) for name in offline)
