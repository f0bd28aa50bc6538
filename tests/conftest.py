"""Test set-up: 8 simulated CPU devices, set once before JAX starts a backend; shared fixtures.

Shared configs and helpers live in ``tests/helpers.py`` (``from helpers import ...``).
"""

import os
import re
import shutil
import tempfile

# CPU only: with libtpu installed (the `tpu` extra) JAX would otherwise probe for a TPU at start-up
# (seconds, and log noise); the planner's TPU topologies need no TPU backend. Set before JAX is imported.
# One exception, decided in `pytest_configure` before any backend starts: a run that selects the chip's tests
# (`-m tpu`, tests/tpu) leaves the platform to JAX, which then picks the TPU where there is one.
_PLATFORM_GIVEN = "JAX_PLATFORMS" in os.environ
_XLA_FLAGS_GIVEN = os.environ.get("XLA_FLAGS")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import chex  # noqa: E402

# The test models are tiny: compile time dominates the suite. Skipping LLVM's optimisation passes halves it, and
# XLA CPU's older loop emitters (fusion emitters off) cut a third again (one file at a time: test_collectives 18.7 ->
# 11.7 s, test_trainer 58.7 -> 43.5 s, test_freezing 44.0 -> 33.4 s). Every layout compiles with the same flags. Two
# different programs of the same computation (a light and a full step, a scanned and an unrolled model) may round
# differently under these emitters: the tests hold them to a tolerance, and bit for bit only what runs the same
# program (a resumed run against an uninterrupted one, a layout's replicas).
# LLVM's code generation in one piece instead of up to 32 run on a thread pool: the tiny programs' modules gain
# nothing from the split on a 2-core machine that runs two test workers (a step compiled and run three times: 6.4 ->
# 5.9 s); the same code either way.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                           " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1").strip()
# One persistent compilation cache per test run, shared by the xdist workers and every process a test starts (they
# inherit the environment): the tiny programs the suite compiles again and again (the one-device reference steps,
# the same job in many CLI runs) compile once. Entries are the compiled executables themselves, so a hit changes no
# value; the folder goes when the run ends (`pytest_sessionfinish`).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
_XLA_CACHE = os.path.join(tempfile.gettempdir(), f"meshdistill-tests-xla-{_RUN}")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
chex.set_n_cpu_devices(8)

import gc  # noqa: E402

import pytest  # noqa: E402
from helpers import STUDENT_CFG, TEACHER_CFG  # noqa: E402  (after the devices are set)

# Python's cyclic garbage collector ran ~650 times per compiled tiny step (tracing allocates many short-lived
# objects) and took about a tenth of a test's CPU time. The modules imported so far stay for the whole run (frozen out
# of every collection) and a collection waits for 50,000 new objects instead of 700; the garbage left between
# collections is small next to a worker's memory. Reference counting frees everything else as before.
gc.freeze()
gc.set_threshold(50_000, 20, 20)


def wants_the_chip(config) -> bool:
  """Whether this run is the chip's test set on a TPU: ``-m`` selects the ``tpu`` marker, the user set no
  ``JAX_PLATFORMS``, ``MESHDISTILL_TPU_TESTS_ON`` is unset or ``tpu`` (``cpu``: the same tests on the CPU) and this is
  no pytest-xdist worker (one process at a time can hold the chip)."""
  selects = re.search(r"(?<!not )\btpu\b", config.option.markexpr or "")
  return bool(selects and not _PLATFORM_GIVEN and not hasattr(config, "workerinput")
              and os.environ.get("MESHDISTILL_TPU_TESTS_ON", "tpu") == "tpu")


def pytest_configure(config):
  """A run of the chip's tests leaves the platform to JAX (TPU first, the CPU beside it) and drops the CPU compile
  flags above; nothing has started a backend yet, so JAX reads the change when the first test asks for a device."""
  if wants_the_chip(config):
    import jax  # pylint: disable=g-import-not-at-top  (already imported by chex)

    del os.environ["JAX_PLATFORMS"]
    jax.config.update("jax_platforms", None)
    os.environ["XLA_FLAGS"] = " ".join(
        f for f in os.environ["XLA_FLAGS"].split()
        if f.startswith("--xla_force_host_platform_device_count") or f in (_XLA_FLAGS_GIVEN or "").split())


# Where `meshdistill.train.tuning` keeps its choices (``$MESHDISTILL_TUNING``): a file of each test's own, in a
# folder of the run, so no test reads a choice another made nor writes the user's ``~/.cache``.
_TUNING = os.path.join(tempfile.gettempdir(), f"meshdistill-tests-tuning-{_RUN}")


@pytest.fixture(autouse=True)
def _own_tuning_file(request, monkeypatch):
  name = re.sub(r"[^\w.-]", "_", request.node.nodeid)[-150:]
  monkeypatch.setenv("MESHDISTILL_TUNING", os.path.join(_TUNING, f"{os.getpid()}-{name}.json"))


@pytest.fixture
def tiny_cfgs():
  return TEACHER_CFG, STUDENT_CFG


def pytest_sessionfinish(session):
  """The run's compilation cache and tuning choices go with the run (the controller, after every worker has
  finished)."""
  if not hasattr(session.config, "workerinput"):
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)
    shutil.rmtree(_TUNING, ignore_errors=True)

