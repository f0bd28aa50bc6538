"""Which JAX platform a process uses: the CPU unless this machine has an accelerator or the user chose one.

With libtpu installed (the ``tpu`` extra, which the ``test`` extra pulls in) JAX probes for a TPU when
its first backend starts, even on a machine that has none: seconds of start-up and lines such as
``Failed to find host bounds ...`` and ``E0000 ... INVALID_ARGUMENT ...`` on stderr. The ``meshdistill``
command calls `select_platform` once, before JAX starts, for every command: it sets ``JAX_PLATFORMS=cpu``
unless ``JAX_PLATFORMS`` is already set (the user's choice wins: ``JAX_PLATFORMS=tpu`` or ``cuda``) or
this machine shows an accelerator (a TPU's ``/dev/accel*`` or ``/dev/vfio/N``, an NVIDIA or AMD GPU's
device files), in which case JAX picks it as usual. ``meshdistill plan`` always runs on the CPU: it compiles
TPU programs with libtpu's compiler from the host and needs no TPU backend. Processes started by
``meshdistill launch`` get ``JAX_PLATFORMS=cpu`` from the launcher.

Library users: on a machine without an accelerator but with libtpu installed, set ``JAX_PLATFORMS=cpu``
in the environment (or call ``meshdistill.parallel.distributed.platforms.select_platform()``) before the first JAX computation,
as the command does; JAX reads the setting when its first backend starts, so it cannot be changed after
that. On TPU or GPU machines leave it unset, or set it to the platform you want.
"""

from __future__ import annotations

import glob
import logging
import os
import sys

log = logging.getLogger(__name__)

# device files an accelerator driver creates (TPU v2-v4: accel; v5e/v5p/v6e: vfio; NVIDIA; AMD ROCm)
_ACCELERATOR_FILES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def accelerator_present(patterns: tuple[str, ...] = _ACCELERATOR_FILES) -> bool:
  """Whether this machine shows a TPU or GPU device file (no JAX needed, nothing probed)."""
  return any(glob.glob(p) for p in patterns)


def select_platform(force_cpu: bool = False) -> str:
  """Sets ``JAX_PLATFORMS=cpu`` unless the user set it or (``force_cpu`` False) an accelerator is present.

  Call before JAX starts a backend; afterwards it changes nothing. Returns the ``JAX_PLATFORMS`` value in force
  (``""``: JAX chooses, an accelerator being present).
  """
  chosen = os.environ.get("JAX_PLATFORMS", "").strip()
  if chosen:
    return chosen
  if not force_cpu and accelerator_present():
    return ""
  if backend_started():
    log.debug("JAX already started a backend; JAX_PLATFORMS left unset")
    return ""
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:  # jax read the environment when it was imported
    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_platforms", "cpu")
  return "cpu"


def cpu_only() -> bool:
  """Whether this process's JAX runs (or will run) on the CPU platform: the backend it started, else the
  ``JAX_PLATFORMS`` chosen, else no accelerator's device files (nothing probed, JAX not started)."""
  if backend_started():
    import jax  # pylint: disable=g-import-not-at-top

    return jax.default_backend() == "cpu"
  chosen = os.environ.get("JAX_PLATFORMS", "").strip()
  if chosen:
    return chosen.split(",")[0] == "cpu"
  return not accelerator_present()


def backend_started() -> bool:
  """Whether JAX has started a backend (from then on its platform and CPU device count are fixed); False while
  nothing has imported JAX."""
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge  # lazy: JAX (only read once imported)

  return xla_bridge.backends_are_initialized()
