"""Hugging Face ``config.json`` <-> `ModelConfig`, and the weight-name map between the two layouts.

Each family's mapping lives in its module of `meshdistill.models.families` (its architectures and
model_type, block options, written fields, presets); these functions ask the registry for the family
of a config and let it do the work.
"""

from __future__ import annotations

from typing import Any

from meshdistill.models import families
from meshdistill.models.families._base import weight_name
from meshdistill.models.decoder import ModelConfig

# architecture -> model_type of the families known at import (`families.supported()` is always current)
SUPPORTED = families.supported()


def config_from_hf(hf: dict[str, Any], *, max_len: int | None = None, dtype: str = "auto",
                   where: str = "config.json") -> ModelConfig:
  """A `ModelConfig` equal to the Hugging Face config ``hf`` (a parsed ``config.json``).

  ``max_len`` overrides ``max_position_embeddings`` (it only bounds the sequence length).
  """
  return families.family_for(hf, where).from_hf(hf, max_len=max_len, dtype=dtype, where=where)


def default_family(cfg: ModelConfig) -> str:
  """The Hugging Face family a `ModelConfig` exports as (`families.default_for`): qwen3 with qk_norm, qwen2 with
  qkv_bias, else llama."""
  return families.default_for(cfg).name


def hf_config(cfg: ModelConfig, family: str | None = None, torch_dtype: str = "float32") -> dict[str, Any]:
  """The Hugging Face ``config.json`` contents for a decoder of config ``cfg``."""
  fam = families.default_for(cfg) if family is None else families.get(family)
  return fam.to_hf(cfg, torch_dtype)


def weight_names(path: tuple) -> tuple[str, bool]:
  """(Hugging Face tensor name, transposed?) of a `Decoder` parameter path, in the Llama layout every built-in
  family shares (a family with its own names answers through `Family.weight_name`)."""
  return weight_name(path)
