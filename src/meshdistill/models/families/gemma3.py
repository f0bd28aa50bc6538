"""Gemma 3 text (``Gemma3ForCausalLM``, ``model_type: gemma3_text``): Gemma 2's block with RMSNorm on q and k
(``qk_norm``, as ``1 + w``), five sliding layers to one global (``layer_types``), a RoPE base of their own for the
sliding layers (transformers 5: ``rope_parameters`` per layer type; before: ``rope_local_base_freq``) and the
global layers' linear RoPE scaling; no soft-caps in the published checkpoints (read when set). The planner's
Gemma 3 presets (the text model of each)."""

from __future__ import annotations

from typing import Any

from meshdistill.models._config import ModelConfig
from meshdistill.models.families import register
from meshdistill.models.families._base import write_rope_scaling
from meshdistill.models.families.gemma2 import Gemma2

_TYPES = ("full_attention", "sliding_attention")


def _gemma3(vocab, d, layers, heads, kv, mlp, head_dim, scalar, window, factor, max_len) -> dict[str, Any]:
  """The shape fields of a published Gemma 3 config.json (the ``text_config`` of the multimodal ones)."""
  return {
      "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": vocab, "hidden_size": d,
      "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
      "num_key_value_heads": kv, "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh",
      "max_position_embeddings": max_len, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
      "rope_local_base_freq": 10_000.0, "sliding_window": window, "sliding_window_pattern": 6,
      "query_pre_attn_scalar": scalar, "tie_word_embeddings": True,
      "rope_scaling": None if factor is None else {"rope_type": "linear", "factor": factor},
  }


@register
class Gemma3(Gemma2):
  name = "gemma3"
  model_type = "gemma3_text"
  architectures = ("Gemma3ForCausalLM",)
  block = {**Gemma2.block, "qk_norm": True}
  options = (*Gemma2.options, "rope_local_theta")
  default_export = True
  global_every = 6
  # google/gemma-3-1b-pt, and the text_config of google/gemma-3-4b-pt, -12b-pt, -27b-pt, on the Hugging Face hub
  presets = {
      "gemma-3-1b": _gemma3(262144, 1152, 26, 4, 1, 6912, 256, 256, 512, None, 32768),
      "gemma-3-4b": _gemma3(262208, 2560, 34, 8, 4, 10240, 256, 256, 1024, 8.0, 131072),
      "gemma-3-12b": _gemma3(262208, 3840, 48, 16, 8, 15360, 256, 256, 1024, 8.0, 131072),
      "gemma-3-27b": _gemma3(262208, 5376, 62, 32, 16, 21504, 128, 168, 1024, 8.0, 131072),
  }

  def from_hf(self, hf: dict[str, Any], *, max_len: int | None = None, dtype: str = "float32",
              where: str = "config.json") -> ModelConfig:
    params = hf.get("rope_parameters") or {}
    if set(params) & set(_TYPES):  # transformers 5: one entry per layer type
      missing = [t for t in _TYPES if not isinstance(params.get(t), dict)]
      if missing:
        raise ValueError(f"{where}: rope_parameters has no {missing} entry; expected one for each of {list(_TYPES)}")
      local = params["sliding_attention"]
      if local.get("rope_type", "default") != "default":
        raise ValueError(f"{where}: rope_parameters.sliding_attention.rope_type={local['rope_type']!r} is not "
                         "supported; expected 'default' (scaling applies to the global layers)")
      hf = {**hf, "rope_parameters": params["full_attention"], "rope_scaling": None, "rope_theta": None,
            "rope_local_base_freq": local.get("rope_theta", 10_000.0)}
    if self.global_every and "layer_types" not in hf:
      every = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
      hf = {**hf, "layer_types": [_TYPES[bool((i + 1) % every)] for i in range(int(hf["num_hidden_layers"]))]}
    return super().from_hf(hf, max_len=max_len, dtype=dtype, where=where)

  def config_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
    return {**super().config_fields(hf, where), "rope_local_theta": float(hf.get("rope_local_base_freq") or 10_000.0)}

  def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
      full.update(write_rope_scaling(cfg.rope_scaling), rope_theta=cfg.rope_theta)
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    return {**super().hf_fields(cfg), "rope_parameters": {"full_attention": full, "sliding_attention": local},
            "rope_local_base_freq": local["rope_theta"]}

  def to_hf(self, cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    out = super().to_hf(cfg.replace(rope_scaling=None), torch_dtype)  # written inside rope_parameters instead
    out.pop("rope_scaling", None)
    out.update(self.hf_fields(cfg))
    return out

