"""Reliability, round three, the first hour of a new user (`benchmarks/results/reliability.md`, items 14-17): a
`--set` the planner would have ignored is applied to the preset, ..."""

from meshdistill import planner


def test_r3_plan_applies_set_shape_settings_to_a_named_preset():
  """Item 14: `plan --student qwen3-0.6b --set student.n_layers=4` planned the 28-layer preset without a word; the
  shape settings of --set now apply to the preset, and the plan's label says so."""
  pl = planner.make_planner("qwen3-1.7b", "qwen3-0.6b", devices="cpu:8",
                            overrides=["student.n_layers=4", "teacher.d_model=1024", "train.batch_size=8"])
  assert pl.student.n_layers == 4 and pl.student.d_model == 1024  # the preset's other fields stay
  assert pl.teacher.d_model == 1024 and pl.teacher.n_layers == 28
  assert pl.labels == ("qwen3-1.7b with d_model=1024", "qwen3-0.6b with n_layers=4")
  plain = planner.make_planner("qwen3-1.7b", "qwen3-0.6b", devices="cpu:8")
  assert plain.student.n_layers == 28 and plain.labels == ("qwen3-1.7b", "qwen3-0.6b")
