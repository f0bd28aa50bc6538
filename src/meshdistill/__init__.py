"""meshdistill: knowledge distillation of language models on a JAX (data, tensor) mesh.

The public names below are resolved lazily (PEP 562 module ``__getattr__``): ``import meshdistill``
imports neither JAX nor the data pipeline, so the ``meshdistill`` command starts in a fraction of a
second; ``meshdistill.Distiller`` (or ``from meshdistill import Distiller``) imports its module on first
use. Subpackages (``meshdistill.teachers.cache``, ``meshdistill.jobs``, ...) resolve the same way.

Type checkers read the same names from the ``if TYPE_CHECKING:`` imports below (never run); ``tests/test_typed_seams.py``
holds them equal to ``_EXPORTS``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it (the name is that module itself when it is the module's last part, e.g.
# "compress"), or "module:attribute" where the public name differs from what the module calls it or the module's own
# name would shadow it ("generate" is both a module and its sampler)
_EXPORTS: dict[str, str] = {
    # submodules
    "compress": "meshdistill.models.compress",
    "data": "meshdistill.data",
    "freezing": "meshdistill.train.freezing",
    "fsdp": "meshdistill.parallel.fsdp",
    "layout": "meshdistill.parallel.layout",
    "losses": "meshdistill.losses",
    "memory": "meshdistill.train.memory",
    "safeguards": "meshdistill.train.loop.safeguards",
    "schedules": "meshdistill.losses.schedules",
    "strategies": "meshdistill.strategies",
    # data
    "DataConfig": "meshdistill.data",
    "build_data": "meshdistill.data",
    # distillation
    "Distiller": "meshdistill.train.distiller",
    "Layout": "meshdistill.parallel.layout",
    "make_layout": "meshdistill.parallel.backends",
    "wrap_step": "meshdistill.parallel.backends",
    "TrainState": "meshdistill.train.step",
    "per_device_step": "meshdistill.train.step",
    # freezing
    "Stage": "meshdistill.train.freezing",
    "default_stages": "meshdistill.train.freezing",
    "freeze_status": "meshdistill.train.freezing",
    "progressive_freeze": "meshdistill.train.freezing",
    # memory and planning
    "MemoryReport": "meshdistill.train.memory",
    "fit_remat": "meshdistill.train.memory",
    "step_memory": "meshdistill.train.memory",
    "Plan": "meshdistill.planner",
    "plan": "meshdistill.planner",
    # safeguards and optimizers
    "DivergenceGuard": "meshdistill.train.loop.guard",
    "default_optimizer": "meshdistill.train.optimizers",
    "safeguarded": "meshdistill.train.optimizers",
    "skipped_updates": "meshdistill.train.optimizers",
    "fit_guarded": "meshdistill.train.loop.safeguards",
    # mesh
    "AXES": "meshdistill.parallel.mesh",
    "DATA": "meshdistill.parallel.mesh",
    "TENSOR": "meshdistill.parallel.mesh",
    "host_to_global": "meshdistill.parallel.mesh",
    "make_mesh": "meshdistill.parallel.mesh",
    "simulate_cpu_devices": "meshdistill.parallel.mesh",
    # models
    "Decoder": "meshdistill.models",
    "ModelConfig": "meshdistill.models",
    "ModelOutput": "meshdistill.models",
    "export_hf": "meshdistill.models",
    "init_model": "meshdistill.models",
    "load_hf": "meshdistill.models",
    "param_count": "meshdistill.models",
    "shard_model": "meshdistill.models",
    # generation (the sampler: KV cache, greedy / temperature / top-k / top-p)
    "Generation": "meshdistill.models.generate",
    "SamplingConfig": "meshdistill.models.generate",
    "generate": "meshdistill.models.generate:generate",
    "left_pad": "meshdistill.models.generate",
    # compression (pruning, quantization-aware students)
    "PruneTargets": "meshdistill.models.compress",
    "QuantizeAware": "meshdistill.models.compress",
    "convert_quantized": "meshdistill.models.compress",
    "export_quantized": "meshdistill.models.compress",
    "load_quantized": "meshdistill.models.compress",
    "prune": "meshdistill.models.compress",
    # strategies
    "AttentionTransfer": "meshdistill.strategies",
    "ChunkedLogitKD": "meshdistill.strategies",
    "Composite": "meshdistill.strategies",
    "FeaturePooling": "meshdistill.strategies",
    "FeatureProjection": "meshdistill.strategies",
    "HardLabelCE": "meshdistill.strategies",
    "LogitKD": "meshdistill.strategies",
    "LogitMSE": "meshdistill.strategies",
    "fallback_strategy": "meshdistill.strategies",
    # runs on disk
    "LoadedRun": "meshdistill.jobs",
    "export": "meshdistill.jobs.export:export_run",
    "load_run": "meshdistill.jobs",
}

__all__ = sorted(_EXPORTS, key=str.lower)

if TYPE_CHECKING:  # the public names of `_EXPORTS`, as a type checker sees them (nothing here runs)
  from meshdistill import data, losses, strategies
  from meshdistill.data import DataConfig, build_data
  from meshdistill.jobs import LoadedRun, load_run
  from meshdistill.jobs.export import export_run as export
  from meshdistill.losses import schedules
  from meshdistill.models import (
      Decoder, ModelConfig, ModelOutput, compress, export_hf, init_model, load_hf, param_count, shard_model,
  )
  from meshdistill.models.compress import (
      PruneTargets, QuantizeAware, convert_quantized, export_quantized, load_quantized, prune,
  )
  from meshdistill.models.generate import Generation, SamplingConfig, generate, left_pad
  from meshdistill.parallel import fsdp, layout
  from meshdistill.parallel.backends import make_layout, wrap_step
  from meshdistill.parallel.layout import Layout
  from meshdistill.parallel.mesh import AXES, DATA, TENSOR, host_to_global, make_mesh, simulate_cpu_devices
  from meshdistill.planner import Plan, plan
  from meshdistill.strategies import (
      AttentionTransfer, ChunkedLogitKD, Composite, FeaturePooling, FeatureProjection, HardLabelCE, LogitKD, LogitMSE,
      fallback_strategy,
  )
  from meshdistill.train import freezing, memory
  from meshdistill.train.distiller import Distiller
  from meshdistill.train.freezing import Stage, default_stages, freeze_status, progressive_freeze
  from meshdistill.train.loop import safeguards
  from meshdistill.train.loop.guard import DivergenceGuard
  from meshdistill.train.loop.safeguards import fit_guarded
  from meshdistill.train.memory import MemoryReport, fit_remat, step_memory
  from meshdistill.train.optimizers import default_optimizer, safeguarded, skipped_updates
  from meshdistill.train.step import TrainState, per_device_step


# public names that became something else: name -> what to use instead (the AttributeError says it)
_REPLACED: dict[str, str] = {
    "ScaledLoss": "static loss scaling is a setting of the step: Distiller(..., loss_scale=S) with an optimizer "
                  "safeguarded(..., loss_scale=S) (config: safeguards.loss_scale)",
}


def __getattr__(name: str) -> Any:
  """Imports the module behind a public name (or a submodule) on first use and caches the value."""
  where = _EXPORTS.get(name)
  if where is None:
    if name in _REPLACED:
      raise AttributeError(f"meshdistill.{name} is gone: {_REPLACED[name]}")
    if name.startswith("__"):
      raise AttributeError(f"module 'meshdistill' has no attribute {name!r}")
    try:  # any other subpackage: meshdistill.teachers, meshdistill.jobs, ...
      return importlib.import_module(f"meshdistill.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"meshdistill.{name}":
        raise
      raise AttributeError(f"module 'meshdistill' has no attribute {name!r}") from None
  where, _, attribute = where.partition(":")
  module = importlib.import_module(where)
  if attribute:
    value = getattr(module, attribute)
  else:
    value = module if module.__name__.rsplit(".", 1)[-1] == name else getattr(module, name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))
