"""The type checker over ``src/meshdistill`` (mypy, its settings in pyproject.toml's ``[tool.mypy]``: every module
checked except those listed as not clean yet; other libraries' types taken as Any) finds nothing, and it does read
the seams: a strategy given as a string, a misspelt keyword of the step and a teacher of the wrong type are errors.

One mypy run without a cache (7 to 16 s on a shared 2-core machine; keep it under 30 s)."""

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("mypy", reason="the type checker comes with the test extra: pip install -e '.[test]'")

ROOT = pathlib.Path(__file__).resolve().parents[1]

WRONG = '''\
import meshdistill as md
from meshdistill.train.step import apply_gradients

student = md.init_model(md.ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, mlp_hidden=32, max_len=8))
md.Distiller(student, None, strategy="hard_label")
md.Distiller(student, teacher=md.ModelConfig())
apply_gradients(None, {}, {}, optimizer=md.default_optimizer(), one_devices=True)
'''


def test_the_type_checker_passes_over_src_and_reads_the_seams(tmp_path):
  wrong = tmp_path / "wrong_seams.py"
  wrong.write_text(WRONG)
  # a cache of its own: a shared one may hold another file of the same module name
  run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
                        str(tmp_path / "cache"), "src/meshdistill", str(wrong)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  errors = [line for line in run.stdout.splitlines() if ": error:" in line]
  in_src = [line for line in errors if not line.startswith(str(wrong))]
  assert not in_src, "mypy over src/meshdistill:\n" + "\n".join(in_src)
  found = {int(re.match(r".*wrong_seams\.py:(\d+):", line).group(1)) for line in errors}
  assert found == {5, 6, 7}, run.stdout  # the strategy, the teacher, the misspelt keyword
  assert 'Unexpected keyword argument "one_devices"' in run.stdout
