"""`benchmarks/bench/`: the benchmarks' harness (interleaved rounds, paired ratios), the throughput report rendered
from its stored raw results, and scripts that import the package, not each other."""

import ast
import importlib
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


@pytest.fixture(scope="module")
def tpu_step():
  bench_module("results")  # puts benchmarks/ on the path, as the script runs
  return importlib.import_module("tpu_step")


def _gen(system, batch, tokens_per_s=None, error=None):
  row = {"pair": "qwen3", "system": system, "batch": batch, "prompt": 128, "new": 256, "tag": "t"}
  if error:
    return {**row, "error": error}
  return {**row, "tokens_per_s": tokens_per_s, "seconds": batch * 256 / tokens_per_s, "first_call_s": 12.5,
          "weight_bytes": 1503266816}


def test_rendering_the_stored_rows_again_changes_nothing_in_tpu_step_md(tpu_step, tmp_path):
  md = tmp_path / "tpu_step.md"
  committed = (BENCHMARKS / "results" / "tpu_step.md").read_text()
  md.write_text(committed)  # its hand-written notes are kept from the file rendered into
  tpu_step.render(str(BENCHMARKS / "results" / "tpu_step.jsonl"), str(md))
  assert md.read_text() == committed


def test_generation_table_puts_tunix_rows_beside_meshdistill_with_their_share_and_says_what_did_not_run(
    tpu_step, tmp_path):
  results = bench_module("results")
  jsonl = str(tmp_path / "rows.jsonl")
  where = {"date": "2026-12-06", "commit": "c09a527", "device": "TPU v5 lite", "jax": "0.10.2", "libtpu": "0.0.42.1",
           "command": "python3 benchmarks/tpu_step.py --systems generate,tunix-generate"}
  for row in (_gen("generate", 1, 800.0), _gen("generate", 64, 6000.0), _gen("tunix-generate", 1, 400.0),
              _gen("tunix-generate", 64, error="XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory | 5 GiB"),
              _gen("tunix-generate", 8, error="ValueError: Total sampling steps 384 must be\nless than the cache")):
    results.append_row(jsonl, {**row, **where})
  text = tpu_step.render(jsonl, str(tmp_path / "out.md"))
  table = [line for line in text.splitlines() if line.startswith("| qwen3 |")]
  limit1 = tpu_step.generation_limit(_gen("generate", 1, 800.0))
  assert limit1 == pytest.approx(1069, abs=1)  # the stored table's limit at batch 1
  tail = ("2026-12-06 | c09a527 | TPU v5 lite | 0.10.2 | 0.0.42.1 | `python3 benchmarks/tpu_step.py --systems "
          "generate,tunix-generate` |")
  assert tpu_step.provenance(where) == tail
  assert table == [
      f"| qwen3 | meshdistill | 1 | 128 + 256 | 800 | {limit1:,.0f} | {100 * 800 / limit1:.0f}% | 12.5 | ran | {tail}",
      f"| qwen3 | tunix | 1 | 128 + 256 | 400 | {limit1:,.0f} | {100 * 400 / limit1:.0f}% | 12.5 | ran | {tail}",
      "| qwen3 | tunix | 8 | 128 + 256 | | | | | did not run: ValueError: Total sampling steps 384 must be less "
      f"than the cache | {tail}",
      table[3],
      f"| qwen3 | tunix | 64 | 128 + 256 | | | | | did not run: out of HBM | {tail}",
  ]
  assert table[3].startswith("| qwen3 | meshdistill | 64 | 128 + 256 | 6,000 |")


def test_tunix_sampler_on_the_tiny_student_returns_rows_of_new_tokens_and_refuses_a_shape_it_lacks(tpu_step):
  tunix_generate = bench_module("tunix_generate")
  _, student = tpu_step.model_configs("tiny", tpu_step.Setting(attn="xla", remat="none"))
  rows = tpu_step.measure_tunix_generation("tiny", (2,), 4, 3)
  assert [r["batch"] for r in rows] == [2] and "error" not in rows[0], rows
  row = rows[0]
  assert set(tunix_generate.FIELDS) | {"pair", "system", "device"} <= set(row)
  assert (row["system"], row["tokens_out"], row["dtype"], row["param_dtype"]) == ("tunix-generate", 3, "bfloat16",
                                                                                  "float32")
  assert row["tokens_per_s"] == pytest.approx(2 * 3 / row["seconds"])
  assert len(row["times"]) == tpu_step.GEN_CALLS and row["first_call_s"] > 0
  bad = tunix_generate.sample_rows(student.replace(sliding_window=4), (1, 2), 4, 3)
  assert [(r["batch"], r["error"].split(":")[0]) for r in bad] == [(1, "ValueError"), (2, "ValueError")]
  assert "sliding_window=4" in bad[0]["error"]


def test_the_chip_section_of_plan_calibration_md_is_the_render_of_its_stored_rows():
  """``plan_calibration.py --render`` ends the report with `bench.chip_calibration.section` of
  plan_calibration_chip.json: the committed report holds it as rendered now (no compile)."""
  chip = bench_module("chip_calibration")
  text = chip.section(chip.load())
  assert text in (BENCHMARKS / "results" / "plan_calibration.md").read_text()
  assert "s_matmul = " in text and "leave-one-config-out" in text and "Leave one pair out" in text
  # each pair predicted from the other pairs' rows only: a fit that saw the pair would change its figure
  rows = chip.fitted(chip.load())
  others = [r for r in rows if r["pair"] != "gemma3"]
  gemma3 = [i for i, r in enumerate(rows) if r["pair"] == "gemma3"]
  want = chip.fit_rows(others)[0].predict([chip.chip_terms(rows[i]) for i in gemma3])
  assert [chip.leave_one_pair_out(rows)[i] for i in gemma3] == pytest.approx(list(want))
  assert list(want) != pytest.approx(list(chip.fit_rows(rows)[0].predict([chip.chip_terms(rows[i]) for i in gemma3])))
  assert len(rows) < len(chip.load()) and all(chip.earlier_code(r) for r in chip.load() if r not in rows)
  assert "earlier code: not fitted" in text  # measured on an earlier program: shown, not fitted
  one_pair = chip.section([r for r in rows if r["pair"] == "qwen3"])
  assert "leaving one pair out needs two" in one_pair and "Leave one pair out" not in one_pair


def test_side_by_side_table_holds_each_command_with_peers_and_compares_best_against_best(tpu_step):
  setting = {"b": 2, "t": 2048, "remat": "full", "chunk": 1024, "attn": "splash", "blocks": "default"}
  row = lambda system, step_s, tag="one-run", b=2, **kw: {  # noqa: E731
      "pair": "qwen3", "system": system, "tag": tag, "setting": {**setting, "b": b, **kw.pop("setting", {})},
      "label": f"b={b}", "step_s": step_s, "tokens_per_s": b * 2048 / step_s, "commit": "abc1234",
      "command": f"run {tag}", **kw}
  auto = {"remat": "auto", "chunk": "auto", "mb": "auto", "attn": "auto", "dtypes": "auto"}
  rows = [row("meshdistill", 0.25, step_times=[0.25, 0.26]), row("plain", 0.30, step_times=[0.30, 0.30]),
          row("tunix", 0.20), row("meshdistill", 0.40, b=4, setting=auto, remat_chosen="dots",
                                  auto={"chunk": 1024, "micro_batch": 4}),  # the command's best: the reference
          row("meshdistill", 0.10, tag="other-run")]  # another command's meshdistill: never the reference
  lines = [line for line in tpu_step.side_by_side_section(rows) if line.startswith("| qwen3")]
  where = " |  | abc1234 |  |  |  | `run one-run` |"
  full = "remat full, chunk 1024, attention splash"
  assert lines == [
      f"| qwen3 | meshdistill | 2 x 2048 | {full} | 250 | 16,384 | 4.00% | 0.80x | ran" + where,
      "| qwen3 | meshdistill | 4 x 2048 | remat auto -> dots, chunk auto -> 1024, micro-batch auto -> 4, attention "
      "auto, dtypes auto | 400 | 20,480 | not recorded | 1.00x | ran" + where,
      f"| qwen3 | plain | 2 x 2048 | {full} | 300 | 13,653 | 0.00% | 0.67x | ran" + where,
      "| qwen3 | tunix | 2 x 2048 | its example's: student remat decoder, splash attention | 200 | 20,480 | not recorded | 1.00x | ran" + where,
  ]
  text = "\n".join(tpu_step.side_by_side_section(rows))
  assert all(config in text for config in tpu_step.SIDE_CONFIG.values())  # each system's configuration is stated


def test_a_setting_measured_by_some_systems_only_keeps_its_label_and_configuration(tpu_step):
  """``only=tunix+plain`` limits who measures a setting; the row's label and configuration key are those of the same
  setting without it (so it supersedes and is superseded as before), and an empty name is refused."""
  only = tpu_step.Setting.parse("b=2,remat=dots_no_batch,only=tunix+plain")
  plain = tpu_step.Setting.parse("b=2,remat=dots_no_batch")
  assert only.measured_by("tunix") and only.measured_by("plain") and not only.measured_by("meshdistill")
  assert plain.measured_by("meshdistill") and only.label() == plain.label()
  key = lambda s: tpu_step.config_key({"pair": "qwen3", "setting": vars(s)})  # noqa: E731
  assert key(only) == key(plain)
  with pytest.raises(SystemExit, match="only=tunix"):
    tpu_step.Setting.parse("b=2,only=tunix+")


def test_a_chip_setting_names_which_models_scan_their_layers_and_refuses_another_word(tpu_step):
  """``--config ...,scan=none`` builds both models unrolled (``scan=student``: only the student scanned), the label
  and the planner's configuration key say so (a scanned row of the same batch is another configuration), and a word
  outside both / teacher / student / none is refused with the choices."""
  calibration = bench_module("chip_calibration")
  unrolled = tpu_step.Setting.parse("b=6,remat=dots_no_batch,attn=xla,scan=none")
  teacher, student = tpu_step.model_configs("tiny", unrolled)
  assert (teacher.scan_layers, student.scan_layers) == (False, False)
  teacher, student = tpu_step.model_configs("tiny", tpu_step.Setting.parse("attn=xla,scan=student"))
  assert (teacher.scan_layers, student.scan_layers) == (False, True)
  assert unrolled.label().endswith(",scan=none") and "scan" not in tpu_step.Setting(b=6).label()
  scanned = dict(vars(unrolled), scan="both")
  assert calibration.config_key(vars(unrolled)) == calibration.config_key(scanned) + ",scan=none"
  with pytest.raises(SystemExit, match="scan='some'.*both, teacher, student, none"):
    tpu_step.Setting.parse("scan=some")


def test_an_earlier_checkouts_row_goes_to_the_appendix_and_a_later_untraced_row_keeps_the_trace(tpu_step, tmp_path):
  """A sampler row measured with an earlier checkout (``code``) is in the appendix under that commit, the current
  row in the table; a setting's trace stays in the profile table when a later row of the setting has none, while the
  steps table shows that later row and puts the traced one in the appendix."""
  results = bench_module("results")
  jsonl = str(tmp_path / "rows.jsonl")
  step = {"pair": "qwen3", "system": "meshdistill", "label": "b=4", "tag": "traced", "step_s": 0.5,
          "tokens_per_s": 1.0, "mfu": 0.5, "program_bytes": 2**30, "commit": "1111111",
          "setting": {"b": 4, "t": 2048, "remat": "full", "chunk": 1024, "attn": "xla"},
          "profile": {"ms": {"matmul": 300.0, "loss": 100.0}}}
  for row in (step, {**step, "tag": "later", "profile": None, "commit": "2222222"},
              {**_gen("generate", 64, 9000.0), "code": "abc1234"}, _gen("generate", 64, 16000.0)):
    results.append_row(jsonl, row)
  text = tpu_step.render(jsonl, str(tmp_path / "out.md"))
  main, appendix = text.split("## Appendix")
  rows = lambda part, start: [ln.split(" | ")[:6] for ln in part.splitlines() if ln.startswith(start)]  # noqa: E731
  assert rows(main, "| qwen3 | meshdistill | 64") == [["| qwen3", "meshdistill", "64", "128 + 256", "16,000", "30,994"]]
  assert [ln for ln in appendix.splitlines() if ln.startswith("| qwen3 | meshdistill | 64")][0].split(" | ")[4:5] == [
      "9,000"] and "| abc1234 |" in appendix
  section = main.split("## Profiles")[1].split("\n## ")[0]
  traces = [line for line in section.splitlines() if line.startswith("| qwen3")]
  assert traces == ["| qwen3 | b=4 | 300 (75%) | 0 (0%) | 100 (25%) | 0 (0%) | 0 (0%) | 0 (0%) | 0 (0%) |  | 1111111 |"
                    "  |  |  |  |"]
  steps = main.split("## Steps")[1].split("\n## ")[0]
  assert "| 2222222 |" in steps and "| 1111111 |" not in steps and "| 1111111 |" in appendix.split("### Steps")[1]

def test_the_sampler_runs_over_scanned_or_unrolled_layers_and_the_table_names_which(tpu_step, monkeypatch):
  """``--systems generate`` samples with the student's layers scanned (as it trains), ``generate-unrolled`` with them
  unrolled (one KV cache per layer); each gives its own rows, and the sampling table names the unrolled sampler."""
  built, real = [], tpu_step.model_configs
  monkeypatch.setattr(tpu_step, "model_configs", lambda pair, s: (built.append(s.scan), real(pair, s))[1])
  rows = [r for system in ("generate", "generate-unrolled") for r in tpu_step.measure_generation("tiny", (2,), 4, 3,
                                                                                                  system)]
  assert built == ["both", "none"]
  assert [(r["system"], r["batch"]) for r in rows] == [("generate", 2), ("generate-unrolled", 2)], rows
  assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows
  failed = {"pair": "tiny", "system": "tunix-generate", "batch": 2, "prompt": 4, "new": 3, "error": "ValueError: no"}
  for r in rows:  # a chip's bandwidth, so that the table has a limit to set them beside
    r["bandwidth_limit_tokens_per_s"] = 1e4
  table = [line for line in tpu_step.generation_section(rows + [failed]) if line.startswith("| tiny")]
  assert [line.split(" | ")[1] for line in table] == ["meshdistill", "meshdistill, layers unrolled", "tunix"], table


def test_a_decoding_variant_is_measured_in_its_own_programs_named_in_its_rows_and_undone_after(tpu_step):
  """``--gen-loops`` / ``--gen-programs`` / ``--gen-kernels``: `decoding_variant` replaces the package's number of
  decoding loops, its choice of compilation and its decoding attention while it measures (the loops a traced program
  holds are the variant's: the jitted programs are dropped on the way in and out), then restores them; each row names
  its variant and the table says it; a variant it cannot measure is refused by name."""
  from meshdistill.models import generate as gen

  saved = gen.DECODE_STAGES, gen.CACHE_BOUND_STAGES, gen.MIN_STAGE_TOKENS, gen.cache_bound
  seen = []
  real = gen.decode_stages
  with pytest.MonkeyPatch.context() as mp:
    def counted(p, n, loops=None):
      stages = real(p, n, loops)
      seen.append(len(stages))
      return stages

    mp.setattr(gen, "decode_stages", counted)
    with tpu_step.decoding_variant(1, "default"):
      assert (gen.DECODE_STAGES, gen.CACHE_BOUND_STAGES, gen.MIN_STAGE_TOKENS, gen.cache_bound(None, 0, 0, 0)) == (
          1, 1, 1, False)
    rows = [r for loops in (1, 3) for r in tpu_step.measure_generation("tiny", (2,), 4, 64, loops=loops)]
  assert (gen.DECODE_STAGES, gen.CACHE_BOUND_STAGES, gen.MIN_STAGE_TOKENS, gen.cache_bound) == saved
  assert seen == [1, 3], seen  # each variant traced afresh, in its own loops (3 of 21 tokens: fewer than 32 each)
  assert [(r["loops"], "program" in r, "error" in r) for r in rows] == [(1, False, False), (3, False, False)], rows
  for r in rows:
    r["bandwidth_limit_tokens_per_s"] = 1e4
  variant = {**rows[1], "program": "selective"}
  table = [line.split(" | ")[1] for line in tpu_step.generation_section(rows + [variant]) if line.startswith("| tiny")]
  assert table == ["meshdistill, 1 decoding loop", "meshdistill, 3 decoding loops",
                   "meshdistill, 3 decoding loops, the cache-bound program at every batch"], table
  with pytest.raises(ValueError, match="decoding program 'fast': choose from auto, selective, default"):
    with tpu_step.decoding_variant(None, "fast"):
      pass
  from meshdistill.models import _decode_attention

  kernel = _decode_attention.usable, _decode_attention.STEP_BYTES
  with tpu_step.decoding_variant(None, "auto", "xla"):  # ``--gen-kernels``: no decoding kernel, or its block bytes
    assert not _decode_attention.usable(384, 2, 128)
  with tpu_step.decoding_variant(None, "auto", "0.5"):
    assert _decode_attention.STEP_BYTES == 2**19 and _decode_attention.usable(384, 2, 128)
  assert (_decode_attention.usable, _decode_attention.STEP_BYTES) == kernel
  labels = [tpu_step.sampler_label({**rows[0], "loops": None, "kernel": k}) for k in ("xla", "2")]
  assert labels == ["meshdistill, decoding attention in XLA", "meshdistill, decoding kernel reading 2 MiB a step"]
  with pytest.raises(ValueError, match=r"decoding kernel 'fast': auto, xla \(no kernel\) or the MiB"):
    with tpu_step.decoding_variant(None, "auto", "fast"):
      pass
  with pytest.raises(ValueError, match="a TPU's, not cpu's"):
    tpu_step.measure_generation("tiny", (2,), 4, 3, program="selective")
  assert (gen.DECODE_STAGES, gen.CACHE_BOUND_STAGES, gen.MIN_STAGE_TOKENS, gen.cache_bound) == saved


def test_a_decoding_trace_s_instructions_fall_in_the_roles_their_descriptions_name():
  """`decode_profile.role_of` on instructions as a v5e trace of cached sampling named and described them (batch 64,
  8 key/value heads of 128): each role by what the instruction computes, whatever the cache's rows and slots."""
  bench_module("results")
  role_of = importlib.import_module("decode_profile").role_of
  dims = (8, 128)
  cases = {
      ("bitcast_reduce_fusion.168", "(f32[2,64,8] jit(_generate)/while/body/vmap(BTNH,BSNH->BNTS)/dot_general"):
          "attention",
      ("fusion.9027", "bf16[64,1,8,2,128] jit(_generate)/while/body/vmap(BNTS,BSNH->BTNH)/dot_general"): "attention",
      ("dynamic_update_slice.1237", "bf16[64,383,8,128] jit(_generate)/while/body/dynamic_update_slice"):
          "cache writes",
      ("dynamic_update_slice.1266", "s32[64,256] jit(_generate)/while/body/dynamic_update_slice"): "other",
      ("copy-done.103", "bf16[64,383,8,128]"): "cache moves",
      ("slice-done.279", "bf16[16,319,8,128]"): "cache moves",  # a piece of 16 of the 64 rows
      ("copy-done.64", "bf16[1,1024,3072]"): "weights",
      ("fusion.9030", "(f32[64] jit(_generate)/while/body/dot_general"): "weights",
      ("convert.1284", "f32[1,1,1024] jit(_generate)/while/body/convert_element_type"): "other",
      ("fusion.12", "bf16[64,128,1024] jit(_generate)/dot_general"): "prefill",
      ("decode_attention.1", "(bf16[64,8,2,128], bf16[64,8,384,128], bf16[64,8,384,128]) "
       "jit(_generate)/while/body/decode_attention/pallas_call"): "attention",  # the kernel, its slot write within
  }
  assert {k: role_of(*k, dims) for k in cases} == cases
