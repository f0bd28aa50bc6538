"""What the benchmarks share for their result files: appending a measured row to a ``.jsonl``, reading back the
newest row of each key, which rows still need measuring, and replacing one ``## ...`` section of a Markdown file
that several benchmarks write into."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

NOTES = "\n<!-- notes -->\n"  # notes written by hand below a generated table are kept


def libtpu_version() -> str | None:
  """The installed libtpu's version (what a TPU row records beside jax's), None without one."""
  from importlib.metadata import PackageNotFoundError, version  # pylint: disable=g-import-not-at-top

  try:
    return version("libtpu")
  except PackageNotFoundError:
    return None


def append_row(jsonl: str, row: dict) -> None:
  """Appends ``row`` as one line of ``jsonl`` (its folder made if missing): results only grow, a rerun adds."""
  os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)
  with open(jsonl, "a", encoding="utf-8") as f:
    f.write(json.dumps(row) + "\n")


def newest_rows(jsonl: str, key: Callable[[dict], Any] = lambda r: r["row"],
                superseded: list | None = None) -> dict[Any, dict]:
  """The last row of each ``key(row)`` in ``jsonl`` (empty if the file does not exist); the rows a later one of the
  same key replaced go to ``superseded`` when it is given."""
  rows: dict[Any, dict] = {}
  if os.path.isfile(jsonl):
    with open(jsonl, encoding="utf-8") as f:
      for line in f:
        if not line.strip():
          continue
        r = json.loads(line)
        k = key(r)
        if k in rows and superseded is not None:
          superseded.append(rows[k])
        rows[k] = r
  return rows


def pending_rows(jsonl: str, rows: str | None, n_rows: int) -> list[int]:
  """The row indices to run: ``rows`` (comma-separated) if given, else every one of ``range(n_rows)`` that
  ``jsonl`` holds no ``"row"`` for."""
  if rows:
    return [int(x) for x in rows.split(",")]
  done = newest_rows(jsonl)
  return [i for i in range(n_rows) if i not in done]


def write_keeping_notes(path: str, text: str) -> None:
  """Writes ``text`` (a generated file) to ``path``, keeping the hand-written notes below ``NOTES`` in the old one."""
  old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
  with open(path, "w", encoding="utf-8") as f:
    f.write(text + (old[old.index(NOTES):] if NOTES in old else ""))


def replace_section(path: str, marker: str, section: str) -> None:
  """Writes ``section`` into ``path`` in place of the section that starts with ``marker`` (``"\\n## Title"``),
  keeping the rest of the file, any section after it, and hand-written notes below ``NOTES`` in it."""
  text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
  head, _, rest = text.partition(marker)
  own, _, tail = rest.partition("\n## ")  # our section, and any section after it
  kept = own[own.index(NOTES):] if NOTES in own else ""
  out = head.rstrip("\n") + "\n\n" + section + kept.rstrip("\n") + ("\n\n## " + tail if tail else "")
  with open(path, "w", encoding="utf-8") as f:
    f.write(out.rstrip("\n") + "\n")
