"""Hugging Face ``config.json`` <-> `ModelConfig`, and the weight-name map between the two layouts.

Supported families (all pre-norm RMSNorm, rotate-half RoPE, GQA, SwiGLU, no biases besides
Qwen2's q/k/v):

===================  ==========  =================================================
architecture         model_type  what differs from the plain Llama block
===================  ==========  =================================================
LlamaForCausalLM     llama       optional Llama-3 ``rope_scaling`` (``rope_type="llama3"``)
Qwen3ForCausalLM     qwen3       RMSNorm over head_dim on q and k (``qk_norm``)
Qwen2ForCausalLM     qwen2       biases on q/k/v (``qkv_bias``)
===================  ==========  =================================================
"""

from __future__ import annotations

from typing import Any

from meshdistill.models.decoder import ModelConfig, RopeScaling

# architecture -> model_type
SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2"}
_BY_TYPE = {v: k for k, v in SUPPORTED.items()}


def hf_family(hf: dict[str, Any], where: str = "config.json") -> str:
  """The model_type (``llama``/``qwen3``/``qwen2``) of a Hugging Face config, or a ValueError naming both fields."""
  archs = hf.get("architectures") or []
  model_type = hf.get("model_type")
  for arch in archs:
    if arch in SUPPORTED:
      return SUPPORTED[arch]
  if not archs and model_type in _BY_TYPE:
    return model_type
  raise ValueError(
      f"{where}: architectures={archs!r}, model_type={model_type!r} is not supported; "
      f"supported architectures: {sorted(SUPPORTED)} (model_type {sorted(_BY_TYPE)})"
  )


def _rope(hf: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
  # transformers < 5 writes `rope_theta` + `rope_scaling`; >= 5 may write `rope_parameters`.
  params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10_000.0)
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind == "llama3":
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_len=int(params["original_max_position_embeddings"]),
    )
  raise ValueError(f"{where}: rope_type={kind!r} is not supported; supported: 'default', 'llama3'")


def config_from_hf(hf: dict[str, Any], *, max_len: int | None = None, dtype: str = "float32",
                   where: str = "config.json") -> ModelConfig:
  """A `ModelConfig` equal to the Hugging Face config ``hf`` (a parsed ``config.json``).

  ``max_len`` overrides ``max_position_embeddings`` (it only bounds the sequence length).
  """
  family = hf_family(hf, where)
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"{where}: hidden_act={act!r} is not supported; the decoder's MLP is SwiGLU (silu)")
  for flag in ("mlp_bias",) + (("attention_bias",) if family != "qwen2" else ()):
    if hf.get(flag):
      raise ValueError(f"{where}: {flag}=true is not supported for model_type={family!r}; expected false")
  if hf.get("use_sliding_window"):
    raise ValueError(f"{where}: use_sliding_window=true is not supported; the decoder attends over the whole sequence")
  theta, scaling = _rope(hf, where)
  d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]),
      d_model=d,
      n_layers=int(hf["num_hidden_layers"]),
      n_heads=heads,
      n_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or d // heads),
      mlp_hidden=int(hf["intermediate_size"]),
      max_len=int(max_len or hf.get("max_position_embeddings") or 2048),
      rope_theta=theta,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      dtype=dtype,
      qk_norm=family == "qwen3",
      qkv_bias=family == "qwen2",
      rope_scaling=scaling,
  )


def default_family(cfg: ModelConfig) -> str:
  """The Hugging Face family a `ModelConfig` exports as: qwen3 with qk_norm, qwen2 with qkv_bias, else llama."""
  if cfg.qk_norm and cfg.qkv_bias:
    raise ValueError("ModelConfig with both qk_norm and qkv_bias matches no supported Hugging Face family")
  return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def hf_config(cfg: ModelConfig, family: str | None = None, torch_dtype: str = "float32") -> dict[str, Any]:
  """The Hugging Face ``config.json`` contents for a decoder of config ``cfg``."""
  family = family or default_family(cfg)
  if family not in _BY_TYPE:
    raise ValueError(f"family={family!r}; choose one of {sorted(_BY_TYPE)}")
  need = {"llama": (False, False), "qwen3": (True, False), "qwen2": (False, True)}[family]
  if (cfg.qk_norm, cfg.qkv_bias) != need:
    raise ValueError(
        f"a decoder with qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias} cannot be written as {family!r}; "
        f"use family={default_family(cfg)!r}"
    )
  if cfg.rope_scaling is not None and family != "llama":
    raise ValueError(f"rope_scaling is only written for family 'llama', not {family!r}")
  out: dict[str, Any] = {
      "architectures": [_BY_TYPE[family]],
      "model_type": family,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_hidden,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.hd,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_len,
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None,
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": cfg.qkv_bias,
      "attention_dropout": 0.0,
      "initializer_range": 0.02,
      "use_cache": True,
      "torch_dtype": torch_dtype,
  }
  if family == "llama":
    out["mlp_bias"] = False
  else:
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    out["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_len,
    }
  return out


def weight_names(path: tuple) -> tuple[str, bool]:
  """(Hugging Face tensor name, transposed?) of a `Decoder` parameter path.

  Hugging Face stores Linear weights as [out, in]; the decoder's kernels are [in, out].
  Embedding [V, D] and norm scales are stored alike. Both store q/k in rotate-half order,
  so no RoPE permutation is needed.
  """
  p = tuple(str(x) for x in path)
  if p == ("embed", "embedding"):
    return "model.embed_tokens.weight", False
  if p == ("final_norm", "scale"):
    return "model.norm.weight", False
  if p == ("head", "kernel"):
    return "lm_head.weight", True
  if p[0] == "blocks":
    layer = f"model.layers.{p[1]}."
    rest = p[2:]
    table = {
        ("attn_norm", "scale"): ("input_layernorm.weight", False),
        ("mlp_norm", "scale"): ("post_attention_layernorm.weight", False),
        ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", False),
        ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", False),
        ("attn", "o", "kernel"): ("self_attn.o_proj.weight", True),
        ("mlp", "gate", "kernel"): ("mlp.gate_proj.weight", True),
        ("mlp", "up", "kernel"): ("mlp.up_proj.weight", True),
        ("mlp", "down", "kernel"): ("mlp.down_proj.weight", True),
    }
    for x in "qkv":
      table[("attn", x, "kernel")] = (f"self_attn.{x}_proj.weight", True)
      table[("attn", x, "bias")] = (f"self_attn.{x}_proj.bias", False)
    if rest in table:
      name, t = table[rest]
      return layer + name, t
  raise ValueError(f"decoder parameter {'.'.join(p)} has no Hugging Face counterpart")
