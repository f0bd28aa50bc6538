"""``auto`` at start-up (`meshdistill.train.tuning`): the search over remat, micro-batch and chunk compiles only what
can be chosen and picks the fastest fitting candidate where there is an estimate, the first fitting in cost order
where there is none, micro-batches where no remat fits the whole batch; the real step so on the CPU with a fake
budget and a fake estimate, the choice kept by program so a second start compiles nothing, and nothing compiled or
changed where no memory limit is known."""

import json
import logging

import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, make_batch

import meshdistill as md
from meshdistill.train import memory, tuning
from meshdistill.train.tuning import Candidate, Measured

REMATS = memory.REMAT_ORDER


def fake(need: dict, seconds: dict | None = None):
  """``(measure, calls)``: a measurement of each candidate from tables keyed by ``(remat, micro_batch, chunk)``
  (memory default 100 bytes, seconds default none), and the candidates it was asked for (the compiles)."""
  calls = []

  def measure(c: Candidate) -> Measured:
    calls.append(c)
    key = (c.remat, c.micro_batch, c.chunk)
    return Measured(memory.MemoryReport(need.get(key, 100), 0, 0, 0), None if seconds is None else seconds.get(key))

  return measure, calls


def test_the_estimate_ranks_the_fitting_candidates_and_only_those_that_can_win_are_compiled():
  # 8 rows: the whole batch fits only with full remat; 4 rows fit with dots, 2 rows with none
  need = {(r, 8, 1024): 1000 for r in REMATS[:3]} | {("none", 4, 1024): 1000}
  seconds = {("full", 8, 1024): 1.0, ("dots", 4, 1024): 0.8, ("none", 2, 1024): 0.9, ("dots", 4, 512): 0.85,
             ("dots", 4, 2048): 0.7}
  measure, calls = fake(need, seconds)
  chosen, fits, why, measured = tuning.search(REMATS, [8, 4, 2, 1], [1024, 512, 2048], measure, 500, estimated=True)
  assert (chosen, fits) == (Candidate("dots", 4, 2048), True)
  # the whole batch up to its first fit (4), 4 rows up to dots (2), 2 rows at none only (1: it fits, nothing smaller
  # can win), then the fastest at the other chunks (2)
  assert calls == [Candidate(r, 8, 1024) for r in REMATS] + [Candidate("none", 4, 1024), Candidate("dots", 4, 1024),
                                                             Candidate("none", 2, 1024), Candidate("dots", 4, 512),
                                                             Candidate("dots", 4, 2048)]
  assert set(measured) == set(calls) and "fastest estimated of 5 that fit, 9 compiled: 700 ms" in why


def test_without_an_estimate_the_first_that_fits_in_cost_order_is_taken_at_the_default_chunk():
  need = {("none", 8, 1024): 1000, ("dots", 8, 1024): 1000}
  measure, calls = fake(need, {("full", 8, 1024): 9.0})
  chosen, fits, _, _ = tuning.search(REMATS, [8, 4], [1024, 512], measure, 500, estimated=False)
  assert (chosen, fits) == (Candidate("dots_no_batch", 8, 1024), True) and len(calls) == 3
  # the whole batch that fits with no remat ends the search at once, estimate or not
  measure, calls = fake({})
  assert tuning.search(REMATS, [8, 4], [1024], measure, 500, estimated=True)[0] == Candidate("none", 8, 1024)
  assert len(calls) == 1


def test_micro_batches_are_taken_where_no_remat_fits_the_whole_batch_and_the_leanest_where_nothing_fits():
  need = {(r, 8, None): 1000 for r in REMATS} | {(r, 4, None): 1000 for r in REMATS}
  measure, calls = fake(need)
  chosen, fits, _, _ = tuning.search(REMATS, [8, 4, 2, 1], [None], measure, 500, estimated=False)
  assert (chosen, fits, len(calls)) == (Candidate("none", 2, None), True, 9)
  measure, calls = fake({(r, m, None): (1000 - m) * 2**20 for r in REMATS for m in (8, 4)})
  chosen, fits, why, _ = tuning.search(REMATS, [8, 4], [None], measure, 500 * 2**20, estimated=False)
  assert (chosen, fits, len(calls)) == (Candidate("none", 8, None), False, 8)
  assert why == "none of 8 compiled fits; the leanest, which needs 992.00 MiB"
  measure, calls = fake({})
  assert tuning.search(REMATS, [8, 4], [1024], measure, None, estimated=True)[:2] == (Candidate("none", 8, 1024), True)
  assert not calls  # no memory limit known: nothing compiled


@pytest.fixture(scope="module")
def auto_distiller():
  """A tiny pair with remat and micro-batch left at auto, its state and an 8-row batch, and the bytes its step needs
  at 8 and at 4 rows per pass (compiled once here)."""
  d = md.Distiller(md.init_model(STUDENT_CFG, seed=1), md.init_model(TEACHER_CFG, seed=0), micro_batch="auto")
  state, batch = d.init_state(), make_batch(batch=8)
  need = {m: tuning.measure_step(tuning.variant(d, Candidate("none", m, None), 8), state, batch, None).report
          for m in (8, 4)}
  return d, state, batch, {m: r.need_bytes for m, r in need.items()}


def test_the_real_step_falls_back_to_micro_batches_and_a_second_start_reads_the_kept_choice(
    auto_distiller, tmp_path, monkeypatch, caplog):
  d, state, batch, need = auto_distiller
  # on the CPU remat barely changes the step's bytes; 4 rows per pass need well under the whole batch
  assert need[4] < 0.8 * need[8]
  budget = int((need[4] + need[8]) / 2 / 0.9)  # 90% of it: above the 4-row step, below every whole-batch one
  monkeypatch.setenv("MESHDISTILL_TUNING", str(tmp_path / "tuning.json"))
  real, compiles = tuning.measure_step, []

  def counted(*a, **k):
    compiles.append(a[0])
    return real(*a, **k)

  monkeypatch.setattr(tuning, "measure_step", counted)
  estimate = lambda trainer, compiled, batch: {None: 1.0, 4: 0.9, 2: 0.95}[trainer.micro_batch]  # noqa: E731
  with caplog.at_level(logging.INFO, logger="meshdistill.train.tuning"):
    chosen, first = tuning.auto_tune(d, state, batch, budget_bytes=budget, estimate=estimate)
  assert (first.chosen, first.fits, first.cached) == (Candidate("none", 4, None), True, False)
  assert len(compiles) == len(REMATS) + 1  # every remat at 8 rows, then none at 4 rows fits: nothing smaller can win
  assert chosen.micro_batch == 4 and chosen.student_cfg.remat == "none" and d.micro_batch == "auto"
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto: ")]
  assert lines == ["auto: remat=none, micro_batch=4, chunk=n/a (the fastest estimated of 1 that fit, 5 compiled: "
                   f"900 ms, in 90% of {budget / 2**20:.2f} MiB)"]
  assert list(json.loads((tmp_path / "tuning.json").read_text()).values()) == [
      {"remat": "none", "micro_batch": 4, "chunk": None, "fits": True}]
  compiles.clear()
  again, second = tuning.auto_tune(d, state, batch, budget_bytes=budget, estimate=estimate)
  assert not compiles and second.cached and second.chosen == first.chosen and again.micro_batch == 4
  # the Distiller's own first step makes the same choice and trains on it
  monkeypatch.setattr(md.Distiller, "decide_auto", _with_budget(md.Distiller.decide_auto, budget, estimate))
  d2 = md.Distiller(md.init_model(STUDENT_CFG, seed=1), md.init_model(TEACHER_CFG, seed=0), micro_batch="auto")
  _, metrics = d2.step(d2.init_state(), batch)
  assert not compiles and (d2.micro_batch, d2.student_cfg.remat) == (4, "none") and float(metrics["loss"]) > 0


def _with_budget(decide, budget, estimate):
  return lambda self, state, batch, **kw: decide(self, state, batch, budget_bytes=budget, estimate=estimate)


def test_without_a_memory_limit_auto_compiles_nothing_and_runs_the_whole_batch_without_remat(auto_distiller):
  d, state, batch, _ = auto_distiller
  chosen, tuned = tuning.auto_tune(d, state, batch)  # a CPU device reports no memory limit
  assert tuned.chosen == Candidate("none", 8, None) and not tuned.measured and tuned.budget_bytes is None
  assert chosen.micro_batch is None and chosen.student_cfg.remat == "none"
  assert tuned.line() == "auto: remat=none, micro_batch=8, chunk=n/a (no memory limit known: nothing compiled)"


# a TPU program as libtpu writes it, cut to what the estimate reads: a loop of 4 iterations whose body runs a matmul
# fusion (100 estimated cycles) and an add (10), and one instruction outside (7)
PROGRAM = """HloModule step

%fused_dot (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %f = f32[8,8]{1,0} fusion(%x, %x), kind=kOutput, calls=%fused_dot, backend_config={"estimated_cycles":"100"}
  %a = f32[8,8]{1,0} add(%f, %f), backend_config={"estimated_cycles":"10"}
  ROOT %r = (s32[], f32[8,8]{1,0}) tuple(%i, %a)
}

%cond (t: (s32[], f32[8,8])) -> pred[] {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %c = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %z = s32[] constant(0)
  %s = f32[8,8]{1,0} negate(%x), backend_config={"estimated_cycles":"7"}
  %t = (s32[], f32[8,8]{1,0}) tuple(%z, %s)
  %w = (s32[], f32[8,8]{1,0}) while(%t), condition=%cond, body=%body
  ROOT %o = f32[8,8]{1,0} get-tuple-element(%w), index=1
}
"""


def test_a_tpu_programs_estimated_cycles_become_the_chip_calibrations_seconds():
  from meshdistill.planner import TPU_CHIPS
  from meshdistill.train import cost

  assert cost.estimated_cycles(cost.parse(PROGRAM)) == {"matmul": 400, "other": 47, "kernel_calls": 0, "kernel_bytes": 0}
  calibration, peak = cost.calibration_for("TPU v5 lite")
  assert calibration is cost.CHIP_CALIBRATION and peak == TPU_CHIPS["v5e"].peak_bf16_flops  # one chip, one peak
  assert cost.calibration_for("cpu") is None and cost.calibration_for("TPU v6 lite") is None
  xla = STUDENT_CFG.replace(attention="xla")
  assert cost.step_seconds(PROGRAM, None, xla, "none", 8, 64, calibration, peak) == pytest.approx(
      400 * calibration.s_matmul + 47 * calibration.s_other)
  splash = STUDENT_CFG.replace(attention="splash")  # the kernels the compiler does not estimate, at their FLOPs
  kernels = cost.kernel_flops(None, splash, "full", 8, executed=True) * 64 / peak
  assert kernels > 0 and cost.step_seconds(PROGRAM, None, splash, "full", 8, 64, calibration, peak) == pytest.approx(
      400 * calibration.s_matmul + 47 * calibration.s_other + kernels / calibration.kernel_fraction)
  assert cost.step_seconds(PROGRAM.replace("estimated_cycles", "x"), None, xla, "none", 8, 64, calibration,
                           peak) is None  # a program compiled for another backend carries no estimate
