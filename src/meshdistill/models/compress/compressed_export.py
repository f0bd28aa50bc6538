"""A quantization-aware student in the compressed-tensors format (what llm-compressor writes, vLLM and transformers
read), written with the ``compressed-tensors`` package (the ``compress`` extra: it needs torch).

`compressed_config(scheme(settings, modules))` is the ``quantization_config`` of ``config.json``: one scheme over the
quantized block projections (``targets``: one ``re:`` pattern per projection kind, ``.*self_attn\\.q_proj$`` ...),
``quant_method: compressed-tensors``, weights ``int`` of 4 or 8 bits (``float`` of 8 for fp8), ``symmetric: true``
(qwix's scales are absmax, no zero point), ``strategy: group`` with the run's ``group_size`` (``channel`` where it is
null) and, for ``activations: int8``, dynamic int8 input activations scaled as qwix scales them (per token, and per
``group_size`` features of a token where the group size is set). The format is the one compressed-tensors infers for
that scheme on a linear layer (as llm-compressor does): ``pack-quantized`` for weight-only int4 / int8 (eight int4 or
four int8 values in each int32), ``int-quantized`` with int8 activations (the values one per int8); ``weights: fp8``
(``type: float``, float8_e4m3fn values) is ``naive-quantized`` (``float-quantized`` with int8 activations).

`compress_tensors(quantized, scheme)` turns each projection's integer values and scales (the student's own, from
`meshdistill.models.compress.qat.post_training`) into the tensors of that format through the format's compressor
(``weight_packed`` int32 ``[out, in * bits / 32]`` + ``weight_shape`` + ``weight_scale``, or ``weight`` int8 +
``weight_scale``); it is handed the dequantized weight ``values * scale`` and the scales, so the compressor's own
rounding (``round(w / scale)``, clamped to the type's range) gives back exactly the student's integers.
"""

from __future__ import annotations

import re

import numpy as np

EXTRA = "compress"
INSTALL = f"pip install 'meshdistill[{EXTRA}]'"
TYPES = {"int4": ("int", 4), "int8": ("int", 8), "fp8": ("float", 8)}  # weights -> compressed-tensors' type, bits


def require() -> None:
  """Raises ImportError, saying how to install it, when the ``compressed-tensors`` package is absent (checked without
  importing it: torch loads only when an export is written)."""
  import importlib.util  # pylint: disable=g-import-not-at-top

  if importlib.util.find_spec("compressed_tensors") is None or importlib.util.find_spec("torch") is None:
    raise ImportError(f"the quantized export writes the compressed-tensors format, which needs the compressed-tensors "
                      f"package and torch: {INSTALL}")


def targets(modules: list[str]) -> list[str]:
  """One ``re:`` target per projection kind of the module names ``modules`` (``model.layers.0.self_attn.q_proj`` ->
  ``re:.*self_attn\\.q_proj$``): the scheme matches those projections in every block and nothing else (not the LM
  head, not a mixture-of-experts router)."""
  kinds = sorted({re.sub(r"^model\.layers\.\d+\.", "", m) for m in modules})
  return [f"re:.*{re.escape(k)}$" for k in kinds]


def scheme(settings, modules: list[str]):
  """The compressed-tensors ``QuantizationScheme`` of a `QuantizeAware` ``settings`` over ``modules``, its ``format``
  the one compressed-tensors infers for a linear layer."""
  import torch  # pylint: disable=g-import-not-at-top
  from compressed_tensors.compressors.format import infer_module_format  # pylint: disable=g-import-not-at-top
  from compressed_tensors.quantization import QuantizationArgs  # pylint: disable=g-import-not-at-top
  from compressed_tensors.quantization import QuantizationScheme  # pylint: disable=g-import-not-at-top

  g = settings.group_size
  kind, bits = TYPES[settings.weights]
  weights = QuantizationArgs(num_bits=bits, type=kind, symmetric=True, strategy="group" if g else "channel",
                             group_size=g)
  acts = None
  if settings.activations == "int8":  # qwix scales an input per token, and per group of its features with a group size
    acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="group" if g else "token",
                            group_size=g, dynamic=True)
  found = QuantizationScheme(targets=targets(modules), weights=weights, input_activations=acts)
  found.format = infer_module_format(torch.nn.Linear, found).value
  return found


def compressed_config(found) -> dict:
  """``config.json``'s ``quantization_config`` of an export whose projections all follow the scheme ``found``
  (`scheme`), as compressed-tensors writes it (its ``version`` included)."""
  import compressed_tensors  # pylint: disable=g-import-not-at-top
  from compressed_tensors.base import COMPRESSION_VERSION_NAME  # pylint: disable=g-import-not-at-top
  from compressed_tensors.quantization import QuantizationConfig  # pylint: disable=g-import-not-at-top

  config = QuantizationConfig(config_groups={"group_0": found}, format=found.format, quantization_status="compressed")
  return {**config.model_dump(), COMPRESSION_VERSION_NAME: compressed_tensors.__version__}


def compress_tensors(quantized: dict[str, tuple[np.ndarray, np.ndarray]], found) -> dict:
  """``{module name: (values [out, in] int8, or float32 on the float8 grid, scales [out, in / group_size or 1]
  float32)}`` -> the tensors of ``found``'s format (``{module}.weight_packed``, ``.weight_shape``, ``.weight_scale``,
  or ``{module}.weight`` (int8, float8_e4m3fn), ``.weight_scale``), as torch tensors (numpy has no float8)."""
  import torch  # pylint: disable=g-import-not-at-top
  from compressed_tensors.compressors import BaseCompressor  # pylint: disable=g-import-not-at-top

  compressor = BaseCompressor.get_value_from_registry(found.format)
  out = {}
  for module, (values, scales) in quantized.items():
    group = values.shape[1] // scales.shape[1]
    weight = values.astype(np.float32) * np.repeat(scales.astype(np.float32), group, axis=1)
    state = compressor.compress({"weight": torch.from_numpy(weight), "weight_scale": torch.tensor(scales)}, found)
    for local, tensor in state.items():
      out[f"{module}.{local}"] = tensor.contiguous()
  return out


def save_file(tensors: dict, path: str, metadata: dict[str, str] | None = None) -> None:
  """safetensors' torch writer for ``tensors`` of numpy arrays (float32, float16, ml_dtypes' bfloat16) and torch
  tensors (the compressed ones, float8 among them)."""
  import torch  # pylint: disable=g-import-not-at-top
  from safetensors.torch import save_file as save  # pylint: disable=g-import-not-at-top

  def as_torch(x):
    if isinstance(x, torch.Tensor):
      return x
    if x.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: the same bits
      return torch.from_numpy(np.ascontiguousarray(x).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(x))

  save({k: as_torch(v) for k, v in tensors.items()}, path, metadata=metadata)


__all__ = ["EXTRA", "INSTALL", "TYPES", "compress_tensors", "compressed_config", "require", "save_file", "scheme",
           "targets"]
