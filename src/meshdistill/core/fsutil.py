"""Files a run writes: atomic output directories, content digests, one run per run directory.

Three rules every command follows (see ``benchmarks/results/reliability.md``):

* An output directory is built in a temporary sibling (``.tmp-<name>-XXXX`` next to it) and
  renamed into place when complete (`atomic_output_dir`), so a reader never sees a half-written
  output and a failed write leaves what was there before. Files and directories made this way get
  the modes any new one gets (the umask), not ``tempfile``'s ``0600`` / ``0700``. Symlinks inside an
  old target are never written through: the new directory is a fresh one.
* What the user did not create is never deleted or overwritten: an output directory is replaced
  or reused only when its owner marker proves meshdistill wrote it (`meshdistill.core.ownership`), so
  ``--out .`` or ``--out ~`` is refused. Nothing is written through a symlink (`SymlinkError`): the
  lock and ``metrics.jsonl`` open with ``O_NOFOLLOW``, other files are renamed into place.
* One run per run directory: `RunLock` holds an OS lock (``fcntl.flock``) on
  ``<run_dir>/.meshdistill.lock`` for the life of the run. The OS drops the lock when the
  process ends, however it ends, so a lock file left by a killed run is stale by construction:
  it is detected (its owner's pid is no longer alive or no longer holds it) and taken over.

`file_digests` / `verify_digests` record and check SHA-256 digests of a directory's files
(checkpoint steps and the teacher cache use them to detect damaged files).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

LOCK_FILE = ".meshdistill.lock"


class OutputExistsError(FileExistsError):
  """An output target exists and holds files; the message says how to proceed."""


class SymlinkError(OutputExistsError):
  """A symlink where meshdistill would write a file: never written through."""

  def __init__(self, path: str):
    super().__init__(
      f"{path} is a symbolic link (to {os.readlink(path) if os.path.islink(path) else '?'}); meshdistill never "
      "writes through a link: remove the link, or choose another run.run_dir / output directory"
    )
    self.path = path


class RunLockedError(RuntimeError):
  """Another live process holds the run directory's lock."""


# --------------------------------------------------------------------------- output directories
@contextlib.contextmanager
def atomic_output_dir(path: str) -> Iterator[str]:
  """Yields a fresh temporary sibling of ``path``; on success it replaces ``path`` by renames.

  An old ``path`` (already checked with `check_output_dir`) is renamed aside first and removed
  only after the new directory is in place. On an exception the temporary directory is removed
  and ``path`` is left as it was.
  """
  path = os.path.abspath(path)
  parent, name = os.path.dirname(path), os.path.basename(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".tmp-{name}-")
  os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700: the output honours the umask like any directory
  try:
    yield tmp
    old = None
    if os.path.lexists(path):
      if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
        os.rmdir(path)
      else:
        old = tempfile.mkdtemp(dir=parent, prefix=f".old-{name}-")
        os.rmdir(old)
        os.rename(path, old)
    try:
      os.rename(tmp, path)
    except OSError:
      if old is not None:
        os.rename(old, path)
      raise
    fsync_dir(parent)
    if old is not None and os.path.islink(old):
      os.unlink(old)  # a symlinked target: the link goes, what it pointed to stays
    elif old is not None:
      shutil.rmtree(old, ignore_errors=True)
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)


def open_append(path: str):
  """``open(path, "a")`` that never follows a symlink at ``path`` (an error naming it instead)."""
  try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise SymlinkError(path) from None
    raise
  return os.fdopen(fd, "a", encoding="utf-8")


def fsync_dir(path: str) -> None:
  """Makes a rename inside ``path`` durable (best effort: some filesystems refuse)."""
  with contextlib.suppress(OSError):
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def current_umask() -> int:
  """The process's umask (read by setting it and setting it back)."""
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def write_text_atomic(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` through a temporary sibling and a rename (never a half-written file).

  The rename replaces a symlink at ``path`` itself, never the file it points to; the file gets the
  mode any new file gets (``0o666`` less the umask), not `tempfile.mkstemp`'s ``0o600``.
  """
  parent = os.path.dirname(os.path.abspath(path)) or "."
  fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".tmp-{os.path.basename(path)}-")
  try:
    os.fchmod(fd, 0o666 & ~current_umask())
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)



def write_file_atomic(path: str, write: Callable[[str], object]) -> None:
  """``write(tmp)`` fills a temporary sibling of ``path`` (its folder made if missing), then a rename puts it at
  ``path``: never a half-written file, whatever ``write`` is (a safetensors or numpy writer, a tokenizer's ``save``);
  the file gets the mode any new file gets, not `tempfile.mkstemp`'s ``0o600``."""
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=parent, prefix=".tmp-")
  os.close(fd)
  try:
    write(tmp)
    os.chmod(tmp, 0o666 & ~current_umask())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)

# --------------------------------------------------------------------------- digests
def file_digests(root: str, exclude: tuple[str, ...] = ()) -> dict[str, str]:
  """``{relative path: sha256 hex}`` of every regular file under ``root`` (``exclude``: relative paths)."""
  out = {}
  for d, _, files in os.walk(root):
    for n in files:
      full = os.path.join(d, n)
      rel = os.path.relpath(full, root)
      if rel in exclude or os.path.islink(full):
        continue
      with open(full, "rb") as f:
        out[rel] = hashlib.file_digest(f, "sha256").hexdigest()
  return dict(sorted(out.items()))


def verify_digests(root: str, expected: dict[str, str], exclude: tuple[str, ...] = ()) -> str | None:
  """None when the files under ``root`` match ``expected``; else what differs (file names, for a message)."""
  have = file_digests(root, exclude)
  missing = sorted(set(expected) - set(have))
  changed = sorted(k for k in expected if k in have and have[k] != expected[k])
  problems = []
  if missing:
    problems.append(f"missing {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
  if changed:
    problems.append(f"checksum mismatch in {', '.join(changed[:3])}" + (" ..." if len(changed) > 3 else ""))
  return "; ".join(problems) or None


def read_json(path: str, what: str = "") -> dict:
  """The JSON object in ``path``; a parse error names the file and what it is."""
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}{' (' + what + ')' if what else ''} is not valid JSON: {e}") from None
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}{' (' + what + ')' if what else ''} is not UTF-8 text: {e}") from None
  if not isinstance(value, dict):
    raise ValueError(f"{path}{' (' + what + ')' if what else ''} must hold a JSON object, got {type(value).__name__}")
  return value


# --------------------------------------------------------------------------- run lock
def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


class RunLock:
  """An exclusive OS lock on ``<run_dir>/.meshdistill.lock`` for one run (a context manager).

  ``acquire`` raises `RunLockedError` naming the pid that holds it. A lock file whose
  writer is gone (killed with ``kill -9``, a crashed machine) is stale: the OS already released
  its ``flock``, so it is taken over and the takeover logged. Released on ``release`` / exit.
  """

  def __init__(self, run_dir: str, what: str = "run"):
    self.run_dir = os.path.abspath(run_dir)
    self.path = os.path.join(self.run_dir, LOCK_FILE)
    self.what = what
    self._fd: int | None = None

  def acquire(self) -> RunLock:
    os.makedirs(self.run_dir, exist_ok=True)
    try:  # a link at the lock's place is refused: truncating it would truncate what it points to
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
      if e.errno == errno.ELOOP:
        raise SymlinkError(self.path) from None
      raise
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise
      holder = self._holder()
      raise RunLockedError(
        f"{self.run_dir} is in use by another {self.what} (pid {holder or 'unknown'}); one run per run directory: "
        "wait for it to finish, or use another run.run_dir"
      ) from None
    previous = self._holder()
    if previous is not None and previous != os.getpid():
      state = "no longer running" if not _pid_alive(previous) else "no longer holding it"
      log.warning("%s: stale lock of pid %d (%s) taken over", self.path, previous, state)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    self._fd = fd
    return self

  def _holder(self) -> int | None:
    try:
      fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
      with os.fdopen(fd, encoding="utf-8") as f:
        return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
      return None

  def release(self) -> None:
    if self._fd is None:
      return
    with contextlib.suppress(OSError):
      os.ftruncate(self._fd, 0)
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> RunLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
