"""Multi-process runtime: start-up settings (`resolve`, `initialize`), process queries, `agree_on`, `data_shard`.

Part of `meshdistill.parallel.distributed` (see its docstring for what each process does in a run); import the
names from there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

log = logging.getLogger("meshdistill.parallel.distributed")

ENV = {
    "coordinator": "MESHDISTILL_COORDINATOR",
    "num_processes": "MESHDISTILL_NUM_PROCESSES",
    "process_id": "MESHDISTILL_PROCESS_ID",
    "heartbeat_timeout": "MESHDISTILL_HEARTBEAT_TIMEOUT",
    "init_timeout": "MESHDISTILL_INIT_TIMEOUT",
}
AUTO = "auto"  # --coordinator auto: JAX's own cluster detection
LOCAL_HEARTBEAT_TIMEOUT = 10  # seconds, for processes on one machine (JAX's default is 100)
LOCAL_SHUTDOWN_TIMEOUT = 10  # seconds a finishing local process waits for the others (JAX's default: 300)

# Variables by which a cluster launcher announces a job of several processes; JAX's
# `jax.distributed.initialize()` knows how to read the rest of the settings from them.
_CLUSTER_HINTS = (
    ("JAX_COORDINATOR_ADDRESS", None),
    ("SLURM_NTASKS", "slurm"),
    ("OMPI_COMM_WORLD_SIZE", "ompi"),
    ("MEGASCALE_COORDINATOR_ADDRESS", None),
    ("TPU_WORKER_HOSTNAMES", None),
)


class DistributedError(ValueError):
  """A multi-process setting that cannot work (named, with what would)."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """How this process joins a job. ``coordinator=None``: one process, nothing to start.

  ``coordinator`` is ``HOST:PORT`` of process 0's coordination service, or ``"auto"`` for JAX's
  cluster auto-detection (then ``num_processes``/``process_id`` may stay None).
  """

  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout: int | None = None
  init_timeout: int | None = None

  @property
  def multi(self) -> bool:
    return self.coordinator is not None


def _int_setting(name: str, value, minimum: int) -> int | None:
  if value is None or value == "":
    return None
  try:
    v = int(value)
  except (TypeError, ValueError):
    v = None
  if v is None or v < minimum or str(value).strip() != str(v):
    raise DistributedError(f"{name}={value!r} must be an integer >= {minimum}")
  return v


def _cluster_detected(environ: Mapping[str, str]) -> str | None:
  """The variable that says a cluster launcher started several processes, or None."""
  for var, _ in _CLUSTER_HINTS:
    value = environ.get(var)
    if not value:
      continue
    if var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
      if value.isdigit() and int(value) > 1:
        return var
    elif var == "TPU_WORKER_HOSTNAMES":
      if len([h for h in value.split(",") if h.strip()]) > 1:
        return var
    else:
      return var
  return None


def resolve(
    coordinator: str | None = None,
    num_processes: int | str | None = None,
    process_id: int | str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
  """The `Settings` from command-line values (first), then ``MESHDISTILL_*`` variables, then a cluster.

  Raises:
    DistributedError: incomplete or inconsistent settings (the message names them).
  """
  env = os.environ if environ is None else environ
  coordinator = coordinator or env.get(ENV["coordinator"]) or None
  n = _int_setting("--num-processes", num_processes, 1) if num_processes is not None else None
  n = n if n is not None else _int_setting(ENV["num_processes"], env.get(ENV["num_processes"]), 1)
  i = _int_setting("--process-id", process_id, 0) if process_id is not None else None
  i = i if i is not None else _int_setting(ENV["process_id"], env.get(ENV["process_id"]), 0)
  heartbeat = _int_setting(ENV["heartbeat_timeout"], env.get(ENV["heartbeat_timeout"]), 1)
  init_timeout = _int_setting(ENV["init_timeout"], env.get(ENV["init_timeout"]), 1)
  if coordinator is None:
    if n is not None and n > 1 or i is not None and i > 0:
      raise DistributedError(
          f"num_processes={n}, process_id={i} given without a coordinator; pass --coordinator HOST:PORT (the address "
          f"of process 0, the same on every process) or set {ENV['coordinator']}, or --coordinator auto on a cluster"
      )
    hint = _cluster_detected(env)
    if hint is None:
      return Settings(heartbeat_timeout=heartbeat, init_timeout=init_timeout)
    log.info("distributed: %s is set; starting JAX's multi-process runtime with cluster auto-detection", hint)
    coordinator = AUTO
  if coordinator != AUTO:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
      raise DistributedError(
          f"coordinator={coordinator!r} must be HOST:PORT (e.g. 10.0.0.1:8476, process 0's address) or 'auto'"
      )
    missing = [name for name, v in (("--num-processes", n), ("--process-id", i)) if v is None]
    if missing:
      raise DistributedError(
          f"coordinator {coordinator} needs {' and '.join(missing)} (or {ENV['num_processes']} / {ENV['process_id']}); "
          "every process passes the same coordinator and process count and its own id 0..N-1"
      )
  if n is not None and i is not None and i >= n:
    raise DistributedError(f"process_id={i} must be smaller than num_processes={n} (ids are 0..{n - 1})")
  return Settings(coordinator, n, i, heartbeat, init_timeout)


_STARTED: Settings | None = None


def initialize(settings: Settings) -> bool:
  """Starts JAX's multi-process runtime for ``settings``; returns whether it did (False: one process).

  Call before anything creates an array or asks for devices. On the CPU platform the
  collectives between processes go through gloo. ``heartbeat_timeout`` (when set) bounds how
  long the others run on after a process dies, and a finishing process then waits at most
  ``max(heartbeat_timeout, LOCAL_SHUTDOWN_TIMEOUT)`` seconds for the rest. Calling it again with
  the same settings is a no-op.

  Raises:
    DistributedError: a backend already started, or settings other than the ones already in force.
  """
  global _STARTED
  if not settings.multi:
    return False
  if _STARTED is not None:
    if _STARTED != settings:
      raise DistributedError(f"the multi-process runtime already started with {_STARTED}, not {settings}")
    return True
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

  if xla_bridge.backends_are_initialized():
    raise DistributedError(
        "the multi-process runtime must start before JAX starts a backend (before any array or jax.devices()); "
        "call meshdistill.parallel.distributed.initialize first thing in the program"
    )
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = {}
  if settings.coordinator != AUTO:
    kwargs.update(
        coordinator_address=settings.coordinator, num_processes=settings.num_processes, process_id=settings.process_id
    )
  elif settings.num_processes is not None:
    kwargs["num_processes"] = settings.num_processes
  if settings.heartbeat_timeout is not None:
    kwargs["heartbeat_timeout_seconds"] = settings.heartbeat_timeout
    kwargs["shutdown_timeout_seconds"] = max(settings.heartbeat_timeout, LOCAL_SHUTDOWN_TIMEOUT)
  if settings.init_timeout is not None:
    kwargs["initialization_timeout"] = settings.init_timeout
  log.info("distributed: jax.distributed.initialize(%s)", kwargs)
  try:
    jax.distributed.initialize(**kwargs)
  except (ValueError, RuntimeError) as e:
    raise DistributedError(
        f"could not join the job as process {settings.process_id} of {settings.num_processes} via "
        f"{settings.coordinator}: {e}"
    ) from e
  _STARTED = settings
  return True


def _global_state():
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  return distributed.global_state


def process_count() -> int:
  """Processes in the job, known without starting a backend (1 until the runtime starts)."""
  state = _global_state()
  return int(state.num_processes) if state.client is not None and state.num_processes else 1


def process_index() -> int:
  """This process's index, known without starting a backend (0 in a single-process run)."""
  state = _global_state()
  return int(state.process_id) if state.client is not None and state.process_id is not None else 0


def is_primary() -> bool:
  """True on the process that writes the run's host files (process 0)."""
  return process_index() == 0


def local_device_share(devices: int) -> int:
  """Devices each process contributes to a mesh of ``devices`` (for simulated CPU devices).

  Raises:
    DistributedError: ``devices`` cannot be split evenly over the processes.
  """
  n = process_count()
  if devices % n:
    raise DistributedError(
        f"the mesh has {devices} devices, which {n} processes cannot share evenly; use mesh.data x mesh.tensor "
        f"divisible by {n} (e.g. --set mesh.data={n})"
    )
  return devices // n


def barrier(name: str, timeout_s: int = 600) -> None:
  """Waits until every process reaches the barrier ``name`` (no-op with one process)."""
  if process_count() == 1:
    return
  _global_state().client.wait_at_barrier(f"meshdistill:{name}", timeout_in_ms=timeout_s * 1000)


def agree_on(value: int | None, what: str) -> int | None:
  """Process 0's ``value`` (a non-negative int or None) on every process; ``value`` itself with one process.

  For host decisions read from the file system rather than from a replicated array: which
  checkpoint step to resume from must be the same on every process, even where a shared file
  system lists directories with some delay.
  """
  if process_count() == 1:
    return value
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  got = int(multihost_utils.broadcast_one_to_all(np.int64(-1 if value is None else value)))
  got = None if got < 0 else got
  if got != value:
    log.warning("distributed: %s is %s here, %s on process 0; using process 0's", what, value, got)
  return got


def any_process(flag: bool, what: str) -> bool:
  """Whether ``flag`` holds on at least one process (``flag`` itself with one process).

  Every process must call it at the same point of its program (it is a collective): the training loop
  asks it at the same steps on every process, so a stop request that reached one process (a signal sent
  to one host) stops all of them after the same step instead of leaving the others waiting in the next
  step's collectives.
  """
  if process_count() == 1:
    return bool(flag)
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  flags = np.asarray(multihost_utils.process_allgather(np.int32(bool(flag))))
  if bool(flags.any()) and not flag:
    log.warning("distributed: %s on process(es) %s, not here; following them", what,
                [int(i) for i in np.flatnonzero(flags)])
  return bool(flags.any())


def data_shard(mesh) -> tuple[int, int]:
  """``(index, count)``: this process reads part ``index`` of ``count`` equal parts of every global batch.

  The part is the batch rows held by the mesh rows (``data`` indices) of this process's devices.
  With whole mesh rows per process (``mesh.data`` a multiple of the process count, e.g. 2
  processes x 4 devices on 2x4) that is ``(process_index, process_count)``; when several
  processes share mesh rows (one GPU per process and ``tensor`` spanning a host's GPUs) they
  read the same part, and `meshdistill.host_to_global` builds the global batch from it.

  Raises:
    DistributedError: a process's devices hold scattered rows, or processes hold overlapping
      but different rows (the message says which layouts work).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  n = jax.process_count()
  if n == 1:
    return 0, 1
  if mesh is None:
    raise DistributedError(
        f"mesh.backend=single runs on one device, but this job has {n} processes; use mesh.backend=shard_map"
    )
  owners = np.vectorize(lambda d: d.process_index)(mesh.devices)  # [data, tensor] process of each device
  got = batch_part(owners, jax.process_index())
  if got is None:
    raise DistributedError(
        f"mesh data={owners.shape[0]} x tensor={owners.shape[1]} over {n} processes: each process's devices must "
        "hold consecutive rows of the data axis, one equal share of every batch per process or per group of "
        f"processes; use mesh.data a multiple of {n} with mesh.tensor at most {jax.local_device_count()} (one "
        "process's devices), or mesh.tensor a multiple of the devices per process"
    )
  return got


def batch_part(owners_DxT, process: int) -> tuple[int, int] | None:
  """`data_shard` for a mesh whose device ``[d, t]`` belongs to process ``owners_DxT[d, t]`` (None: no layout).

  Rows of the mesh are batch parts; a process reads the part its devices' rows form. Those rows
  must be consecutive, and the distinct parts of all processes equal and covering every row.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top

  owners_DxT = np.asarray(owners_DxT)
  rows = owners_DxT.shape[0]
  spans = {}
  for p in np.unique(owners_DxT):
    held = np.flatnonzero((owners_DxT == p).any(axis=1))
    if held[-1] + 1 - held[0] != held.size:  # scattered rows
      return None
    spans[int(p)] = (int(held[0]), int(held[-1]) + 1)
  parts = sorted(set(spans.values()))
  size = rows // len(parts)
  if parts != [(k * size, (k + 1) * size) for k in range(len(parts))] or process not in spans:
    return None
  return parts.index(spans[process]), len(parts)

