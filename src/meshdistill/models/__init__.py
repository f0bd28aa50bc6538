"""Models: the built-in Llama-style decoder, its construction on a mesh, Hugging Face import/export.

What every model offers its callers is written down in ``meshdistill.models.contract`` (`LanguageModel`,
`DecodingModel`); the Hugging Face families the decoder reads and writes (Llama, Qwen3, Qwen2) are one
module each in ``meshdistill.models.families``.

``meshdistill.models.tunix_adapter`` (tunix's Llama 3 / Qwen3 modules) is imported on use only.
"""

from meshdistill.models._attention import splash_block_sizes, splash_blocks
from meshdistill.models._build import abstract_params, fit_model, frozen_model, init_model, shard_model
from meshdistill.models._hf_config import config_from_hf, default_family
from meshdistill.models._variants import softcap
from meshdistill.models.decoder import (
    CAPTURABLE,
    ATTENTION,
    REMAT_POLICIES,
    Decoder,
    ModelConfig,
    ModelOutput,
    RopeScaling,
    param_count,
)
from meshdistill.models.hf import export_hf, load_hf, read_hf_config

__all__ = [
    "ATTENTION",
    "CAPTURABLE",
    "Decoder",
    "ModelConfig",
    "ModelOutput",
    "REMAT_POLICIES",
    "RopeScaling",
    "abstract_params",
    "config_from_hf",
    "default_family",
    "export_hf",
    "fit_model",
    "frozen_model",
    "init_model",
    "load_hf",
    "param_count",
    "read_hf_config",
    "shard_model",
    "softcap",
    "splash_block_sizes",
    "splash_blocks",
]
