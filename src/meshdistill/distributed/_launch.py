"""The local launcher: N local CPU processes as one job (`launch`, `local_env`, ``[pN]``-prefixed output).

Part of `meshdistill.distributed`; import the names from there.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from meshdistill.distributed._runtime import ENV, LOCAL_HEARTBEAT_TIMEOUT, DistributedError


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
  ``grace_s`` seconds, and its code is returned (minus the signal number when a signal stopped it, as
  `subprocess` reports it; the log then names the signal and says to rerun the command, since such a process
  printed no advice of its own); 0 when every process succeeded. Ctrl-C stops them all.

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
          out.write(f"[launch] process {i} {_ended(code)}; stopping the others\n")
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
  if failed < 0:  # a process stopped by a signal printed no advice of its own
    out.write("[launch] the job stopped; rerun the same command to resume (distill: from the last checkpoint; "
              "cache-teacher: from the shards written)\n")
    out.flush()
  return failed


def _ended(code: int) -> str:
  """How a child process ended, for the launcher's log: its exit code, or the signal that stopped it."""
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f"signal {-code}"
    why = " (a native library aborted it: its message is above)" if -code == signal.SIGABRT else ""
    return f"was stopped by {name}{why}"
  return f"exited with code {code}"
