"""The run configuration: typed sections from YAML files and ``--set`` overrides (`Config`, `load_config`).

`__all__` is the one list of the package's names; each is the name of that object in ``config/_config.py``
(loading; it imports them from ``sections.py``, the section dataclasses, ``files.py``, packaged configs and YAML with
overrides, and `meshdistill.core.typed_yaml`, dataclasses from nested YAML and `ConfigError`). They resolve on first
use, so that importing the package (or ``config.files``) does not load the sections and, through them, JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CheckpointSettings",
    "Config",
    "ConfigError",
    "DistillSettings",
    "GuardSettings",
    "MeshSettings",
    "OnPolicySettings",
    "PreferenceSettings",
    "PretrainSettings",
    "RematSettings",
    "RunSettings",
    "SafeguardSettings",
    "TrainSettings",
    "config_path",
    "dump_config",
    "load_config",
    "run_config",
]


def __getattr__(name: str) -> Any:
  if name not in __all__:
    raise AttributeError(f"module 'meshdistill.config' has no attribute {name!r}")
  value = getattr(importlib.import_module("meshdistill.config._config"), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))

