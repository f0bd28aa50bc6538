"""Which directories meshdistill may replace or reuse: the owner marker, one rule for every output.

Every command that creates an output directory (a run directory, a saved teacher, an export, an
adapter directory, a teacher cache, a plot directory) writes ``.meshdistill-owner.json`` into it:
``{"format", "kind", "identity", "inode", "dir", "created"}``. A later command replaces (``--overwrite``) or reuses
(resume, rerun) a directory only when that marker proves it holds this kind of output:

* a missing or empty directory is always fine (the marker is written when it is created);
* a marker of this kind: reused / replaced (replaced only with ``--overwrite``, and only when every
  top-level entry is one this kind's writer puts there: a file the user added is never deleted);
* a marker of another kind: refused (a run directory is not an export directory);
* no marker (a user's directory, or an output of a version before markers): refused with exit code 2,
  naming the directory, a few of its files and what to do -- unless the directory has the full
  structure of that output as earlier versions wrote it (`OutputKind.legacy`: every entry one the
  writer puts there AND the content only meshdistill writes, e.g. a teacher whose ``teacher.json`` lists
  the checksum of every file under it). An export (``config.json``, ``*.safetensors``, tokenizer
  files) has no such content -- a downloaded model looks the same -- so a marker-less export is never
  replaced: remove it yourself or export to a new directory.

A marker names the directory it was written in (``inode``: the directory's inode number, which a rename keeps, so an
output written to a temporary sibling and renamed into place, or moved with ``mv`` on one file system, keeps its
marker; ``dir``: its path then, for messages): a marker copied into (or written by hand for) another directory
proves nothing there, and that directory is judged as one without a marker. A genuine output copied elsewhere (or
on a file system whose inode numbers change across mounts) is judged the same way, by its structure
(`OutputKind.legacy`), and gets a marker of its own when reused.

A symlink where meshdistill would write (the directory itself, or a file of a reused directory) is an
error naming it (`meshdistill.core.fsutil.SymlinkError`), never written through.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Callable

from meshdistill.core.fsutil import OutputExistsError, SymlinkError, read_json, write_text_atomic

log = logging.getLogger(__name__)

MARKER = ".meshdistill-owner.json"
OWNER_FORMAT = "meshdistill.owner/1"


@dataclasses.dataclass(frozen=True)
class OutputKind:
  """One kind of output directory.

  Attributes:
    name: the marker's ``kind`` (``run``, ``teacher``, ``export``, ``adapter``, ``teacher-cache``, ``plots``).
    what: how messages name it (``teacher directory``).
    ours: whether a top-level entry name is one this kind's writer puts there.
    legacy: for a directory without a marker whose entries are all ``ours``: None when its content proves
      an earlier meshdistill wrote it, else why it does not (for the message).
  """

  name: str
  what: str
  ours: Callable[[str], bool]
  legacy: Callable[[str], str | None] = lambda path: "it has no owner marker"


def read_marker(path: str) -> dict | None:
  """The owner marker of directory ``path`` (None: none, not a readable marker, or a marker written for another
  directory: copied or moved here)."""
  marker = os.path.join(path, MARKER)
  if os.path.islink(marker):
    raise SymlinkError(marker)
  if not os.path.isfile(marker):
    return None
  try:
    value = read_json(marker, "owner marker")
  except (OSError, ValueError):
    return None
  if value.get("format") != OWNER_FORMAT or not isinstance(value.get("kind"), str):
    return None
  inode = value.get("inode")
  if inode is not None and inode != os.stat(path).st_ino:
    log.info("%s was written for another directory (%s): it proves nothing here", marker, value.get("dir"))
    return None
  identity = value.get("identity")
  if inode is None and not (isinstance(identity, dict) and isinstance(identity.get("id"), str)):
    return None  # not written by `write_marker` (a hand-written marker has neither its directory nor its id)
  return value


def write_marker(path: str, kind: OutputKind | str, identity: dict | None = None) -> None:
  """Writes the owner marker of ``kind`` into directory ``path`` (created), atomically."""
  os.makedirs(path, exist_ok=True)
  name = kind.name if isinstance(kind, OutputKind) else kind
  record = {"format": OWNER_FORMAT, "kind": name, "identity": {"id": uuid.uuid4().hex, **(identity or {})},
            "inode": os.stat(path).st_ino, "dir": os.path.realpath(path),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
  write_text_atomic(os.path.join(path, MARKER), json.dumps(record, indent=1, default=str) + "\n")


def _shown(names: list[str]) -> str:
  return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _files_under(path: str, limit: int = 6) -> list[str]:
  """Up to ``limit`` paths of files (or links) under ``path``, relative to it (for messages)."""
  out = []
  for d, dirs, files in os.walk(path):
    dirs.sort()
    for n in sorted(files):
      out.append(os.path.relpath(os.path.join(d, n), path))
      if len(out) >= limit:
        return out
  return out


def check_owned(path: str, kind: OutputKind, *, overwrite: bool | None, flag: str = "--overwrite") -> bool:
  """Raises unless ``path`` may receive an output of ``kind``; returns whether it already holds one.

  ``overwrite``: True / False for an output that is replaced whole (a non-empty one needs it), None for
  one that is reused (a run directory resumed, a teacher cache finished, plots redrawn). The rules are the
  module's: a marker of ``kind`` (or, without a marker, the structure of an earlier version's output) and,
  for a replaced output, no entry its writer does not put there.
  """
  path = os.path.abspath(path)
  if os.path.islink(path):
    raise SymlinkError(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise OutputExistsError(f"{kind.what} {path} exists and is not a directory; choose a new directory")
  entries = sorted(os.listdir(path)) if os.path.isdir(path) else []
  if not [n for n in entries if n != MARKER]:
    return bool(entries)
  marker = read_marker(path)
  if marker is not None and marker["kind"] != kind.name:
    raise OutputExistsError(
      f"{kind.what} {path} holds a meshdistill {marker['kind']} output, not a {kind.name} output; nothing was "
      "changed. Choose a new or empty directory"
    )
  foreign = [n for n in entries if n != MARKER and not kind.ours(n)]
  if foreign and (overwrite is not None or marker is None):
    raise OutputExistsError(
      f"{kind.what} {path} holds files this command did not write ({_shown(foreign)}); nothing was changed. "
      "Choose a new or empty directory"
    )
  if overwrite is False:
    raise OutputExistsError(
      f"{kind.what} {path} already exists and is not empty; nothing was changed. Pass {flag} to replace it (only an "
      "output meshdistill wrote there is replaced), or choose a new directory"
    )
  if marker is None:
    why = kind.legacy(path)
    if why is not None:
      raise OutputExistsError(
        f"{kind.what} {path} is not empty and nothing proves meshdistill wrote it ({why}; it holds "
        f"{_shown(_files_under(path))}); nothing was changed. Choose a new or empty directory, or move those "
        "files away"
      )
  return True


def refuse_links(path: str, names: tuple[str, ...]) -> None:
  """Raises `SymlinkError` naming the first of ``names`` (entries of ``path``) that is a symlink."""
  for n in names:
    full = os.path.join(path, n)
    if os.path.islink(full):
      raise SymlinkError(full)


__all__ = ["MARKER", "OutputKind", "check_owned", "read_marker", "refuse_links", "write_marker"]
