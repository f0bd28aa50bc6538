"""Run configuration: YAML + overrides -> typed dataclasses; every bad key or value is named."""

import dataclasses
import os
import subprocess
import sys

import jax
import pytest
import yaml

from meshdistill import cli
from meshdistill.config import Config, ConfigError, config_path, dump_config, load_config
from meshdistill.config.files import default_yaml
from meshdistill.models import abstract_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_default_yaml_equals_the_dataclass_defaults():
  assert load_config("default") == Config()
  assert load_config(None) == Config()


def test_packaged_default_yaml_is_generated_from_the_dataclass_defaults():
  with open(config_path("default"), encoding="utf-8") as f:
    text = f.read()
  assert text == default_yaml(Config().to_dict()), "run: python scripts/write_default_config.py"
  assert yaml.safe_load(text) == Config().to_dict()  # every setting spelled out, none left to the defaults
  # the script's check mode agrees
  script = os.path.join(REPO, "scripts", "write_default_config.py")
  assert subprocess.run([sys.executable, script, "--check"], capture_output=True).returncode == 0


def test_repository_configs_named_like_packaged_ones_are_links_to_them_not_copies():
  packaged = os.path.dirname(config_path("default"))
  linked = []
  for name in sorted(os.listdir(os.path.join(REPO, "configs"))):
    if os.path.exists(os.path.join(packaged, name)):
      assert os.path.realpath(os.path.join(REPO, "configs", name)) == os.path.realpath(os.path.join(packaged, name))
      linked.append(name)
  assert {"default.yaml", "tiny.yaml"} <= set(linked)  # README: --config configs/tiny.yaml


def test_main_job_is_a_2x4_mesh_with_student_under_30_percent_of_teacher():
  cfg = Config()
  assert (cfg.mesh.data, cfg.mesh.tensor) == ("auto", "auto")  # the devices present: 2x4 without an accelerator
  mesh = cfg.mesh.resolved(None)
  assert (mesh.data, mesh.tensor) == (2, 4)

  def count(model_cfg):  # parameter count from abstract shapes, nothing allocated
    return sum(x.size for x in jax.tree.leaves(abstract_params(model_cfg)[1]))

  assert count(cfg.student) <= 0.30 * count(cfg.teacher)


def test_partial_yaml_keeps_the_other_defaults(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("train: {steps: 70}\nteacher: {d_model: 64}\n")
  cfg = load_config(str(path))
  assert cfg.train.steps == 70 and cfg.train.batch_size == Config().train.batch_size
  assert cfg.teacher.d_model == 64 and cfg.teacher.vocab_size == Config().teacher.vocab_size


def test_overrides_are_parsed_as_yaml():
  cfg = load_config(
    None,
    [
      "train.steps=200",
      "distill.alpha=0.7",
      "mesh.simulate_cpu_devices=false",
      "distill.temperature={kind: linear, start: 3, end: 1, steps: 500}",
      "data.max_chars=null",
    ],
  )
  assert cfg.train.steps == 200 and cfg.distill.alpha == 0.7
  assert cfg.mesh.simulate_cpu_devices is False
  assert cfg.distill.temperature == {"kind": "linear", "start": 3, "end": 1, "steps": 500}
  assert cfg.data.max_chars is None
  assert isinstance(load_config(None, ["train.lr=1"]).train.lr, float)


def test_config_round_trips_through_yaml(tmp_path):
  cfg = load_config("tiny", ["distill.alpha=0.25"])
  dump_config(cfg, str(tmp_path / "c.yaml"))
  assert load_config(str(tmp_path / "c.yaml")) == cfg


@pytest.mark.parametrize(
  "override, named, hint",
  [
    ("train.stepz=5", "train.stepz", "did you mean 'train.steps'"),
    ("trian.steps=5", "trian", "did you mean 'train'"),
    ("teacher.dmodel=64", "teacher.dmodel", "'d_model'"),
    ("distill.tau=2", "distill.tau", "temperature"),
  ],
)
def test_unknown_key_names_the_dotted_key_and_the_valid_keys(override, named, hint):
  with pytest.raises(ConfigError) as e:
    load_config(None, [override])
  msg = str(e.value)
  assert f"unknown key '{named}'" in msg and hint in msg and "valid keys" in msg


@pytest.mark.parametrize(
  "override, named, allowed",
  [
    ("train.steps=many", "train.steps", "expected int"),
    ("train.steps=0", "train.steps", "positive integer"),
    ("train.lr=-0.1", "train.lr", "(0.0, 1.0]"),
    ("distill.alpha=1.5", "distill.alpha", "[0"),
    ("distill.temperature=0", "distill.temperature", ">= 0.01"),
    ("distill.divergence=kl2", "distill.divergence", "forward_kl"),
    ("distill.chunk_size=-4", "distill.chunk_size", "non-negative integer"),
    ("mesh.backend=tpu", "mesh.backend", "shard_map"),
    ("mesh.data=0", "mesh.data", "positive integer"),
    ("mesh.simulate_cpu_devices=maybe", "mesh.simulate_cpu_devices", "auto"),
    ("teacher.d_model=-1", "teacher.d_model", "positive integer"),
    ("student.n_heads=3", "student.n_heads", "n_kv_heads"),
    ("data.val_fraction=2", "data.val_fraction", "[0, 1)"),
    ("checkpoint.keep=0", "checkpoint.keep", "positive integer"),
    ("train.batch_size=7", "train.batch_size", "mesh.data"),
    ("data.seq_len=512", "max_len", "data.seq_len"),
    ("student.vocab_size=300", "student.vocab_size", "teacher.vocab_size"),
  ],
)
def test_bad_value_names_the_key_and_what_is_allowed(override, named, allowed):
  with pytest.raises(ConfigError) as e:
    load_config(None, [override])
  msg = str(e.value)
  assert named in msg and allowed in msg, msg


def test_section_given_a_scalar_is_an_error():
  with pytest.raises(ConfigError, match="'train' must be a mapping"):
    load_config(None, ["train=5"])


def test_malformed_override_is_an_error():
  with pytest.raises(ConfigError, match="key.path=value"):
    load_config(None, ["train.steps"])


def test_unknown_config_name_lists_packaged_configs():
  with pytest.raises(FileNotFoundError, match="default"):
    load_config("no-such-config")


def test_yaml_with_unknown_section_fails(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump({"trainer": {"steps": 3}}))
  with pytest.raises(ConfigError, match="unknown key 'trainer'"):
    load_config(str(path))


def test_cli_reports_a_bad_key_before_any_work(capsys):
  assert cli.main(["distill", "--set", "train.stepz=3"]) == 2
  err = capsys.readouterr().err
  assert "train.stepz" in err and "did you mean 'train.steps'" in err


def test_cli_config_prints_the_effective_settings(capsys):
  assert cli.main(["config", "--set", "train.steps=42"]) == 0
  printed = yaml.safe_load(capsys.readouterr().out)
  assert printed["train"]["steps"] == 42
  assert printed == dataclasses.replace(Config(), train=load_config(None, ["train.steps=42"]).train).to_dict()


def test_freezing_schedule_is_checked_against_the_student():
  stages = "[{start_step: 0, freeze: 0.5, lr: 0.003}, {start_step: 100, freeze: [0], lr: 0.001}]"
  cfg = load_config(None, [f"train.freeze={stages}"])
  got = cfg.train.stages()
  assert [s.start_step for s in got] == [0, 100] and got[1].freeze == (0,)
  with pytest.raises(ConfigError, match=r"train.freeze\[0\].*start_step"):
    load_config(None, ["train.freeze=[{start_step: 0, lr: 0.1, frezee: 0.5}]"])
  with pytest.raises(ConfigError, match=r"train.freeze\[0\].*lr"):
    load_config(None, ["train.freeze=[{start_step: 0, lr: -1}]"])
  with pytest.raises(ConfigError, match=r"train.freeze: .*n_layers=4"):
    load_config(None, ["train.freeze=[{start_step: 0, freeze: [7], lr: 0.1}]"])


def test_teacher_cache_key_counts_a_pretrain_freezing_schedule():
  from meshdistill.jobs import teacher_key  # pylint: disable=g-import-not-at-top

  class Tokenizer:
    fingerprint = "bytes"

  plain = teacher_key(load_config(None), Tokenizer())
  frozen = teacher_key(load_config(None, ["pretrain.freeze=[{start_step: 0, freeze: [0], lr: 0.003}]"]), Tokenizer())
  assert plain == teacher_key(load_config(None), Tokenizer()) and frozen != plain


def test_cli_rejects_a_bad_profile_window_before_any_work(capsys):
  assert cli.main(["distill", "--profile", "5"]) == 2
  assert "START:STOP" in capsys.readouterr().err


def test_chunk_size_selects_the_chunked_loss_with_the_same_recipe():
  from meshdistill.strategies import ChunkedLogitKD, LogitKD

  plain = load_config("tiny").distill.strategy()
  chunked = load_config("tiny", ["distill.chunk_size=16"]).distill.strategy()
  assert isinstance(plain, LogitKD) and isinstance(chunked, ChunkedLogitKD) and chunked.chunk_size == 16
  assert (chunked.temperature, chunked.alpha, chunked.divergence) == (plain.temperature, plain.alpha, plain.divergence)
  with pytest.raises(ConfigError, match="distill.chunk_size=16 and distill.top_k=8 exclude each other"):
    load_config("tiny", ["distill.chunk_size=16", "distill.top_k=8"])


def test_distill_kind_names_a_registered_strategy_with_options():
  from meshdistill.strategies import AttentionTransfer, LogitKD

  kd = load_config("tiny", ["distill.divergence=jsd", "distill.options={beta: 0.3}"]).distill.strategy()
  assert kd == LogitKD(temperature=2.0, alpha=0.5, divergence="jsd", beta=0.3)
  attn = load_config(None, ["distill.kind=attention_transfer", "distill.options={loss: mse}"]).distill.strategy()
  assert attn == AttentionTransfer(loss="mse")
  for sets, match in [
      (["distill.kind=logit_kdd"], r"distill.kind='logit_kdd' is not a registered strategy; choose one of \[.*'logit_kd'"),
      (["distill.options={bta: 0.3}"], r"distill.options.bta=0.3 is not a setting of LogitKD .*its settings: .*'beta'"),
      (["distill.divergence=jsd", "distill.options={beta: 1.5}"], r"distill.options.beta=1.5 must be in \[0.0, 1.0\]"),
      (["distill.kind=attention_transfer", "distill.options={loss: l1}"], r"distill.options.loss='l1'; choose one of"),
  ]:
    with pytest.raises(ConfigError, match=match):
      load_config(None, sets)


def test_a_setting_the_chosen_strategy_does_not_have_is_named_with_the_settings_it_has():
  from meshdistill.strategies import AttentionTransfer

  sets = ["distill.kind=attention_transfer", "distill.temperature=7.5", "distill.divergence=jsd", "distill.top_k=3"]
  with pytest.raises(ConfigError) as e:
    load_config("tiny", sets)
  msg = str(e.value)
  for key in ("distill.temperature=7.5", "distill.divergence='jsd'", "distill.top_k=3"):
    assert key in msg, msg
  assert "AttentionTransfer" in msg and all(f"'{name}'" in msg for name in AttentionTransfer.settings()), msg
  with pytest.raises(ConfigError, match=r"distill.options.beta=0.3 is not a setting of AttentionTransfer"):
    load_config(None, ["distill.kind=attention_transfer", "distill.options={beta: 0.3}"])
  with pytest.raises(ConfigError, match=r"distill.top_k=8 is not a setting of ChunkedLogitKD .*'chunk_size'"):
    load_config(None, ["distill.kind=chunked_logit_kd", "distill.top_k=8"])
  # naming a kind starts from that strategy's defaults: the main job's logit_kd settings do not follow
  assert load_config(None, ["distill.kind=attention_transfer"]).distill.strategy() == AttentionTransfer()
  assert load_config("tiny", ["distill.kind=attention_transfer"]).distill.strategy() == AttentionTransfer()


def test_the_config_and_the_api_share_the_strategies_defaults():
  from meshdistill.strategies import ChunkedLogitKD, LogitKD

  assert load_config("tiny").distill.strategy() == LogitKD()  # tiny names the kind: LogitKD's own defaults
  assert load_config(None, ["distill.kind=logit_kd"]).distill.strategy() == LogitKD()
  assert load_config(None, ["distill.kind=chunked_logit_kd"]).distill.strategy() == ChunkedLogitKD()
  # the main job states its recipe (temperature 1.0, alpha 1.0) and keeps it under other overrides
  main = LogitKD(temperature=1.0, alpha=1.0, divergence="forward_kl")
  assert Config().distill.strategy() == main == load_config("default").distill.strategy()
  assert load_config(None, ["distill.alpha=0.7"]).distill.strategy() == LogitKD(temperature=1.0, alpha=0.7)
  assert load_config("tiny").distill.value("temperature") == LogitKD().temperature == 2.0

  for path in ("configs/hf_example.yaml", "configs/preference.yaml"):  # the shipped configs still load
    assert load_config(os.path.join(REPO, path)).distill.strategy() is not None


def test_the_config_package_lists_exactly_the_names_its_loader_exports():
  # `meshdistill.config` resolves its names lazily from its `__all__`, the one list: every name there is the loader's
  # object, and every public class or function the loader defines or gathers from `sections` is listed
  import inspect

  import meshdistill.config as config_pkg
  from meshdistill.config import _config, sections

  assert all(getattr(config_pkg, name) is getattr(_config, name) for name in config_pkg.__all__)
  settings = {n for n, v in vars(sections).items() if inspect.isclass(v) and n.endswith("Settings")
              and v.__module__ == sections.__name__ and hasattr(_config, n)}
  own = {n for n, v in vars(_config).items() if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
         and v.__module__ == _config.__name__}
  assert settings | own <= set(config_pkg.__all__), sorted((settings | own) - set(config_pkg.__all__))


def test_train_mu_dtype_sets_adamws_first_moment_and_refuses_other_dtypes():
  import jax.numpy as jnp
  import optax

  from meshdistill.train.optimizers import make_optimizer

  params = {"w": jnp.ones((4, 3), jnp.float32)}
  for name, want in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
    settings = load_config(None, [f"train.mu_dtype={name}"]).train
    state = make_optimizer(settings).init(params)
    mus = [s.mu["w"].dtype for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
           if isinstance(s, optax.ScaleByAdamState)]
    nus = [s.nu["w"].dtype for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
           if isinstance(s, optax.ScaleByAdamState)]
    assert mus == [want] and nus == [jnp.float32], (name, mus, nus)
  with pytest.raises(ConfigError, match=r"train.mu_dtype='float16'.*bfloat16"):
    load_config(None, ["train.mu_dtype=float16"])
