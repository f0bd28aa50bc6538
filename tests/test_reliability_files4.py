"""Reliability, round four, files and settings (`benchmarks/results/reliability.md`, items 2, 3, 4, 6, 7 and 16):
checkpoint steps the run did not write, duplicated YAML keys and alias bombs, several teachers' weights, what
`md.load_run` gives for a quantization-aware run, and owner markers that prove nothing."""

import json
import os
import shutil

import numpy as np
import pytest
from test_reliability import cli_sets, corpus, data, kd, tree_of  # noqa: F401 -- fixtures and helpers shared

import meshdistill as md
from meshdistill import cli
from meshdistill.config import ConfigError, load_config
from meshdistill.core.ownership import MARKER, MARKER_FIELDS, MarkerError, check_owned, read_marker, write_marker
from meshdistill.storage.checkpoint import Checkpointer, CheckpointError
from meshdistill.train.loop.trainer import fit


# ----------------------------------------------------------------------------- item 2: steps the run did not write
def _saved(kd, directory, steps):
  """A checkpoint directory holding ``steps`` (the untrained state; ``meta`` records each step number)."""
  ckpt = Checkpointer(str(directory), every=0, keep=len(steps))
  for s in steps:
    ckpt.save(s, kd, kd.init_state(), {"next_batch": s}, {"kind": "distill"})
  ckpt.close()
  return directory


def _refused_everywhere(kd, data, ckpt_dir, says):
  """Every reader of ``ckpt_dir`` (resume, eval's restore, load_run's student, meta) refuses, naming ``says``;
  nothing in the directory moves."""
  before = sorted(os.listdir(ckpt_dir))
  reader = Checkpointer(str(ckpt_dir), read_only=True)
  for read in (reader.intact_step, lambda: reader.restore(kd, kd.init_state()), reader.read_meta,
               lambda: reader.restore_student(kd.student_cfg, None), lambda: reader.read_meta(6)):
    with pytest.raises(CheckpointError, match=says):
      read()
  reader.close()
  resumed = Checkpointer(str(ckpt_dir), every=2, keep=3)  # a resuming run
  try:
    with pytest.raises(CheckpointError, match=says):
      fit(kd, data, steps=10, checkpointer=resumed)
  finally:
    resumed.close()
  assert sorted(os.listdir(ckpt_dir)) == before  # nothing restored, moved aside or saved


def test_r4_a_symlinked_checkpoint_step_is_refused_naming_it(kd, data, tmp_path):
  """Item 2: `checkpoints/6 -> another run's step 8` was resumed from ("resumed from step 8")."""
  other = _saved(kd, tmp_path / "other", [8])
  mine = _saved(kd, tmp_path / "mine", [2])
  (mine / "6").symlink_to(other / "8")
  _refused_everywhere(kd, data, mine, f"{mine / '6'} is a symbolic link \\(to {other / '8'}\\)")
  assert os.path.islink(mine / "6") and sorted(os.listdir(other)) == ["8"]  # the other run is untouched


def test_r4_a_link_inside_a_step_is_refused_naming_it(kd, data, tmp_path):
  other = _saved(kd, tmp_path / "other", [6])
  mine = _saved(kd, tmp_path / "mine", [2, 6])
  meta = mine / "6" / "meta" / "metadata"
  meta.unlink()
  meta.symlink_to(other / "6" / "meta" / "metadata")
  _refused_everywhere(kd, data, mine, f"{meta} is a symbolic link")


def test_r4_a_step_copied_in_under_another_number_is_refused_naming_it(kd, data, tmp_path):
  other = _saved(kd, tmp_path / "other", [8])
  mine = _saved(kd, tmp_path / "mine", [2])
  shutil.copytree(other / "8", mine / "6")  # checksums intact: only its meta says it is step 8
  _refused_everywhere(kd, data, mine, f"{mine / '6' / 'meta' / 'metadata'} records step 8")


def test_r4_steps_the_run_wrote_still_resume(kd, tmp_path):
  mine = _saved(kd, tmp_path / "mine", [2, 4])
  reader = Checkpointer(str(mine), read_only=True)
  assert reader.intact_step() == 4 and reader.read_meta()["step"] == 4 and reader.read_meta(2)["step"] == 2
  reader.close()


# ----------------------------------------------------------------------------- items 3 and 16: YAML
def _config_file(tmp_path, text):
  path = tmp_path / "run.yaml"
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("text,says", [
    ("train:\n  steps: 5\nrun:\n  run_dir: runs/x\ntrain:\n  lr: 0.1\n",
     r"key 'train' is given twice, at line 1 and at line 5: .* drop the whole first section"),
    ("train:\n  steps: 5\n  lr: 0.1\n  steps: 7\n", r"key 'train.steps' is given twice, at line 2 and at line 4"),
    ("train:\n  freeze:\n    - {start_step: 0, lr: 1.0, lr: 2.0}\n",
     r"key 'train.freeze\[0\].lr' is given twice, at line 3, column 23 and at line 3, column 32"),
    ("distill:\n  options:\n    beta: 0.1\n    beta: 0.9\n", r"key 'distill.options.beta' is given twice"),
], ids=["section", "key", "in-a-list", "free-mapping"])
def test_r4_a_key_given_twice_is_refused_naming_both_lines(tmp_path, text, says):
  """Item 3: a second `train:` silently replaced the whole first one; every level is checked."""
  path = _config_file(tmp_path, text)
  with pytest.raises(ConfigError, match=f"config {path}: {says}"):
    load_config(path, [])


def test_r4_a_key_given_twice_in_a_set_value_or_from_the_command_is_refused(tmp_path, capsys):
  with pytest.raises(ConfigError, match=r"override 'distill.options=\{beta: 1, beta: 2\}': key 'beta' is given twice"):
    load_config("tiny", ["distill.options={beta: 1, beta: 2}"])
  path = _config_file(tmp_path, "train:\n  steps: 5\ntrain:\n  steps: 6\n")
  assert cli.main(["config", "--config", path]) == 2
  assert "key 'train' is given twice, at line 1 and at line 3" in capsys.readouterr().err


def test_r4_merge_keys_and_plain_aliases_still_load(tmp_path):
  """A merge key is not a duplicate (the keys beside it win, as YAML says); aliases that stay small expand."""
  path = _config_file(tmp_path, "pretrain: &base {lr: 0.01, warmup: 3}\ntrain:\n  <<: *base\n  warmup: 5\n"
                                "data:\n  corpora: {python: &src /data/py, more: *src}\n")
  cfg = load_config(path, [])
  assert (cfg.train.lr, cfg.train.warmup, cfg.pretrain.warmup) == (0.01, 5, 3)
  assert cfg.data.corpora == {"python": "/data/py", "more": "/data/py"}


def _laughs(levels: int) -> str:
  """A "billion laughs" document: each level 9 aliases of the one before (9 ** levels values), as train.steps."""
  lines = ["distill:", "  options:", '    l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
  lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
  return "\n".join(lines) + f"\ntrain:\n  steps: *l{levels - 1}\n"


def test_r4_an_alias_bomb_is_refused_with_a_named_error_at_once(tmp_path, capsys):
  """Item 16: 9 levels of 9 aliases (9.3e8 values expanded) ended in a MemoryError after 46 s; 7 levels (1.1e7) put
  a 39 MB repr in the error. Alias expansion is bounded (100,000 added values), checked before anything is built."""
  path = _config_file(tmp_path, _laughs(9))
  with pytest.raises(ConfigError, match=r"aliases \(\*name\) expand [\d,]+ written values to [\d,]+ .*billion") as e:
    load_config(path, [])
  assert len(str(e.value)) < 600
  assert cli.main(["config", "--config", _config_file(tmp_path, _laughs(7))]) == 2
  err = capsys.readouterr().err
  assert "billion laughs" in err and len(err) < 600 and "Traceback" not in err
  with pytest.raises(ConfigError, match=r"override 'distill.options=.*contains an alias to itself"):
    load_config("tiny", ["distill.options=&a {x: *a}"])


# ----------------------------------------------------------------------------- item 4: several teachers' weights
def _teachers(weight_b, weight_a=1.0):
  return [f"teachers.sources=[{{name: a, source: cache, cache: /c/a, weight: {weight_a}}}, "
          f"{{name: b, source: cache, cache: /c/b, weight: {weight_b}}}]", "teachers.combine=mix", "distill.top_k=4"]


@pytest.mark.parametrize("weight_b,says", [
    (".inf", r"teachers.sources\[1\].weight=inf must be a positive number, finite \(b's share"),
    ("-.inf", r"teachers.sources\[1\].weight=-inf must be a positive number, finite \(b's share"),
    (".nan", r"teachers.sources\[1\].weight=nan must be a positive number, finite \(b's share"),
    ("0", r"teachers.sources\[1\].weight=0 must be a positive number, finite \(b's share"),
    ("1.0e-40", r"sources\[1\].weight=1e-40 \(b\): the weights \[1.0, 1e-40\] .* share 1e-40, outside float32"),
])
def test_r4_teacher_weights_are_finite_positive_shares_named_at_start(weight_b, says):
  """Item 4: `weight: .inf` was accepted and the run died with NaN blamed on the learning rate."""
  with pytest.raises(ConfigError, match=says):
    load_config("tiny", _teachers(weight_b))


def test_r4_weights_whose_sum_overflows_float32_are_refused_and_sound_ones_load():
  with pytest.raises(ConfigError, match=r"teachers.sources\[0\].weight=3e\+38 \(a\): the weights .* sum to 6e\+38"):
    load_config("tiny", _teachers("3.0e+38", "3.0e+38"))  # each finite, their float32 sum inf: every share NaN
  with pytest.raises(ConfigError, match=r"sources\[0\].temperature=inf must be a number >= 0.01, finite \(a's"):
    load_config("tiny", [_teachers(1)[0].replace("weight: 1.0}", "weight: 1.0, temperature: .inf}"), *_teachers(1)[1:]])
  cfg = load_config("tiny", _teachers("3"))
  assert [m.weight for m in cfg.teachers.members()] == [1.0, 3.0]


# ----------------------------------------------------------------------------- item 6: load_run of a QAD run
@pytest.fixture(scope="module")
def qad_run(tmp_path_factory):
  """A quantization-aware run directory (int4, the tiny config on one device): its config.yaml and one checkpoint of
  the distiller's state, and that distiller (the student it trained and validated)."""
  from meshdistill import jobs
  from meshdistill.jobs._setup import _write_config

  run_dir = tmp_path_factory.mktemp("qad") / "run"
  cfg = load_config("tiny", [f"run.run_dir={run_dir}", "student.quantize_aware={weights: int4}", "mesh.backend=single",
                             "mesh.data=1", "mesh.tensor=1"])
  distiller = jobs.make_distiller(cfg, md.init_model(cfg.teacher, seed=0), None)
  state = distiller.init_state()
  _write_config(cfg, str(run_dir))
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0)
  ckpt.save(1, distiller, state, {}, {"kind": "distill"})
  ckpt.close()
  return run_dir, distiller.student(state)


def test_r4_load_run_of_a_quantization_aware_run_gives_the_quantized_forward_it_trained(qad_run, tmp_path):
  """Item 6: `md.load_run` returned the float student; its logits differed by up to 1.31 from both exports."""
  from flax import nnx

  from meshdistill.jobs.export import export_run

  run_dir, trained = qad_run
  tokens = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % 256
  want = np.asarray(trained(tokens).logits)  # what every training and validation step computed
  loaded = md.load_run(str(run_dir))
  got = np.asarray(loaded.student(tokens).logits)
  np.testing.assert_array_equal(got, want)  # the same weights through the same program
  float_student = nnx.merge(nnx.graphdef(md.init_model(loaded.config.student, seed=0)),
                            nnx.state(loaded.student, nnx.Param))  # the checkpoint's weights, computing in float
  assert np.abs(np.asarray(float_student(tokens).logits) - want).max() > 0.1  # the quantization is in the forward
  export_run(str(run_dir), str(tmp_path / "hf"))  # `meshdistill export`: the weights on the quantization grid
  exported = np.asarray(md.load_hf(str(tmp_path / "hf"))(tokens).logits)
  np.testing.assert_allclose(got, exported, rtol=1e-5, atol=1e-5)  # fake-quantized vs dequantized: float rounding


# ----------------------------------------------------------------------------- item 7: owner markers
def _dir_of(path, **files):
  path.mkdir()
  for name, text in files.items():
    (path / name).write_text(text)
  return path


def _marker(path, **record):
  (path / MARKER).write_text(json.dumps({"format": "meshdistill.owner/1", **record}))


def test_r4_a_hand_written_run_marker_is_refused_naming_it_and_the_users_config_kept(tmp_path, corpus, capsys):
  """Item 7: a marker with an identity id and no inode let `distill` overwrite the user's config.yaml."""
  user = _dir_of(tmp_path / "user", **{"config.yaml": "my settings\n"})
  _marker(user, kind="run", identity={"id": "x"})
  before = tree_of(user)
  assert cli.main(["distill", "--config", "tiny", *cli_sets(tmp_path, corpus, f"run.run_dir={user}")]) == 2
  err = capsys.readouterr().err
  assert f"{user / MARKER} is not an owner marker meshdistill wrote (inode (missing); device (missing)" in err
  assert "Remove the file" in err and tree_of(user) == before


def test_r4_a_hand_written_export_marker_does_not_let_export_overwrite_a_downloaded_model(tmp_path):
  from meshdistill.jobs.export import check_out_dir

  model = _dir_of(tmp_path / "model", **{"config.json": "{}", "model.safetensors": "weights"})
  _marker(model, kind="export", identity={"id": "x"})
  before = tree_of(model)
  with pytest.raises(MarkerError, match=f"{model / MARKER} is not an owner marker meshdistill wrote"):
    check_out_dir(str(model), overwrite=True)  # `meshdistill export RUN model --overwrite`
  assert tree_of(model) == before


@pytest.mark.parametrize("field", sorted(MARKER_FIELDS))
def test_r4_a_marker_missing_any_field_proves_nothing(tmp_path, field):
  from meshdistill.jobs._setup import RUN_KIND, claim_run_dir

  run = tmp_path / "run"
  write_marker(str(run), RUN_KIND)
  (run / "config.yaml").write_text("my settings\n")
  claim_run_dir(str(run))  # the marker as written: this run's directory
  record = json.loads((run / MARKER).read_text())
  del record[field]
  (run / MARKER).write_text(json.dumps(record))
  if field == "device":  # every other field as written: an earlier version's marker, judged by the files
    assert read_marker(str(run)) is None
    with pytest.raises(OSError, match="nothing proves meshdistill wrote it"):
      claim_run_dir(str(run))
  else:
    with pytest.raises(MarkerError, match=f"{run / MARKER} is not an owner marker .*{field} \\(missing\\)"):
      claim_run_dir(str(run))
  assert (run / "config.yaml").read_text() == "my settings\n"


@pytest.mark.parametrize("change,says", [
    ({"inode": "123"}, r"inode='123' \(not a int\)"),
    ({"kind": 5}, r"kind=5 \(not a str\)"),
    ({"format": "meshdistill.owner/9"}, r"format='meshdistill.owner/9' \(not 'meshdistill.owner/1'\)"),
    ({"identity": {}}, r"identity.id \(missing\)"),
])
def test_r4_a_marker_field_of_another_type_is_refused_naming_it(tmp_path, change, says):
  run = tmp_path / "run"
  write_marker(str(run), "run")
  (run / "metrics.jsonl").write_text("")
  record = {**json.loads((run / MARKER).read_text()), **change}
  (run / MARKER).write_text(json.dumps(record))
  with pytest.raises(MarkerError, match=says):
    read_marker(str(run))


def test_r4_a_complete_marker_of_another_kind_or_directory_is_named(tmp_path):
  from meshdistill.models.hf import export_kind

  out = tmp_path / "out"
  write_marker(str(out), "run")
  (out / "config.json").write_text("{}")
  with pytest.raises(OSError, match=f"\\({out / MARKER} says kind 'run'\\), not a export output"):
    check_owned(str(out), export_kind(), overwrite=True)
  record = json.loads((out / MARKER).read_text())
  (out / MARKER).write_text(json.dumps({**record, "device": record["device"] + 1}))  # written on another device
  assert read_marker(str(out)) is None
  (out / MARKER).write_text(json.dumps(record))
  assert read_marker(str(out))["kind"] == "run"  # the marker as written
