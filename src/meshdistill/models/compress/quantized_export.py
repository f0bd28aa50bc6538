"""A quantization-aware student on disk with its integer weights and scales (``meshdistill export --quantized``).

`export_quantized(model, settings, out_dir)` writes the weights the student computes with -- the integers and scales
of ``settings``' rule (`meshdistill.models.compress.qat.post_training`, the rule the student trained through) -- in
one of two layouts:

* ``compressed-tensors`` (the default): what llm-compressor writes and vLLM and transformers load -- ``config.json``
  with a ``quantization_config`` (``quant_method: compressed-tensors``), ``model.safetensors`` with each block
  projection's integers (packed) or float8 values compressed by the compressed-tensors package, and its scales
  (`compressed_export`; the ``compress`` extra);
* ``meshdistill.quantized/1`` (below): the integers unpacked, in a file no float loader reads.

`load_quantized(out_dir)` reads a ``meshdistill.quantized/1`` export back as the quantized decoder (qwix ``QArray``
weights: the same integers, the same scales) or, with ``dequantize=True``, as a float decoder of the dequantized
weights; `convert_quantized(out_dir, new_dir)` rewrites one in the compressed-tensors layout.

Layout ``meshdistill.quantized/1`` (an export directory: its owner marker is an export's):

* ``config.json`` -- the float student's Hugging Face config, as `meshdistill.models.export_hf` writes it;
* ``quantized.safetensors`` -- named so that no loader of float checkpoints takes the integers for weights:

  - every block projection (attention q / k / v / o, MLP gate / up / down) as two tensors, under its Hugging Face
    name ``N`` (``model.layers.0.self_attn.q_proj.weight``) in that tensor's layout (``[out, in]``):
    ``N`` the quantized values -- ``int8`` for ``weights: int8`` and for ``weights: int4`` (int4 values, -8..7,
    stored UNPACKED, one per int8 byte) -- and ``N_scale``, float32 ``[out, in / group_size]`` (``[out, 1]``: one scale per output channel). The weight is
    ``N[o, i] * N_scale[o, i // group_size]``: symmetric, no zero point;
  - every other tensor (embedding, norms, LM head) as `export_hf` writes it, in ``dtype``;
  - header metadata (strings): ``format`` = ``meshdistill.quantized/1``, ``quantization`` = JSON of the
    ``student.quantize_aware`` section (``{"weights", "activations", "group_size"}``; activations are quantized
    at run time, nothing of them is stored), ``quantized`` = JSON list of the names ``N``, ``int4`` =
    ``unpacked int8``;
* the tokenizer files, when given.

``weights: fp8`` is written in the compressed-tensors layout only (float8_e4m3fn values and float32 scales; the
torch writer of safetensors: numpy has no float8); ``meshdistill.quantized/1`` refuses it (its plain export,
``export_hf`` of `dequantized`, holds the float8 grid exactly in float32).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshdistill.models import families
from meshdistill.models.compress import compressed_export
from meshdistill.models.compress.qat import SETTING, WEIGHTS, QuantizeAware, post_training, quantized_weights
from meshdistill.models.hf import TOKENIZER_FILES, hf_tensors, host_value, read_checkpoint, read_hf_config
from meshdistill.models.hf import write_checkpoint
from meshdistill.models.quantize import placed
from meshdistill.models.stacking import to_unrolled

log = logging.getLogger(__name__)

FORMAT = "meshdistill.quantized/1"
COMPRESSED = "compressed-tensors"
LAYOUTS = (COMPRESSED, FORMAT)
FILE = "quantized.safetensors"
SCALE = "_scale"  # the scales of tensor N are N + SCALE
STORED = {"int8": np.int8, "int4": np.int8}  # the file's dtype of the values, per ``weights``


def export_quantized(model, settings: QuantizeAware, out_dir: str | os.PathLike, tokenizer: Any = None, *,
                     family: str | None = None, dtype: str = "float32", overwrite: bool = False,
                     layout: str = COMPRESSED) -> Path:
  """Writes the float decoder ``model`` quantized by ``settings``: ``layout`` ``compressed-tensors`` (the default:
  ``config.json`` with its ``quantization_config``, ``model.safetensors``; module docstring) or
  ``meshdistill.quantized/1`` (``quantized.safetensors``, values unpacked). ``tokenizer``, ``family``, ``dtype`` (of the
  tensors that stay float) and ``overwrite`` as in `export_hf`: a non-empty ``out_dir`` is refused unless
  ``overwrite`` and an earlier export wrote it.

  Raises ValueError when ``settings.weights`` is null (nothing to quantize), ``fp8`` in ``meshdistill.quantized/1``
  (integers only), or for another ``layout``; ImportError when ``compressed-tensors`` is not installed (the
  ``compress`` extra)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r}; choose one of {list(LAYOUTS)}")
  if not settings.enabled:
    raise ValueError(f"{SETTING}.weights is null: the student is not quantized; write it with export_hf, or choose "
                     f"weights from {list(WEIGHTS)}")
  if layout == FORMAT and settings.weights not in STORED:
    raise ValueError(f"{SETTING}.weights={settings.weights!r}: the {FORMAT} layout holds integer weights "
                     f"({list(STORED)}); write it with layout={COMPRESSED!r} (float8 values and their scales), or "
                     "export it with export_hf (its float8 grid, dequantized, is exact in float32)")
  if layout == COMPRESSED:
    compressed_export.require()
  unrolled = to_unrolled(model) if model.cfg.scan_layers else model
  fam = families.default_for(model.cfg) if family is None else families.get(family)
  config = fam.to_hf(model.cfg, torch_dtype=dtype)
  tensors = hf_tensors(unrolled, fam, dtype)
  quantized = {}  # {Hugging Face name: (values [out, in] int8 / float32, scales [out, in / group_size or 1] float32)}
  for key, qarray in quantized_weights(post_training(unrolled, settings)).items():
    name, transposed = fam.weight_name(key)
    # fp8 values as float32 (exact: every float8_e4m3fn value is a float32 one); the compressor casts them back
    values = host_value(qarray.qvalue.astype(STORED.get(settings.weights, np.float32)))
    scales = host_value(qarray.scale)
    if transposed:
      values, scales = values.T, scales.T
    real = tensors[name].shape  # the checkpoint's shape (replicated key / value heads cut off)
    scales = scales[tuple(slice(0, -(-n * s // v)) for n, s, v in zip(real, scales.shape, values.shape))]
    values = values[tuple(slice(0, n) for n in real)]
    quantized[name] = (np.ascontiguousarray(values, dtype=STORED.get(settings.weights, values.dtype)),
                       np.ascontiguousarray(scales, dtype=np.float32))
  identity = {"architecture": config["architectures"][0], "format": layout, "quantization": _section(settings)}
  if layout == COMPRESSED:
    out = _write_compressed(out_dir, tensors, quantized, config, settings, tokenizer, overwrite, identity)
  else:
    for name, (values, scales) in quantized.items():
      tensors[name], tensors[name + SCALE] = values, scales
    metadata = {"format": FORMAT, "quantization": json.dumps(_section(settings)),
                "quantized": json.dumps(list(quantized)), "int4": "unpacked int8"}
    out = write_checkpoint(out_dir, tensors, config, tokenizer, overwrite=overwrite, file=FILE, metadata=metadata,
                           identity=identity)
  log.info("wrote %d quantized projections (%s, %s) to %s", len(quantized), settings.describe(), layout, out)
  return out


def _write_compressed(out_dir, tensors: dict, quantized: dict, config: dict, settings: QuantizeAware, tokenizer,
                      overwrite: bool, identity: dict) -> Path:
  """The compressed-tensors export: each quantized ``N`` (``...q_proj.weight``) replaced by its module's compressed
  tensors, ``config.json`` with the ``quantization_config``."""
  bad = [name for name in quantized if not name.endswith(".weight")]
  if bad:
    raise ValueError(f"{SETTING}: the compressed-tensors export holds linear layers' weights; {bad[:4]} are not")
  modules = [name.removesuffix(".weight") for name in quantized]
  found = compressed_export.scheme(settings, modules)
  config = {**config, "quantization_config": compressed_export.compressed_config(found)}
  packed = compressed_export.compress_tensors(
      {name.removesuffix(".weight"): arrays for name, arrays in quantized.items()}, found)
  floats = {k: v for k, v in tensors.items() if k not in quantized}
  return write_checkpoint(out_dir, {**floats, **packed}, config, tokenizer, overwrite=overwrite, identity=identity,
                          save_file=compressed_export.save_file)


def _section(settings: QuantizeAware) -> dict:
  return {"weights": settings.weights, "activations": settings.activations, "group_size": settings.group_size}


def _header(path: Path) -> dict[str, str]:
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  file = path / FILE
  if not file.is_file():
    config = read_hf_config(path) if (path / "config.json").is_file() else {}
    if (config.get("quantization_config") or {}).get("quant_method") == COMPRESSED:
      raise ValueError(f"{path} is a compressed-tensors export (config.json's quantization_config), not a {FORMAT} "
                       "one: load it with transformers (AutoModelForCausalLM.from_pretrained) or vLLM")
    raise FileNotFoundError(f"{path} holds no {FILE}: not a {FORMAT} export (write one with "
                            f"export_quantized(..., layout={FORMAT!r}))")
  with safe_open(str(file), "numpy") as f:
    meta = f.metadata() or {}
  if meta.get("format") != FORMAT:
    raise ValueError(f"{file} has format {meta.get('format')!r}; this version reads {FORMAT!r}")
  return meta


def convert_quantized(path: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
  """The ``meshdistill.quantized/1`` export at ``path`` rewritten at ``out_dir`` in the compressed-tensors layout --
  the same integers, the same scales, the same float tensors and tokenizer files: what `export_quantized` writes
  for the student it was written from. ``overwrite`` as in `export_quantized`.

  Raises FileNotFoundError / ValueError for a ``path`` that is not such an export (`load_quantized`'s errors),
  ImportError without ``compressed-tensors`` (the ``compress`` extra)."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  path = Path(path)
  meta = _header(path)
  compressed_export.require()
  settings = QuantizeAware(**json.loads(meta["quantization"]))
  with safe_open(str(path / FILE), "numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  missing = [n for n in json.loads(meta["quantized"]) if n not in tensors or n + SCALE not in tensors]
  if missing:
    raise ValueError(f"{path / FILE} lacks the values or scales of {missing[:4]}; the file is damaged")
  quantized = {n: (tensors.pop(n), tensors.pop(n + SCALE)) for n in json.loads(meta["quantized"])}
  config = read_hf_config(path)
  tokenizer = path if any((path / n).is_file() for n in TOKENIZER_FILES) else None
  identity = {"architecture": config["architectures"][0], "format": COMPRESSED, "quantization": _section(settings)}
  out = _write_compressed(out_dir, tensors, quantized, config, settings, tokenizer, overwrite, identity)
  log.info("converted %s (%s) to the compressed-tensors layout at %s", path, FORMAT, out)
  return out


def quantized_settings(path: str | os.PathLike) -> QuantizeAware:
  """The ``student.quantize_aware`` settings a ``meshdistill.quantized/1`` export at ``path`` was written with."""
  return QuantizeAware(**json.loads(_header(Path(path))["quantization"]))


def load_quantized(path: str | os.PathLike, mesh=None, *, dequantize: bool = False, dtype: str = "float32"):
  """The student of a ``meshdistill.quantized/1`` export at ``path``.

  Default: the quantized decoder -- its projections hold qwix ``QArray`` weights whose ``qvalue`` and ``scale``
  are the file's integers and scales exactly (int4 back to ``int4``), with the file's activation quantization --
  which computes what the quantization-aware student computed. ``dequantize=True``: a float `Decoder` whose
  projection weights are ``N * N_scale`` (the form `export_hf` writes). ``mesh``: weights split over ``tensor`` as
  `load_hf` splits them. ``dtype``: the compute dtype."""
  path = Path(path)
  meta = _header(path)
  settings = QuantizeAware(**json.loads(meta["quantization"]))
  names = set(json.loads(meta["quantized"]))
  model, unused = read_checkpoint(path, mesh, dtype=dtype, file=FILE)  # a quantized N read as its values in float
  missing = sorted(n + SCALE for n in names if n + SCALE not in unused)
  if missing:
    raise ValueError(f"{path / FILE} lacks the scales {missing[:4]} of its quantized tensors; the file is damaged")
  fam = families.family_for(read_hf_config(path), str(path / "config.json"))
  codes, scales = {}, {}
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  with safe_open(str(path / FILE), "numpy") as f:
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      name, transposed = fam.weight_name(key)
      if name in names:
        scale = f.get_tensor(name + SCALE)
        codes[key], scales[key] = var.get_value(), scale.T if transposed else scale
  if len(codes) != len(names):
    raise ValueError(f"{path / FILE} lists {len(names)} quantized tensors but the model of its config.json has "
                     f"{len(codes)} of them")
  graphdef, state = nnx.split(model)
  float_leaves = [(k, v.replace(_dequantize(codes[k], scales[k])) if k in codes else v)
                  for k, v in nnx.to_flat_state(state)]
  floats = nnx.merge(graphdef, nnx.from_flat_state(float_leaves))
  log.info("loaded %d quantized projections (%s) from %s", len(codes), settings.describe(), path)
  if dequantize:
    return floats
  quantized = post_training(floats, settings)  # the structure; its integers and scales replaced by the file's
  graphdef, state = nnx.split(quantized)
  leaves = []
  for k, v in nnx.to_flat_state(state):
    where, leaf = k[:-2], k[-1]
    if k[-2] == "array" and where in codes and leaf in ("qvalue", "scale"):
      stored = codes[where] if leaf == "qvalue" else scales[where]
      if tuple(stored.shape) != tuple(v.get_value().shape):
        raise ValueError(f"{path / FILE}: {'.'.join(map(str, where))} {leaf} has shape {list(stored.shape)}; the "
                         f"quantization {settings.describe()} gives {list(v.get_value().shape)}")
      v = v.replace(jnp.asarray(stored).astype(v.get_value().dtype))
    leaves.append((k, v))
  quantized = nnx.merge(graphdef, nnx.from_flat_state(leaves))
  return placed(quantized, mesh) if mesh is not None else quantized


def _dequantize(codes, scales_np: np.ndarray) -> jax.Array:
  """``codes * scales`` with each scale repeated over its group (``codes``: the values read as float, in the
  model's layout; ``scales_np``: ``[in / group_size or 1, out]``)."""
  expanded = scales_np
  for axis, (n, s) in enumerate(zip(codes.shape, scales_np.shape)):
    if n % s:
      raise ValueError(f"scales of shape {list(scales_np.shape)} do not tile a weight of shape {list(codes.shape)}")
    expanded = np.repeat(expanded, n // s, axis=axis)
  return codes * jax.device_put(jnp.asarray(expanded, codes.dtype), codes.sharding)


__all__ = ["COMPRESSED", "FILE", "FORMAT", "LAYOUTS", "convert_quantized", "export_quantized", "load_quantized", "quantized_settings"]
