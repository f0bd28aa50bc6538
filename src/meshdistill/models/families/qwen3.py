"""Qwen3 (``Qwen3ForCausalLM``): RMSNorm over head_dim on queries and keys (``qk_norm``); the planner's Qwen3
presets."""

from __future__ import annotations

from typing import Any

from meshdistill.models._config import ModelConfig
from meshdistill.models.families import register
from meshdistill.models.families._base import Family


def qwen_fields(cfg: ModelConfig) -> dict[str, Any]:
  """The sliding-window fields every Qwen config.json carries (off: the decoder attends over the whole sequence)."""
  return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}


def _qwen3(d, layers, heads, mlp, tied) -> dict[str, Any]:
  """The shape fields of a published Qwen3 config.json."""
  return {
      "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": d,
      "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
      "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
      "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": tied,
  }


@register
class Qwen3(Family):
  name = "qwen3"
  architectures = ("Qwen3ForCausalLM",)
  block = {"qk_norm": True}
  default_export = True
  # Qwen/Qwen3-0.6B, -1.7B, -4B, -8B, -32B on the Hugging Face hub
  presets = {
      "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, True),
      "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, True),
      "qwen3-4b": _qwen3(2560, 36, 32, 9728, True),
      "qwen3-8b": _qwen3(4096, 36, 32, 12288, False),
      "qwen3-32b": _qwen3(5120, 64, 64, 25600, False),
  }

  def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    return qwen_fields(cfg)
