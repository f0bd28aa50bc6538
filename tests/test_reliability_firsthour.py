"""Reliability, round three, the first hour of a new user (`benchmarks/results/reliability.md`, items 14-17): a
`--set` the planner would have ignored is applied to the preset; `distill` ends saying where its outputs are and what
to run next; `md.load_run` logs nothing the user did not cause."""

import contextlib
import io
import logging

import pytest
from helpers import write_corpus

from meshdistill import cli, planner


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


def tiny_sets(tmp, corpus, *extra):
  """The tiny CLI config on a small corpus, a few steps (as `test_reliability.tiny_sets`)."""
  sets = [f"data.source={corpus}", "data.seq_len=16", "data.val_fraction=0.25", "data.max_chars=null",
          "teacher.max_len=16", "student.max_len=16", "train.warmup=1", "train.eval_every=0", "train.log_every=1",
          "pretrain.warmup=1", "pretrain.eval_every=0", "pretrain.log_every=1", "checkpoint.every=0",
          "train.steps=2", "pretrain.steps=2", f"pretrain.cache_dir={tmp / 'cache'}", "mesh.backend=single",
          "mesh.data=1", "mesh.tensor=1", *extra]
  return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """One finished `meshdistill distill` run (2 steps) and what the command printed."""
  root = tmp_path_factory.mktemp("firsthour")
  corpus = write_corpus(root / "corpus", 12)
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli.main(["distill", "--config", "tiny", *tiny_sets(root, corpus, f"run.run_dir={root / 'run'}")])
  assert rc == 0, err.getvalue()[-2000:]
  return dict(root=root, corpus=corpus, run=root / "run", out=out.getvalue())


def test_r3_distill_ends_with_where_its_outputs_are_and_what_to_run_next(finished_run):
  """Item 17: the end of `meshdistill distill` said neither where its outputs are nor what reads them."""
  run = str(finished_run["run"])
  out = finished_run["out"]
  assert f"outputs in {run}: checkpoints/, metrics.jsonl, tb/ (TensorBoard), summary.json, config.yaml" in out
  for command in (f"meshdistill eval {run}", f"meshdistill plot {run}", f"meshdistill export {run} OUT_DIR",
                  f'md.load_run("{run}")'):
    assert command in out, out


def test_r3_load_run_logs_no_read_only_notes(finished_run):
  """Item 17: `md.load_run` logged absl's "read_only=True, setting save_interval_steps=0" and "Given directory is read
  only" notes: what a read-only load asked for, not the user's business. Other absl warnings still pass."""
  import meshdistill as md

  class Keep(logging.Handler):
    def __init__(self):
      super().__init__(logging.DEBUG)
      self.messages = []

    def emit(self, record):
      self.messages.append(record.getMessage())

  absl, keep = logging.getLogger("absl"), Keep()
  level = absl.level
  absl.setLevel(logging.WARNING)  # as in a fresh Python session (the CLI above set it to ERROR)
  absl.addHandler(keep)
  try:
    loaded = md.load_run(str(finished_run["run"]))
    absl.warning("another note")
  finally:
    absl.removeHandler(keep)
    absl.setLevel(level)
  assert loaded.step == 2
  assert not [m for m in keep.messages if "read only" in m or "read_only" in m], keep.messages
  assert "another note" in keep.messages
