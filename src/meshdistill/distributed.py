"""Several processes, one job: JAX's multi-controller start-up, the local launcher, process-0 duties.

On a TPU pod slice or a GPU cluster every host runs the same ``meshdistill`` command as its own
Python process. Each process drives its local devices; together they see every device of the
job (``jax.devices()``), build the same mesh and run the same compiled programs, whose
collectives cross the processes. This module

* starts that runtime (`initialize`) before anything touches a backend, from the
  ``--coordinator`` / ``--num-processes`` / ``--process-id`` flags, the ``MESHDISTILL_*``
  environment variables (`ENV`), or the variables cluster launchers set (JAX's own
  auto-detection: Cloud TPU pod slices, SLURM, Open MPI, Kubernetes jobs);
* launches N local CPU processes as one job for development and tests (`launch`, the
  ``meshdistill launch`` command): gloo collectives, ``[pN]``-prefixed output, and when one
  process fails the rest are stopped and the launcher exits non-zero;
* answers the questions the rest of the code asks: `process_count` / `is_primary` without
  starting a backend, `barrier`, `data_shard` (which rows of each batch this process reads).

What each process does in a run (see also README.md, "Several hosts"):

* data: every process builds the same `DataBundle` and reads only its own contiguous slice of
  every global batch (`meshdistill.data.process_slice`); `meshdistill.host_to_global` assembles
  the slices with ``jax.make_array_from_process_local_data``. A global batch depends only on the
  data, the seed and the GLOBAL batch size, so the global batch at every step is the
  single-process one, and the saved data position (a global batch index) resumes on any
  process count;
* checkpoints: orbax writes every process's shards and commits once (the primary process
  finalises the step directory after a barrier); restoring reads each shard straight onto the
  new layout, on any process count;
* host files: ``config.yaml``, ``metrics.jsonl``, ``tb/``, ``summary.json``, plots and the
  teacher cache's ``teacher.json``/tokenizer are written by process 0 only (`is_primary`);
  every process prints its own progress line (a launcher shows them with a ``[pN]`` prefix).

Host decisions are identical on every process. Every value the loop reads from a device to
decide something -- the divergence guard's loss, the skipped-update count, the learning rate,
evaluation sums -- is a REPLICATED output of one SPMD program: the train step returns the loss
with ``out_specs=P()`` after a ``psum`` over ``data``, so every device of every process holds
the result of the same all-reduce, and every process reads its own copy of the same bits. The
rest of what the loop branches on (step counters, checkpoint cadence, the guard's history) is
a function of those values and of the configuration, which every process loads identically.
The one decision read from the file system, the step to resume from, is process 0's on every
process (`agree_on`); orbax's list of saved steps then changes only through saves, which every
process makes together. So no process can take a branch (restore, switch to the fallback loss,
save, stop) that another does not take, which would leave the others waiting in a collective.
`tests/test_multiprocess.py` checks it: both processes of a 2-process run print the same loss
(as displayed, 4 decimals) at every step, and process 0's logged losses equal a 1-process run's.

Failure: when a process dies, the others stop with an error instead of waiting forever. Its
peers' next collective fails (gloo on CPU: the connection closes), and the coordination service
notices the missing heartbeats after ``heartbeat_timeout`` seconds and stops every process. The
local launcher sets short timeouts (`LOCAL_HEARTBEAT_TIMEOUT`); on a cluster JAX's defaults
apply unless ``MESHDISTILL_HEARTBEAT_TIMEOUT`` is set. A rerun of the same command resumes
from the last finished checkpoint (orbax only ever finalises complete steps).

The run directory must be on a file system every process sees (NFS, GCS through gcsfuse,
...): every process reads the configuration, the teacher and the checkpoints from it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

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
        "call meshdistill.distributed.initialize first thing in the program"
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


# --------------------------------------------------------------------------- local launcher
def free_port() -> int:
  """A TCP port free on 127.0.0.1 right now (for a local coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def local_env(
    process_id: int, num_processes: int, port: int, base: Mapping[str, str] | None = None,
    heartbeat_timeout: int = LOCAL_HEARTBEAT_TIMEOUT,
) -> dict[str, str]:
  """The environment of local process ``process_id`` of a job coordinated on ``127.0.0.1:port`` (CPU)."""
  env = dict(os.environ if base is None else base)
  env.update({
      ENV["coordinator"]: f"127.0.0.1:{port}",
      ENV["num_processes"]: str(num_processes),
      ENV["process_id"]: str(process_id),
      ENV["heartbeat_timeout"]: str(heartbeat_timeout),
      "JAX_PLATFORMS": "cpu",
      "PYTHONUNBUFFERED": "1",
  })
  return env


def command_line(command: Sequence[str]) -> list[str]:
  """``command`` with a leading ``meshdistill`` run by this Python (``python -m meshdistill``)."""
  command = list(command)
  if command and command[0] == "meshdistill":
    return [sys.executable, "-m", "meshdistill", *command[1:]]
  return command


def launch(
    num_processes: int,
    command: Sequence[str],
    *,
    port: int | None = None,
    out=None,
    grace_s: float = 10.0,
    heartbeat_timeout: int = LOCAL_HEARTBEAT_TIMEOUT,
) -> int:
  """Runs ``command`` as ``num_processes`` local processes of one job; returns the job's exit code.

  Each process gets `local_env` (coordinator ``127.0.0.1:port``, its id, CPU platform, gloo);
  its stdout and stderr are forwarded line by line to ``out`` (default stdout) prefixed with
  ``[pN] ``. When a process exits non-zero the others are sent SIGTERM, then SIGKILL after
  ``grace_s`` seconds, and its code is returned; 0 when every process succeeded. Ctrl-C stops them all.

  Raises:
    DistributedError: ``num_processes`` below 1 or an empty command.
  """
  if not isinstance(num_processes, int) or num_processes < 1:
    raise DistributedError(f"--processes={num_processes!r} must be a positive integer")
  if not command:
    raise DistributedError(
        "launch needs a command after --, e.g. meshdistill launch --processes 2 -- meshdistill distill"
    )
  out = out or sys.stdout
  port = port or free_port()
  argv = command_line(command)
  procs = []
  for i in range(num_processes):
    procs.append(subprocess.Popen(  # pylint: disable=consider-using-with
        argv, env=local_env(i, num_processes, port, heartbeat_timeout=heartbeat_timeout),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    ))
  sel = selectors.DefaultSelector()
  for i, p in enumerate(procs):
    os.set_blocking(p.stdout.fileno(), False)
    sel.register(p.stdout, selectors.EVENT_READ, i)
  partial = [b""] * num_processes
  failed: int | None = None
  deadline = None

  def emit(i: int, data: bytes, final: bool = False) -> None:
    partial[i] += data
    *lines, partial[i] = partial[i].split(b"\n")
    if final and partial[i]:
      lines, partial[i] = [*lines, partial[i]], b""
    for line in lines:
      out.write(f"[p{i}] {line.decode(errors='replace')}\n")
    if lines:
      out.flush()

  def signal_all(sig: int) -> None:
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass

  try:
    while sel.get_map():
      for key, _ in sel.select(timeout=0.2):
        i = key.data
        try:
          data = os.read(key.fileobj.fileno(), 65536)
        except BlockingIOError:
          continue
        if data:
          emit(i, data)
        else:
          emit(i, b"", final=True)
          sel.unregister(key.fileobj)
      for i, p in enumerate(procs):
        code = p.poll()
        if code is not None and code != 0 and failed is None:
          failed = code
          out.write(f"[launch] process {i} exited with code {code}; stopping the others\n")
          out.flush()
          signal_all(signal.SIGTERM)
          deadline = time.monotonic() + grace_s
      if deadline is not None and time.monotonic() > deadline:
        signal_all(signal.SIGKILL)
        deadline = None
  except KeyboardInterrupt:
    signal_all(signal.SIGINT)
    failed = 130
  for p in procs:
    try:
      p.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()
  if failed is None:
    failed = next((p.returncode for p in procs if p.returncode), 0)
  return failed
