"""A LoRA student's adapters as a Hugging Face PEFT adapter directory (``meshdistill export --adapter``).

`export_adapter(model, out_dir)` writes, for a student holding adapters (`meshdistill.models.lora`):

* ``adapter_config.json``: ``peft_type: LORA``, ``task_type: CAUSAL_LM``, ``r``, ``lora_alpha``,
  ``target_modules`` (Hugging Face projection names: ``q_proj`` ... ``down_proj``), ``lora_dropout``,
  ``bias: none``, ``fan_in_fan_out: false`` and ``base_model_name_or_path``;
* ``adapter_model.safetensors``: per adapted projection ``base_model.model.<weight>.lora_A.weight``
  ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``, ``<weight>`` the projection's name in the
  Hugging Face checkpoint without ``.weight`` (``model.layers.N.self_attn.q_proj``).

A PEFT loader computes ``W + (lora_alpha / r) * B @ A`` for every adapted ``W`` ``[out, in]``: exactly
the merged export's weights (`merge_lora`). The adapters apply to the student's frozen base: with
``base`` (a Hugging Face directory the base is exactly, e.g. the run's ``student.hf``) the config
points there; otherwise the base itself -- dequantised, for a quantized (QLoRA) base -- is written
to ``base/`` inside the directory (a Hugging Face checkpoint) and the config points to it (absolute path).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshdistill.core.fsutil import atomic_output_dir
from meshdistill.models._hf_config import weight_names
from meshdistill.models._build import abstract_params
from meshdistill.models.hf import export_hf
from meshdistill.models.lora import is_lora, merge_lora
from meshdistill.core.ownership import OutputKind, check_owned, write_marker

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BASE_DIR = "base"
PREFIX = "base_model.model."


def is_adapter_file(name: str) -> bool:
  """Whether ``name`` is an entry `export_adapter` puts in its directory."""
  return name in (CONFIG_FILE, WEIGHTS_FILE, BASE_DIR)


def adapter_kind():
  """An adapter directory: replaced only when its owner marker proves `export_adapter` wrote it."""
  return OutputKind("adapter", "adapter directory", is_adapter_file,
                    lambda path: "an adapter directory without an owner marker looks like a downloaded adapter")


def _host(x) -> np.ndarray:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def adapter_tensors(model) -> dict[str, np.ndarray]:
  """``{PEFT name: array}`` of the adapters of ``model``: ``lora_A`` ``[r, in]`` and ``lora_B`` ``[r, out]^T``
  = ``[out, r]`` per adapted projection (float32, key/value heads a mesh replicated cut back to the model's)."""
  cfg = model.cfg
  real = cfg.replace(vocab_multiple=1, replicate_kv=False)
  real_shapes = {tuple(map(str, k)): tuple(v.get_value().shape)
                 for k, v in nnx.to_flat_state(abstract_params(real)[1])}
  tensors = {}
  for path, m in nnx.iter_modules(model):
    if not hasattr(m, "kernel_lora_a"):
      continue
    key = tuple(str(p) for p in path) + ("kernel",)
    name, _ = weight_names(key)
    stem = PREFIX + name[: -len(".weight")]
    in_f, out_f = real_shapes[key]
    a_IxR = _host(m.kernel_lora_a[...])[:in_f]
    b_RxO = _host(m.kernel_lora_b[...])[:, :out_f]
    tensors[stem + ".lora_A.weight"] = np.ascontiguousarray(a_IxR.T, dtype=np.float32)
    tensors[stem + ".lora_B.weight"] = np.ascontiguousarray(b_RxO.T, dtype=np.float32)
  return tensors


def adapter_config(model, base_model_name_or_path: str) -> dict[str, Any]:
  """The ``adapter_config.json`` of ``model``'s adapters (`meshdistill.models.lora.LoraConfig`)."""
  lora = model.lora
  modules = []
  for t in lora.targets:  # Hugging Face names of the adapted projections
    section = "attn" if t in ("q", "k", "v", "o") else "mlp"
    modules.append(weight_names(("blocks", 0, section, t, "kernel"))[0].split(".")[-2])
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path,
      "r": lora.rank,
      "lora_alpha": lora.scale_alpha,
      "lora_dropout": lora.dropout,
      "target_modules": modules,
      "bias": "none",
      "fan_in_fan_out": False,
      "inference_mode": True,
      "modules_to_save": None,
  }


def export_adapter(model, out_dir: str | os.PathLike, *, base: str | None = None, tokenizer: Any = None,
                   dtype: str = "float32", overwrite: bool = False) -> Path:
  """Writes ``model``'s adapters to ``out_dir`` as a PEFT adapter directory (see the module docstring).

  Args:
    model: a `Decoder` holding LoRA adapters (`meshdistill.models.lora.apply_lora`).
    base: a Hugging Face directory holding exactly the frozen base (the config points there); ``None``
      writes the base (dequantised) to ``out_dir/base`` with ``tokenizer``, at ``dtype``.
    overwrite: replace a non-empty ``out_dir`` holding only what this function writes.

  ``out_dir`` is written to a temporary sibling and renamed into place: it is absent, untouched or
  complete. In a multi-process run every process must call it; only process 0 writes.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  if not is_lora(model):
    raise ValueError("export_adapter: the model holds no LoRA adapters (student.lora.rank is 0); export the whole "
                     "student instead (without --adapter)")
  tensors = adapter_tensors(model)
  base_model = merge_lora(model, adapters=False) if base is None else None  # every process gathers
  out = Path(out_dir)
  if jax.process_index() != 0:
    if base_model is not None:
      export_hf(base_model, out / BASE_DIR, tokenizer=tokenizer, dtype=dtype)
    return out

  check_owned(str(out), adapter_kind(), overwrite=overwrite, flag="overwrite=True")
  with atomic_output_dir(str(out)) as tmp:
    tmp = Path(tmp)
    write_marker(str(tmp), adapter_kind(), {"rank": model.lora.rank})
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    if base_model is not None:
      export_hf(base_model, tmp / BASE_DIR, tokenizer=tokenizer, dtype=dtype)
    config = adapter_config(model, os.path.abspath(out / BASE_DIR if base is None else base))
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
  log.info("wrote %d adapter tensors (r=%d) to %s%s", len(tensors), model.lora.rank, out,
           "" if base is None else f"; base {base}")
  return out


__all__ = ["BASE_DIR", "CONFIG_FILE", "WEIGHTS_FILE", "adapter_config", "adapter_tensors", "export_adapter",
           "is_adapter_file"]
