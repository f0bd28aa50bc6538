"""The local launcher: N local CPU processes as one job (`launch`, `local_env`, ``[pN]``-prefixed output).

Part of `meshdistill.parallel.distributed`; import the names from there.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from meshdistill.parallel.distributed._runtime import ENV, LOCAL_HEARTBEAT_TIMEOUT, DistributedError


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
    stop_grace_s: float = 120.0,
    heartbeat_timeout: int = LOCAL_HEARTBEAT_TIMEOUT,
) -> int:
  """Runs ``command`` as ``num_processes`` local processes of one job; returns the job's exit code.

  Each process gets `local_env` (coordinator ``127.0.0.1:port``, its id, CPU platform, gloo) and its own
  session; its stdout and stderr are forwarded line by line to ``out`` (default stdout) prefixed with
  ``[pN] ``. When a process exits non-zero the others are sent SIGTERM, then SIGKILL after ``grace_s``
  seconds. A SIGTERM or SIGINT to the launcher (called from the main thread) is forwarded to every
  process's group (each then finishes its step or shard and saves it, `meshdistill.train.loop.stopping`); those
  still running ``stop_grace_s`` seconds later are killed; a second signal kills them at once.

  Returns:
    0 when every process succeeded; otherwise the first failing process's exit code, ``128 + N`` for a
    process ended by signal N (the shell's convention: 137 for SIGKILL, 134 for SIGABRT), so a stopped
    job exits 143 (SIGTERM) or 130 (SIGINT) like a single process. The log names the signal and says to
    rerun the command, since such a process printed no advice of its own.

  Raises:
    DistributedError: ``num_processes`` below 1, an empty command, or a command that cannot be started.
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
  procs: list[subprocess.Popen] = []

  def signal_all(sig: int) -> None:
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass

  for i in range(num_processes):
    try:
      procs.append(subprocess.Popen(  # pylint: disable=consider-using-with
          argv, env=local_env(i, num_processes, port, heartbeat_timeout=heartbeat_timeout),
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
      ))
    except OSError as e:  # not found, not executable
      signal_all(signal.SIGKILL)
      for p in procs:
        p.wait()
      raise DistributedError(f"launch cannot start {argv[0]!r}: {e.strerror or e}; give a command on the PATH "
                             "or a path to one, e.g. -- meshdistill distill --config tiny") from None
  sel = selectors.DefaultSelector()
  for i, p in enumerate(procs):
    os.set_blocking(p.stdout.fileno(), False)
    sel.register(p.stdout, selectors.EVENT_READ, i)
  partial = [b""] * num_processes
  failed: int | None = None
  deadline = None
  received: list[int] = []  # signals the launcher got, forwarded by the loop below

  def emit(i: int, data: bytes, final: bool = False) -> None:
    partial[i] += data
    *lines, partial[i] = partial[i].split(b"\n")
    if final and partial[i]:
      lines, partial[i] = [*lines, partial[i]], b""
    for line in lines:
      out.write(f"[p{i}] {line.decode(errors='replace')}\n")
    if lines:
      out.flush()

  def on_signal(signum, frame):  # noqa: ARG001
    received.append(signum)

  previous = _install(on_signal)
  forwarded = 0
  try:
    while sel.get_map():
      if len(received) > forwarded:  # forward here (not in the handler): one place sends signals
        sig = received[-1]
        if forwarded == 0:
          out.write(f"[launch] {signal.Signals(sig).name} received: forwarded to the processes; they stop after "
                    f"their step in flight (killed after {stop_grace_s:.0f} s; send it again to kill them now)\n")
          out.flush()
          signal_all(sig)
          deadline = time.monotonic() + stop_grace_s
        else:
          signal_all(signal.SIGKILL)
        forwarded = len(received)
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
          if not received:
            out.write(f"[launch] process {i} {_ended(code)}; stopping the others\n")
            out.flush()
            signal_all(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
      if deadline is not None and time.monotonic() > deadline:
        signal_all(signal.SIGKILL)
        deadline = None
    for p in procs:
      try:
        p.wait(timeout=grace_s)
      except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  finally:
    _restore(previous)
    signal_all(signal.SIGKILL)  # never leave a process behind (a no-op when all have ended)
  if failed is None:
    failed = next((p.returncode for p in procs if p.returncode), 0)
  if failed < 0:  # a process stopped by a signal printed no advice of its own
    out.write(f"[launch] a process {_ended(failed)}; the job stopped; rerun the same command to resume (distill: "
              "from the last checkpoint; cache-teacher: from the shards written)\n")
    out.flush()
    failed = 128 - failed
  return failed


def _install(handler) -> dict:
  """Installs ``handler`` for SIGTERM and SIGINT (main thread only); returns the previous handlers."""
  if threading.current_thread() is not threading.main_thread():
    return {}
  return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}


def _restore(previous: dict) -> None:
  for s, h in previous.items():
    signal.signal(s, h)


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
