"""Model shapes the planner knows by name, and turning a teacher / student argument into a `ModelConfig`.

Each preset is the subset of the model's published Hugging Face ``config.json`` that sets its
shape (the files of ``meta-llama/Llama-3.2-1B``, ``meta-llama/Llama-3.2-3B``, ``meta-llama/Llama-3.1-8B``,
``meta-llama/Llama-3.1-70B``, ``Qwen/Qwen3-0.6B``, ``Qwen/Qwen3-1.7B``, ``Qwen/Qwen3-4B``,
``Qwen/Qwen3-8B`` and ``Qwen/Qwen3-32B`` on the Hugging Face hub), read by the same reader as a
downloaded ``config.json`` (`meshdistill.models._hf_config.config_from_hf`). Only shapes matter to
the planner: no weights are read.
"""

from __future__ import annotations

import json
import os
from typing import Any

from meshdistill.models._hf_config import config_from_hf
from meshdistill.models.decoder import ModelConfig


def _llama(d, layers, heads, mlp, head_dim, tied, factor):
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": d,
      "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
      "num_key_value_heads": 8, "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": 131072,
      "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": tied,
      "rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192},
  }


def _qwen3(d, layers, heads, mlp, tied):
  return {
      "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": d,
      "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
      "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
      "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": tied,
  }


# name -> the shape fields of the model's published config.json
PRESETS: dict[str, dict[str, Any]] = {
    "llama3.2-1b": _llama(2048, 16, 32, 8192, 64, True, 32.0),
    "llama3.2-3b": _llama(3072, 28, 24, 8192, 128, True, 32.0),
    "llama3.1-8b": _llama(4096, 32, 32, 14336, 128, False, 8.0),
    "llama3.1-70b": _llama(8192, 80, 64, 28672, 128, False, 8.0),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, False),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, False),
}


def resolve_model(spec: Any, *, who: str, dtype: str | None = None,
                  remat: str | None = None, scan_layers: bool | None = None,
                  attention: str | None = None, param_dtype: str | None = None) -> tuple[ModelConfig, str]:
  """``(ModelConfig, label)`` of a teacher / student argument.

  ``spec``: a `ModelConfig`, a preset name (`PRESETS`), or the path of a Hugging Face ``config.json``
  (or of the directory holding one). ``dtype`` / ``remat`` / ``scan_layers`` / ``attention`` / ``param_dtype`` replace
  the compute dtype / remat policy / scanned blocks / attention kernel / stored weights' dtype.
  """
  if isinstance(spec, ModelConfig):
    cfg, label = spec, "ModelConfig"
  elif isinstance(spec, str) and spec.lower() in PRESETS:
    cfg, label = config_from_hf(PRESETS[spec.lower()], where=f"preset {spec}"), spec.lower()
  elif isinstance(spec, (str, os.PathLike)) and os.path.exists(spec):
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else os.fspath(spec)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{who}={spec!r}: no config.json in that directory")
    with open(path, encoding="utf-8") as f:
      cfg, label = config_from_hf(json.load(f), where=path), path
  else:
    raise ValueError(
        f"{who}={spec!r} is neither a preset nor an existing config.json path; presets: {sorted(PRESETS)}"
    )
  changes = {k: v for k, v in (("dtype", dtype), ("remat", remat), ("scan_layers", scan_layers),
                                ("attention", attention), ("param_dtype", param_dtype)) if v is not None}
  try:
    return (cfg.replace(**changes) if changes else cfg), label
  except ValueError as e:
    raise ValueError(f"{who}: {e}") from None
