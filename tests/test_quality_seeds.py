"""`benchmarks/quality.py --seeds`: the spread section's mean and standard deviation over seeds
(`benchmarks/bench/render_quality.py`)."""

import statistics

import pytest

from helpers import bench_module


@pytest.fixture(scope="module")
def quality():
  return bench_module("render_quality")


def _row(seed, distilled, scratch):
  settings = {
      "teacher": {"d_model": 128, "n_layers": 4},
      "student": {"d_model": 64, "n_layers": 4},
      "distill": {"temperature": 1.0, "alpha": 1.0},
      "train": {"steps": 300, "lr": 0.003},
      "pretrain": {"steps": 400},
  }
  return {"seed": seed, "date": "d", "settings": settings, "distilled": {"loss": distilled},
          "scratch": {"loss": scratch}, "loss_ratio": distilled / scratch}


def test_spread_reports_mean_and_sample_sd(quality):
  rows = [_row(1, 1.8, 2.0), _row(2, 1.7, 1.9), _row(3, 1.85, 1.95), _row(2, 1.75, 1.9)]  # seed 2 rerun: last wins
  text = quality.render_seeds(rows)
  ratios = [1.8 / 2.0, 1.75 / 1.9, 1.85 / 1.95]
  assert "(3 seed(s) finished)" in text
  assert f"mean **{statistics.mean(ratios):.4f}**, sd {statistics.stdev(ratios):.4f} over 3 seed(s)" in text
  assert "met on every seed" in text and "NOT met" not in text
  assert quality.render_seeds([_row(1, 1.95, 2.0)]).count("NOT met on every seed") == 1
