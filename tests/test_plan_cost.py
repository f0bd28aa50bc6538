"""The planner's cost model: scanned loops counted whole, the FLOPs split by model, and the calibrated step time."""

import json
import os

import numpy as np
import pytest
from helpers import bench_module

import meshdistill as md
from meshdistill import cli, planner
from meshdistill.config.sections import OnPolicySettings
from meshdistill.planner import _calibrate, _published, _report
from meshdistill.train import cost
from meshdistill.planner._cost import flops_split
from meshdistill.planner._placement import placements

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "plan_calibration.json")
CHIP_RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "plan_calibration_chip.json")
needs_libtpu = pytest.mark.skipif(not planner.libtpu_available(),
                                  reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")

TEACHER = md.ModelConfig(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=1024,
                         max_len=16, tie_embeddings=False, dtype="bfloat16", param_dtype="float32")
STUDENT = TEACHER.replace(d_model=128, n_heads=2, n_kv_heads=2, mlp_hidden=512, n_layers=3)


@pytest.fixture(scope="module")
def scanned_and_unrolled():
  """The same pair and configuration on v5e:2x2, planned with scanned blocks and with unrolled ones (the full-logits
  loss), and scanned with the chunked loss (a loop of 4 chunks of 8 tokens per device)."""
  kw = dict(topology="v5e:2x2", mesh="2x2", batch=4, seq=16, remat="full")
  scanned = dict(teacher=TEACHER.replace(scan_layers=True), student=STUDENT.replace(scan_layers=True))
  unrolled = dict(teacher=TEACHER.replace(scan_layers=False), student=STUDENT.replace(scan_layers=False))
  return md.plan(**scanned, **kw), md.plan(**unrolled, **kw), md.plan(**scanned, chunk_size=8, **kw)


@needs_libtpu
def test_scanned_loops_are_counted_whole_as_the_unrolled_program_counts_them(scanned_and_unrolled):
  scanned, unrolled, _ = scanned_and_unrolled
  # the scanned program's own count holds one block per loop: well under the whole step
  assert scanned.flops["compiled"] < 0.8 * unrolled.flops["compiled"]
  # counted whole (each loop body times its trip count) it equals the unrolled program's count within 0.5%
  assert scanned.flops["counted"] == pytest.approx(unrolled.flops["compiled"], rel=5e-3)
  wire = lambda p: sum(c["wire_bytes"] for c in p.collectives)  # noqa: E731
  assert wire(scanned) == pytest.approx(wire(unrolled), rel=1e-2)
  assert scanned.step_seconds is not None and scanned.step_seconds == pytest.approx(unrolled.step_seconds, rel=0.2)
  assert "loops counted whole" in scanned.table()
  # the TPU compiler's own estimated cycles, loops counted whole: the matmul fusions' as the unrolled program's
  # (the rest holds the scan's own slicing of the stacked weights)
  cycles = scanned.time["cycles"], unrolled.time["cycles"]
  assert cycles[0]["matmul"] == pytest.approx(cycles[1]["matmul"], rel=1e-2) and cycles[1]["other"] > 0
  assert scanned.time["kernel_s"] == 0 and cycles[0]["kernel_calls"] == 0  # XLA attention: no Mosaic kernel
  # a pod topology's estimate comes from the published source
  assert scanned.time["calibrated"]["source"] == "published"
  # memory is the scanned program's own (its stacked blocks' loop carries), and it fits as the unrolled one does
  assert scanned.memory["total"] > 0 and scanned.fits == unrolled.fits is True


@needs_libtpu
def test_fast_compile_counts_the_flops_and_collectives_of_the_full_compile_and_says_its_memory_is_another_programs(
    scanned_and_unrolled):
  """`plan --fast-compile` (XLA's least execution-time effort) against the default compile of the same scanned,
  chunked configuration: FLOPs and collectives within 0.5% (the stated tolerance); memory and bytes accessed are its
  own program's (on this pair +19% memory), which the plan says in a note."""
  full = scanned_and_unrolled[2]
  scanned = dict(teacher=TEACHER.replace(scan_layers=True), student=STUDENT.replace(scan_layers=True))
  fast = md.plan(**scanned, topology="v5e:2x2", mesh="2x2", batch=4, seq=16, remat="full", chunk_size=8,
                 fast_compile=True)
  assert fast.compiler_options == {"exec_time_optimization_effort": -1.0} and full.compiler_options is None
  assert fast.flops["counted"] == pytest.approx(full.flops["counted"], rel=5e-3)
  wire = lambda p: sum(c["wire_bytes"] for c in p.collectives)  # noqa: E731
  assert wire(fast) == pytest.approx(wire(full), rel=5e-3)
  assert fast.memory["total"] > 0 and any(n.startswith("--fast-compile") for n in fast.notes)
  assert not any(n.startswith("--fast-compile") for n in full.notes)


def test_a_calibrated_step_is_never_shorter_than_its_collectives_at_full_bandwidth():
  f = _calibrate.Fit(a={"v5e": 0.8}, a_pooled=0.6, k=0.02)
  # collectives mostly hidden where compute dominates, as the published rows showed
  assert f.step_seconds(8.0, 1.0, 0.5, "v5e") == pytest.approx(8.0 / 0.8 + 0.02 * 0.5)
  # where they outweigh compute and HBM (a large teacher gathered under FSDP) the step takes at least their time
  assert f.step_seconds(1.0, 2.0, 6.0, "v5e") == pytest.approx(6.0 + 0.02 * 6.0)
  assert f.predict([[1.0, 2.0, 6.0]], ["tpu7x"])[0] == pytest.approx(6.0 + 0.02 * 6.0)


def test_the_fit_recovers_a_fraction_of_peak_per_generation_and_the_shared_collective_cost():
  rng = np.random.default_rng(0)
  terms = np.column_stack([rng.uniform(1, 40, 9), rng.uniform(0.1, 2, 9), rng.uniform(0.5, 10, 9)])
  gens = ["v5e"] * 3 + ["v5p"] * 3 + ["v6e"] * 3
  true = _calibrate.Fit(a={"v5e": 0.8, "v5p": 0.65, "v6e": 0.5}, a_pooled=0.6, k=0.3)
  measured = true.predict(terms, gens)
  f = _calibrate.fit(terms, measured, gens)
  assert f.a == pytest.approx(true.a, rel=1e-4) and f.k == pytest.approx(0.3, rel=1e-4)
  assert np.allclose(f.predict(terms, gens), measured, rtol=1e-5)
  assert np.allclose(_calibrate.leave_one_out(terms, measured, gens), measured, rtol=1e-4)
  # a generation left out gets the pooled fraction of the others: v6e (0.5) predicted from 0.65-0.8 is too fast
  lgo = np.array(_calibrate.leave_generation_out(terms, measured, gens))
  assert np.all(lgo[6:] < measured[6:] * 0.9)
  # a row off the model: its leave-one-out error shows it, the others stay close
  off = measured.copy()
  off[0] *= 1.5
  loo = np.array(_calibrate.leave_one_out(terms, off, gens))
  assert abs(loo[0] / off[0] - 1) > 0.2 and np.all(np.abs(loo[3:] / off[3:] - 1) < 0.2)
  # no generation with two rows: k cannot be told from the fractions and is held
  assert _calibrate.fit(terms[[0, 3, 6]], measured[[0, 3, 6]], ["v5e", "v5p", "v6e"]).k == _calibrate.HELD_K
  with pytest.raises(ValueError, match="one length"):
    _calibrate.fit(terms, measured, gens[:-1])


def test_the_stored_calibration_is_the_fit_of_the_published_rows_and_reproduces_them():
  """Refits from the stored json (no compile): the constants in `_calibrate.CALIBRATION` are that fit's, and its
  predictions on the fitted rows are the refit's."""
  with open(RESULTS) as f:
    rows = json.load(f)
  pubs = [_published.PUBLISHED[r["row"]] for r in rows]
  terms = [(r["compute_s"], r["hbm_s"], r["comm_s"]) for r in rows]
  measured = [p.step_seconds for p in pubs]
  gens = [p.generation for p in pubs]
  assert all(r["topology"] == p.topology and r["seq"] == p.seq for r, p in zip(rows, pubs))
  # the roofline is an upper bound on speed: every published step is slower than its roofline
  assert rows and all(max(c, h) + m < s for (c, h, m), s in zip(terms, measured))
  stored = _calibrate.CALIBRATION
  cal = _calibrate.calibrate(terms, measured, gens)
  assert stored.rows == len(rows) and stored.a.keys() == cal.a.keys() and stored.band.keys() == cal.band.keys()
  assert stored.a == pytest.approx(cal.a, rel=1e-3) and stored.band == pytest.approx(cal.band, rel=1e-3, abs=1e-4)
  assert (stored.a_pooled, stored.k, stored.band_unseen) == pytest.approx((cal.a_pooled, cal.k, cal.band_unseen),
                                                                           rel=1e-3, abs=1e-4)
  assert stored.comm_share == pytest.approx(cal.comm_share, abs=1e-6) and 0 < stored.comm_share < 1
  # the literal names its source and each fitted row (the model and its published slice)
  assert stored.source == "published" and stored.row_names == tuple(f"{p.name} on {p.topology}" for p in pubs)
  fitted = stored.predict(terms, gens)
  assert np.allclose(fitted, cal.predict(terms, gens), rtol=2e-3)
  # every fitted row within its generation's band (the largest leave-one-out error bounds the in-sample ones)
  assert all(abs(p / m - 1) <= stored.band[g] + 1e-3 for p, m, g in zip(fitted, measured, gens))


def test_the_stored_chip_calibration_is_the_fit_of_the_measured_chip_rows_and_kept_apart_from_the_published():
  """Refits the chip source from its stored rows (no compile): steps measured on one TPU v5e chip, each with the TPU
  compiler's estimated cycles of its one-chip program and its attention kernels' FLOPs, fitted apart from the pod
  rows."""
  with open(CHIP_RESULTS) as f:
    rows = bench_module("chip_calibration").fitted(json.load(f))  # measured on the program the planner compiles
  stored = cost.CHIP_CALIBRATION
  assert rows and stored is not None and stored.source == "chip" and _calibrate.CALIBRATION.source == "published"
  assert stored.row_names == tuple(f"{r['pair']} {r['config']}" for r in rows) and stored.rows == len(rows)
  assert len(set(stored.row_names)) == len(rows) and stored.generation == "v5e"  # one row per configuration
  # the one-chip program (one device of v5e:2x2): no collectives; the data=4 stand-in, where compiled, has its
  # gradient all-reduce
  assert all(r["comm_s"] == 0 and "one device" in r["compiled_for"] and r["device"] == "TPU v5 lite" for r in rows)
  assert all(r["stand_in"]["wire_bytes"] > 0 for r in rows if r.get("stand_in"))
  terms = [(r["cycles"]["matmul"], r["cycles"]["other"], r["kernel_s"]) for r in rows]
  measured = [r["step_s"] for r in rows]
  cal = _calibrate.calibrate_chip(terms, measured, [r["config"] for r in rows])
  assert stored.s_matmul == pytest.approx(cal.s_matmul, rel=1e-3)
  assert stored.s_other == pytest.approx(cal.s_other, rel=1e-3)
  assert stored.kernel_fraction == pytest.approx(cal.kernel_fraction, rel=1e-3)
  assert stored.band == pytest.approx(cal.band, rel=1e-3, abs=1e-4)
  # the splash rows run kernels the compiler does not estimate; XLA's attention runs none
  assert all((r["kernel_s"] > 0) == (r["setting"]["attn"] == "splash") for r in rows)
  # every fitted row within the band of the fit (the largest leave-one-config-out error bounds the in-sample ones)
  fitted = stored.predict(terms)
  assert all(abs(p / m - 1) <= stored.band + 1e-3 for p, m in zip(fitted, measured))


def test_the_chip_fit_recovers_its_rates_and_refuses_too_few_rows():
  clock = 1.5e9
  truth = (1.0 / clock, 0.5 / clock, 0.7)  # s_matmul, s_other, the kernels' fraction of peak
  terms = [(3e8, 2e8, 0.03), (6e8, 3e8, 0.06), (2e8, 4e8, 0.0), (5e8, 1e8, 0.01), (1e8, 1e8, 0.02)]
  measured = [m * truth[0] + o * truth[1] + k / truth[2] for m, o, k in terms]
  cal = _calibrate.calibrate_chip(terms, measured, list("abcde"))
  assert cal.source == "chip" and cal.row_names == tuple("abcde") and cal.rows == 5
  assert (cal.s_matmul, cal.s_other, cal.kernel_fraction) == pytest.approx(truth, rel=1e-3)
  assert cal.band < 1e-3 and cal.step_seconds(*terms[0]) == pytest.approx(measured[0], rel=1e-6)
  # rows without a kernel say nothing of the kernels' fraction: held where it starts
  assert _calibrate.calibrate_chip([(m, o, 0.0) for m, o, _ in terms], [m * truth[0] + o * truth[1] for m, o, _ in
                                                                       terms], list("abcde")).kernel_fraction == 0.7
  with pytest.raises(ValueError, match="at least 4"):
    _calibrate.calibrate_chip(terms[:3], measured[:3], ["a", "b", "c"])
  with pytest.raises(ValueError, match="one name and one measured step per row"):
    _calibrate.calibrate_chip(terms, measured, ["a"])


def test_one_chip_takes_the_chip_source_and_every_other_target_the_published(monkeypatch):
  from meshdistill.config import load_config  # pylint: disable=g-import-not-at-top
  from meshdistill.planner import TPU_CHIPS, Planner, Target  # pylint: disable=g-import-not-at-top

  chip = cost.ChipCalibration(generation="v5e", s_matmul=1 / 1.5e9, s_other=0.5 / 1.5e9, kernel_fraction=0.5,
                                    band=0.05, rows=5)
  monkeypatch.setattr(cost, "CHIP_CALIBRATION", chip)
  published = _calibrate.CALIBRATION
  assert _calibrate.source_for(1, "v5e") is chip  # this machine's chip, or one compiled for from a host (v5e:1x1)
  for chips, gen in ((4, "v5e"), (1, "v6e")):
    assert _calibrate.source_for(chips, gen) is published  # a slice, a generation without rows

  def planner(name, n):
    return Planner(load_config(None, ()), TEACHER, STUDENT, ("t", "s"), Target(name, (object(),) * n,
                                                                                 TPU_CHIPS["v5e"]), 16)

  assert planner("local:v5ex1", 1).calibration() is chip
  assert planner("local:v5ex4", 4).calibration() is published
  assert planner("v5e:2x2", 4).calibration() is published
  assert planner("v5e:1x1", 1).calibration() is chip
  t = {"compute_s": 1.0, "hbm_s": 0.8, "comm_s": 0.0, "step_s": 1.0, "mfu": 0.5, "tokens_per_s": 100.0}
  assert chip.of(t, "v5e") is None  # no cycles of the TPU compiler: the chip source has nothing to read
  t.update(cycles={"matmul": 1.5e9, "other": 1.5e9, "kernel_calls": 4}, kernel_s=0.25)
  assert chip.of(t, "v6e") is None  # measured on another generation
  t["calibrated"] = chip.of(t, "v5e")
  assert t["calibrated"]["source"] == "chip" and t["calibrated"]["step_s"] == pytest.approx(1.0 + 0.5 + 0.5)
  lines = _report.step_time_lines(t)
  assert "leave-one-config-out error on steps measured on one v5e chip" in lines[0]
  assert "TPU compiler's estimate 1,500 + 1,500 M cycles" in lines[1] and "kernels 250.0 ms" in lines[1]


def test_the_published_rows_are_consistent_with_their_sources_arithmetic():
  from meshdistill.planner import TPU_CHIPS  # pylint: disable=g-import-not-at-top

  assert {g: TPU_CHIPS[g].peak_bf16_flops for g in _published.PEAK_FLOPS} == _published.PEAK_FLOPS
  # MaxText's global_parameter_scale 128 (December 2023): heads and MLP x8, embedding and layers x4
  assert _published.maxtext_2023_shape(128) == {"emb": 10240, "heads": 64, "head_dim": 256, "mlp": 65536,
                                                "layers": 64, "vocab": 32768}
  for s in (16, 32, 64, 128):  # "16B" ... "128B": the parameter counts the names say
    assert _published.maxtext_2023_params(s) / 1e9 == pytest.approx(s, rel=0.03)
  for p in _published.PUBLISHED:  # tokens/s x chips x step time = the global batch's tokens
    assert p.tokens_per_chip * p.chips * p.step_seconds == pytest.approx(p.batch * p.seq)
    assert 0.3 < p.mfu < 0.75 and p.generation in _published.PEAK_FLOPS
  with pytest.raises(ValueError, match="topology"):
    _published.Published("x", "llama2-70b", "v9z:2x2", 4, 2048, 8, "full", 1.0, 0.5, "")


def test_a_plan_prints_the_calibrated_step_beside_the_roofline():
  cal = _calibrate.Calibration(a={"v5e": 0.5}, a_pooled=0.4, k=0.25, band={"v5e": 0.1}, band_unseen=0.3, rows=4)
  time = {"compute_s": 1.0, "hbm_s": 0.5, "comm_s": 0.4, "step_s": 1.4, "mfu": 0.7, "tokens_per_s": 1000.0}
  out = cal.of(time, "v5e")
  assert out["step_s"] == pytest.approx(2.0 + 0.1) and out["low_s"] == pytest.approx(0.9 * 2.1)
  assert out["mfu"] == pytest.approx(0.7 * 1.4 / 2.1) and out["tokens_per_s"] == pytest.approx(1000 * 1.4 / 2.1)
  assert not out["pooled"]
  # a generation without published rows: the pooled fraction and the leave-generation-out band
  unseen = cal.of(time, "tpu7x")
  assert unseen["step_s"] == pytest.approx(2.5 + 0.1) and unseen["band"] == 0.3 and unseen["pooled"]
  assert cal.of({"step_s": None}, "v5e") is None


def test_the_roofline_is_called_an_upper_bound_only_where_the_calibrated_step_is_not_shorter():
  cal = _calibrate.Calibration(a={"v5e": 0.5}, a_pooled=0.4, k=0.25, band={"v5e": 0.1}, band_unseen=0.3, rows=4,
                               comm_share=0.3)
  # compute-bound, collectives 29% of the roofline step (within the published rows' 30%): roofline 1.4 s, calibrated 2.1
  t = {"compute_s": 1.0, "hbm_s": 0.5, "comm_s": 0.4, "step_s": 1.4, "mfu": 0.7, "tokens_per_s": 1000.0}
  t["calibrated"] = cal.of(t, "v5e")
  lines = _report.step_time_lines(t)
  assert t["calibrated"]["extrapolated"] is False and t["calibrated"]["comm_share"] == pytest.approx(0.4 / 1.4)
  assert "(an upper bound on speed)" in lines[1] and "extrapolated" not in lines[0]
  # collective-heavy (a teacher gathered under FSDP): roofline 1.0 + 3.0 = 4.0 s, calibrated max(2, 3) + 0.75 = 3.75
  t = {"compute_s": 1.0, "hbm_s": 0.2, "comm_s": 3.0, "step_s": 4.0, "mfu": 0.25, "tokens_per_s": 1000.0}
  t["calibrated"] = cal.of(t, "v5e")
  assert t["calibrated"]["step_s"] == pytest.approx(3.75) and t["calibrated"]["extrapolated"] is True
  lines = _report.step_time_lines(t)
  assert lines[0].startswith("calibrated step time 3750.0 ms")
  assert "collectives are 75% of the roofline step" in lines[0]
  assert "more than on any published run (30%)" in lines[0]
  assert lines[1].startswith("roofline step time 4000.0 ms") and "upper bound on speed)" not in lines[1]
  assert "not an upper bound" in lines[1]
  # without a calibration (CPU devices, or no published rows) only the roofline line
  assert _report.step_time_lines({**t, "calibrated": None})[0].startswith("roofline step time 4000.0 ms")
  assert _report.step_time_lines({"step_s": None, "why": "no peak"}) == ["step time: no estimate (no peak)"]


@needs_libtpu
def test_the_chunked_loss_loop_is_counted_whole(scanned_and_unrolled):
  scanned, unrolled, chunked = scanned_and_unrolled
  loss_loops = [lp for lp in chunked.flops["loops"] if lp["owner"] == "other"]
  assert loss_loops and all(lp["trip"] == 4 for lp in loss_loops)
  # XLA's own count sees one chunk of four; counted whole the step does the full-logits step's work (within 2%)
  assert chunked.flops["compiled"] < 0.9 * unrolled.flops["compiled"]
  assert chunked.flops["counted"] == pytest.approx(unrolled.flops["counted"], rel=2e-2)
  assert chunked.flops["counted"] == pytest.approx(scanned.flops["counted"], rel=2e-2)


@needs_libtpu
def test_the_flops_split_by_model_adds_up_to_the_step(scanned_and_unrolled):
  scanned, unrolled, _ = scanned_and_unrolled
  for p in (scanned, unrolled):
    split, shares = p.flops["split"], p.time["mfu_split"]
    assert split["teacher_forward"] + split["student_forward_backward"] == pytest.approx(p.flops["analytic"])
    assert shares["teacher_forward"] + shares["student_forward_backward"] == pytest.approx(p.time["mfu"])
    assert split["teacher_forward"] / split["student_forward_backward"] == pytest.approx(
        2 * p.flops["matmul_params_teacher"] / (6 * p.flops["matmul_params_student"]))
  # XLA's own split (scanned plans): the teacher's blocks, the student's blocks and the rest make the counted step
  s = scanned.flops["split"]
  assert s["compiled_teacher_blocks"] + s["compiled_student_blocks"] + s["compiled_rest"] == pytest.approx(
      scanned.flops["counted"], rel=1e-6)
  assert s["compiled_student_blocks"] > s["compiled_teacher_blocks"] / TEACHER.n_layers * STUDENT.n_layers * 0.5
  assert "student forward+backward" in scanned.table()


def test_on_policy_settings_add_the_sampling_flops():
  on = OnPolicySettings(lmbda=0.5, max_new_tokens=8)
  split = flops_split(n_t=1000, n_s=100, batch=4, seq=16, devices=2, on_policy=on)
  assert split["generation"] == pytest.approx(2 * 100 * (0.5 * 4) * 17 / 2)
  seq_kd = flops_split(n_t=1000, n_s=100, batch=4, seq=16, devices=2, on_policy=OnPolicySettings(seq_kd=True))
  assert seq_kd["generation"] == pytest.approx(2 * 1000 * 4 * 17 / 2)
  assert "generation" not in flops_split(n_t=1000, n_s=100, batch=4, seq=16, devices=2, on_policy=OnPolicySettings())


@needs_libtpu
def test_placement_of_a_tiny_pair_returns_each_option_and_recommends_one(scanned_and_unrolled):
  p = scanned_and_unrolled[1]
  out = placements(p, vocab=TEACHER.vocab_size, k=8, ici_bytes_per_s=400e9)
  opts = out["options"]
  assert set(opts) == {"in_step", "sub_mesh", "offline_cache", "remote"}
  assert all(o["step_s"] is not None and o["step_s"] > 0 for o in opts.values())
  assert opts["sub_mesh"]["teacher_chips"] + opts["sub_mesh"]["student_chips"] == 4
  # without the teacher in the step a chip holds less; the student's steps alone are faster than the step with it
  assert opts["offline_cache"]["memory_bytes"] == p.need_bytes - p.memory["teacher_weights"]
  assert opts["offline_cache"]["step_s"] < opts["in_step"]["step_s"]
  # top-8 of V=2048: 8 ids of 11 bits (11 B), 8 float16 values and the tail
  assert out["topk_bytes_per_token"] == 11 + 16 + 2 and opts["remote"]["network_bytes_per_step"] == 29 * 4 * 16
  assert out["recommended"] in opts


def test_cli_plan_placement_on_cpu_devices_lists_each_option(capsys):
  rc = cli.main(["plan", "--devices", "cpu:8", "--json", "--hbm-gib", "0.5", "--set", "train.batch_size=8",
                 "--placement", "4"])
  assert rc == 0
  out = json.loads(capsys.readouterr().out)["placement"]
  assert set(out["options"]) == {"in_step", "sub_mesh", "offline_cache", "remote"} and out["k"] == 4
  assert out["options"]["remote"]["network_bytes_per_step"] > 0


def test_loop_counts_multiply_each_loop_body_and_its_collectives_by_the_trip_counts():
  """A nested scan of matmuls with an all-reduce per inner iteration, compiled for 8 CPU devices: counted whole,
  the FLOPs are outer x inner matmuls and the all-reduces outer x inner (the flat analysis sees one of each)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from meshdistill.planner._compile import CompiledStep
  from meshdistill.planner._cost import loop_counts

  mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  outer, inner, n = 5, 7, 32

  def per_device(w, x):
    def inner_body(h, _):
      return jax.lax.psum(jnp.tanh(h @ w), "tensor"), None

    def outer_body(h, _):
      return jax.lax.scan(inner_body, h, None, length=inner)[0], None
    return jax.lax.scan(outer_body, x, None, length=outer)[0]

  f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))
  w = jax.ShapeDtypeStruct((n, n), jnp.float32, sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct((2 * n, n), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  compiled = f.lower(w, x).compile()
  flat = compiled.cost_analysis()
  flat = flat[0] if isinstance(flat, (list, tuple)) else flat
  step = CompiledStep(None, float(flat["flops"]), float(flat["bytes accessed"]), compiled.as_text(), 0.0, 0.0, {}, {})
  counts = loop_counts(step, (2, 4), (0, 0))
  matmul = 2 * n * n * n  # one [n, n] @ [n, n] per device and iteration
  assert sorted((lp["trip"], lp["times"]) for lp in counts.loops) == [(outer, 1), (inner, outer)]
  assert counts.flops == pytest.approx(outer * inner * matmul, rel=0.05)
  assert float(flat["flops"]) < 0.1 * counts.flops  # XLA's own count: one iteration of each loop
  reduces = [e for e in counts.collectives if e["kind"] == "all-reduce" and e["axis"] == "tensor"]
  assert len(reduces) == 1 and reduces[0]["count"] == outer * inner
  assert reduces[0]["bytes"] == outer * inner * n * n * 4


def test_the_attention_kernels_executed_flops_count_whole_blocks_and_pad_narrow_heads():
  from meshdistill.train.cost import _executed_keys, kernel_flops  # pylint: disable=g-import-not-at-top

  # causal, 2048 tokens in blocks of 512: 10 of the 16 block pairs computed, 1280 keys per query (the model's 1024)
  assert _executed_keys(2048, None, 512) == 1280 and _executed_keys(2048, None, 1024) == 1536
  # a 512-token window touches its own block and the one before: 7 pairs; the first block of a short sequence, whole
  assert _executed_keys(2048, 512, 512) == 896 and _executed_keys(128, None, 512) == 128
  assert _executed_keys(2048, None, 2048) == 2048
  splash = dict(attention="splash", n_layers=2, scan_layers=False)
  wide = STUDENT.replace(**splash, n_heads=4, n_kv_heads=4, head_dim=128)
  narrow = wide.replace(head_dim=64)
  for cfg in (wide, narrow):  # the model's count is linear in the head width; executed, 64 lanes cost as 128
    assert kernel_flops(cfg, cfg, "none", 2048) == pytest.approx(4 * 1024 * 4 * cfg.hd * 2 * (1 + 3))
  assert kernel_flops(narrow, narrow, "none", 2048, executed=True) == kernel_flops(wide, wide, "none", 2048,
                                                                                   executed=True)
  # the student's forward again under remat full; XLA attention runs no kernel
  assert kernel_flops(wide, wide, "full", 2048) == pytest.approx(kernel_flops(wide, wide, "none", 2048) * 5 / 4)
  for kept in ("dots", "dots_no_batch"):  # the splash kernel's residuals kept: its forward runs once
    assert kernel_flops(wide, wide, kept, 2048, executed=True) == kernel_flops(wide, wide, "none", 2048, executed=True)
  assert kernel_flops(wide.replace(attention="xla"), wide.replace(attention="xla"), "full", 2048,
                      executed=True) == 0
