"""The CPU devices of the throughput benchmarks, set before JAX is imported.

Importing this module (before JAX) makes JAX use the CPU (with libtpu installed, the `tpu` extra, JAX would
first probe for a TPU, as the CLI and the tests avoid too) and, unless ``MESHDISTILL_THROUGHPUT_ONE_DEVICE=1``,
simulate 8 CPU devices for the 2x4 mesh. The one-device rows run in a child process of their own with one CPU
device (`one_device_env`): in a process whose CPU client simulates 8 devices, a program placed on one of them
runs slower than in a process with one device.
"""

from __future__ import annotations

import os

ONE_DEVICE_ENV = "MESHDISTILL_THROUGHPUT_ONE_DEVICE"
XLA_FLAGS_BEFORE = os.environ.get("XLA_FLAGS")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import meshdistill as md  # noqa: E402

ONE_DEVICE = os.environ.get(ONE_DEVICE_ENV) == "1"
if not ONE_DEVICE:
  md.simulate_cpu_devices(8)


def one_device_env() -> dict[str, str]:
  """This process's environment for a child process whose JAX has one CPU device: the device-count flag this
  module added removed, the one-device switch on."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if XLA_FLAGS_BEFORE is not None:
    env["XLA_FLAGS"] = XLA_FLAGS_BEFORE
  env[ONE_DEVICE_ENV] = "1"
  return env
