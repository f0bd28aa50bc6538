"""What the benchmarks share for their result files: which rows of a ``.jsonl`` still need measuring, and
replacing one ``## ...`` section of a Markdown file that several benchmarks write into."""

from __future__ import annotations

import json
import os

NOTES = "\n<!-- notes -->\n"  # notes written by hand below a generated table are kept


def pending_rows(jsonl: str, rows: str | None, n_rows: int) -> list[int]:
  """The row indices to run: ``rows`` (comma-separated) if given, else every one of ``range(n_rows)`` that
  ``jsonl`` holds no ``"row"`` for."""
  if rows:
    return [int(x) for x in rows.split(",")]
  done = set()
  if os.path.isfile(jsonl):
    with open(jsonl, encoding="utf-8") as f:
      done = {json.loads(line)["row"] for line in f}
  return [i for i in range(n_rows) if i not in done]


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
