"""meshdistill: knowledge distillation of language models on a JAX (data, tensor) mesh."""

from meshdistill import data, losses, schedules, strategies
from meshdistill.data import DataConfig, build_data
from meshdistill.distiller import Distiller, default_optimizer
from meshdistill.mesh import AXES, DATA, TENSOR, host_to_global, make_mesh, simulate_cpu_devices
from meshdistill.models import Decoder, ModelConfig, ModelOutput, init_model, param_count, shard_model
from meshdistill.step import TrainState, per_device_step, wrap_step
from meshdistill.strategies import (
    AttentionTransfer,
    ChunkedLogitKD,
    Composite,
    FeaturePooling,
    FeatureProjection,
    HardLabelCE,
    LogitKD,
)

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "AttentionTransfer",
    "ChunkedLogitKD",
    "Composite",
    "DATA",
    "DataConfig",
    "Decoder",
    "FeaturePooling",
    "FeatureProjection",
    "HardLabelCE",
    "Distiller",
    "LogitKD",
    "ModelConfig",
    "ModelOutput",
    "TENSOR",
    "TrainState",
    "build_data",
    "data",
    "default_optimizer",
    "host_to_global",
    "init_model",
    "losses",
    "make_mesh",
    "param_count",
    "per_device_step",
    "shard_model",
    "schedules",
    "simulate_cpu_devices",
    "strategies",
    "wrap_step",
]
