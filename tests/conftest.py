"""Test set-up: 8 simulated CPU devices, set once before JAX starts a backend; shared fixtures.

Shared configs and helpers live in ``tests/helpers.py`` (``from helpers import ...``).
"""

import os

# CPU only: with libtpu installed (the `tpu` extra) JAX would otherwise probe for a TPU at start-up
# (seconds, and log noise); the planner's TPU topologies need no TPU backend. Set before JAX is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import chex  # noqa: E402

# The test models are tiny and compiling dominates the suite: skipping LLVM's optimisation passes halves compile
# time, and XLA's older elemental emitters compile the tiny fusions in about two thirds of the time of its fusion
# emitters (same values). Every layout compiles with the same flags; subprocesses inherit them.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
).strip()
chex.set_n_cpu_devices(8)

import pytest  # noqa: E402
from helpers import STUDENT_CFG, TEACHER_CFG  # noqa: E402  (after the devices are set)


@pytest.fixture
def tiny_cfgs():
  return TEACHER_CFG, STUDENT_CFG
