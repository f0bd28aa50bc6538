"""Target devices of a plan: abstract TPU devices of a libtpu topology, or this machine's CPU devices.

Each target's chip is a row of the chip table, `meshdistill.core.chips.TPU_CHIPS` (HBM capacity, peak bf16 FLOP/s,
HBM bandwidth, ICI bandwidth: the numbers the report compares against). Compiling for a topology needs no TPU:
libtpu's compiler runs on the CPU host (``pip install 'meshdistill[tpu]'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re

import jax

from meshdistill.core.chips import GIB, TPU_CHIPS, Chip, chip_of_kind

_TOPOLOGY = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+)+)$")
EXAMPLES = "v5e:1x1, v5e:2x2, v5e:4x4, v5e:8x8, v5e:16x16, v5p:2x2x1, v5p:4x4x4, v6e:4x4, v4:2x2x1, v3:4x4"


@dataclasses.dataclass(frozen=True)
class Target:
  """The devices a plan compiles for: ``devices`` (a flat list), their chip numbers, and a name."""

  name: str
  devices: tuple
  chip: Chip | None  # None on CPU
  devices_per_chip: int = 1
  hbm_budget_bytes: int | None = None  # per device; a given budget replaces the chip's usable HBM

  @property
  def platform(self) -> str:
    return "cpu" if self.chip is None else "tpu"

  @property
  def budget_bytes(self) -> int | None:
    if self.hbm_budget_bytes is not None:
      return self.hbm_budget_bytes
    return None if self.chip is None else self.chip.usable_bytes // self.devices_per_chip

  def per_device(self, value: float | None) -> float | None:
    return None if value is None else value / self.devices_per_chip


def libtpu_available() -> bool:
  return importlib.util.find_spec("libtpu") is not None


# the stack size of libtpu's fibers (its `default_thread_stack_size`, the threads' own, does not stop the overflow)
_STACK_FLAG = "fibers_default_thread_stack_size"
_STACK_BYTES = 16 * 2**20


# What a compile-only libtpu is told while it loads (`_quiet_libtpu`).
_QUIET_VARS = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
               "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


@contextlib.contextmanager
def _quiet_libtpu():
  """While libtpu loads (it reads these then): tells it it runs on no TPU VM (it otherwise queries metadata and logs
  errors) and only compiles, several planning processes at once (it otherwise takes a machine-wide lock), with deep
  fiber stacks (`_with_stack_flags`); in CPU-only processes (``JAX_PLATFORMS=cpu``, as the CLI and the tests set)
  only. Afterwards the environment is the process's own again: a subprocess it starts (a job on this machine's
  real TPU, say) does not inherit a made-up accelerator type."""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() != "cpu":
    yield
    return
  saved = {k: os.environ.get(k) for k in (*_QUIET_VARS, "LIBTPU_INIT_ARGS")}
  for k, v in _QUIET_VARS.items():
    os.environ.setdefault(k, v)
  os.environ["LIBTPU_INIT_ARGS"] = _with_stack_flags(os.environ.get("LIBTPU_INIT_ARGS", ""))
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def _with_stack_flags(args: str) -> str:
  """``args`` with libtpu's fiber stacks set to `_STACK_BYTES` unless the user set them.

  libtpu 0.0.42 lowers on fibers whose default stack its convolution-window search can overflow (SIGSEGV "STACK
  OVERFLOW" in FusedSpatialMajorConvolution::MakeConvWindows: Qwen3-4B -> 0.6B on v5e:4x4 at T=2048, batch 192);
  16 MiB stacks (reserved, touched only as deep as used) compile it. libtpu exits on a flag it does not define, so
  the flag is also named in ``--undefok`` (merged into the user's own): a libtpu without it ignores it."""
  tokens = args.split()
  if any(t.startswith(f"--{_STACK_FLAG}=") for t in tokens):
    return args
  tokens.append(f"--{_STACK_FLAG}={_STACK_BYTES}")
  undefok = [i for i, t in enumerate(tokens) if t.startswith("--undefok=")]
  if undefok:
    tokens[undefok[-1]] = f"{tokens[undefok[-1]].rstrip(',')},{_STACK_FLAG}"
  else:
    tokens.append(f"--undefok={_STACK_FLAG}")
  return " ".join(tokens)


def tpu_target(topology: str, hbm_budget_bytes: int | None = None) -> Target:
  """Abstract devices of the TPU slice ``topology`` (e.g. ``v5e:4x4``), compiled for on this host."""
  m = _TOPOLOGY.match(topology.strip().lower()) if isinstance(topology, str) else None
  if m is None or m.group(1) not in TPU_CHIPS:
    raise ValueError(
        f"topology={topology!r} is not a TPU topology name; use FAMILY:SHAPE with a family in {sorted(TPU_CHIPS)}, "
        f"e.g. {EXAMPLES}"
    )
  if not libtpu_available():
    raise ValueError(
        f"topology={topology!r} needs libtpu (the TPU compiler) on this machine: pip install 'meshdistill[tpu]'; "
        "or plan on this machine's CPU devices with --devices cpu:N"
    )
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  name = f"{m.group(1)}:{m.group(2)}"
  try:
    with _quiet_libtpu():
      desc = _topology_desc(topologies, name, [int(d) for d in m.group(2).split("x")])
  except Exception as e:  # noqa: BLE001 -- libtpu raises JaxRuntimeError with its own text
    first = str(e).splitlines()[0]
    raise ValueError(f"topology={topology!r} was rejected by libtpu ({first}); e.g. {EXAMPLES}") from None
  devices = tuple(desc.devices)
  chip = TPU_CHIPS[m.group(1)]
  chips = len({tuple(getattr(d, "coords", (i,))) for i, d in enumerate(devices)})
  return Target(name, devices, chip, max(1, len(devices) // max(chips, 1)), hbm_budget_bytes)


def _topology_desc(topologies, name: str, dims: list[int]):
  """libtpu's description of slice ``name``. A slice smaller than one host of its family (``v5e:1x1``, a v5e host
  having 2x2 chips) is refused as it stands ("not divisible by ... chips_per_host_bounds 2x2x1"); it is described as
  a host of just those chips (``chips_per_host_bounds`` the slice's own shape), so a plan for one chip compiles the
  program one chip runs (mesh 1x1), not that of a 2x2 slice with four times the rows and a gradient all-reduce."""
  try:
    return topologies.get_topology_desc(platform="tpu", topology_name=name)
  except Exception as e:  # noqa: BLE001 -- libtpu raises JaxRuntimeError with its own text
    host = re.search(r'chips_per_host_bounds "(\d+)x(\d+)x(\d+)"', str(e))
    bounds = tuple(dims + [1] * (3 - len(dims)))
    if host is None or len(bounds) != 3 or any(d > int(h) for d, h in zip(bounds, host.groups())):
      raise  # not a slice within one host: the refusal stands
    try:
      return topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=bounds)
    except Exception:  # noqa: BLE001 -- the first refusal says what is wrong with the name
      raise e from None


# The most CPU devices one process simulates. XLA's CPU client (jax 0.10.2) ran a program sharded over 2048 of them
# (17 s, 2.5 GB of host memory) and failed one over 4096 ("Multiprocess computations aren't implemented on the CPU
# backend", after 100 s and 4 GB); the largest TPU slice the planner compiles for from this host has 512 chips
# (v5p:8x8x8), so a larger CPU plan has nothing to stand for.
MAX_CPU_DEVICES = 2048
# Host memory each simulated device takes for even a trivial sharded program: 1.24 GB for 1024 devices, 2.52 GB for
# 2048 (the process's peak resident memory, measured); a plan's program takes more.
CPU_DEVICE_BYTES = 1.25e6


def _available_bytes() -> float | None:
  """Memory the kernel says a new process can take (``MemAvailable`` of ``/proc/meminfo``, else the free pages);
  None where neither is known."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return float(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError, AttributeError):
    return None


def max_cpu_devices() -> int:
  """How many CPU devices this machine can simulate: `MAX_CPU_DEVICES`, fewer where the memory available now holds
  fewer at `CPU_DEVICE_BYTES` each."""
  free = _available_bytes()
  return MAX_CPU_DEVICES if free is None else max(1, min(MAX_CPU_DEVICES, int(free // CPU_DEVICE_BYTES)))


def check_cpu_count(n: int) -> int:
  """``n`` when this machine can simulate ``n`` CPU devices (`max_cpu_devices`); a `ValueError` naming the bound
  otherwise, raised before any device exists (asking XLA for 100,000 devices takes minutes and gigabytes before it
  fails)."""
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"devices=cpu:{n!r}: the device count must be a positive integer")
  bound = max_cpu_devices()
  if n > bound:
    free = _available_bytes()
    why = ("XLA's CPU client ran programs over 2048 devices and failed them over 4096" if bound == MAX_CPU_DEVICES else
           f"each takes about {CPU_DEVICE_BYTES / 1e6:.2f} MB and {free / GIB:.1f} GiB of memory is available")
    raise ValueError(f"devices=cpu:{n}: this machine can simulate at most {bound} CPU devices ({why}); use cpu:N with "
                     f"N <= {bound}, or a TPU topology (e.g. --topology v5e:16x16, 256 chips: libtpu compiles for it "
                     "without simulating devices)")
  return n


def cpu_target(n: int, hbm_budget_bytes: int | None = None) -> Target:
  """``n`` of this process's CPU devices (see `meshdistill.simulate_cpu_devices`); at most `max_cpu_devices`."""
  check_cpu_count(n)
  have = jax.devices("cpu")
  if len(have) < n:
    raise ValueError(
        f"devices=cpu:{n} but this process has {len(have)} CPU device(s); call meshdistill.simulate_cpu_devices({n}) "
        "before JAX starts (the CLI does), or plan for fewer devices"
    )
  return Target(f"cpu:{n}", tuple(have[:n]), None, 1, hbm_budget_bytes)


def local_target(hbm_budget_bytes: int | None = None) -> Target:
  """The TPU chips this process has (``jax.devices()``): a plan compiled for, and runnable on, this machine."""
  have = jax.devices()
  kind, platform = have[0].device_kind, have[0].platform
  chip = chip_of_kind(kind)
  if platform != "tpu" or chip is None:
    raise ValueError(
        f"devices=local plans for the TPU chips of this machine, but its devices are {len(have)} x {kind!r} "
        f"({platform}); use devices=cpu:N here, or a TPU topology such as v5e:4x4 (libtpu compiles for it)"
    )
  chips = len({tuple(getattr(d, "coords", (i,))) for i, d in enumerate(have)})
  return Target(f"local:{chip.family}x{chips}", tuple(have), chip, max(1, len(have) // max(chips, 1)),
                hbm_budget_bytes)


def parse_target(topology: str | None, devices: str | None, hbm_budget_bytes: int | None = None) -> Target:
  """The `Target` of ``topology`` (a TPU topology name) or ``devices`` (``cpu:N``, or ``local``: this machine's
  TPU chips); exactly one is given."""
  if (topology is None) == (devices is None):
    raise ValueError("give exactly one target: topology (e.g. 'v5e:4x4') or devices (e.g. 'cpu:8', 'local')")
  if topology is not None:
    return tpu_target(topology, hbm_budget_bytes)
  if isinstance(devices, str) and devices.strip().lower() in ("local", "tpu"):
    return local_target(hbm_budget_bytes)
  m = re.fullmatch(r"cpu:(\d+)", devices.strip().lower()) if isinstance(devices, str) else None
  if m is None:
    raise ValueError(f"devices={devices!r}; use cpu:N (N simulated CPU devices), local (this machine's TPU chips), "
                     "or a TPU topology such as v5e:4x4")
  return cpu_target(int(m.group(1)), hbm_budget_bytes)


def cpu_count_of(devices: str | None) -> int | None:
  """N of a ``cpu:N`` devices argument (None otherwise); the CLI simulates that many devices before JAX starts, so
  an N beyond what this machine can simulate (`check_cpu_count`) is refused here, at once."""
  m = re.fullmatch(r"cpu:(\d+)", devices.strip().lower()) if isinstance(devices, str) else None
  return check_cpu_count(int(m.group(1))) if m else None
