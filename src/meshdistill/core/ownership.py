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

A marker names the directory it was written in (``inode`` and ``device``: the directory's inode number and the
device of its file system, which a rename keeps, so an output written to a temporary sibling and renamed into place,
or moved with ``mv`` on one file system, keeps its marker; ``dir``: its path then, for messages): a marker copied into
another directory proves nothing there, and that directory is judged as one without a marker. A genuine output copied
elsewhere (or on a file system whose inode or device numbers change across mounts, or a marker of a version before
``device`` was recorded) is judged the same way, by its structure (`OutputKind.legacy`), and gets a marker of its own
when reused.

A marker proves ownership only with every field `write_marker` writes, each of its type (`MARKER_FIELDS`); a file of
that name that is not such a record (hand-written, missing the inode, another format, not JSON) is refused with
`MarkerError`, naming the file and what it lacks: nothing is judged, replaced or reused while it is there.

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
# What `write_marker` writes, and the type of each (``identity`` holds at least a string ``id``)
MARKER_FIELDS = {"format": str, "kind": str, "identity": dict, "inode": int, "device": int, "dir": str, "created": str}


class MarkerError(OutputExistsError):
  """A file named `MARKER` that `write_marker` did not write (fields missing or of another type): it proves nothing,
  and the directory is left alone until it is removed."""


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
  """The owner marker of directory ``path``; None when there is none or it was written for another directory (copied
  or moved here; one of a version that did not record the directory's device).

  Raises `MarkerError` naming the file when it is not a marker `write_marker` wrote (not JSON, another format, a
  field of `MARKER_FIELDS` missing or of another type), `SymlinkError` when it is a link."""
  marker = os.path.join(path, MARKER)
  if os.path.islink(marker):
    raise SymlinkError(marker)
  if not os.path.lexists(marker):
    return None
  try:
    value = read_json(marker, "owner marker")
  except (OSError, ValueError) as e:
    raise MarkerError(_not_a_marker(marker, f"it cannot be read as JSON ({e})")) from None
  if not isinstance(value, dict):
    raise MarkerError(_not_a_marker(marker, "it is not a JSON object"))
  legacy_device = "device" not in value and all(k in value for k in MARKER_FIELDS if k != "device")
  wrong = [f"{k} (missing)" if k not in value else f"{k}={value[k]!r} (not a {t.__name__})"
           for k, t in MARKER_FIELDS.items()
           if not (k == "device" and legacy_device)
           and (k not in value or isinstance(value[k], bool) or not isinstance(value[k], t))]
  if value.get("format", OWNER_FORMAT) != OWNER_FORMAT:
    wrong.insert(0, f"format={value['format']!r} (not {OWNER_FORMAT!r})")
  identity = value.get("identity")
  if isinstance(identity, dict) and not (isinstance(identity.get("id"), str) and identity["id"]):
    wrong.append("identity.id (missing)")
  if wrong:
    raise MarkerError(_not_a_marker(marker, "; ".join(wrong)))
  st = os.stat(path)
  if legacy_device:
    log.info("%s records no device (an earlier meshdistill): the directory is judged by its files", marker)
    return None
  if (value["inode"], value["device"]) != (st.st_ino, st.st_dev):
    log.info("%s was written for another directory (%s): it proves nothing here", marker, value.get("dir"))
    return None
  return value


def _not_a_marker(marker: str, why: str) -> str:
  return (f"{marker} is not an owner marker meshdistill wrote ({why}); it proves nothing, so nothing was changed. "
          f"Every field a command writes is needed ({', '.join(MARKER_FIELDS)}). Remove the file: the directory is "
          "then judged by its files (an earlier meshdistill's output is still recognised), or choose a new or empty "
          "directory")


def write_marker(path: str, kind: OutputKind | str, identity: dict | None = None) -> None:
  """Writes the owner marker of ``kind`` into directory ``path`` (created), atomically."""
  os.makedirs(path, exist_ok=True)
  name = kind.name if isinstance(kind, OutputKind) else kind
  st = os.stat(path)
  record = {"format": OWNER_FORMAT, "kind": name, "identity": {"id": uuid.uuid4().hex, **(identity or {})},
            "inode": st.st_ino, "device": st.st_dev, "dir": os.path.realpath(path),
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
      f"{kind.what} {path} holds a meshdistill {marker['kind']} output ({os.path.join(path, MARKER)} says kind "
      f"{marker['kind']!r}), not a {kind.name} output; nothing was changed. Choose a new or empty directory"
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


__all__ = ["MARKER", "MARKER_FIELDS", "MarkerError", "OutputKind", "check_owned", "read_marker", "refuse_links",
           "write_marker"]
