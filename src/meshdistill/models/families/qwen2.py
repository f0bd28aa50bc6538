"""Qwen2 (``Qwen2ForCausalLM``): biases on the q/k/v projections (``qkv_bias``), so ``attention_bias`` is not
refused."""

from __future__ import annotations

from typing import Any

from meshdistill.models._config import ModelConfig
from meshdistill.models.families import register
from meshdistill.models.families._base import Family
from meshdistill.models.families.qwen3 import qwen_fields


@register
class Qwen2(Family):
  name = "qwen2"
  architectures = ("Qwen2ForCausalLM",)
  block = {"qkv_bias": True}
  default_export = True

  def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    return qwen_fields(cfg)
