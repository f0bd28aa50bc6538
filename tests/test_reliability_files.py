"""Reliability, round three: teacher-cache manifests checked value by value, and the cases no one had tried with a
user's files (`benchmarks/results/reliability.md`, items 10-11)."""

import json
import math

import pytest

from meshdistill.teachers import cache as tc


def _manifest(tmp_path, **change):
  """A hand-written cache directory: a manifest whose every entry has its type, one shard file of 64 bytes."""
  (tmp_path / "shard-00000.safetensors").write_bytes(b"\0" * 64)
  m = {"format": 2, "k": 2, "seq_len": 4, "rows": 4, "rows_per_shard": 4, "id_bits": 5, "vocab": 32,
       "temperature": 1.0, "precision": "float16", "teacher": {"config": {"vocab_size": 32}}, "data": {},
       "shards": [{"name": "shard-00000.safetensors", "bytes": 64, "sha256": "0" * 64}]}
  m.update(change)
  (tmp_path / tc.MANIFEST).write_text(json.dumps(m, allow_nan=True))
  return str(tmp_path)


@pytest.mark.parametrize("change,says", [
    ({"rows_per_shard": 0}, "rows_per_shard: 0"),
    ({"rows_per_shard": -4}, "rows_per_shard: -4"),
    ({"rows_per_shard": True}, "a bool as its 'rows_per_shard' entry"),
    ({"k": 0}, "k: 0"),
    ({"seq_len": 0}, "seq_len: 0"),
    ({"rows": 0, "shards": []}, "rows: 0"),
    ({"vocab": 0}, "vocab: 0"),
    ({"id_bits": 0}, "id_bits: 0"),
    ({"id_bits": 3}, "id_bits: 3"),  # 8 ids for a vocabulary of 32
    ({"k": 40}, "k: 40, more than its vocab"),
    ({"temperature": 0}, "temperature: 0"),
    ({"temperature": math.nan}, "temperature: nan"),
    ({"precision": "int3"}, "precision: 'int3'"),
    ({"rows": 8}, "1 shards listed for 8 rows"),
    ({"teacher": {"config": [1]}}, "teacher.config"),
])
def test_r3_every_manifest_value_is_checked_with_a_named_cache_error(tmp_path, change, says):
  """Item 10: `rows_per_shard: 0` ended in ZeroDivisionError at the first row read; every manifest entry is now checked
  for its range when the cache is opened, naming the file, the entry and what was expected."""
  with pytest.raises(tc.CacheError, match=f"manifest.json has {says}.*cache-teacher") as e:
    cache = tc.TeacherCache(_manifest(tmp_path, **change))
    cache.rows([0])
  assert "teacher.cache=" in str(e.value)


def test_r3_a_hand_written_manifest_with_sound_values_opens(tmp_path):
  assert tc.TeacherCache(_manifest(tmp_path)).num_rows == 4


# ----------------------------------------------------------------------------------------------- item 11: user files
def _user_dir(path, **files):
  path.mkdir()
  for name, text in files.items():
    (path / name).write_text(text)
  return path


def test_r3_an_owner_marker_copied_into_a_users_directory_proves_nothing_there(tmp_path):
  """Item 11: a run's `.meshdistill-owner.json` copied into a directory of the user's files let `distill` reuse it
  and write over the user's own config.yaml; a marker now names the directory it was written in."""
  import shutil

  from meshdistill.jobs._setup import claim_run_dir
  from meshdistill.core.fsutil import OutputExistsError
  from meshdistill.core.ownership import MARKER, write_marker
  from meshdistill.jobs._setup import RUN_KIND

  run = tmp_path / "run"
  write_marker(str(run), RUN_KIND)
  claim_run_dir(str(run))  # its own directory: fine
  user = _user_dir(tmp_path / "user", **{"config.yaml": "my settings\n", "notes.txt": "mine\n"})
  shutil.copy(run / MARKER, user / MARKER)
  with pytest.raises(OutputExistsError, match="holds files this command did not write"):
    claim_run_dir(str(user))
  only_ours = _user_dir(tmp_path / "only_ours", **{"config.yaml": "my settings\n"})  # names a run writes, not a run
  shutil.copy(run / MARKER, only_ours / MARKER)
  with pytest.raises(OutputExistsError, match="nothing proves meshdistill wrote it"):
    claim_run_dir(str(only_ours))
  assert (user / "config.yaml").read_text() == "my settings\n" and (only_ours / "config.yaml").exists()


def test_r3_a_hand_written_marker_does_not_let_overwrite_replace_a_downloaded_model(tmp_path):
  """Item 11: a hand-written export marker over a downloaded model (config.json, model.safetensors: every name one an
  export writes) let `export --overwrite` delete it; such a marker proves nothing now."""
  from meshdistill.models.hf import export_kind
  from meshdistill.core.fsutil import OutputExistsError
  from meshdistill.core.ownership import MARKER, check_owned

  model = _user_dir(tmp_path / "model", **{"config.json": "{}", "model.safetensors": "weights"})
  (model / MARKER).write_text(json.dumps({"format": "meshdistill.owner/1", "kind": "export"}))
  with pytest.raises(OutputExistsError, match="is not an owner marker meshdistill wrote"):  # round four: named
    check_owned(str(model), export_kind(), overwrite=True)
  assert sorted(p.name for p in model.iterdir()) == [MARKER, "config.json", "model.safetensors"]


def test_r3_a_run_directory_moved_keeps_its_marker_and_a_copied_one_resumes_by_its_structure(tmp_path):
  import shutil

  from meshdistill.jobs._setup import RUN_KIND, claim_run_dir
  from meshdistill.core.ownership import read_marker, write_marker

  old = tmp_path / "old"
  write_marker(str(old), RUN_KIND)
  (old / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 1.0}\n{"step": 2, "split": "train"}\n')
  moved = tmp_path / "moved"
  old.rename(moved)
  assert read_marker(str(moved))["kind"] == "run"  # a rename keeps the directory (its inode)
  copied = tmp_path / "copied"
  shutil.copytree(moved, copied)
  assert read_marker(str(copied)) is None  # written for another directory
  claim_run_dir(str(copied))  # an earlier run by its structure (metrics.jsonl of meshdistill rows): reused


@pytest.mark.parametrize("entry", ["tb", "checkpoints", "plots"])
def test_r3_a_symlinked_directory_in_a_run_directory_is_refused_not_written_through(tmp_path, entry):
  """Item 11: a symlinked tb/ received the run's event files and a symlinked checkpoints/ its steps, written through
  the link into the directory it points at."""
  from meshdistill.jobs._setup import RUN_KIND, claim_run_dir
  from meshdistill.core.fsutil import SymlinkError
  from meshdistill.core.ownership import write_marker

  run = tmp_path / "run"
  write_marker(str(run), RUN_KIND)
  elsewhere = _user_dir(tmp_path / "elsewhere", **{"keep.txt": "x"})
  (run / entry).symlink_to(elsewhere)
  with pytest.raises(SymlinkError, match=f"{entry} is a symbolic link"):
    claim_run_dir(str(run))


def test_r3_run_dir_tilde_alone_names_yamls_null_reading():
  """Item 11: `--set run.run_dir=~` (YAML reads a bare ~ as null) said only "has the wrong type"."""
  from meshdistill.config import ConfigError, load_config

  with pytest.raises(ConfigError, match=r"run.run_dir=None has the wrong type: expected str \(YAML reads a bare ~"):
    load_config("tiny", ["run.run_dir=~"])


def test_r3_a_missing_teacher_tokenizer_file_is_named_as_data_teacher_tokenizer(tmp_path):
  """Item 11 (cross-tokenizer settings): a missing `data.teacher_tokenizer` file was reported as `data.tokenizer`."""
  from meshdistill.data import DataConfig, build_data

  (tmp_path / "doc.txt").write_text("def f(x): return x\n" * 50)
  cfg = DataConfig(source=str(tmp_path / "doc.txt"), seq_len=16, val_fraction=0.0, teacher_tokenizer="/nope/tok.json")
  with pytest.raises(FileNotFoundError, match="data.teacher_tokenizer: no tokenizer file at '/nope/tok.json'"):
    build_data(cfg, batch_size=2)
