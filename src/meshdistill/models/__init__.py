"""Models: the built-in Llama-style decoder and its construction on a mesh."""

from meshdistill.models._build import abstract_params, init_model, shard_model
from meshdistill.models.decoder import CAPTURABLE, Decoder, ModelConfig, ModelOutput, param_count

__all__ = [
    "CAPTURABLE",
    "Decoder",
    "ModelConfig",
    "ModelOutput",
    "abstract_params",
    "init_model",
    "param_count",
    "shard_model",
]
