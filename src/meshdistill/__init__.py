"""meshdistill: knowledge distillation of language models on a JAX (data, tensor) mesh."""

from meshdistill import data, freezing, fsdp, layout, losses, memory, safeguards, schedules, strategies
from meshdistill.data import DataConfig, build_data
from meshdistill.distiller import Distiller
from meshdistill.layout import Layout, make_layout, wrap_step
from meshdistill.freezing import Stage, default_stages, freeze_status, progressive_freeze
from meshdistill.memory import MemoryReport, fit_remat, step_memory
from meshdistill.guard import DivergenceGuard
from meshdistill.jobs import load_run
from meshdistill.planner import Plan, plan
from meshdistill.optimizers import default_optimizer, safeguarded, skipped_updates
from meshdistill.safeguards import fit_guarded
from meshdistill.mesh import AXES, DATA, TENSOR, host_to_global, make_mesh, simulate_cpu_devices
from meshdistill.models import (
    Decoder,
    ModelConfig,
    ModelOutput,
    export_hf,
    init_model,
    load_hf,
    param_count,
    shard_model,
)
from meshdistill.step import TrainState, per_device_step
from meshdistill.strategies import (
    AttentionTransfer,
    ChunkedLogitKD,
    Composite,
    FeaturePooling,
    FeatureProjection,
    HardLabelCE,
    LogitKD,
    LogitMSE,
    ScaledLoss,
    fallback_strategy,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionTransfer",
    "AXES",
    "build_data",
    "ChunkedLogitKD",
    "Composite",
    "DATA",
    "data",
    "DataConfig",
    "Decoder",
    "default_optimizer",
    "default_stages",
    "Distiller",
    "DivergenceGuard",
    "export_hf",
    "fallback_strategy",
    "FeaturePooling",
    "FeatureProjection",
    "fit_guarded",
    "fit_remat",
    "freeze_status",
    "freezing",
    "fsdp",
    "HardLabelCE",
    "host_to_global",
    "init_model",
    "layout",
    "Layout",
    "LogitKD",
    "LogitMSE",
    "load_hf",
  "load_run",
    "losses",
    "make_layout",
    "make_mesh",
    "memory",
    "MemoryReport",
    "ModelConfig",
    "ModelOutput",
    "param_count",
    "per_device_step",
    "Plan",
    "plan",
    "progressive_freeze",
    "safeguarded",
    "safeguards",
    "ScaledLoss",
    "schedules",
    "shard_model",
    "simulate_cpu_devices",
    "skipped_updates",
    "Stage",
    "step_memory",
    "strategies",
    "TENSOR",
    "TrainState",
    "wrap_step",
]
