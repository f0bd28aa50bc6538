"""Gemma 2 (``Gemma2ForCausalLM``): GeGLU with tanh GELU, RMSNorm as ``1 + w``, embeddings times sqrt(d_model),
norms before and after attention and MLP, ``query_pre_attn_scalar``, attention and final logit soft-capping,
sliding and global layers alternating (``layer_types``, ``sliding_window``), tied embeddings; the planner's
Gemma 2 presets. `meshdistill.models.families.gemma3` builds on it."""

from __future__ import annotations

from typing import Any

from meshdistill.models._config import ModelConfig
from meshdistill.models.families import register
from meshdistill.models.families._base import BLOCK_WEIGHTS, Family

# Gemma's four block norms: ``post_attention_layernorm`` is the norm of the attention OUTPUT (Llama's name for the
# norm before the MLP), ``pre_feedforward_layernorm`` the one before the MLP.
GEMMA_WEIGHTS = {
    **BLOCK_WEIGHTS,
    ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", False),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", False),
    ("post_mlp_norm", "scale"): ("post_feedforward_layernorm.weight", False),
}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of the tanh-approximated GELU


def layer_types(hf: dict[str, Any], every: int) -> list[str]:
  """``layer_types`` of ``hf``, or (configs written before transformers 5) every ``every``-th layer global."""
  n = int(hf["num_hidden_layers"])
  return list(hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                        for i in range(n)])


def _gemma2(d, layers, heads, kv, mlp, head_dim, scalar) -> dict[str, Any]:
  """The shape fields of a published Gemma 2 config.json."""
  return {
      "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000, "hidden_size": d,
      "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
      "num_key_value_heads": kv, "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh",
      "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096,
      "query_pre_attn_scalar": scalar, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
      "tie_word_embeddings": True,
  }


@register
class Gemma2(Family):
  name = "gemma2"
  architectures = ("Gemma2ForCausalLM",)
  block = {"geglu": True, "norm_offset": True, "embed_scale": True, "post_norms": True}
  options = ("sliding_window", "layer_types", "query_scale", "attn_softcap", "final_softcap")
  block_weights = GEMMA_WEIGHTS
  default_export = True
  global_every = 2  # configs without layer_types: every 2nd layer global
  # google/gemma-2-2b, -9b, -27b on the Hugging Face hub
  presets = {
      "gemma-2-2b": _gemma2(2304, 26, 8, 4, 9216, 256, 256),
      "gemma-2-9b": _gemma2(3584, 42, 16, 8, 14336, 256, 256),
      "gemma-2-27b": _gemma2(4608, 46, 32, 16, 36864, 128, 144),
  }

  def check_hf(self, hf: dict[str, Any], where: str) -> None:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
      raise ValueError(f"{where}: hidden_activation={act!r} is not supported for model_type={self.model_type!r}; "
                       f"the decoder's Gemma MLP is GeGLU with the tanh GELU ({GELU_TANH[0]!r})")
    for flag in ("attention_bias", "use_bidirectional_attention"):
      if hf.get(flag):
        raise ValueError(f"{where}: {flag}=true is not supported for model_type={self.model_type!r}; expected "
                         "false (causal attention without biases)")
    types = layer_types(hf, self.global_every)
    if "sliding_attention" in types and not hf.get("sliding_window"):
      raise ValueError(f"{where}: layer_types has sliding_attention layers but sliding_window="
                       f"{hf.get('sliding_window')!r}; give the window (a positive integer)")

  def config_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
    types = layer_types(hf, self.global_every)
    scalar = hf.get("query_pre_attn_scalar")
    return {
        "sliding_window": int(hf["sliding_window"]) if "sliding_attention" in types else None,
        "layer_types": tuple(types),
        "query_scale": None if scalar is None else float(scalar) ** -0.5,
        "attn_softcap": _opt_float(hf.get("attn_logit_softcapping")),
        "final_softcap": _opt_float(hf.get("final_logit_softcapping")),
    }

  def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    types = list(cfg.layer_types or ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.n_layers)
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": cfg.sliding_window,
        "layer_types": types,
        "query_pre_attn_scalar": _scalar(cfg),
        "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.final_softcap,
        "pad_token_id": 0,
    }


def _scalar(cfg: ModelConfig) -> float | int:
  """``query_pre_attn_scalar`` of ``cfg`` (an integer when it is one)."""
  v = cfg.hd if cfg.query_scale is None else round(cfg.query_scale**-2, 6)
  return int(v) if float(v).is_integer() else v


def _opt_float(v) -> float | None:
  return None if v is None else float(v)
