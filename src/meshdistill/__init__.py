"""meshdistill: knowledge distillation of language models on a JAX (data, tensor) mesh.

The public names below are resolved lazily (PEP 562 module ``__getattr__``): ``import meshdistill``
imports neither JAX nor the data pipeline, so the ``meshdistill`` command starts in a fraction of a
second; ``meshdistill.Distiller`` (or ``from meshdistill import Distiller``) imports its module on first
use. Subpackages (``meshdistill.teacher_cache``, ``meshdistill.jobs``, ...) resolve the same way.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it ("" : the name is itself a submodule of meshdistill)
_EXPORTS: dict[str, str] = {
    # submodules
    "data": "",
    "freezing": "",
    "fsdp": "",
    "layout": "",
    "losses": "",
    "memory": "",
    "safeguards": "",
    "schedules": "",
    "strategies": "",
    # data
    "DataConfig": "meshdistill.data",
    "build_data": "meshdistill.data",
    # distillation
    "Distiller": "meshdistill.distiller",
    "Layout": "meshdistill.layout",
    "make_layout": "meshdistill.layout",
    "wrap_step": "meshdistill.layout",
    "TrainState": "meshdistill.step",
    "per_device_step": "meshdistill.step",
    # freezing
    "Stage": "meshdistill.freezing",
    "default_stages": "meshdistill.freezing",
    "freeze_status": "meshdistill.freezing",
    "progressive_freeze": "meshdistill.freezing",
    # memory and planning
    "MemoryReport": "meshdistill.memory",
    "fit_remat": "meshdistill.memory",
    "step_memory": "meshdistill.memory",
    "Plan": "meshdistill.planner",
    "plan": "meshdistill.planner",
    # safeguards and optimizers
    "DivergenceGuard": "meshdistill.guard",
    "default_optimizer": "meshdistill.optimizers",
    "safeguarded": "meshdistill.optimizers",
    "skipped_updates": "meshdistill.optimizers",
    "fit_guarded": "meshdistill.safeguards",
    # mesh
    "AXES": "meshdistill.mesh",
    "DATA": "meshdistill.mesh",
    "TENSOR": "meshdistill.mesh",
    "host_to_global": "meshdistill.mesh",
    "make_mesh": "meshdistill.mesh",
    "simulate_cpu_devices": "meshdistill.mesh",
    # models
    "Decoder": "meshdistill.models",
    "ModelConfig": "meshdistill.models",
    "ModelOutput": "meshdistill.models",
    "export_hf": "meshdistill.models",
    "init_model": "meshdistill.models",
    "load_hf": "meshdistill.models",
    "param_count": "meshdistill.models",
    "shard_model": "meshdistill.models",
    # strategies
    "AttentionTransfer": "meshdistill.strategies",
    "ChunkedLogitKD": "meshdistill.strategies",
    "Composite": "meshdistill.strategies",
    "FeaturePooling": "meshdistill.strategies",
    "FeatureProjection": "meshdistill.strategies",
    "HardLabelCE": "meshdistill.strategies",
    "LogitKD": "meshdistill.strategies",
    "LogitMSE": "meshdistill.strategies",
    "ScaledLoss": "meshdistill.strategies",
    "fallback_strategy": "meshdistill.strategies",
    # runs on disk
    "LoadedRun": "meshdistill.jobs",
    "load_run": "meshdistill.jobs",
}

__all__ = sorted(_EXPORTS, key=str.lower)


def __getattr__(name: str) -> Any:
  """Imports the module behind a public name (or a submodule) on first use and caches the value."""
  where = _EXPORTS.get(name)
  if where is None:
    if name.startswith("__"):
      raise AttributeError(f"module 'meshdistill' has no attribute {name!r}")
    try:  # any other submodule: meshdistill.teacher_cache, meshdistill.jobs, ...
      return importlib.import_module(f"meshdistill.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"meshdistill.{name}":
        raise
      raise AttributeError(f"module 'meshdistill' has no attribute {name!r}") from None
  value = importlib.import_module(f"meshdistill.{name}") if where == "" else getattr(
      importlib.import_module(where), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))
