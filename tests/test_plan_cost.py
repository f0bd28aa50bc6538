"""The planner's cost model: scanned loops counted whole, the FLOPs split by model, and the calibrated step time."""

import pytest

import meshdistill as md
from meshdistill import planner

needs_libtpu = pytest.mark.skipif(not planner.libtpu_available(),
                                  reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")

TEACHER = md.ModelConfig(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=1024,
                         max_len=16, tie_embeddings=False, dtype="bfloat16")
STUDENT = TEACHER.replace(d_model=128, n_heads=2, n_kv_heads=2, mlp_hidden=512, n_layers=3)


@pytest.fixture(scope="module")
def scanned_and_unrolled():
  """The same pair and configuration on v5e:2x2, planned with scanned blocks and with unrolled ones."""
  kw = dict(topology="v5e:2x2", mesh="2x2", batch=4, seq=16, remat="full")
  return (md.plan(TEACHER.replace(scan_layers=True), STUDENT.replace(scan_layers=True), **kw),
          md.plan(TEACHER, STUDENT, **kw))


@needs_libtpu
def test_scanned_loops_are_counted_whole_as_the_unrolled_program_counts_them(scanned_and_unrolled):
  scanned, unrolled = scanned_and_unrolled
  # the scanned program's own count holds one block per loop: well under the whole step
  assert scanned.flops["compiled"] < 0.8 * unrolled.flops["compiled"]
  # counted whole (extended from 1- and 2-block compiles) it equals the unrolled program's count within 0.5%
  assert scanned.flops["counted"] == pytest.approx(unrolled.flops["compiled"], rel=5e-3)
  wire = lambda p: sum(c["wire_bytes"] for c in p.collectives)  # noqa: E731
  assert wire(scanned) == pytest.approx(wire(unrolled), rel=1e-2)
  assert scanned.step_seconds is not None and scanned.step_seconds == pytest.approx(unrolled.step_seconds, rel=0.2)
  assert "scanned loops counted whole" in scanned.table()
