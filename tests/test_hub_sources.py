"""Hugging Face Hub ids as teacher / student sources, resolved from a Hub cache folder with no network
(``HF_HUB_OFFLINE=1``): the committed Qwen3 fixture laid out as huggingface_hub caches a download."""

import dataclasses
import json
import pathlib
import shutil

import pytest

from meshdistill.config import ConfigError, dump_config, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
QWEN3 = FIXTURES / "hf_qwen3"
EXAMPLE = str(ROOT / "configs" / "hf_example.yaml")
TEXT = f"data.source={FIXTURES / 'hf_text.jsonl'}"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_repo(cache: pathlib.Path, repo: str, files: dict[str, pathlib.Path], refs=("main",)) -> pathlib.Path:
  """``repo`` in huggingface_hub's cache layout: ``models--org--name/snapshots/<commit>/...`` and ``refs/<ref>``."""
  root = cache / ("models--" + repo.replace("/", "--"))
  snapshot = root / "snapshots" / COMMIT
  for name, src in files.items():
    (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, snapshot / name)
  (root / "refs").mkdir(parents=True, exist_ok=True)
  for ref in refs:
    (root / "refs" / ref).write_text(COMMIT)
  return snapshot


@pytest.fixture()
def hub(tmp_path, monkeypatch):
  cache = tmp_path / "hub"
  snapshot = cache_repo(cache, "acme/tiny-qwen3", {f: QWEN3 / f for f in FILES}, refs=("main", "v1"))
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return cache, snapshot


@pytest.mark.parametrize("given", ["acme/tiny-qwen3", "acme/tiny-qwen3@v1", f"acme/tiny-qwen3@{COMMIT}"])
def test_a_hub_id_resolves_from_the_cache_offline(hub, given):
  _, snapshot = hub
  cfg = load_config(EXAMPLE, [f"teacher.hf={given}", TEXT])
  local = load_config(EXAMPLE, [f"teacher.hf={QWEN3}", TEXT])
  assert cfg.models.teacher_hf == str(snapshot)
  assert cfg.models.hub == {"teacher.hf": f"acme/tiny-qwen3@{COMMIT}"}
  assert cfg.teacher == local.teacher and cfg.student == local.student  # shapes from the same config.json


def test_the_written_config_names_the_id_pinned_to_its_commit(hub, tmp_path):
  cfg = load_config(EXAMPLE, ["teacher.hf=acme/tiny-qwen3", TEXT])
  dump_config(cfg, tmp_path / "config.yaml")
  assert f"hf: acme/tiny-qwen3@{COMMIT}" in (tmp_path / "config.yaml").read_text()
  assert load_config(str(tmp_path / "config.yaml")) == cfg


def test_student_hf_and_a_pruned_student_from_the_hub(hub):
  cache, _ = hub
  cache_repo(cache, "acme/tiny-student", {f: QWEN3 / f for f in FILES})
  cfg = load_config(EXAMPLE, ["teacher.hf=acme/tiny-qwen3", "student.hf=acme/tiny-student", "student.init=null", TEXT])
  assert cfg.models.hub["student.hf"] == f"acme/tiny-student@{COMMIT}" and cfg.student.n_layers == cfg.teacher.n_layers
  # a `meshdistill prune --out DIR` folder pushed to the Hub: its student/teacher.json read from the snapshot
  pruned = cache / "pruned.json"
  model = {k: v for k, v in dataclasses.asdict(cfg.teacher.replace(mlp_hidden=32)).items()}
  pruned.write_text(json.dumps({"model": model}))
  snap = cache_repo(cache, "acme/pruned", {"student/teacher.json": pruned})
  cfg = load_config(EXAMPLE, ["teacher.hf=acme/tiny-qwen3", "student.init={pruned: acme/pruned}", TEXT])
  assert cfg.models.student_init.pruned == str(snap) and cfg.student.mlp_hidden == 32
  assert cfg.models.hub["student.init.pruned"] == f"acme/pruned@{COMMIT}"


def test_a_missing_id_names_the_id_the_revision_and_the_cache(hub):
  cache, _ = hub
  with pytest.raises(ConfigError, match=r"teacher.hf='acme/absent@v2' .*repository 'acme/absent', revision 'v2'.*"
                                        + str(cache) + ".*HF_HUB_OFFLINE"):
    load_config(EXAMPLE, ["teacher.hf=acme/absent@v2", TEXT])
  with pytest.raises(ConfigError, match=r"student.hf='acme/nothing' .*revision 'main'"):
    load_config(EXAMPLE, ["teacher.hf=acme/tiny-qwen3", "student.hf=acme/nothing", "student.init=null", TEXT])


def test_a_local_directory_of_the_ids_shape_wins(hub, tmp_path, monkeypatch):
  local = tmp_path / "acme" / "tiny-qwen3"
  shutil.copytree(QWEN3, local)
  monkeypatch.chdir(tmp_path)
  cfg = load_config(EXAMPLE, ["teacher.hf=acme/tiny-qwen3", TEXT])
  assert cfg.models.teacher_hf == str(local) and cfg.models.hub == {}
