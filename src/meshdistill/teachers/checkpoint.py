"""The teacher checkpoint: a pretrained teacher's directory (`save_teacher` / `load_teacher`).

A directory with ``params/`` (orbax), ``teacher.json`` (its `ModelConfig`, the tokenizer's identity,
how it was trained, the SHA-256 of every file) and the tokenizer itself. Loading checks the files
against the recorded checksums (`verify_teacher`), the architecture field by field against the
configured teacher (`check_teacher_architecture`) and the tokenizer against the run's. The names are
also importable from `meshdistill.storage.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from meshdistill.core.fsutil import (
  atomic_output_dir,
  file_digests,
  read_json,
  verify_digests,
)
from meshdistill.models import Decoder, ModelConfig, abstract_params
from meshdistill.core.ownership import OutputKind, check_owned, write_marker
from meshdistill.parallel.distributed import barrier, is_primary
from meshdistill.models.stacking import to_scanned, to_unrolled
from meshdistill.storage.checkpoint import COMPUTE_FIELDS

log = logging.getLogger("meshdistill.storage.checkpoint")

TEACHER_FORMAT = "meshdistill.teacher/1"



def _model_fields(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


TEACHER_ENTRIES = ("params", "tokenizer", "teacher.json")  # what `save_teacher` writes into a teacher directory


def _earlier_teacher(directory: str) -> str | None:
  """None when a marker-less ``directory`` is a teacher an earlier version saved: a meshdistill ``teacher.json``
  whose checksums list every file under the directory (a file anyone added is not listed); else why not."""
  try:
    meta = read_json(os.path.join(directory, "teacher.json"), "teacher metadata")
  except (OSError, ValueError):
    return "no readable teacher.json"
  if meta.get("format") != TEACHER_FORMAT or not isinstance(meta.get("checksums"), dict):
    return f"teacher.json is not a {TEACHER_FORMAT} record"
  for d, _, files in os.walk(directory):
    for n in files:
      rel = os.path.relpath(os.path.join(d, n), directory)
      if rel != "teacher.json" and rel not in meta["checksums"]:
        return f"{rel} is not a file teacher.json lists"
  return None


TEACHER_KIND = OutputKind("teacher", "teacher directory", lambda n: n in TEACHER_ENTRIES, _earlier_teacher)


class TeacherDamagedError(ValueError):
  """A teacher directory whose files no longer match the checksums recorded when it was written."""


def save_teacher(
  directory: str, model: Decoder, tokenizer: Any, info: dict | None = None, *, overwrite: bool = False
) -> str:
  """Writes ``model`` (params + `ModelConfig`) and ``tokenizer`` to ``directory``, atomically.

  The files are written into a temporary sibling directory that is renamed into place when
  complete, so a reader never sees a half-written teacher. ``teacher.json`` records the SHA-256
  of every parameter and tokenizer file (`load_teacher` checks them). An existing non-empty
  ``directory`` is an error unless ``overwrite``, and even then only a teacher directory is
  replaced (`meshdistill.core.ownership.check_owned`: its owner marker, written here, proves it). In a job of
  several processes every process writes its shards of the parameters and process 0 the rest (call it on
  every process).
  """
  directory = os.path.abspath(directory)
  if jax.process_count() > 1:
    return _save_teacher_multiprocess(directory, model, tokenizer, info, overwrite)
  check_teacher_target(directory, overwrite=overwrite)
  with atomic_output_dir(directory) as tmp:
    params = jax.tree.map(np.asarray, jax.device_get(nnx.state(model)))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(tmp, "params"), params)
    ckptr.wait_until_finished()
    tokenizer.save(os.path.join(tmp, "tokenizer"))
    meta = _teacher_meta(model, tokenizer, info, file_digests(tmp))  # before teacher.json exists
    with open(os.path.join(tmp, "teacher.json"), "w", encoding="utf-8") as f:
      json.dump(meta, f, indent=2, default=str)
    write_marker(tmp, TEACHER_KIND, {"model": _model_fields(model.cfg)})
  log.info("teacher: saved to %s", directory)
  return directory


def check_teacher_target(directory: str, *, overwrite: bool) -> None:
  """Raises `OutputExistsError` unless `save_teacher` may write ``directory`` (call it before training)."""
  check_owned(directory, TEACHER_KIND, overwrite=overwrite, flag="--overwrite (pretrain.overwrite)")


def _teacher_meta(model: Decoder, tokenizer: Any, info: dict | None, checksums: dict) -> dict:
  return {
    "format": TEACHER_FORMAT,
    "model": _model_fields(model.cfg),
    "tokenizer": {"fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size, "repr": repr(tokenizer)},
    "info": info or {},
    "checksums": checksums,
  }


def _save_teacher_multiprocess(directory: str, model: Decoder, tokenizer: Any, info: dict | None,
                               overwrite: bool) -> str:
  """`save_teacher` in a job of several processes: every process writes its shards of the parameters
  (orbax), process 0 alone checks the target, writes ``teacher.json`` (with the checksums) and the
  tokenizer and renames the directory into place (an old teacher renamed aside, then removed)."""
  tmp = os.path.join(os.path.dirname(directory), f".tmp-{os.path.basename(directory)}-job")
  if is_primary():
    check_teacher_target(directory, overwrite=overwrite)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a job that died while saving
    os.makedirs(tmp)
  barrier("save_teacher:start")
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(tmp, "params"), nnx.state(model))
  ckptr.wait_until_finished()
  if is_primary():
    tokenizer.save(os.path.join(tmp, "tokenizer"))
    meta = _teacher_meta(model, tokenizer, info, file_digests(tmp))  # before teacher.json exists
    with open(os.path.join(tmp, "teacher.json"), "w", encoding="utf-8") as f:
      json.dump(meta, f, indent=2, default=str)
    write_marker(tmp, TEACHER_KIND, {"model": _model_fields(model.cfg)})
    old = f"{tmp}-old"
    if os.path.exists(directory):
      os.rename(directory, old)
    os.rename(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
  barrier("save_teacher:done")
  log.info("teacher: saved to %s", directory)
  return directory


def read_teacher_meta(directory: str) -> dict:
  """The ``teacher.json`` of a teacher directory (raises FileNotFoundError with a hint when absent)."""
  path = os.path.join(directory, "teacher.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"{directory} is not a teacher directory (no teacher.json); write one with `meshdistill pretrain` "
      "or leave pretrain.teacher unset to pretrain and cache a teacher"
    )
  meta = read_json(path, "teacher metadata")
  if meta.get("format") != TEACHER_FORMAT:
    raise ValueError(f"{path}: format {meta.get('format')!r} is not {TEACHER_FORMAT!r}")
  return meta


def verify_teacher(directory: str, meta: dict | None = None) -> None:
  """Raises `TeacherDamagedError` (naming the files) when ``directory``'s files differ from its recorded checksums.

  A teacher written before checksums were recorded is accepted with a log line.
  """
  meta = read_teacher_meta(directory) if meta is None else meta
  expected = meta.get("checksums")
  if expected is None:
    log.info("teacher %s records no checksums (written by an older version); not verified", directory)
    return
  problem = verify_digests(directory, expected, exclude=("teacher.json",))
  if problem is not None:
    raise TeacherDamagedError(f"teacher {directory} is damaged ({problem})")


def check_teacher_architecture(saved: dict, expected: ModelConfig, where: str) -> None:
  """Raises ValueError listing every `ModelConfig` field where ``saved`` differs from ``expected``."""
  want = _model_fields(expected)
  # How a model computes (remat policy, activation dtype) is not part of its architecture.
  diff = {
    k: (saved.get(k, "<missing>"), v)
    for k, v in want.items()
    if saved.get(k, "<missing>") != v and k not in COMPUTE_FIELDS
  }
  diff.update({k: (v, "<unknown field>") for k, v in saved.items() if k not in want})
  if diff:
    desc = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in sorted(diff.items()))
    raise ValueError(
      f"teacher checkpoint {where} has another architecture than the configured teacher ({desc}); "
      "set the teacher.* sizes to the checkpoint's, or point pretrain.teacher at a matching checkpoint"
    )


def load_teacher(directory: str, expected: ModelConfig, mesh: Mesh | None, tokenizer: Any = None) -> Decoder:
  """Loads the teacher in ``directory`` onto ``mesh`` (split over ``tensor``; None = one device).

  Raises:
    FileNotFoundError: ``directory`` holds no teacher.
    ValueError: its architecture differs from ``expected`` (every differing field is named), or
      it was trained with another tokenizer than ``tokenizer``.
    TeacherDamagedError: its files differ from the checksums in ``teacher.json``.
  """
  directory = os.path.abspath(directory)
  meta = read_teacher_meta(directory)
  verify_teacher(directory, meta)
  check_teacher_architecture(meta["model"], expected, directory)
  if tokenizer is not None and meta["tokenizer"]["fingerprint"] != tokenizer.fingerprint:
    raise ValueError(
      f"teacher {directory} was trained with tokenizer {meta['tokenizer']['repr']} (fingerprint "
      f"{meta['tokenizer']['fingerprint']}) but this run uses {tokenizer!r} (fingerprint {tokenizer.fingerprint}); "
      "use the same data.tokenizer as the teacher"
    )
  # restored with its padding rows and its blocks layout, then converted to the configured layout
  expected = expected.with_scan_on(mesh)
  saved = expected.replace(vocab_multiple=meta["model"].get("vocab_multiple", 1),
                           scan_layers=meta["model"].get("scan_layers", False) is True)
  cfg = saved if mesh is None else saved.for_tensor(mesh.shape["tensor"])
  if cfg.padded_vocab != saved.padded_vocab:
    raise ValueError(
      f"teacher checkpoint {directory} holds {saved.padded_vocab} vocabulary rows (vocab_size {saved.vocab_size} "
      f"padded), which mesh tensor={mesh.shape['tensor']} does not divide; use a tensor size that divides "
      f"{saved.padded_vocab}"
    )
  graphdef, abstract, shardings = abstract_params(cfg, mesh)
  if shardings is None:
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  params = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), target)
  log.info("teacher: loaded %s", directory)
  model = nnx.merge(graphdef, params)
  if saved.scan_layers == expected.scan_layers:
    return model

  return to_scanned(model) if expected.scan_layers else to_unrolled(model)
