"""Model shapes the planner knows by name, and turning a teacher / student argument into a `ModelConfig`.

Each preset is the subset of the model's published Hugging Face ``config.json`` that sets its
shape (Llama 3.x and Qwen3 models of the Hugging Face hub), defined in its family's module
(``presets`` of `meshdistill.models.families.llama`, `meshdistill.models.families.qwen3`, ...) and
read by the same reader as a downloaded ``config.json`` (`meshdistill.models._hf_config.config_from_hf`).
Only shapes matter to the planner: no weights are read.
"""

from __future__ import annotations

import json
import os
from typing import Any

from meshdistill.models import families
from meshdistill.models import config_from_hf
from meshdistill.models.decoder import ModelConfig


# name -> the shape fields of the model's published config.json, from every family's module
# (`meshdistill.models.families`: llama.py, qwen3.py, ...)
PRESETS: dict[str, dict[str, Any]] = families.presets()


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
