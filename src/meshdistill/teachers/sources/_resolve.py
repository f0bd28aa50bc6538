"""Deriving a config's shapes from its sources (`resolve`), with the checks on Hugging Face directories
(``config.json``, weights) and tokenizers (teacher vs ``data.tokenizer``, teacher vs student); only JSON
files are read. Hugging Face Hub ids among the sources become local snapshot directories first
(`meshdistill.teachers.sources._hub`: the local cache, downloading only where allowed)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from meshdistill.core.typed_yaml import ConfigError
from meshdistill.teachers.sources._hub import hub_id, resolve_hub
from meshdistill.teachers.sources._settings import ModelSources
from meshdistill.data import tokenizer_file
from meshdistill.models import ModelConfig, config_from_hf, default_family
from meshdistill.core.vocab import PADDING_TOLERANCE

log = logging.getLogger(__name__)

_TOKENIZER_SETTINGS = ("padding", "truncation")  # tokenizer.json keys allowed to differ between teacher and student


# --------------------------------------------------------------------------- checks on files
def check_hf_dir(path: str, setting: str) -> dict:
  """The parsed ``config.json`` of a Hugging Face directory, or a `ConfigError` naming ``setting``."""
  if not os.path.isdir(path):
    raise ConfigError(f"{setting}={path!r} is not a directory; give a local Hugging Face model directory "
                      "(config.json + *.safetensors)")
  config = os.path.join(path, "config.json")
  if not os.path.isfile(config):
    raise ConfigError(f"{setting}={path!r} holds no config.json; a Hugging Face model directory holds config.json "
                      "and model.safetensors (or model-*.safetensors with model.safetensors.index.json)")
  if not any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json")):
    raise ConfigError(f"{setting}={path!r} holds no model.safetensors or model.safetensors.index.json; only "
                      "safetensors weights can be loaded (convert PyTorch .bin files with transformers first)")
  try:
    with open(config, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{setting}={path!r}: config.json is not valid JSON ({e})") from None


def _hf_model_config(path: str, setting: str, section):
  """The `ModelConfig` of ``path``'s config.json with ``section``'s `FREE_KEYS` but ``max_len``: its bound is
  config.json's ``max_position_embeddings`` (`resolve` puts a ``max_len`` the config names in its place)."""
  hf = check_hf_dir(path, setting)
  try:
    cfg = config_from_hf(hf, max_len=None, dtype=section.dtype, where=f"{setting}={path!r}: config.json")
  except (KeyError, TypeError, ValueError) as e:
    raise ConfigError(f"{setting}={path!r}: {e if not isinstance(e, KeyError) else f'config.json lacks {e}'}") from None
  return cfg.replace(remat=section.remat, scan_layers=section.scan_layers, attention=section.attention,
                     param_dtype=section.param_dtype)


def _family(cfg) -> str:
  return default_family(cfg)


def tokenizer_file(path: str) -> str | None:
  file = os.path.join(path, "tokenizer.json")
  return file if os.path.isfile(file) else None


def _tokenizer_spec(file: str) -> dict:
  with open(file, encoding="utf-8") as f:
    spec = json.load(f)
  return {k: v for k, v in spec.items() if k not in _TOKENIZER_SETTINGS} if isinstance(spec, dict) else spec


def tokenizer_difference(file_a: str, file_b: str) -> list[str]:
  """The top-level keys in which two tokenizer.json files differ (ignoring padding / truncation)."""
  a, b = _tokenizer_spec(file_a), _tokenizer_spec(file_b)
  if not isinstance(a, dict) or not isinstance(b, dict):
    return [] if a == b else ["<whole file>"]
  return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def resolve(cfg) -> dict:
  """The derived ``teacher`` / ``student`` `ModelConfig` and ``data`` settings of a `Config` with sources.

  Returns a dict of the sections to replace (possibly empty; ``models`` when a Hub id was resolved to a local
  directory, or ``max_len_from_hf`` was used). Raises `ConfigError` naming the setting.

  A shape read from a config.json (``teacher.hf``, ``student.hf``, and ``student.init.from_teacher`` with
  ``teacher.hf``) is bounded by its ``max_position_embeddings`` where the config named no ``max_len``
  (``models.max_len_from_hf``), else by the named ``max_len``. ``max_len_from_hf`` is emptied here: the sections
  now hold the bound, so resolving again (`Config.replace`) keeps it, and a written config names it.
  """
  src: ModelSources = local_sources(cfg.models)
  follow = src.max_len_from_hf
  if follow:
    src = dataclasses.replace(src, max_len_from_hf=())
  out: dict[str, Any] = {} if src is cfg.models else {"models": src}
  if not src.any:
    return out
  teacher = cfg.teacher
  positions = None  # max_position_embeddings of teacher.hf's config.json
  if src.teacher_hf:
    if cfg.pretrain.teacher:
      raise ConfigError(
          f"teacher.hf={src.teacher_hf!r} and pretrain.teacher={cfg.pretrain.teacher!r} both name the teacher; "
          "keep one of them"
      )
    teacher = _hf_model_config(src.teacher_hf, "teacher.hf", cfg.teacher)
    positions = teacher.max_len
    if "teacher" not in follow:
      teacher = teacher.replace(max_len=cfg.teacher.max_len)
    out["teacher"] = teacher
    out["data"] = _teacher_tokenizer(cfg, src.teacher_hf)
  if src.student_hf:
    student = _hf_model_config(src.student_hf, "student.hf", cfg.student)
    if "student" not in follow:
      student = student.replace(max_len=cfg.student.max_len)
    tf, sf = _family(teacher), _family(student)
    if (tf, teacher.rope_scaling is None) != (sf, student.rope_scaling is None):
      raise ConfigError(
          f"student.hf={src.student_hf!r} is a {sf!r} model but teacher.hf={src.teacher_hf!r} is a {tf!r} model; "
          "distil within one family (one tokenizer), or start the student from the teacher with "
          "student.init: {from_teacher: true, layers: [...]}"
      )
    _check_student_tokenizer(src, teacher, student)
    out["student"] = student
  elif src.student_init.from_teacher:
    layers = src.student_init.layers
    bad = [i for i in layers if i >= teacher.n_layers]
    if bad:
      raise ConfigError(
          f"student.init.layers={list(layers)}: block {bad[0]} is past the teacher's depth (the teacher has "
          f"{teacher.n_layers} blocks: indices 0..{teacher.n_layers - 1})"
      )
    s = cfg.student
    max_len = positions if positions is not None and "student" in follow else s.max_len
    out["student"] = teacher.with_layers(layers).replace(max_len=max_len, dtype=s.dtype, remat=s.remat,
                                     scan_layers=s.scan_layers, attention=s.attention, param_dtype=s.param_dtype)
  elif src.student_init.pruned:
    out["student"] = _pruned_config(src.student_init.pruned, teacher, cfg.student)
  return out


def local_sources(src: ModelSources) -> ModelSources:
  """``src`` with each Hugging Face Hub id (``teacher.hf``, ``student.hf``, ``student.init.pruned``) replaced by its
  local snapshot directory, the pinned ids kept in ``hub`` (``src`` itself when it names none)."""
  changes, pinned = {}, dict(src.hub)
  for setting, field in (("teacher.hf", "teacher_hf"), ("student.hf", "student_hf")):
    value = getattr(src, field)
    if value and hub_id(value):
      changes[field], pinned[setting] = resolve_hub(value, setting)
  pruned = src.student_init.pruned
  if pruned and hub_id(pruned):  # a `meshdistill prune` directory: every file
    path, pinned["student.init.pruned"] = resolve_hub(pruned, "student.init.pruned", patterns=None)
    changes["student_init"] = dataclasses.replace(src.student_init, pruned=path)
  return dataclasses.replace(src, **changes, hub=pinned) if changes else src


def _pruned_config(path: str, teacher, section):
  """The `ModelConfig` of the student ``meshdistill prune --out path`` wrote (its ``FREE_KEYS`` from ``section``),
  checked against the run's teacher (one vocabulary, one family)."""
  meta_file = os.path.join(path, "student", "teacher.json")
  if not os.path.isfile(meta_file):
    raise ConfigError(f"student.init.pruned={path!r} holds no student/teacher.json; give the --out directory of "
                      "`meshdistill prune`")
  with open(meta_file, encoding="utf-8") as f:
    fields = json.load(f)["model"]
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  cfg = ModelConfig(**{k: v for k, v in fields.items() if k in known})
  same = ("vocab_size", "qk_norm", "qkv_bias", "geglu", "norm_offset", "embed_scale", "post_norms", "tie_embeddings")
  diff = [k for k in same if getattr(cfg, k) != getattr(teacher, k)]
  if diff:
    raise ConfigError(f"student.init.pruned={path!r} was cut from another teacher (it differs from this run's "
                      f"teacher in {diff}); prune this run's teacher with `meshdistill prune`")
  return cfg.replace(max_len=section.max_len, dtype=section.dtype, remat=section.remat, scan_layers=section.scan_layers,
                     attention=section.attention, param_dtype=section.param_dtype, vocab_multiple=1,
                     replicate_kv=False)


def _teacher_tokenizer(cfg, path: str):
  """``data`` with ``tokenizer`` = the teacher's tokenizer.json (or a checked equal one)."""
  file = tokenizer_file(path)
  given = cfg.data.tokenizer
  if given in ("byte", path, file):
    if file is None:
      raise ConfigError(
          f"teacher.hf={path!r} holds no tokenizer.json, which the data pipeline tokenizes with; add it to the "
          "directory, or set data.tokenizer to the path of the teacher's tokenizer.json"
      )
    return cfg.data.replace(tokenizer=path)
  if given == "bpe":
    raise ConfigError(
        f"data.tokenizer='bpe' trains a new tokenizer, but teacher.hf={path!r} has its own; remove data.tokenizer "
        "(the teacher's tokenizer.json is used)"
    )

  other = tokenizer_file(os.path.expanduser(given))
  if not os.path.isfile(other):
    raise ConfigError(f"data.tokenizer={given!r}: no tokenizer file at {other!r}")
  if file is not None:
    diff = tokenizer_difference(file, other)
    if diff:
      raise ConfigError(
          f"data.tokenizer={given!r} differs from the tokenizer of teacher.hf={path!r} (in {diff}); remove "
          "data.tokenizer: with teacher.hf the data is tokenized with the teacher's tokenizer.json"
      )
  return cfg.data


def _check_student_tokenizer(src: ModelSources, teacher, student) -> None:
  t_file, s_file = tokenizer_file(src.teacher_hf), tokenizer_file(src.student_hf)
  if t_file and s_file:
    diff = tokenizer_difference(t_file, s_file)
    if diff:
      raise ConfigError(
          f"the tokenizers of teacher.hf={src.teacher_hf!r} and student.hf={src.student_hf!r} differ (tokenizer.json "
          f"keys {diff}); distillation compares distributions token by token, so both need one tokenizer (only "
          "padding / truncation settings may differ)"
      )
  elif s_file is None:
    log.info("student.hf=%s has no tokenizer.json; comparing vocabulary sizes only", src.student_hf)
  small, large = sorted((teacher.vocab_size, student.vocab_size))
  if large - small > PADDING_TOLERANCE * large:
    raise ConfigError(
        f"student.hf={src.student_hf!r} has vocab_size={student.vocab_size} but teacher.hf={src.teacher_hf!r} has "
        f"{teacher.vocab_size}: more than padding apart, so not one tokenizer; choose a student of the teacher's "
        "tokenizer"
    )
