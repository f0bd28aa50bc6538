"""Checkpoints (orbax): train states for exact resume, and the pretrained-teacher cache.

Train-state checkpoints (`Checkpointer`): one `orbax.checkpoint.CheckpointManager` step
directory per saved step, holding three items:

* ``state`` -- the whole `TrainState` (student and strategy parameters, optimizer state,
  step) as arrays (``StandardSave``);
* ``data``  -- the training iterator's position (``JsonSave``), so a resumed run reads
  exactly the batches an uninterrupted run would;
* ``meta``  -- what produced it (``JsonSave``): job kind, step, model configs, tokenizer
  fingerprint, seed, mesh shape.

There is no other random state to save: the train step is deterministic given the state
and the batch (no dropout), parameters are initialised from the config's seed, and the
data order is a function of the data seed and the iterator position above.

Saves are atomic: orbax writes each step into a temporary directory and renames it when
complete, so a process killed mid-save leaves the previous finished checkpoint as the
latest loadable one (the half-written directory is ignored and cleaned up later).

Restoring onto a different mesh (saved on 2x4, resumed on 4x2 or 1x8): the caller passes a
freshly initialised state on the NEW layout as a template; every leaf becomes an abstract
``jax.ShapeDtypeStruct(shape, dtype, sharding=<new sharding>)`` and orbax reads each shard
straight into place.

The teacher cache (`save_teacher` / `load_teacher`): a directory with ``params/`` (orbax),
``teacher.json`` (its `ModelConfig`, the tokenizer's identity, how it was trained) and the
tokenizer itself. Loading checks the architecture field by field against the configured
teacher and the tokenizer against the run's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from meshdistill.models import Decoder, ModelConfig
from meshdistill.models._build import abstract_params
from meshdistill.step import TrainState

log = logging.getLogger(__name__)

ITEMS = ("state", "data", "meta")
TEACHER_FORMAT = "meshdistill.teacher/1"


class Checkpointer:
  """Saves and restores train states under ``directory`` (every ``every`` steps, newest ``keep`` kept).

  Args:
    directory: checkpoint root (created if missing).
    every: save interval in steps for `maybe_save`; 0 = only explicit final saves.
    keep: number of newest checkpoints kept.
  """

  def __init__(self, directory: str, *, every: int = 100, keep: int = 2):
    self.directory = os.path.abspath(directory)
    self.every = every
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

  def latest_step(self) -> int | None:
    """The newest completely written step, or None."""
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def save(self, step: int, trainer, state: TrainState, data_state: dict, meta: dict) -> None:
    """Writes ``state`` (one replica of it: `meshdistill.layout.Layout.unreplicate`), the data position and
    ``meta`` as ``step``."""
    state = trainer.layout.unreplicate(state)
    meta = {**meta, "step": int(step)}
    self._mgr.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)
      ),
      force=True,
    )
    self._mgr.wait_until_finished()
    log.info("checkpoint: saved step %d to %s", step, self.directory)

  def maybe_save(
    self, step: int, trainer, state: TrainState, data_state: dict, meta: dict, final: bool = False
  ) -> bool:
    """Saves when ``step`` is a multiple of ``every`` (or ``final``); returns whether it saved."""
    due = final or (self.every and step % self.every == 0)
    if due and step not in self.all_steps():
      self.save(step, trainer, state, data_state, meta)
      return True
    return False

  def read_meta(self, step: int | None = None) -> dict:
    """The ``meta`` item of ``step`` (default: the latest)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
    return dict(self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

  def restore(self, trainer, template: TrainState, step: int | None = None) -> tuple[TrainState, dict, dict]:
    """Restores ``(state, data_state, meta)`` of ``step`` (default: latest) onto ``template``'s layout.

    ``template`` is a fresh ``trainer.init_state()`` on the mesh to resume on, which may
    differ from the mesh the checkpoint was written on.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
    target = trainer.layout.checkpoint_target(template)
    try:
      got = self._mgr.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()
        ),
      )
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(
        f"checkpoint step {step} in {self.directory} does not fit this run's train state ({e}); it was written "
        "by a run with other model sizes or another strategy/optimizer: use another checkpoint.dir or run_dir"
      ) from e
    state = trainer.layout.replicate(got.state)
    log.info("checkpoint: restored step %d from %s", step, self.directory)
    return state, dict(got.data), dict(got.meta)

  def restore_student(self, cfg: ModelConfig, mesh: Mesh | None, step: int | None = None, lora=None) -> Decoder:
    """Only the student of a distillation checkpoint (no optimizer state, no teacher), onto ``mesh``.

    ``cfg`` is the student's `ModelConfig`; each weight is read straight into its `tensor` shards.
    ``lora``: the run's `meshdistill.models.lora.LoraConfig` when its student holds adapters (the
    returned student then holds them too; `merge_lora` folds them in).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
    if lora is not None and lora.enabled:
      from meshdistill.models.lora import abstract_lora  # pylint: disable=g-import-not-at-top

      graphdef, abstract, shardings = abstract_lora(cfg, lora, mesh)
    else:
      graphdef, abstract, shardings = abstract_params(cfg, mesh)
    one = SingleDeviceSharding(jax.devices()[0])
    where = jax.tree.map(lambda _: one, abstract) if shardings is None else shardings
    target = {"params": {"student": jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, where)}}
    args = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    try:
      got = self._mgr.restore(step, args=ocp.args.Composite(state=args))
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(
          f"checkpoint step {step} in {self.directory} holds no student of this shape ({e}); it was written by a "
          "run with other model sizes"
      ) from e
    return nnx.merge(graphdef, got.state["params"]["student"])

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()


# --------------------------------------------------------------------------- teacher cache
COMPUTE_FIELDS = ("remat", "dtype")  # `ModelConfig` fields that change no parameter


def _model_fields(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def save_teacher(directory: str, model: Decoder, tokenizer: Any, info: dict | None = None) -> str:
  """Writes ``model`` (params + `ModelConfig`) and ``tokenizer`` to ``directory``, atomically.

  The files are written into a temporary sibling directory that is renamed into place when
  complete, so a reader never sees a half-written teacher. In a job of several processes every
  process writes its shards of the parameters and process 0 the rest (call it on every process).
  """
  directory = os.path.abspath(directory)
  parent = os.path.dirname(directory)
  if jax.process_count() > 1:
    return _save_teacher_multiprocess(directory, model, tokenizer, info)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".tmp-{os.path.basename(directory)}-")
  try:
    params = jax.tree.map(np.asarray, jax.device_get(nnx.state(model)))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(tmp, "params"), params)
    ckptr.wait_until_finished()
    tokenizer.save(os.path.join(tmp, "tokenizer"))
    with open(os.path.join(tmp, "teacher.json"), "w", encoding="utf-8") as f:
      json.dump(_teacher_meta(model, tokenizer, info), f, indent=2, default=str)
    if os.path.exists(directory):
      shutil.rmtree(directory)
    os.rename(tmp, directory)
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)
  log.info("teacher: saved to %s", directory)
  return directory


def _teacher_meta(model: Decoder, tokenizer: Any, info: dict | None) -> dict:
  return {
    "format": TEACHER_FORMAT,
    "model": _model_fields(model.cfg),
    "tokenizer": {"fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size, "repr": repr(tokenizer)},
    "info": info or {},
  }


def _save_teacher_multiprocess(directory: str, model: Decoder, tokenizer: Any, info: dict | None) -> str:
  """`save_teacher` in a job of several processes: every process writes its shards of the parameters
  (orbax), process 0 alone writes ``teacher.json`` and the tokenizer and renames the directory into place."""
  from meshdistill.distributed import barrier, is_primary  # pylint: disable=g-import-not-at-top

  tmp = os.path.join(os.path.dirname(directory), f".tmp-{os.path.basename(directory)}-job")
  if is_primary():
    shutil.rmtree(tmp, ignore_errors=True)  # left by a job that died while saving
    os.makedirs(tmp)
  barrier("save_teacher:start")
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(tmp, "params"), nnx.state(model))
  ckptr.wait_until_finished()
  if is_primary():
    tokenizer.save(os.path.join(tmp, "tokenizer"))
    with open(os.path.join(tmp, "teacher.json"), "w", encoding="utf-8") as f:
      json.dump(_teacher_meta(model, tokenizer, info), f, indent=2, default=str)
    if os.path.exists(directory):
      shutil.rmtree(directory)
    os.rename(tmp, directory)
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
  with open(path, encoding="utf-8") as f:
    meta = json.load(f)
  if meta.get("format") != TEACHER_FORMAT:
    raise ValueError(f"{path}: format {meta.get('format')!r} is not {TEACHER_FORMAT!r}")
  return meta


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
  """
  directory = os.path.abspath(directory)
  meta = read_teacher_meta(directory)
  check_teacher_architecture(meta["model"], expected, directory)
  if tokenizer is not None and meta["tokenizer"]["fingerprint"] != tokenizer.fingerprint:
    raise ValueError(
      f"teacher {directory} was trained with tokenizer {meta['tokenizer']['repr']} (fingerprint "
      f"{meta['tokenizer']['fingerprint']}) but this run uses {tokenizer!r} (fingerprint {tokenizer.fingerprint}); "
      "use the same data.tokenizer as the teacher"
    )
  graphdef, abstract, shardings = abstract_params(expected, mesh)
  if shardings is None:
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  params = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), target)
  log.info("teacher: loaded %s", directory)
  return nnx.merge(graphdef, params)
