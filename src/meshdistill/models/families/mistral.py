"""Mistral (``MistralForCausalLM``): the Llama block with an optional sliding window on every layer
(``sliding_window``; ``null`` attends over the whole sequence); the planner's Mistral presets."""

from __future__ import annotations

from typing import Any

from meshdistill.models._config import ModelConfig
from meshdistill.models.families import register
from meshdistill.models.families._base import Family


def _mistral(vocab, d, layers, heads, kv, mlp, head_dim, theta, max_len) -> dict[str, Any]:
  """The shape fields of a published Mistral config.json."""
  return {
      "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": vocab, "hidden_size": d,
      "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
      "num_key_value_heads": kv, "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": max_len,
      "rms_norm_eps": 1e-5, "rope_theta": theta, "sliding_window": None, "tie_word_embeddings": False,
  }


@register
class Mistral(Family):
  name = "mistral"
  architectures = ("MistralForCausalLM",)
  options = ("sliding_window",)
  # mistralai/Mistral-7B-v0.3 and mistralai/Mistral-Small-24B-Base-2501 on the Hugging Face hub
  presets = {
      "mistral-7b-v0.3": _mistral(32768, 4096, 32, 32, 8, 14336, 128, 1_000_000.0, 32768),
      "mistral-small-24b": _mistral(131072, 5120, 40, 32, 8, 32768, 128, 100_000_000.0, 32768),
  }

  def check_hf(self, hf: dict[str, Any], where: str) -> None:
    super().check_hf(hf, where)
    w = hf.get("sliding_window")
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
      raise ValueError(f"{where}: sliding_window={w!r} must be a positive integer or null (no window)")

  def config_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
    return {"sliding_window": hf.get("sliding_window")}

  def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": cfg.sliding_window}
