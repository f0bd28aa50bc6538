"""Model families: which Hugging Face checkpoints the built-in `Decoder` reads and writes, one module each.

The contract is `meshdistill.models.families._base.Family`. Built in:

===========  ===================  ==========================================================
family       architecture         what differs from the plain Llama block
===========  ===================  ==========================================================
``llama``    LlamaForCausalLM     optional Llama-3 ``rope_scaling`` (``rope_type="llama3"``)
``qwen3``    Qwen3ForCausalLM     RMSNorm over head_dim on q and k (``qk_norm``)
``qwen2``    Qwen2ForCausalLM     biases on q/k/v (``qkv_bias``)
``mistral``  MistralForCausalLM   a sliding window on every layer (``sliding_window``)
``gemma2``   Gemma2ForCausalLM    GeGLU, 1 + w norms, post-norms, scaled embeddings, soft-caps,
                                  sliding / global layers (`meshdistill.models._variants`)
``gemma3``   Gemma3ForCausalLM    Gemma 2's block with q/k norms, a local RoPE base, no soft-caps
qwen3_moe    Qwen3MoeForCausalLM  ``qk_norm`` and mixture-of-experts MLPs (``moe``, `families._moe`)
``mixtral``  MixtralForCausalLM   mixture-of-experts MLPs in every layer (``moe``)
===========  ===================  ==========================================================

Adding a family is one module here: a `Family` subclass decorated with ``@register``. Every module
of this package is imported below, so the decorator runs; `family_for` then recognises the
family's ``architectures`` / ``model_type`` in a ``config.json``, `get` finds it by name (``export_hf``'s
``family=``) and its ``presets`` join the planner's.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from meshdistill.models.families._base import _REGISTRY, Family, all_families, default_for, names



def register(cls: type[Family]) -> type[Family]:
  """Class decorator: makes the family (an instance of ``cls``) known by its ``name``, architectures and model_type."""
  fam = cls()
  for attr in ("name", "architectures"):
    if not getattr(cls, attr, None):
      raise ValueError(f"family class {cls.__name__} has no {attr}; set it in the class body")
  taken = {a: f for f in _REGISTRY.values() if f.name != fam.name for a in (*f.architectures, f.model_type)}
  clash = sorted({*fam.architectures, fam.model_type} & set(taken))
  if clash:
    raise ValueError(f"family {fam.name!r}: {clash} already name family {taken[clash[0]].name!r}; choose others")
  if fam.default_export:
    other = next((f for f in _REGISTRY.values() if f.name != fam.name and f.default_export and f.block == fam.block
                  and f.experts == fam.experts),
                 None)
    if other is not None:
      raise ValueError(f"family {fam.name!r} and {other.name!r} are both default_export for block {fam.block}; "
                       "only one family can be the default for a block")
  _REGISTRY[fam.name] = fam
  return cls


def get(name: str) -> Family:
  """The family registered as ``name`` (e.g. ``export_hf(family=...)``)."""
  if name not in _REGISTRY:
    raise ValueError(f"family={name!r}; choose one of {names()}")
  return _REGISTRY[name]


def supported() -> dict[str, str]:
  """architecture -> model_type of every registered family."""
  return {a: f.model_type for f in all_families() for a in f.architectures}


def family_for(hf: dict[str, Any], where: str = "config.json") -> Family:
  """The family of a Hugging Face config (a parsed ``config.json``): by its ``architectures``, or by its
  ``model_type`` when it names no architecture; a ValueError naming both fields and what is supported."""
  archs = hf.get("architectures") or []
  model_type = hf.get("model_type")
  by_arch = {a: f for f in all_families() for a in f.architectures}
  for arch in archs:
    if arch in by_arch:
      return by_arch[arch]
  by_type = {f.model_type: f for f in all_families()}
  if not archs and model_type in by_type:
    return by_type[model_type]
  raise ValueError(
      f"{where}: architectures={archs!r}, model_type={model_type!r} is not supported; "
      f"supported architectures: {sorted(by_arch)} (model_type {sorted(by_type)})"
  )


def presets() -> dict[str, dict[str, Any]]:
  """Every family's planner presets: name -> the shape fields of the model's published ``config.json``."""
  out: dict[str, dict[str, Any]] = {}
  for fam in all_families():
    for name, hf in fam.presets.items():
      if name in out:
        raise ValueError(f"preset {name!r} is defined by two families; rename one in family {fam.name!r}")
      out[name] = hf
  return out


for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
  if not _mod.startswith("_"):
    importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["Family", "all_families", "default_for", "family_for", "get", "names", "presets", "register", "supported"]
