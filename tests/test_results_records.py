"""`benchmarks/results/tpu_step.md` is a record: every table row names the commit of the code it measured (one git
knows, where this is a full git checkout) and the command that measured it; the chip's results speak of the project
and the chip only; `benchmarks/tpu_step.py` refuses to store a row without a commit."""

import pathlib
import re
import subprocess

import pytest
from helpers import bench_module

REPO = pathlib.Path(__file__).resolve().parents[1]
TPU_STEP = REPO / "benchmarks" / "results" / "tpu_step.md"
# the results a reader of the chip's figures reads: they say what was measured, not how the measuring was arranged
RECORDS = (TPU_STEP, REPO / "docs" / "tpu.md", REPO / "benchmarks" / "results" / "throughput_notes.md",
           REPO / "benchmarks" / "results" / "loss_kernel.md")
SCHEDULING = re.compile(r"\b(sessions?|lent|earlier|turns?)\b", re.IGNORECASE)


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
  """Every Markdown table of ``text``: its header cells and the cells of each row (a ``\\|`` inside a cell kept)."""
  def cells(line):
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]

  found, lines = [], text.splitlines()
  for i, line in enumerate(lines[:-1]):
    if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
      rows = []
      for row in lines[i + 2:]:
        if not row.startswith("|"):
          break
        rows.append(cells(row))
      found.append((cells(line), rows))
  return found


def _git(*args) -> subprocess.CompletedProcess:
  return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)


def _full_checkout() -> bool:
  """Whether git here can say which commits exist: a git checkout with its whole history (not a shallow clone)."""
  try:
    inside, shallow = _git("rev-parse", "--is-inside-work-tree"), _git("rev-parse", "--is-shallow-repository")
  except (OSError, subprocess.SubprocessError):
    return False
  return inside.stdout.strip() == "true" and shallow.stdout.strip() == "false"


def test_every_row_of_tpu_step_md_names_its_commit_and_command():
  found = tables(TPU_STEP.read_text(encoding="utf-8"))
  assert len(found) >= 8, "the steps, pairs, side by side, profile, sampling, planner and notes tables"
  commits, bad = set(), []
  for header, rows in found:
    assert "commit" in header and "command" in header, header
    at, cmd = header.index("commit"), header.index("command")
    for row in rows:
      assert len(row) == len(header), (header, row)
      commit, command = row[at], row[cmd]
      if not re.fullmatch(r"[0-9a-f]{7,40}", commit) or not re.fullmatch(r"`[^`]*python3? [^`]+`.*", command):
        bad.append(row)
      commits.add(commit)
  assert not bad, bad[:5]
  if not _full_checkout():
    pytest.skip("not a full git checkout: the commits' existence is not checked")
  out = subprocess.run(["git", "-C", str(REPO), "cat-file", "--batch-check"], input="".join(
      f"{c}^{{commit}}\n" for c in sorted(commits)), capture_output=True, text=True, timeout=60)
  missing = [line.split()[0] for line in out.stdout.splitlines() if line.endswith("missing")]
  assert out.returncode == 0 and not missing, missing


def test_tables_parse_escaped_pipes_and_a_row_without_a_commit_is_caught():
  text = ("| a | commit | command |\n|---|---|---:|\n| x | abc1234 | `python3 b.py --k a\\|b` |\n"
          "| y |  | `python3 b.py` |\n\nprose\n")
  [(header, rows)] = tables(text)
  assert header == ["a", "commit", "command"] and rows[0][2] == "`python3 b.py --k a|b`" and rows[1][1] == ""


def test_the_chip_records_say_nothing_of_how_measurements_were_scheduled():
  words = {str(p.relative_to(REPO)): sorted({m.group(0).lower() for m in SCHEDULING.finditer(p.read_text("utf-8"))})
           for p in RECORDS}
  assert not any(words.values()), words
  assert not re.search(r"\bcalls?\b", TPU_STEP.read_text("utf-8"))  # a row's command is one process, not "a call"


def test_tpu_step_refuses_to_store_rows_without_the_commit_measured(capsys):
  bench_module("results")  # benchmarks/ on the path, as the script runs
  import tpu_step  # pylint: disable=g-import-not-at-top

  with pytest.raises(SystemExit) as e:
    tpu_step.main(["--pair", "tiny", "--commit", "not-a-sha", "--out", "/nonexistent/rows.jsonl"])
  assert e.value.code == 2 and "every row names the commit of the code it measured" in capsys.readouterr().err
