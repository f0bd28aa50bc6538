"""Checkpoints (orbax): train states for exact resume (`Checkpointer`); teacher checkpoints re-exported.

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
latest loadable one (the half-written directory is ignored and cleaned up later). A save
that fails (a full disk) raises `CheckpointError` saying which step is still intact.

Saves are verified: orbax keeps no checksum of the array data (a flipped bit restores as a
silently wrong -- often NaN -- value), so after each save the SHA-256 of every file of the
step is written to ``<step>/checksums.json`` (`meshdistill.storage.checkpoint_steps`). A restore checks
them first: a list that leaves a file out (``{}``) counts as damage. A damaged step (a changed,
truncated, deleted or unlisted file) -- or any step that fails to restore, checksums or not -- is
named in a warning and the next older intact step is used. A resuming run moves damaged newer
steps aside to ``damaged-<step>-<time>`` (never trained on); with no intact step left,
`CheckpointError` lists every step and what is wrong with it.

Only steps the run wrote are read: a step directory that is a symbolic link (``checkpoints/6 -> another run's step
8``), a link anywhere inside a step, or a step whose ``meta`` records another step number (a step copied or renamed
into place) is refused with `CheckpointError` naming the path, before anything is restored, moved aside or saved.
What this cannot see: a real copy of another run's step under its own number (its checksums and ``meta`` are its
own); `meshdistill.train.loop.trainer.check_resumable` still refuses one written by a run of other settings.

Restoring onto a different mesh (saved on 2x4, resumed on 4x2 or 1x8): the caller passes a
freshly initialised state on the NEW layout as a template; every leaf becomes an abstract
``jax.ShapeDtypeStruct(shape, dtype, sharding=<new sharding>)`` and orbax reads each shard
straight into place.

The teacher cache (`save_teacher` / `load_teacher`): a directory with ``params/`` (orbax),
``teacher.json`` (its `ModelConfig`, the tokenizer's identity, how it was trained) and the
tokenizer itself. Loading checks the architecture field by field against the configured
teacher and the tokenizer against the run's. Those functions live in `meshdistill.teachers.checkpoint` (import them
from there: this module, below the teachers, does not re-export them).
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from meshdistill.storage.checkpoint_steps import (CHECKSUM_FILE, first_line, links_in, narrow_uint4, recorded_step,
                                                 verify_complete, widen_uint4)
from meshdistill.core.fsutil import file_digests, read_json, write_text_atomic
from meshdistill.models import Decoder, ModelConfig, abstract_params
from meshdistill.core.state import TrainState
from meshdistill.models.lora import abstract_lora
from meshdistill.models.stacking import to_scanned, to_unrolled

log = logging.getLogger(__name__)

ITEMS = ("state", "data", "meta")
# `ModelConfig` fields that change no parameter (how it computes; how a mesh pads / partitions it)
# (``scan_layers``, stacked vs per-layer blocks, is converted on load; the weights are cast to ``param_dtype`` on load)
COMPUTE_FIELDS = ("remat", "dtype", "attention", "vocab_multiple", "replicate_kv", "scan_layers", "param_dtype")

__all__ = [
  "CHECKSUM_FILE",
  "COMPUTE_FIELDS",
  "ITEMS",
  "CheckpointError",
  "Checkpointer",
]


class CheckpointError(RuntimeError):
  """A checkpoint could not be written, or no intact checkpoint is left to restore; the message says what to do."""


class _DoesNotFit(ValueError):
  """An intact step holding another train state than this run's (other sizes, strategy or optimizer)."""


def _not_damage(e: BaseException) -> bool:
  """Whether a restore failed for a reason of this machine (out of host or device memory), not of the files."""
  text = str(e)
  return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or "Out of memory" in text


class _ReadOnlyNotes(logging.Filter):
  """Drops orbax's notes that a read-only manager is read-only (``read_only=True, setting save_interval_steps=0``,
  ``Given directory is read only``): a `Checkpointer` opened read-only asked for exactly that, so they tell a user of
  ``eval`` / ``export`` / ``md.load_run`` nothing. Every other absl record passes."""

  NOTES = ("read_only=True, setting save_interval_steps", "Given directory is read only")

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(note in message for note in self.NOTES)


_READ_ONLY_NOTES = _ReadOnlyNotes()


class Checkpointer:
  """Saves and restores train states under ``directory`` (every ``every`` steps, newest ``keep`` kept).

  Args:
    directory: checkpoint root (created if missing, unless ``read_only``).
    every: save interval in steps for `maybe_save`; 0 = only explicit final saves.
    keep: number of newest checkpoints kept.
    read_only: never create or change anything under ``directory`` (evaluation): a damaged step is
      skipped but not moved aside.
  """

  def __init__(self, directory: str, *, every: int = 100, keep: int = 2, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    self.every = every
    self.read_only = read_only
    if read_only and not os.path.isdir(self.directory):
      raise FileNotFoundError(f"no checkpoint directory {self.directory}")
    if read_only and _READ_ONLY_NOTES not in logging.getLogger("absl").filters:
      logging.getLogger("absl").addFilter(_READ_ONLY_NOTES)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=None if read_only else keep, create=not read_only, enable_async_checkpointing=False, read_only=read_only
    )
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
    self._damaged: dict[int, str] = {}  # step -> what is wrong with it (found by `verify`)
    self._warned: set[int] = set()  # damaged steps already reported
    self._unverified: set[int] = set()  # steps without checksums (restored unverified)
    self.restored_step: int | None = None  # the step the last restore / restore_student / read_meta read

  def latest_step(self) -> int | None:
    """The newest completely written step (intact or not; see `intact_step`), or None."""
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, trainer, state: TrainState, data_state: dict, meta: dict) -> None:
    """Writes ``state`` (one replica of it: `meshdistill.parallel.layout.Layout.unreplicate`), the data position and
    ``meta`` as ``step``.

    Raises `CheckpointError` when the write fails (e.g. a full disk); earlier steps stay intact.
    """
    state = widen_uint4(trainer.layout.unreplicate(state))  # uint4 (nf4 weights): stored as uint8
    meta = {**meta, "step": int(step)}
    try:
      self._mgr.save(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)
        ),
        force=True,
      )
      self._mgr.wait_until_finished()
      if jax.process_index() == 0:  # one writer; orbax has finished the step on every process here
        digests = file_digests(self.step_dir(step), exclude=(CHECKSUM_FILE,))
        write_text_atomic(os.path.join(self.step_dir(step), CHECKSUM_FILE), json.dumps(digests, indent=1))
    except OSError as e:
      self._mgr.reload()
      intact = [s for s in sorted(self.all_steps(), reverse=True) if s != step]
      kept = f"step {intact[0]} is the newest checkpoint kept" if intact else "no earlier checkpoint exists"
      raise CheckpointError(
        f"could not write checkpoint step {step} to {self.directory} ({e}); {kept}. Free disk space (or choose "
        "another checkpoint.dir) and rerun the same command to resume"
      ) from e
    self._damaged.pop(step, None)
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

  # ------------------------------------------------------------------ verification
  def verify(self, step: int) -> str | None:
    """None when ``step``'s files match the checksums recorded when it was saved; else what is wrong."""
    if step in self._damaged:
      return self._damaged[step]
    path = os.path.join(self.step_dir(step), CHECKSUM_FILE)
    problem = None
    if not os.path.isfile(path):
      # Written before checksums existed, or the process died between orbax's final rename and the checksum
      # write: orbax's own commit marker says the step is complete, so it is used, unverified.
      if step not in self._warned:
        self._warned.add(step)
        log.warning("checkpoint step %d in %s records no checksums (an older meshdistill, or a process killed "
                    "right after saving it); restoring it unverified", step, self.directory)
      self._unverified.add(step)
      return None
    else:
      try:
        problem = verify_complete(self.step_dir(step), read_json(path, "checkpoint checksums"))
      except (OSError, ValueError) as e:
        problem = str(e)
    if problem is not None:
      self._damaged[step] = problem
    return problem

  def refuse_foreign(self) -> None:
    """Raises `CheckpointError` naming the first link in a step (the step directory itself, or an entry inside it):
    orbax follows links, so one to another run's step would restore that run's state as this run's. Nothing is read,
    moved or deleted."""
    for s in sorted(self.all_steps()):
      links = links_in(self.step_dir(s))
      if links:
        raise CheckpointError(
          f"checkpoint step {s} in {self.directory}: {links[0]} is a symbolic link (to {os.readlink(links[0])}); a "
          "run reads only the steps it wrote itself, so nothing was restored, moved or saved. Remove the link (to "
          "start from another run's weights, give them as the student: student.hf, student.init), or give another "
          "checkpoint.dir / run.run_dir"
        )

  def _refuse_renumbered(self, step: int) -> None:
    """Raises `CheckpointError` when ``step``'s ``meta`` records another step number: a step directory copied or
    renamed into place, not one this run saved as ``step``."""
    recorded = recorded_step(self.step_dir(step))
    if recorded is not None and recorded != step:
      raise CheckpointError(
        f"checkpoint step {step} in {self.directory}: {os.path.join(self.step_dir(step), 'meta', 'metadata')} "
        f"records step {recorded!r}, so {self.step_dir(step)} was copied or renamed there, not saved as step {step} "
        "by this run; nothing was restored, moved or saved. Move it out of the checkpoint directory (or give another "
        "checkpoint.dir / run.run_dir)"
      )

  def intact_step(self) -> int | None:
    """The newest step that passes `verify` (a warning names each damaged newer one), or None if no step exists.

    Raises `CheckpointError` when steps exist but none is intact, or when a step is not one this run wrote
    (`refuse_foreign`; a step whose ``meta`` records another step number).
    """
    self.refuse_foreign()
    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      return None
    for s in steps:
      if self.verify(s) is None:
        self._refuse_renumbered(s)
        return s
      if s not in self._warned:
        self._warned.add(s)
        log.warning("checkpoint step %d in %s is damaged (%s); trying an earlier step", s, self.directory,
                    self._damaged[s])
    listing = "; ".join(f"step {s}: {self._damaged[s]}" for s in steps)
    raise CheckpointError(
      f"no intact checkpoint in {self.directory} ({listing}). Nothing was restored; move the directory aside to "
      "start the run over"
    )

  def _set_aside(self, newer_than: int) -> None:
    """Moves damaged steps after ``newer_than`` to ``damaged-<step>-<time>`` so the run can save them anew."""
    if self.read_only or jax.process_index() != 0:
      return
    moved = False
    for s in sorted(self._damaged):
      if s > newer_than and os.path.isdir(self.step_dir(s)):
        dest = os.path.join(self.directory, f"damaged-{s}-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(self.step_dir(s), dest)
        log.warning("checkpoint: moved damaged step %d to %s", s, dest)
        moved = True
    if moved:
      self._mgr.reload()

  def read_meta(self, step: int | None = None) -> dict:
    """The ``meta`` item of ``step`` (default: the newest intact step, trying older ones as `restore` does)."""

    def read(s: int) -> dict:
      try:
        return dict(self._mgr.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
      except Exception as e:  # orbax / json errors do not name the file
        raise CheckpointError(
          f"checkpoint step {s}: {os.path.join(self.step_dir(s), 'meta')} cannot be read ({type(e).__name__}: {e})"
        ) from e

    return self._read_intact(step, read)

  def _restorable(self, step: int | None) -> int:
    """``step`` if it is intact (else `CheckpointError`); without one, the newest intact step."""
    if step is None:
      step = self.intact_step()
      if step is None:
        raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
    else:
      self.refuse_foreign()
      if self.verify(step) is not None:
        raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged ({self._damaged[step]})")
      self._refuse_renumbered(step)
    return step

  def _read_intact(self, step: int | None, read):
    """``read(s)`` of ``step`` (damaged: `CheckpointError`) or, without one, of the newest intact step.

    A step that fails to restore is damaged, like one whose checksums fail: without ``step`` it is reported
    with the same warning and the next older intact step is tried (`CheckpointError` when none is left). Only
    a verified step whose read raises `_DoesNotFit` raises that (this run's state has another shape: every
    step of the directory would fail alike). Sets ``restored_step``.
    """
    while True:
      s = self._restorable(step)
      try:
        got = read(s)
      except Exception as e:  # pylint: disable=broad-except  # tensorstore raises plain Exception on bad bytes
        if _not_damage(e):  # this machine failed (memory), not the files: keep the step, say so
          raise CheckpointError(f"checkpoint step {s} in {self.directory} verified but could not be restored on "
                                f"this machine ({type(e).__name__}: {first_line(e)}); it is kept as it is: rerun "
                                "with more memory (or fewer devices' worth of state per host)") from e
        if step is not None or (isinstance(e, _DoesNotFit) and s not in self._unverified):
          if isinstance(e, (_DoesNotFit, CheckpointError)):
            raise
          raise CheckpointError(f"checkpoint step {s} in {self.directory} cannot be restored "
                                f"({type(e).__name__}: {first_line(e)})") from e
        self._damaged[s] = f"cannot be restored: {type(e).__name__}: {first_line(e)}"
        self._warned.add(s)
        log.warning("checkpoint step %d in %s is damaged (%s); trying an earlier step", s, self.directory,
                    self._damaged[s])
        continue
      self.restored_step = s
      return got

  def restore(self, trainer, template: TrainState, step: int | None = None) -> tuple[TrainState, dict, dict]:
    """Restores ``(state, data_state, meta)`` of ``step`` (default: the newest intact) onto ``template``'s layout.

    ``template`` is a fresh ``trainer.init_state()`` on the mesh to resume on, which may
    differ from the mesh the checkpoint was written on. Without ``step``, damaged steps (checksums that fail,
    or a step that fails to restore) are skipped with a warning; damaged steps newer than the one restored are
    moved aside (unless ``read_only``).
    """
    narrow = trainer.layout.checkpoint_target(template)
    target = widen_uint4(narrow)

    def read(s: int):
      try:
        return self._mgr.restore(
          s,
          args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()
          ),
        )
      except (ValueError, KeyError, TypeError) as e:
        raise _DoesNotFit(
          f"checkpoint step {s} in {self.directory} does not fit this run's train state ({e}); it was written "
          "by a run with other model sizes, another strategy/optimizer or the other student.scan_layers (stacked vs "
          "per-layer blocks; restore_student / export read either): use another checkpoint.dir or run_dir, or the "
          "run's own scan_layers"
        ) from e

    got = self._read_intact(step, read)
    step = self.restored_step
    self._set_aside(step)
    state = trainer.layout.replicate(narrow_uint4(got.state, narrow))
    if any(s > step for s in self._damaged):
      newer = ", ".join(str(s) for s in sorted(self._damaged) if s > step)
      log.warning("checkpoint: restored step %d from %s instead of the damaged step(s) %s", step, self.directory,
                  newer)
    else:
      log.info("checkpoint: restored step %d from %s", step, self.directory)
    return state, dict(got.data), dict(got.meta)

  def restore_student(self, cfg: ModelConfig, mesh: Mesh | None, step: int | None = None, lora=None) -> Decoder:
    """Only the student of a distillation checkpoint (no optimizer state, no teacher), onto ``mesh``.

    ``cfg`` is the student's `ModelConfig`; each weight is read straight into its `tensor` shards.
    Default: the newest intact step (falling back as `restore` does; ``restored_step`` says which was read); an
    explicit damaged ``step`` raises `CheckpointError`.
    ``lora``: the run's `meshdistill.models.lora.LoraConfig` when its student holds adapters (the
    returned student then holds them too; `merge_lora` folds them in). A student stored with the other
    ``scan_layers`` (stacked vs per-layer blocks) is read as stored and converted to ``cfg``'s layout.
    """
    return self._read_intact(step, lambda s: self._read_student_any_layout(s, cfg, mesh, lora))

  def _read_student_any_layout(self, step: int, cfg: ModelConfig, mesh: Mesh | None, lora) -> Decoder:
    cfg = cfg.with_scan_on(mesh)
    try:
      return self._read_student(step, cfg, mesh, lora)
    except ValueError:
      if lora is not None and lora.enabled:
        raise
      try:  # written with the other blocks layout (scan_layers): read it as such, then convert
        other = self._read_student(step, cfg.replace(scan_layers=not cfg.scan_layers), mesh, None)
      except ValueError:
        pass
      else:
        log.info("checkpoint: student of step %d stored with scan_layers=%s, converted", step, not cfg.scan_layers)
        return to_scanned(other) if cfg.scan_layers else to_unrolled(other)
      raise

  def _read_student(self, step: int, cfg: ModelConfig, mesh: Mesh | None, lora) -> Decoder:
    if lora is not None and lora.enabled:
      graphdef, abstract, shardings = abstract_lora(cfg, lora, mesh)
    else:
      graphdef, abstract, shardings = abstract_params(cfg, mesh)
    one = SingleDeviceSharding(jax.devices()[0])
    where = jax.tree.map(lambda _: one, abstract) if shardings is None else shardings
    target = {"params": {"student": jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, where)}}
    narrow, target = target, widen_uint4(target)
    args = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    try:
      got = self._mgr.restore(step, args=ocp.args.Composite(state=args))
    except (ValueError, KeyError, TypeError) as e:
      raise _DoesNotFit(
          f"checkpoint step {step} in {self.directory} holds no student of this shape ({e}); it was written by a "
          "run with other model sizes"
      ) from e
    student = got.state["params"]["student"]
    missing = [p for p, x in jax.tree_util.tree_leaves_with_path(student) if isinstance(x, jax.ShapeDtypeStruct)]
    if missing:  # a partial restore leaves what the checkpoint lacks abstract
      raise _DoesNotFit(
          f"checkpoint step {step} in {self.directory} holds no student weight {jax.tree_util.keystr(missing[0])} "
          f"of this model (scan_layers={cfg.scan_layers}); it was written by a run with other model sizes"
      )
    return nnx.merge(graphdef, narrow_uint4(student, narrow["params"]["student"]))

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()
