"""The run configuration: typed sections from YAML files and ``--set`` overrides (`Config`, `load_config`).

The names below live in ``config/_config.py`` (loading), ``sections.py`` (the section dataclasses),
``files.py`` (packaged configs, YAML with overrides) and ``typed_yaml.py`` (dataclasses from nested YAML,
`ConfigError`). They resolve on first use, so that a light importer (the command's parser, which only needs
`ConfigError` from ``typed_yaml``) does not load the sections and, through them, JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = frozenset({
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
})


def __getattr__(name: str) -> Any:
  if name not in _NAMES:
    raise AttributeError(f"module 'meshdistill.config' has no attribute {name!r}")
  value = getattr(importlib.import_module("meshdistill.config._config"), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | _NAMES)


__all__ = sorted(_NAMES)
