"""Llama (``LlamaForCausalLM``): the plain block, with optional Llama-3 frequency scaling (``rope_scaling`` of
``rope_type="llama3"``); the planner's Llama 3.x presets."""

from __future__ import annotations

from typing import Any

from meshdistill.models._config import ModelConfig
from meshdistill.models.families import register
from meshdistill.models.families._base import Family


def _llama(d, layers, heads, mlp, head_dim, tied, factor) -> dict[str, Any]:
  """The shape fields of a published Llama 3.x config.json."""
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": d,
      "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
      "num_key_value_heads": 8, "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": 131072,
      "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": tied,
      "rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192},
  }


@register
class Llama(Family):
  name = "llama"
  architectures = ("LlamaForCausalLM",)
  rope_scaling = True
  default_export = True
  # meta-llama/Llama-3.2-1B, -3.2-3B, -3.1-8B, -3.1-70B on the Hugging Face hub
  presets = {
      "llama3.2-1b": _llama(2048, 16, 32, 8192, 64, True, 32.0),
      "llama3.2-3b": _llama(3072, 28, 24, 8192, 128, True, 32.0),
      "llama3.1-8b": _llama(4096, 32, 32, 14336, 128, False, 8.0),
      "llama3.1-70b": _llama(8192, 80, 64, 28672, 128, False, 8.0),
  }

  def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    return {"mlp_bias": False}
