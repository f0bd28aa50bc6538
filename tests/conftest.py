"""Test set-up: 8 simulated CPU devices, set once before JAX starts a backend; shared fixtures.

Shared configs and helpers live in ``tests/helpers.py`` (``from helpers import ...``).
"""

import os

import chex

# The test models are tiny: skipping LLVM's optimisation passes halves compile time,
# which dominates the suite. Every layout compiles with the same flags.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
chex.set_n_cpu_devices(8)

import pytest  # noqa: E402
from helpers import STUDENT_CFG, TEACHER_CFG  # noqa: E402  (after the devices are set)


@pytest.fixture
def tiny_cfgs():
  return TEACHER_CFG, STUDENT_CFG
