"""What every job starts from: the devices and the mesh, the data, the run directory (its lock, monitor and
``config.yaml``), and the line reporter jobs write progress with."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import IO

from meshdistill.config import Config, ConfigError, dump_config
from meshdistill.core.fsutil import LOCK_FILE, RunLock
from meshdistill.train.loop.loggers import WANDB_DIR, WANDB_ID_FILE
from meshdistill.train.loop.monitor import Monitor
from meshdistill.core.ownership import MARKER, OutputKind, check_owned, read_marker, refuse_links, write_marker
from meshdistill.data import build_data
from meshdistill.models import ModelConfig
from meshdistill.parallel.distributed import agree_on, data_shard, is_primary, local_device_share, process_count
from meshdistill.parallel.distributed.platforms import cpu_only
from meshdistill.parallel.backends import BACKENDS, layout_class
from meshdistill.parallel.mesh import make_mesh, simulate_cpu_devices
from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.teachers import kinds

log = logging.getLogger("meshdistill.jobs")  # the package's logger: records keep the name they always had


def prepare_devices(cfg: Config) -> Config:
  """Makes the devices the mesh needs exist and returns ``cfg`` with its mesh decided (`resolve_mesh`). Call
  before anything starts JAX.

  ``mesh.simulate_cpu_devices``: ``auto`` asks the CPU platform for ``data * tensor`` devices
  (it only affects the CPU platform: on a GPU/TPU machine JAX still uses the accelerators);
  ``true`` also forces the CPU platform; ``false`` leaves devices as they are. In a job of several
  processes (`meshdistill.parallel.distributed.initialize` first) each process simulates its share.
  """
  sim = cfg.mesh.simulate_cpu_devices
  if sim is True:
    os.environ["JAX_PLATFORMS"] = "cpu"
  if sim is not False and cpu_only():
    cfg = resolve_mesh(cfg)  # no accelerator: decided without starting JAX, before the simulated devices exist
    n = cfg.mesh.devices
    n += kinds.for_config(cfg).extra_devices()  # a teacher on its own mesh takes devices beside the student's
    if n > 1 or sim is True:
      simulate_cpu_devices(local_device_share(n))
  return resolve_mesh(cfg)


def resolve_mesh(cfg: Config) -> Config:
  """``cfg`` with ``mesh.data`` / ``mesh.tensor`` of ``auto`` decided for the devices present
  (`meshdistill.config.MeshSettings.resolved`: without an accelerator the reference 2 x 4 on simulated CPU devices;
  on accelerators all of them, less those a teacher on its own mesh takes); ``cfg`` itself when nothing is auto.
  Starts JAX when accelerators are to be counted. The decision is logged in one line."""
  if not cfg.mesh.auto:
    return cfg
  accelerators = None
  if not cpu_only():
    import jax  # pylint: disable=g-import-not-at-top -- JAX starts here, after prepare_devices / initialize

    accelerators = jax.device_count() - kinds.for_config(cfg).extra_devices()
  mesh = cfg.mesh.resolved(accelerators, cfg.train.batch_size)
  where = "no accelerator: the reference layout" if accelerators is None else f"{accelerators} accelerator(s)"
  log.info("mesh auto -> data=%s x tensor=%s (%s)", mesh.data, mesh.tensor, where)
  return dataclasses.replace(cfg, mesh=mesh)


def checkpoint_layout(model: ModelConfig, checkpoint_dir: str, who: str = "student") -> ModelConfig:
  """``model`` with ``scan_layers: auto`` taken from the newest checkpoint in ``checkpoint_dir`` (its record of the
  trained model, ``who``) when there is one: a train state resumes in the blocks layout it was written in, so a run
  moved between an accelerator (where ``auto`` stacks the blocks) and a CPU resumes there. ``model`` itself when its
  layout is given or nothing was written yet."""
  if model.scan_layers != "auto":
    return model
  # Opening a checkpoint manager is a collective: every process takes process 0's answer on whether there is one.
  if not agree_on(int(os.path.isdir(checkpoint_dir)), "whether the run has a checkpoint directory"):
    return model
  ckpt = Checkpointer(checkpoint_dir, every=0, read_only=True)
  try:
    stored = ckpt.read_meta().get(who, {}).get("scan_layers") if ckpt.latest_step() is not None else None
  finally:
    ckpt.close()
  return model.replace(scan_layers=stored) if isinstance(stored, bool) else model


def build_mesh(cfg: Config):
  """The run's mesh (None for the ``single`` backend)."""
  layout = layout_class(cfg.mesh.backend)
  if process_count() > 1 and not layout.spans_processes:
    spanning = [name for name in BACKENDS if layout_class(name).spans_processes]
    raise ConfigError(
      f"mesh.backend={cfg.mesh.backend!r} cannot span the {process_count()} processes of this job; use "
      f"mesh.backend={spanning[0]}"
    )
  if layout.one_device:
    return None
  cfg = resolve_mesh(cfg)
  try:
    mesh = make_mesh(data=cfg.mesh.data, tensor=cfg.mesh.tensor, axes=cfg.mesh.axes)
    data_shard(mesh)  # each process's share of a batch is well defined
    return mesh
  except ValueError as e:
    raise ConfigError(
      f"{e}. Set the layout with e.g. --set mesh.data=1 --set mesh.tensor=1 (or mesh.backend=single), "
      "or run on simulated CPU devices with --set mesh.simulate_cpu_devices=true"
    ) from None


def describe_devices(mesh, teacher_mesh=None) -> str:
  """One line naming the devices a job runs on: their kind and platform, the processes holding them (when several),
  and the mesh the student's step uses."""
  import jax  # pylint: disable=g-import-not-at-top -- JAX starts after prepare_devices

  devs = jax.devices()
  kinds = sorted({f"{d.device_kind} ({d.platform})" for d in devs})
  where = "one device" if mesh is None else "mesh " + " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
  n = jax.process_count()
  procs = "" if n == 1 else f" in {n} processes (this is process {jax.process_index()})"
  line = f"devices: {len(devs)} x {', '.join(kinds)}{procs}; the step runs on {where}"
  if teacher_mesh is not None:
    line += ", the teacher on its own mesh " + " x ".join(f"{k}={v}" for k, v in teacher_mesh.shape.items())
  return line


def load_data(cfg: Config, batch_size: int | None = None, mesh=None):
  """The data bundle of ``cfg`` for the distillation batch size; checks the vocabulary fits the models.

  In a job of several processes each process reads the rows of every batch its devices of ``mesh``
  hold (`meshdistill.parallel.distributed.data_shard`).
  """
  index, count = data_shard(mesh)
  data = build_data(
    cfg.data, cfg.train.batch_size if batch_size is None else batch_size, process_index=index, process_count=count
  )
  vocab = data.tokenizer.vocab_size
  for who in ("teacher", "student"):
    have = getattr(cfg, who).vocab_size
    if who == "teacher" and data.teacher_tokenizer is not None:  # a teacher of its own tokenizer
      if have < data.teacher_tokenizer.vocab_size:
        raise ConfigError(
          f"teacher.vocab_size={have} is smaller than the teacher tokenizer's vocabulary "
          f"({data.teacher_tokenizer.vocab_size} ids, data.teacher_tokenizer={cfg.data.teacher_tokenizer!r}); set "
          f"teacher.vocab_size={data.teacher_tokenizer.vocab_size}"
        )
      continue
    if have < vocab:
      raise ConfigError(
        f"{who}.vocab_size={have} is smaller than the tokenizer's vocabulary ({vocab} ids, "
        f"data.tokenizer={cfg.data.tokenizer!r}); set teacher.vocab_size={vocab} and student.vocab_size={vocab}"
      )
  return data


def with_batch_size(data, batch_size: int):
  """The same data bundle with another global batch size (no re-reading)."""
  return dataclasses.replace(data, global_batch_size=batch_size)


def _monitor(run_dir: str, steps: int, stream, name: str, cfg: Config | None = None) -> Monitor:
  """The run's monitor; only process 0 writes ``metrics.jsonl``, ``tb/`` and the other ``run.loggers`` of ``cfg``
  (W&B: with the config; every process shows progress)."""
  if cfg is None:
    return Monitor(run_dir if is_primary() else None, steps, stream=stream, name=name)
  return Monitor(run_dir if is_primary() else None, steps, stream=stream, name=name, loggers=cfg.run.loggers,
                 config=cfg.to_dict() if "wandb" in cfg.run.loggers else None)


RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", LOCK_FILE, MARKER,  # files a run writes (never links)
             WANDB_ID_FILE)
RUN_ENTRIES = (*RUN_FILES, "checkpoints", "tb", "plots", "profile", WANDB_DIR)  # and directories; teacher-<key>:
                                                                                # pretraining


def _is_run_entry(name: str) -> bool:
  return (name in RUN_ENTRIES or name.startswith("teacher-")
          or any(name.startswith(f".tmp-{f}-") for f in RUN_FILES))  # a rename interrupted by a kill


def _earlier_run(path: str) -> str | None:
  """None when a marker-less ``path`` is a run directory an earlier version wrote (a checkpoint step, a
  ``metrics.jsonl`` of meshdistill rows, or a pretraining run directory of its own inside); else why not."""
  import json  # pylint: disable=g-import-not-at-top

  entries = [n for n in os.listdir(path) if n not in (LOCK_FILE, MARKER)]
  if not entries:
    return None  # a run killed before it wrote anything
  ckpt = os.path.join(path, "checkpoints")
  if os.path.isdir(ckpt) and any(n.isdigit() and os.path.isdir(os.path.join(ckpt, n, "meta"))
                                 for n in os.listdir(ckpt)):
    return None
  metrics = os.path.join(path, "metrics.jsonl")
  if os.path.isfile(metrics):
    with open(metrics, encoding="utf-8", errors="replace") as f:
      lines = [x for x in f.read().splitlines() if x.strip()]
    try:
      rows = [json.loads(x) for x in lines[:-1]]  # the last line may be torn
    except ValueError:
      rows = [None]
    if lines and all(isinstance(r, dict) and "step" in r and "split" in r for r in rows) and lines[0].startswith("{"):
      return None
  for n in entries:
    sub = os.path.join(path, n)
    if n.startswith("teacher-") and os.path.isdir(sub) and not os.path.islink(sub):
      marker = read_marker(sub)
      if (marker is not None and marker["kind"] == "run") or _earlier_run(sub) is None:
        return None
  return "no checkpoint step and no metrics.jsonl of meshdistill rows"


RUN_KIND = OutputKind("run", "run directory", _is_run_entry, _earlier_run)


def claim_run_dir(run_dir: str) -> None:
  """Raises unless ``run_dir`` may hold this run: new, empty, or a meshdistill run directory (its owner marker,
  or an earlier version's run) with no symlink where the run writes a file or a directory (`checkpoints/`, `tb/`,
  ...) (`meshdistill.core.ownership`)."""
  check_owned(run_dir, RUN_KIND, overwrite=None)
  if os.path.isdir(run_dir):  # files and directories (checkpoints/, tb/, teacher-<key>/ ...): never written through
    refuse_links(run_dir, tuple(sorted(n for n in os.listdir(run_dir) if _is_run_entry(n))))


def _clean_interrupted_saves(checkpoint_dir: str) -> None:
  """Removes the ``*.orbax-checkpoint-tmp*`` steps a killed save left (call only while holding the run's lock)."""
  import shutil  # pylint: disable=g-import-not-at-top

  if not os.path.isdir(checkpoint_dir) or os.path.islink(checkpoint_dir):
    return
  for n in sorted(os.listdir(checkpoint_dir)):
    if ".orbax-checkpoint-tmp" in n:
      log.warning("%s: removing %s, a checkpoint save that was interrupted", checkpoint_dir, n)
      full = os.path.join(checkpoint_dir, n)
      if os.path.isdir(full) and not os.path.islink(full):
        shutil.rmtree(full, ignore_errors=True)
      else:
        os.unlink(full)


class _run_lock:  # noqa: N801 -- used as a function
  """The run directory, held by the process that writes its files (process 0) for the life of the run.

  Entering checks the directory may hold the run (`claim_run_dir`: refused before any work), takes its
  `RunLock`, writes its owner marker when it has none, and removes the checkpoint saves a killed run left
  in ``checkpoint_dir`` (default ``<run_dir>/checkpoints``) -- never while another run holds the lock.
  """

  def __init__(self, run_dir: str, what: str, checkpoint_dir: str | None = None):
    self.run_dir, self.what = run_dir, what
    self.checkpoint_dir = checkpoint_dir or os.path.join(run_dir, "checkpoints")
    self.lock = RunLock(run_dir, what) if is_primary() else None

  def __enter__(self):
    if self.lock is None:
      return self
    claim_run_dir(self.run_dir)
    self.lock.acquire()
    try:
      if read_marker(self.run_dir) is None:
        write_marker(self.run_dir, RUN_KIND, {"job": self.what})
      _clean_interrupted_saves(self.checkpoint_dir)
    except BaseException:
      self.lock.release()
      raise
    return self

  def __exit__(self, *exc) -> None:
    if self.lock is not None:
      self.lock.release()


def _write_config(cfg: Config, run_dir: str) -> None:
  os.makedirs(run_dir, exist_ok=True)
  if is_primary():
    dump_config(cfg, os.path.join(run_dir, "config.yaml"))


def stream_reporter(stream: IO[str] | None):
  """A function writing one line to ``stream`` (or to the log when None)."""

  def say(text: str) -> None:
    if stream is None:
      log.info("%s", text)
    else:
      stream.write(text + "\n")
      stream.flush()

  return say
