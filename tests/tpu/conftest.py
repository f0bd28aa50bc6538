"""The chip's test set (marker ``tpu``): where it runs, and why it is skipped when it does not.

``tests/conftest.py`` keeps every run on the CPU (``JAX_PLATFORMS=cpu``) except one that selects these tests with
``-m tpu``: that run leaves the platform to JAX, which picks the TPU (the CPU stays beside it, for the tests that
compare the chip with the CPU in the same process). So:

- a normal run (CI, ``python -m pytest``): collected and skipped, "no TPU: ...", without starting libtpu;
- ``python -m pytest -o addopts= -m tpu tests/tpu -q -ra`` on a TPU machine: run on the chip, in one process
  (``-o addopts=`` drops the suite's ``-n 2``: one process at a time can hold the chip; ``-n 0`` does the same
  where pytest-xdist is installed); on a machine without a TPU the same command skips them, "no TPU: JAX sees ...";
- ``MESHDISTILL_TPU_TESTS_ON=cpu python -m pytest -n 0 tests/tpu``: the same tests on the CPU (the splash kernel then
  runs in Pallas interpret mode), to check their logic where there is no chip. The "chip" is CPU device 0 and the
  CPU half of a chip-against-CPU test runs on CPU device 1.

A machine whose PCI bus holds a TPU (`tpu_on_this_machine`) but whose JAX sees none (another process holds the chip,
or libtpu failed to start) stops the ``-m tpu`` run with an error instead of skipping: a chip run that skipped every
test would read as a pass.
"""

import glob
import os
import re

import jax
import pytest

_ON = "MESHDISTILL_TPU_TESTS_ON"
_COMMAND = "python -m pytest -o addopts= -m tpu tests/tpu -q -ra"


def _mode() -> str:
  mode = os.environ.get(_ON, "tpu")
  if mode not in ("tpu", "cpu"):
    raise pytest.UsageError(f"{_ON}={mode!r}; choose tpu (the chip, the default) or cpu (the same tests on the CPU)")
  return mode


GOOGLE_PCI_VENDOR = "0x1ae0"  # the vendor id TPU chips report on the PCI bus


def tpu_on_this_machine(pci_devices: str = "/sys/bus/pci/devices") -> bool:
  """Whether a TPU chip is on this machine's PCI bus (a Google device), whatever JAX makes of it."""
  for vendor in glob.glob(os.path.join(pci_devices, "*", "vendor")):
    try:
      with open(vendor, encoding="ascii") as f:
        if f.read().strip().lower() == GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def skip_reason(config) -> str | None:
  """Why the chip's tests cannot run in this process (None: they run). Starts a backend only in a run that selected
  them (``-m tpu``), where the platform is already left to JAX."""
  if _mode() == "cpu":
    return None
  if not re.search(r"(?<!not )\btpu\b", config.option.markexpr or ""):  # tests/conftest.py keeps JAX on the CPU
    return (f"no TPU: this run keeps JAX on the CPU (only `-m tpu` leaves the platform to JAX); on a TPU machine "
            f"run {_COMMAND}, or set {_ON}=cpu to run these tests on the CPU")
  if hasattr(config, "workerinput"):
    return (f"no TPU: this is a pytest-xdist worker and one process at a time can hold the chip; run {_COMMAND} "
            f"(or set {_ON}=cpu)")
  chosen = jax.config.jax_platforms  # the user's JAX_PLATFORMS, if any (tests/conftest.py left it alone)
  if chosen and "tpu" not in chosen.split(","):
    return f"no TPU: JAX_PLATFORMS={chosen}; unset it (or set tpu,cpu) to run these tests on the chip"
  platforms = sorted({d.platform for d in jax.devices()})
  if "tpu" not in platforms:
    if tpu_on_this_machine():
      raise pytest.UsageError(
          f"a TPU is on this machine's PCI bus but JAX sees only {', '.join(platforms)} devices: another process may "
          f"hold the chip (one process at a time can; wait for it to end, e.g. `fuser /dev/vfio/* /dev/accel*`), or "
          f"libtpu failed to start (JAX's warning above says why); these tests would all be skipped")
    return f"no TPU: JAX sees only {', '.join(platforms)} devices; set {_ON}=cpu to run these tests on the CPU"
  return None


def pytest_collection_modifyitems(config, items):
  mine = [item for item in items if item.get_closest_marker("tpu")]
  reason = skip_reason(config) if mine else None
  if reason:
    for item in mine:
      item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def chip():
  """The device the tests run on: the TPU (device 0), or CPU device 0 under ``MESHDISTILL_TPU_TESTS_ON=cpu``."""
  return jax.devices("cpu")[0] if _mode() == "cpu" else jax.devices("tpu")[0]


@pytest.fixture(scope="session")
def host():
  """The CPU device of a chip-against-CPU comparison (another device than ``chip`` in the CPU mode too)."""
  try:
    return jax.devices("cpu")[1 if _mode() == "cpu" else 0]
  except RuntimeError:  # JAX_PLATFORMS=tpu: no CPU backend in this process
    pytest.skip(f"no CPU backend beside the chip (JAX_PLATFORMS={jax.config.jax_platforms}); unset it or set tpu,cpu")


@pytest.fixture(autouse=True)
def _on_chip(chip):
  """Every array a test makes without saying where lives on the chip."""
  with jax.default_device(chip):
    yield
