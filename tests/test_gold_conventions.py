"""`uld` and `span_kl` under TRL GOLD's conventions (merge, EOS skipping, two temperatures, ``beta``) equal TRL's own
`ULDLoss` on a fixed row: tests/fixtures/trl_gold.json, written by scripts/make_trl_fixtures.py with TRL."""

import json
import pathlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from meshdistill import losses
from meshdistill.data.alignment import row_alignment
from meshdistill.models import ModelOutput
from meshdistill.strategies import ByteKL, SpanKL, ULD

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "trl_gold.json").read_text())
# Both sides compute in float32; a loss here sums ~4 spans of ~20 sorted or logged terms each: a few hundred ulps of
# float32 (1.2e-7) at most, so 1e-5 relative holds them and a wrong span, merge or temperature (>= 1e-2) fails.
RTOL = 1e-5


def setting(case: dict, key: str):
  return case["settings"].get(key, FIXTURE["trl_defaults"][key])


def strategy_of(case: dict):
  """meshdistill's strategy for TRL's settings (the mapping docs/cross_tokenizer.md states)."""
  common = dict(alpha=1.0, merge=setting(case, "uld_token_merge_strategy"),
                temperature=setting(case, "uld_student_temperature"),
                teacher_temperature=setting(case, "uld_teacher_temperature"),
                skip_eos=setting(case, "uld_skip_student_eos") or setting(case, "uld_skip_teacher_eos"))
  if not case["settings"].get("uld_use_hybrid_loss"):
    return ULD(**common).with_eos(FIXTURE["teacher_eos"], FIXTURE["student_eos"])
  weight = case["settings"].get("uld_hybrid_matched_weight")
  span_kl = SpanKL(**common, beta=setting(case, "beta"), matched_weight=weight)
  return span_kl.with_eos(FIXTURE["teacher_eos"], FIXTURE["student_eos"]).with_matched(FIXTURE["matched_t"],
                                                                                       FIXTURE["matched_s"])


def ends(pieces):
  return np.cumsum([1 if p is None else len(p.encode()) for p in pieces])


@pytest.fixture(scope="module")
def row():
  s_pieces, t_pieces = FIXTURE["student_pieces"], FIXTURE["teacher_pieces"]
  ts, tt = len(s_pieces), len(t_pieces)
  al = row_alignment(ends(s_pieces), ends(t_pieces), np.ones(ts), np.ones(tt), student_len=ts, teacher_len=tt,
                     spans=tt)
  teacher = losses.Aligned(jnp.asarray(FIXTURE["t_logits"], jnp.float32), jnp.asarray(FIXTURE["t_targets"], jnp.int32),
                           *map(jnp.asarray, (al.teacher_span, al.student_span, al.teacher_last, al.student_last,
                                              al.span_bytes)))
  student = ModelOutput(logits=jnp.asarray(FIXTURE["s_logits"], jnp.float32))
  return student, teacher, jnp.asarray(FIXTURE["s_targets"], jnp.int32)


def run(strategy, row):
  student, teacher, targets = row
  mask = jnp.ones(targets.shape, jnp.float32)
  return jax.device_get(strategy.per_sequence({}, student, teacher, targets, mask, 0))


def test_the_fixture_records_trls_defaults():
  assert FIXTURE["trl_defaults"] == {
      "beta": 0.5, "uld_token_merge_strategy": "observed", "uld_student_temperature": 1.0,
      "uld_teacher_temperature": 1.0, "uld_skip_student_eos": True, "uld_skip_teacher_eos": True,
      "uld_hybrid_matched_weight": None}


@pytest.mark.parametrize("name", sorted(FIXTURE["cases"]))
def test_each_setting_equals_trls_uld_loss(row, name):
  """TRL averages the per-span terms over the spans it compares; meshdistill sums them (the step divides by the
  student's tokens), so the sum equals TRL's loss times its span count, and the spans counted agree."""
  case = FIXTURE["cases"][name]
  got = run(strategy_of(case), row)
  n = case["groups"]
  assert got["spans"] == n
  np.testing.assert_allclose(got["loss"], case["loss"] * n, rtol=RTOL)
  if "matched" in case:
    metric = {0.0: "matched_kl", 1.0: "matched_reverse_kl"}.get(setting(case, "beta"), "matched_jsd")
    np.testing.assert_allclose(got[metric], case["matched"] * n, rtol=RTOL)
    np.testing.assert_allclose(got["unmatched_uld"], case["unmatched"] * n, rtol=RTOL)


def test_beta_moves_the_matched_term_from_forward_to_reverse_kl(row):
  """At beta 0 and 1 the matched term is each KL (computed here directly); beta 0.5 lies apart from both."""
  cases = FIXTURE["cases"]
  kl, jsd, rkl = (cases[f"hybrid_bayesian_beta{b}"]["matched"] for b in ("0", "0.5", "1"))
  assert len({round(kl, 3), round(jsd, 3), round(rkl, 3)}) == 3
  s = jnp.log(jnp.asarray([[0.5, 0.2, 0.1]]))
  t = jnp.log(jnp.asarray([[0.3, 0.3, 0.2]]))
  one = jnp.ones(1)
  fwd = float(losses.matched_divergence(s, t, [0, 1, 2], [0, 1, 2], one, 0.0)[0])
  rev = float(losses.matched_divergence(s, t, [0, 1, 2], [0, 1, 2], one, 1.0)[0])
  p, q = np.array([0.5, 0.2, 0.1]), np.array([0.3, 0.3, 0.2])
  np.testing.assert_allclose(fwd, np.sum(q * np.log(q / p)), rtol=1e-6)
  np.testing.assert_allclose(rev, np.sum(p * np.log(p / q)), rtol=1e-6)


def test_observed_drops_a_span_ending_at_the_rows_last_position(row):
  """Without EOS skipping the end-of-text span ends at the last position: ``observed`` has nothing after it."""
  bayes = run(ULD(alpha=1.0).with_eos(FIXTURE["teacher_eos"], FIXTURE["student_eos"]), row)
  observed = run(ULD(alpha=1.0, merge="observed"), row)
  assert bayes["spans"] == 5 and observed["spans"] == 4


def test_bad_settings_name_themselves():
  with pytest.raises(ValueError, match=r"ULD.merge='first'.*\['bayesian', 'observed'\]"):
    ULD(merge="first")
  with pytest.raises(ValueError, match="SpanKL.beta=1.5 must be a number in"):
    SpanKL(beta=1.5)
  with pytest.raises(ValueError, match="ULD.teacher_temperature"):
    ULD(teacher_temperature=0.0)
  with pytest.raises(ValueError, match="ByteKL.merge='observed' is not used"):
    ByteKL(merge="observed")


def test_skip_eos_needs_the_end_of_text_ids(row):
  with pytest.raises(ValueError, match=r"with_eos\(teacher_eos_id, student_eos_id\)"):
    run(ULD(skip_eos=True), row)


def test_settings_survive_with_matched_and_fallback():
  s = SpanKL(beta=0.5, merge="observed", skip_eos=True).with_eos(19, 11).with_matched([1], [0])
  back = s.fallback()
  assert back.alpha == 0.0 and back.eos == (19, 11) and back.matched == ((1,), (0,)) and back.beta == 0.5
