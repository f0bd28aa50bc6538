"""`benchmarks/long_context.py` without a chip or a compile: which configurations the chip run takes from the stored
plans, the report it renders from stored rows, and a run refused before anything is measured without a commit."""

import importlib
import pathlib

import pytest

from helpers import bench_module

GIB = 2**30
RESULTS = pathlib.Path(__file__).parents[1] / "benchmarks" / "results"


@pytest.fixture(scope="module")
def long_context():
  bench_module("results")  # puts benchmarks/ on the path, as running the script does
  return importlib.import_module("long_context")


def _plan(t, remat, fits, chunk=1024, peak=11.0, ms=600.0, blocks="default", **kw):
  s = {"b": 1, "t": t, "remat": remat, "chunk": chunk, "attn": "splash", "blocks": blocks}
  row = {"kind": "plan", "pair": "qwen3", "setting": s, "fits": fits, "headroom": 0.9, "budget_bytes": 16 * GIB,
         "need_bytes": peak and peak * GIB, "compiler_peak_bytes": peak and peak * GIB, "calibrated_s": ms / 1e3,
         "tokens_per_s": t / (ms / 1e3),
         "commit": "aaaaaaa", "date": "2026-12-07", "device": "TPU v5 lite (compiled for)", "jax": "0.10.2",
         "libtpu": "0.0.42.1", "command": "python3 benchmarks/long_context.py"}
  return {**row, **kw}


def _measured(t, remat, ms=None, error=None, chunk=1024, blocks="default"):
  s = {"b": 1, "t": t, "remat": remat, "chunk": chunk, "attn": "splash", "blocks": blocks}
  row = {"kind": "measured", "pair": "qwen3", "setting": s, "commit": "bbbbbbb", "date": "2026-12-08",
         "device": "TPU v5 lite", "jax": "0.10.2", "libtpu": "0.0.42.1",
         "command": "python3 benchmarks/long_context.py --measure --commit bbbbbbb"}
  if error:
    return {**row, "error": error}
  return {**row, "step_s": ms / 1e3, "tokens_per_s": t / (ms / 1e3), "mfu": 0.4, "compiler_peak_bytes": 12 * GIB,
          "peak_bytes": 13 * GIB}


def test_the_chip_run_takes_each_ladders_longest_fit_and_what_follows_up_to_the_first_refusal_shortest_first(
    long_context):
  oom = dict(peak=None, need_bytes=17.5 * GIB, calibrated_s=None, tokens_per_s=None)
  plans = [_plan(8192, "full", True), _plan(16384, "full", True), _plan(32768, "full", False, peak=14.84),
           _plan(65536, "full", False, **oom), _plan(131072, "full", False, **oom),
           _plan(8192, "dots_no_batch", True), _plan(16384, "dots_no_batch", False, **oom),
           _plan(32768, "full", False, peak=14.84, chunk=512), _plan(65536, "full", True, blocks="q512-kv1024-c512")]
  stored = long_context.newest(plans, "plan")
  got = long_context.chip_list(stored)
  assert [(s.t, s.remat, s.chunk, s.blocks) for s in got] == [
      (8192, "dots_no_batch", 1024, "default"), (16384, "dots_no_batch", 1024, "default"),
      (16384, "full", 1024, "default"), (32768, "full", 512, "default"), (32768, "full", 1024, "default"),
      (65536, "full", 1024, "default"), (65536, "full", 1024, "q512-kv1024-c512")]
  assert all(s.b == 1 and s.attn == "splash" for s in got)
  every = long_context.chip_list(stored, seqs={8192, 16384, 32768, 65536}, remats={"full"}, chunks={1024},
                                 blocks={"default"}, every_fit=True)
  assert [(s.t, s.remat, s.chunk) for s in every] == [(8192, "full", 1024), (16384, "full", 1024),
                                                       (32768, "full", 1024), (65536, "full", 1024)]
  # a newer plan of the same configuration replaces the older
  newer = long_context.chip_list(long_context.newest(plans + [_plan(16384, "dots_no_batch", True)], "plan"))
  assert (8192, "dots_no_batch", 1024) not in [(s.t, s.remat, s.chunk) for s in newer]


def test_the_report_sets_each_plan_beside_its_measurement_and_names_each_ladders_longest(long_context, tmp_path):
  results = bench_module("results")
  jsonl = str(tmp_path / "rows.jsonl")
  oom = "XlaRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm | 17.1G"
  for row in (_plan(8192, "full", True, ms=594.0), _plan(16384, "full", True, peak=11.43, ms=1728.4),
              _plan(32768, "full", False, peak=14.84, ms=5604.6),
              _plan(65536, "full", False, peak=None, need_bytes=17.5 * GIB, calibrated_s=None, tokens_per_s=None),
              _measured(8192, "full", ms=610.0), _measured(16384, "full", ms=1700.0), _measured(32768, "full", ms=5500),
              _measured(65536, "full", error=oom)):
    results.append_row(jsonl, row)
  md = tmp_path / "long_context.md"
  md.write_text("old tables\n<!-- notes -->\nhand-written notes\n")
  text = long_context.render(jsonl, str(md))
  assert md.read_text().endswith("<!-- notes -->\nhand-written notes\n") and "old tables" not in md.read_text()
  lines = text.splitlines()
  fused = "fused backward (the package's) (`default`)"
  assert f"| {fused} | `full` | 1024 | 16,384 | 32,768 |" in lines  # planned within the headroom; ran on the chip
  table = [ln[len(f"| {fused} | `full` | 1024 "):] for ln in lines if ln.startswith(f"| {fused} | `full` | 1024 | ")
           and ln.count("|") > 8]
  assert table == [
      "| 8,192 | fits | 11.00 | 594 | 13,791 | ran | 610 | 13,430 | 40.0% | 12.00 | 13.00 | aaaaaaa | bbbbbbb |",
      "| 16,384 | fits | 11.43 | 1,728 | 9,479 | ran | 1,700 | 9,638 | 40.0% | 12.00 | 13.00 | aaaaaaa | bbbbbbb |",
      "| 32,768 | over 14.4 GiB | 14.84 | 5,605 | 5,847 | ran | 5,500 | 5,958 | 40.0% | 12.00 | 13.00 | aaaaaaa | "
      "bbbbbbb |",
      "| 65,536 | out of HBM (compile) | 17.50 (arguments + temporaries) |  |  | out of HBM |  |  |  |  |  | aaaaaaa | "
      "bbbbbbb |"]
  where = [ln for ln in lines if ln.startswith("| 4 ")]
  assert where == ["| 4 plan | 2026-12-07 | aaaaaaa | TPU v5 lite (compiled for) | 0.10.2 | 0.0.42.1 | "
                   "`python3 benchmarks/long_context.py` |",
                   "| 4 measured | 2026-12-08 | bbbbbbb | TPU v5 lite | 0.10.2 | 0.0.42.1 | "
                   "`python3 benchmarks/long_context.py --measure --commit bbbbbbb` |"]


def test_a_run_without_a_commit_is_refused_before_anything_is_measured(long_context, tmp_path, capsys):
  with pytest.raises(SystemExit):
    long_context.main(["--measure", "--commit", "not-a-sha", "--jsonl", str(tmp_path / "rows.jsonl")])
  assert "7 to 40 hex digits" in capsys.readouterr().err
  assert not (tmp_path / "rows.jsonl").exists()


def test_rendering_the_stored_rows_again_changes_nothing_in_long_context_md(long_context, tmp_path):
  md = tmp_path / "long_context.md"
  committed = (RESULTS / "long_context.md").read_text()
  md.write_text(committed)  # its hand-written notes are kept from the file rendered into
  long_context.render(str(RESULTS / "long_context.jsonl"), str(md))
  assert md.read_text() == committed
