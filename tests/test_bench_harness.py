"""`benchmarks/bench/`: the benchmarks' harness (interleaved rounds, paired ratios), the throughput report rendered
from its stored raw results, and scripts that import the package, not each other."""

import ast
import pathlib

import pytest

from helpers import bench_module

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def harness():
  return bench_module("harness")


def test_interleave_runs_every_system_on_an_input_before_the_next_input_and_keeps_warmup_apart(harness):
  calls = []
  fns = {name: (lambda x, name=name: calls.append((name, x))) for name in ("a", "b", "c")}
  out = harness.interleave(fns, [10, 11, 12, 13], warmup=1, per=2.0)
  assert calls == [(n, x) for x in (10, 11, 12, 13) for n in ("a", "b", "c")]
  assert {n: len(ts) for n, ts in out["times"].items()} == {"a": 3, "b": 3, "c": 3}
  assert {n: len(ts) for n, ts in out["cpu"].items()} == {"a": 3, "b": 3, "c": 3}
  assert set(out["compile_s"]) == {"a", "b", "c"}


def test_interleave_divides_each_time_by_what_one_call_covers(harness, monkeypatch):
  clock = iter([0.0, 4.0, 10.0, 16.0])  # two calls: 4 s and 6 s of wall time
  monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
  out = harness.interleave({"loop": lambda xs: None}, [[1, 2], [3, 4]], per=2)
  assert out["times"]["loop"] == [2.0, 3.0]


def test_interleave_refuses_more_warmup_rounds_than_inputs(harness):
  with pytest.raises(ValueError, match=r"warmup=3 rounds of 2 inputs; choose 0\.\.2"):
    harness.interleave({"a": lambda x: None}, [1, 2], warmup=3)


def test_best_call_keeps_the_fastest_timed_call_and_the_last_output(harness, monkeypatch):
  clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 23.0])  # three timed calls: 5 s, 2 s, 3 s
  monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
  outputs = iter(range(4))  # the first call compiles, untimed
  assert harness.best_call(lambda: next(outputs), 3) == (2.0, 3)
  with pytest.raises(ValueError, match="calls=0; time at least 1 call"):
    harness.best_call(lambda: 0, 0)


def test_paired_ratio_is_the_median_of_the_per_round_ratios_not_the_ratio_of_medians(harness):
  # per round: 3x, 1x, 3x (paired 3x); medians 3 / 2 = 1.5x
  t = {"ours": [1.0, 2.0, 3.0], "peer": [3.0, 2.0, 9.0], "bare_t": [0.5, 1.5, 1.0], "bare_s": [0.5, 0.5, 2.0]}
  by_medians, paired, spread = harness.ratio_of(t, harness.medians(t), "peer", ("ours",))
  assert (by_medians, paired, spread) == (pytest.approx(1.5), pytest.approx(3.0), "1.00-3.00x")
  assert harness.per_round(t, "ours", ("bare_t", "bare_s")) == pytest.approx([1.0, 1.0, 1.0])


def test_throughput_report_renders_the_committed_markdown_from_its_json():
  render = bench_module("render_throughput")
  harness = bench_module("harness")
  raw = harness.read_json(BENCHMARKS / "results" / "throughput.json")
  assert render.report(raw) == (BENCHMARKS / "results" / "throughput.md").read_text()


def test_rendering_without_raw_results_names_the_file_and_what_writes_it(harness, tmp_path):
  with pytest.raises(FileNotFoundError, match=r"throughput\.json: no raw results to render; a full run"):
    harness.read_json(tmp_path / "throughput.json")


def test_no_benchmark_script_imports_another_script():
  scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
  found = []
  for path in BENCHMARKS.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
          [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
      found += [f"{path.name} imports {n}" for n in names if n.split(".")[0] in scripts]
  assert not found


def test_result_rows_append_and_read_back_the_newest_of_each_key(tmp_path):
  results = bench_module("results")
  path = str(tmp_path / "new" / "rows.jsonl")  # the folder does not exist yet
  assert results.newest_rows(path) == {}
  for row in ({"row": 0, "v": 1}, {"row": 1, "v": 2}, {"row": 0, "v": 3}):
    results.append_row(path, row)
  with open(path, "a", encoding="utf-8") as f:
    f.write("\n")  # a blank line (a hand edit) is passed over
  older = []
  assert results.newest_rows(path, superseded=older) == {0: {"row": 0, "v": 3}, 1: {"row": 1, "v": 2}}
  assert older == [{"row": 0, "v": 1}]
  by_value = results.newest_rows(path, key=lambda r: r["v"] % 2)
  assert by_value == {1: {"row": 0, "v": 3}, 0: {"row": 1, "v": 2}}
  assert results.pending_rows(path, None, 3) == [2]
