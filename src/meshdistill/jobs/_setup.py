"""What every job starts from: the devices and the mesh, the data, the run directory (its lock, monitor and
``config.yaml``), and the line reporter jobs write progress with."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import IO

from meshdistill.config import Config, ConfigError, dump_config
from meshdistill.fsutil import RunLock
from meshdistill.monitor import Monitor

log = logging.getLogger("meshdistill.jobs")  # the package's logger: records keep the name they always had


def prepare_devices(cfg: Config) -> None:
  """Makes the devices the mesh needs exist. Call before anything starts JAX.

  ``mesh.simulate_cpu_devices``: ``auto`` asks the CPU platform for ``data * tensor`` devices
  (it only affects the CPU platform: on a GPU/TPU machine JAX still uses the accelerators);
  ``true`` also forces the CPU platform; ``false`` leaves devices as they are. In a job of several
  processes (`meshdistill.distributed.initialize` first) each process simulates its share.
  """
  from meshdistill.distributed import local_device_share  # pylint: disable=g-import-not-at-top
  from meshdistill.mesh import simulate_cpu_devices  # pylint: disable=g-import-not-at-top

  sim = cfg.mesh.simulate_cpu_devices
  if sim is False:
    return
  if sim is True:
    os.environ["JAX_PLATFORMS"] = "cpu"
  n = cfg.mesh.devices
  if cfg.models.teacher_devices:  # the teacher's own mesh takes devices beside the student's
    n += cfg.models.teacher_devices["data"] * cfg.models.teacher_devices["tensor"]
  if n > 1 or sim is True:
    simulate_cpu_devices(local_device_share(n))


def build_mesh(cfg: Config):
  """The run's mesh (None for the ``single`` backend)."""
  from meshdistill.distributed import data_shard, process_count  # pylint: disable=g-import-not-at-top
  from meshdistill.layout import BACKENDS, layout_class  # pylint: disable=g-import-not-at-top
  from meshdistill.mesh import make_mesh  # pylint: disable=g-import-not-at-top

  layout = layout_class(cfg.mesh.backend)
  if process_count() > 1 and not layout.spans_processes:
    spanning = [name for name in BACKENDS if layout_class(name).spans_processes]
    raise ConfigError(
      f"mesh.backend={cfg.mesh.backend!r} cannot span the {process_count()} processes of this job; use "
      f"mesh.backend={spanning[0]}"
    )
  if layout.one_device:
    return None
  try:
    mesh = make_mesh(data=cfg.mesh.data, tensor=cfg.mesh.tensor)
    data_shard(mesh)  # each process's share of a batch is well defined
    return mesh
  except ValueError as e:
    raise ConfigError(
      f"{e}. Set the layout with e.g. --set mesh.data=1 --set mesh.tensor=1 (or mesh.backend=single), "
      "or run on simulated CPU devices with --set mesh.simulate_cpu_devices=true"
    ) from None


def load_data(cfg: Config, batch_size: int | None = None, mesh=None):
  """The data bundle of ``cfg`` for the distillation batch size; checks the vocabulary fits the models.

  In a job of several processes each process reads the rows of every batch its devices of ``mesh``
  hold (`meshdistill.distributed.data_shard`).
  """
  from meshdistill.data import build_data  # pylint: disable=g-import-not-at-top
  from meshdistill.distributed import data_shard  # pylint: disable=g-import-not-at-top

  index, count = data_shard(mesh)
  data = build_data(
    cfg.data, cfg.train.batch_size if batch_size is None else batch_size, process_index=index, process_count=count
  )
  vocab = data.tokenizer.vocab_size
  for who in ("teacher", "student"):
    have = getattr(cfg, who).vocab_size
    if have < vocab:
      raise ConfigError(
        f"{who}.vocab_size={have} is smaller than the tokenizer's vocabulary ({vocab} ids, "
        f"data.tokenizer={cfg.data.tokenizer!r}); set teacher.vocab_size={vocab} and student.vocab_size={vocab}"
      )
  return data


def with_batch_size(data, batch_size: int):
  """The same data bundle with another global batch size (no re-reading)."""
  return dataclasses.replace(data, global_batch_size=batch_size)


def _monitor(run_dir: str, steps: int, stream, name: str) -> Monitor:
  """The run's monitor; only process 0 writes ``metrics.jsonl`` and ``tb/`` (every process shows progress)."""
  from meshdistill.distributed import is_primary  # pylint: disable=g-import-not-at-top

  return Monitor(run_dir if is_primary() else None, steps, stream=stream, name=name)


def _run_lock(run_dir: str, what: str):
  """The run directory's `RunLock`, held by the process that writes its files (process 0)."""
  import contextlib  # pylint: disable=g-import-not-at-top

  from meshdistill.distributed import is_primary  # pylint: disable=g-import-not-at-top

  return RunLock(run_dir, what) if is_primary() else contextlib.nullcontext()


def _write_config(cfg: Config, run_dir: str) -> None:
  from meshdistill.distributed import is_primary  # pylint: disable=g-import-not-at-top

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
