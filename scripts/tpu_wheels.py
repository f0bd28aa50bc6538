"""Prepares the wheels an offline TPU VM needs to run meshdistill from a source checkout.

A TPU VM that reaches PyPI needs none of this (``pip install -e ".[tpu]"``; docs/tpu.md). A chip with no network
(an air-gapped VM, or a machine whose only package index is a local mirror) gets the project's Python
dependencies as wheels, downloaded here, on a machine where ``pip install -e ".[test]"`` was run:

    python scripts/tpu_wheels.py                 # -> .whl-tpu/ (35 wheels, 19.5 MiB) + .whl-tpu/from_index.txt
    python scripts/tpu_wheels.py --with-tunix    # also what tunix's distillation trainer and sampler import (45, 21.9 MiB)

(Sizes measured with the versions installed in a venv that also holds torch, left out.)

The set is what the package imports, measured rather than listed: a child process (``JAX_PLATFORMS=cpu``) imports
the ``meshdistill`` command, the ``Distiller``, every job and the test helpers (and, with ``--with-tunix``, tunix's
trainer, models and sampler), and each imported module is mapped to the distribution that installed it. The wheels
are of the versions installed here, so the chip runs what CI tests. Left out: what the chip's JAX install brings
(jax, jaxlib, libtpu, numpy, scipy, ml_dtypes, opt_einsum), which must stay first on its path, and the large
packages named by ``--from-index`` (pandas, pyarrow, ...), written to ``from_index.txt`` for the chip to take
from its own package index, and what the chip's run does not need though a package imports it where installed
(``NOT_NEEDED``: tensorboardX imports torch, a 192 MiB wheel, when it is there; the probe imports as if it were not,
as on the chip). `scripts/tpu_setup.sh` installs the bundle there.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# installed with JAX on a TPU VM; the chip's own copies stay first on its path
CHIP_OWN = ("jax", "jaxlib", "libtpu", "numpy", "scipy", "ml-dtypes", "opt-einsum", "pip", "setuptools", "pytest",
            "pluggy", "iniconfig", "hypothesis", "sortedcontainers", "meshdistill")
# large wheels that a TPU VM's package index (or PyPI) serves; installed there by name, not carried
FROM_INDEX = ("pandas", "pyarrow", "tensorstore", "sentencepiece", "pillow", "matplotlib", "fonttools", "contourpy",
              "kiwisolver")
# what a run on the chip does not need, though a package imports it where it is installed (tensorboardX takes torch,
# a 192 MiB wheel, for its tensor type): the probe imports as if these were absent, as they are on the chip
NOT_NEEDED = ("torch", "torchvision", "tensorflow", "tensorflow-cpu", "tf-keras", "keras")
# what a run on the chip imports: the command, the trainer, the jobs, the tests' helpers
PROBE = """
import importlib, importlib.abc, importlib.metadata as md, json, sys

class Absent(importlib.abc.MetaPathFinder):  # a package the chip's run does not need imports as if not installed
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in %(absent)r:
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return None

sys.meta_path.insert(0, Absent())
before = set(sys.modules)
import meshdistill as m
m.Distiller; m.ChunkedLogitKD; m.init_model
for name in ("meshdistill.cli", "meshdistill.jobs._distill_job", "meshdistill.jobs._inspect", "meshdistill.jobs._teacher",
             "meshdistill.models.lora", "meshdistill.models.quantize", "meshdistill.models.moe",
             "meshdistill.planner", "meshdistill.train.onpolicy", "chex", "qwix", "tokenizers", "tensorboardX",
             "matplotlib.pyplot", "safetensors.numpy"):  # safetensors: imported by export_hf / load_hf on use
  importlib.import_module(name)
if %(tunix)r:
  for name in ("tunix.distillation", "tunix.distillation.distillation_trainer", "tunix.models.qwen3.model",
               "tunix.models.llama3.model", "tunix.generate.sampler"):
    importlib.import_module(name)
owners = md.packages_distributions()
dists = {d for mod in set(sys.modules) - before for d in owners.get(mod.split(".")[0], [])}
print(json.dumps(sorted({d: md.version(d) for d in dists}.items())))
"""


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def imported_distributions(with_tunix: bool) -> list[tuple[str, str]]:
  """``(distribution, version)`` of everything the probe imports, in a child process on the CPU, with the modules
  of `NOT_NEEDED` made to look absent (a package that takes one where installed then runs without it)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  absent = tuple(sorted({n.replace("-", "_") for n in NOT_NEEDED}))
  out = subprocess.run([sys.executable, "-c", PROBE % {"tunix": with_tunix, "absent": absent}], check=True,
                       capture_output=True, text=True, env=env)
  return [tuple(x) for x in json.loads(out.stdout.strip().splitlines()[-1])]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=str(ROOT / ".whl-tpu"), help="wheel folder (default: .whl-tpu in the checkout)")
  parser.add_argument("--with-tunix", action="store_true", help="also what tunix's trainer, models and sampler import")
  parser.add_argument("--python-version", default="3.11", help="the chip's Python (default 3.11)")
  parser.add_argument("--from-index", default=",".join(FROM_INDEX),
                      help="comma-separated names the chip installs from its own index instead (default: %(default)s)")
  args = parser.parse_args()
  from_index = {_norm(n) for n in args.from_index.split(",") if n}
  skip = {_norm(n) for n in CHIP_OWN}
  dists = [(d, v) for d, v in imported_distributions(args.with_tunix) if _norm(d) not in skip]
  carried = [(d, v) for d, v in dists if _norm(d) not in from_index]
  indexed = sorted(_norm(d) for d, _ in dists if _norm(d) in from_index)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64"]
  cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", args.python_version, "--implementation", "cp", "-d", str(out)]
  for p in platforms:
    cmd += ["--platform", p]
  cmd += ["--platform", "any"]
  subprocess.run(cmd + [f"{d}=={v}" for d, v in carried], check=True)
  (out / "from_index.txt").write_text("\n".join(indexed) + "\n", encoding="utf-8")
  wheels = sorted(out.glob("*.whl"))
  size = sum(w.stat().st_size for w in wheels) / 2**20
  print(f"{len(wheels)} wheels, {size:.1f} MiB in {out}; from the chip's index: {' '.join(indexed) or 'nothing'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
