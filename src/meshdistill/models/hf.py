"""Hugging Face safetensors checkpoints straight onto the mesh, and back out.

`load_hf(path, mesh)` reads a local Hugging Face directory (``config.json`` plus
``model.safetensors``, or sharded ``model-0000x-of-0000n.safetensors`` with
``model.safetensors.index.json``) of a causal LM of a registered family (Llama, Qwen3, Qwen2, Mistral,
Gemma 2, Gemma 3 text: `meshdistill.models.families`) into the built-in `Decoder`, its weights split over the mesh
axis ``tensor`` exactly as `init_model` would split them. Every device reads only its own
slice of each tensor from disk (``safe_open(...).get_slice(name)[...]`` inside
`jax.make_array_from_callback`), so no device and no host buffer ever holds a full
tensor-split weight.

`export_hf(model, out_dir)` writes a decoder as a checkpoint that transformers (and so
vLLM) loads: ``config.json``, ``model.safetensors`` and, when given, tokenizer files. It writes
into a fresh temporary sibling and renames it into place (`meshdistill.storage.fsutil.atomic_output_dir`):
no old shard or index survives next to the new weights, no symlink in the old directory is
written through, and a failure (a bad tokenizer) leaves the old directory as it was. A non-empty
``out_dir`` is replaced only with ``overwrite=True`` and only when it holds nothing but
checkpoint files.

Reading is defensive: a malformed ``config.json``, index or safetensors file is reported with
its path, and an index whose ``weight_map`` names a file outside the model directory (an absolute
path, ``..``) is refused. Files are opened through links, as the Hugging Face hub cache's
``snapshots/<rev>/*`` (links to ``../../blobs/``) need; the NAME decides what is inside.

Why the built-in decoder and not tunix's model classes: the decoder already is the Llama
block (RMSNorm, rotate-half RoPE, GQA, SwiGLU); three default-off `ModelConfig` options
(``qk_norm``, ``qkv_bias``, ``rope_scaling``) cover Qwen3, Qwen2 and Llama 3.x, and the options of
`meshdistill.models._variants` (sliding windows, soft-caps, Gemma's norms and GeGLU) Mistral and Gemma. With it a
loaded teacher gets everything the distillation step needs -- per-layer hidden states,
attention probabilities, the final hidden state and ``head_weight()`` for chunked losses,
per-block remat -- with partitioning over ``tensor``. (tunix 0.1.7's Llama3 also ignores
``rope_theta`` in its attention and has no Llama-3 frequency scaling, so its logits differ
from transformers' for Llama 3.x checkpoints.) `meshdistill.models.tunix_adapter` wraps
tunix's modules for users who already hold them.

Layout: Hugging Face Linear weights are [out, in], the decoder's kernels [in, out]; each
device reads the transposed window of its shard. Both store q/k in rotate-half order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from meshdistill.storage.fsutil import atomic_output_dir, read_json
from meshdistill.storage.ownership import OutputKind, check_owned, write_marker
from meshdistill.parallel.rules import split_ways
from meshdistill.models._build import abstract_params
from meshdistill.models import families
from meshdistill.models._hf_config import SUPPORTED, config_from_hf, hf_config
from meshdistill.models.decoder import Decoder, ModelConfig
from meshdistill.models.stacking import to_scanned

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)
_DTYPES = ("float32", "bfloat16", "float16")

__all__ = ["SUPPORTED", "config_from_hf", "export_hf", "hf_config", "load_hf", "read_hf_config"]


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """The parsed ``config.json`` of a Hugging Face model directory."""
  file = Path(path) / "config.json"
  if not file.is_file():
    raise FileNotFoundError(f"{file} not found; a Hugging Face model directory holds config.json and *.safetensors")
  return read_json(str(file), "Hugging Face model config")


def _safe_open(file: Path):
  """``safetensors.safe_open`` whose errors name the file (a truncated download, a file of another format)."""
  from safetensors import SafetensorError, safe_open

  try:
    return safe_open(file, "numpy")
  except (SafetensorError, OSError, ValueError) as e:
    raise ValueError(f"{file} is not a readable safetensors file ({e}); download it again") from None


def _inside(path: Path, name: Any, index: Path) -> Path:
  """``path / name`` for an index entry, judged by its NAME: a relative path that stays lexically inside ``path``
  (not absolute, no ``..``). The file it names is then opened like ``model.safetensors``, links followed: the
  Hugging Face hub cache links ``snapshots/<rev>/*`` to ``../../blobs/<hash>``."""
  if not isinstance(name, str) or not name or os.path.isabs(name) or PureWindowsPath(name).drive:
    raise ValueError(f"{index}: weight_map entry {name!r} is not a relative file name")
  if ".." in PurePosixPath(name.replace("\\", "/")).parts:
    raise ValueError(f"{index}: weight_map entry {name!r} points outside {path}; refusing to open it")
  return path / name


def _weight_map(path: Path) -> dict[str, Path]:
  """Tensor name -> safetensors file, from the index or the single file."""
  index = path / INDEX_FILE
  if index.is_file():
    names = read_json(str(index), "safetensors index").get("weight_map")
    if not isinstance(names, dict):
      raise ValueError(f"{index} has no 'weight_map' object mapping tensor names to files")
    files = {f: _inside(path, f, index) for f in set(names.values())}
    missing = sorted(f for f, p in files.items() if not p.is_file())
    if missing:
      raise FileNotFoundError(f"{index} lists {missing} but {'it is' if len(missing) == 1 else 'they are'} "
                              f"missing from {path}; download the complete checkpoint")
    return {n: files[f] for n, f in names.items()}
  single = path / SINGLE_FILE
  if single.is_file():
    with _safe_open(single) as f:
      return {n: single for n in f.keys()}
  raise FileNotFoundError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def load_hf(
    path: str | os.PathLike,
    mesh: Mesh | None = None,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    max_len: int | None = None,
    scan_layers: bool = False,
) -> Decoder:
  """Loads a Hugging Face Llama / Qwen3 / Qwen2 causal-LM directory into a `Decoder`.

  Args:
    path: local directory with ``config.json`` and safetensors weights (single file or
      sharded with ``model.safetensors.index.json``).
    mesh: a ``(data, tensor)`` mesh; each weight is created split over ``tensor`` and
      replicated over ``data``, each device reading only its slice from disk. ``None``:
      one device.
    dtype: compute dtype of activations (`ModelConfig.dtype`).
    param_dtype: dtype the weights are stored in on device (`ModelConfig.param_dtype` of the returned model):
      ``"float32"``, or ``"bfloat16"`` / ``"float16"`` for a frozen teacher (half the memory).
    max_len: longest sequence the model accepts (default ``max_position_embeddings``).
    scan_layers: stack the blocks for ``nnx.scan`` (`ModelConfig.scan_layers`); the layers are read one by
      one as usual and then stacked, so the device briefly holds the block weights twice.

  Raises:
    FileNotFoundError: a missing ``config.json`` or shard file (named).
    ValueError: unsupported architecture, or a tensor whose shape disagrees with
      ``config.json`` (names the tensor, the file and both shapes), or a missing tensor.
  """
  path = Path(path)
  if param_dtype not in _DTYPES:
    raise ValueError(f"param_dtype={param_dtype!r}; choose one of {_DTYPES}")
  hf, config_file = read_hf_config(path), str(path / "config.json")
  family = families.family_for(hf, config_file)
  cfg = family.from_hf(hf, max_len=max_len, dtype=dtype, where=config_file)
  cfg = cfg.replace(param_dtype=param_dtype)  # the model's config says how its weights are stored
  real_shapes = None
  if mesh is not None:  # a vocabulary `tensor` does not divide gets zero padding rows, not read from disk
    fitted = cfg.for_tensor(split_ways(mesh, "vocab"))
    if fitted.padded_vocab != cfg.padded_vocab:
      real_shapes = {k: tuple(v.get_value().shape) for k, v in nnx.to_flat_state(abstract_params(cfg)[1])}
    cfg = fitted
  graphdef, abstract, shardings = abstract_params(cfg, mesh)
  state, where, used = read_onto_mesh(path, abstract, shardings, _layouts(family), param_dtype, real_shapes)
  extra = sorted(set(where) - used)
  if extra:
    ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
    odd = [n for n in extra if n not in ignorable and not n.endswith("rotary_emb.inv_freq")]
    if odd:
      log.warning("%s: %d tensors not used by the decoder: %s", path, len(odd), odd[:8])
  log.info("loaded %d layers, d_model=%d, vocab %d from %s", cfg.n_layers, cfg.d_model, cfg.vocab_size, path)
  model = nnx.merge(graphdef, state)
  return to_scanned(model) if scan_layers else model


def _layouts(family: families.Family):
  """``key -> (Hugging Face name, layout)`` of ``family``'s weight-name map (see `read_onto_mesh`)."""

  def names(key: tuple) -> tuple[str, str]:
    name, transposed = family.weight_name(key)
    return name, "T" if transposed else "same"

  return names


def _hf_shape(shape: tuple, layout: str) -> tuple:
  """The Hugging Face shape of a weight of ``shape`` stored in ``layout`` (see `read_onto_mesh`)."""
  if layout == "same":
    return shape
  if layout == "T":
    return shape[::-1]
  if layout == "in_heads":  # [D, N, H] <- [N*H, D]
    return (shape[1] * shape[2], shape[0])
  if layout == "out_heads":  # [N, H, D] <- [D, N*H]
    return (shape[2], shape[0] * shape[1])
  raise ValueError(f"unknown layout {layout!r}")


def _window(index: tuple, shape: tuple, layout: str):
  """(Hugging Face window, fix(block) -> our block) for the device-local ``index`` into ``shape``."""
  if layout == "same":
    return tuple(index), lambda b: b
  if layout == "T":
    return tuple(index[::-1]), lambda b: b.T
  heads, hd = (shape[1], shape[2]) if layout == "in_heads" else (shape[0], shape[1])
  s_n = index[1] if layout == "in_heads" else index[0]
  n0, n1, _ = s_n.indices(heads)
  rows = slice(n0 * hd, n1 * hd)  # head-dim axis is never split, so the window is contiguous
  if layout == "in_heads":
    return (rows, index[0]), lambda b: b.T.reshape(b.shape[1], n1 - n0, hd)
  return (index[2], rows), lambda b: b.T.reshape(n1 - n0, hd, b.shape[0])


def read_onto_mesh(path: str | os.PathLike, abstract: nnx.State, shardings: Any, names, param_dtype: str = "float32",
                   real_shapes: dict | None = None):
  """Fills an abstract NNX state from a Hugging Face directory, each device reading only its window.

  ``names(key) -> (hf_name, layout)`` for every parameter path; layout ``"same"``, ``"T"``
  (HF [out, in] -> [in, out]), ``"in_heads"`` (HF [N*H, D] -> [D, N, H]) or ``"out_heads"``
  (HF [D, N*H] -> [N, H, D]). ``shardings``: a state of `NamedSharding` like ``abstract``
  or ``None`` (one device). ``real_shapes``: parameter path -> the checkpoint's shape (in our
  layout) where ``abstract`` is larger (vocabulary padding): the extra rows are zeros, never read.
  Returns ``(state, weight_map, used_names)``.
  """
  path = Path(path)
  where = _weight_map(path)
  flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  target = np.dtype(jax.numpy.dtype(param_dtype))
  used = set()
  leaves = []
  with contextlib.ExitStack() as stack:
    handles: dict[Path, Any] = {}
    for key, var in nnx.to_flat_state(abstract):
      name, layout = names(key)
      if name not in where:
        raise ValueError(f"tensor {name!r} (for {'.'.join(map(str, key))}) is not in the checkpoint at {path}; "
                         f"config.json describes a model that needs it")
      used.add(name)
      file = where[name]
      if file not in handles:
        handles[file] = stack.enter_context(_safe_open(file))
      sl = handles[file].get_slice(name)
      shape = tuple(var.get_value().shape)
      real = (real_shapes or {}).get(key, shape)
      hf_shape, expect = tuple(sl.get_shape()), _hf_shape(real, layout)
      if hf_shape != expect:
        raise ValueError(f"tensor {name!r} in {file.name} has shape {list(hf_shape)} but config.json implies "
                         f"{list(expect)}; the config does not match the weights")
      sharding = flat_shardings.get(key)
      sharding = sharding.get_value() if hasattr(sharding, "get_value") else sharding
      sharding = sharding or SingleDeviceSharding(jax.devices()[0])

      def read(index, sl=sl, shape=shape, real=real, layout=layout, name=name, file=file):
        def get(window):
          try:
            return np.asarray(sl[window])
          except Exception as e:  # noqa: BLE001 -- safetensors' errors name neither the tensor nor the file
            raise ValueError(f"tensor {name!r} in {file} cannot be read ({e}); the file is damaged") from None

        if real == shape:
          window, fix = _window(index, shape, layout)
          return np.ascontiguousarray(fix(get(window)), dtype=target)
        # padded ("same" / "T" layouts only): read the part inside the checkpoint, zeros beyond it
        spans = [s.indices(n)[:2] for s, n in zip(index, shape)]
        block = np.zeros([b - a for a, b in spans], dtype=target)
        inside = [(a, min(b, r)) for (a, b), r in zip(spans, real)]
        if all(b > a for a, b in inside):
          window, fix = _window(tuple(slice(a, b) for a, b in inside), real, layout)
          block[tuple(slice(0, b - a) for a, b in inside)] = fix(get(window))
        return block

      leaves.append((key, var.replace(jax.make_array_from_callback(shape, sharding, read))))
  return nnx.from_flat_state(leaves), where, used


def is_checkpoint_file(name: str) -> bool:
  """Whether ``name`` is a file an export (or a Hugging Face download) puts in a model directory."""
  return name in ("config.json", INDEX_FILE, *TOKENIZER_FILES) or name.endswith(".safetensors")


def export_kind():
  """An export directory: replaced only when its owner marker proves `export_hf` wrote it (a marker-less
  directory of these files may be a downloaded model: never replaced)."""

  return OutputKind("export", "export directory", is_checkpoint_file,
                    lambda path: "an export without an owner marker looks like a downloaded model")


def _host_value(x: jax.Array) -> np.ndarray:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def _write_tokenizer(tokenizer: Any, out: Path) -> list[str]:
  if isinstance(tokenizer, (str, os.PathLike)):
    src = Path(tokenizer)
    src_dir = src if src.is_dir() else src.parent
    names = [n for n in TOKENIZER_FILES if (src_dir / n).is_file()] if src.is_dir() else [src.name]
    if not names:
      raise FileNotFoundError(f"tokenizer={str(tokenizer)!r} holds none of {TOKENIZER_FILES}")
    for n in names:
      shutil.copyfile(src_dir / n, out / n)
    return names
  if hasattr(tokenizer, "save_pretrained"):  # a transformers tokenizer
    tokenizer.save_pretrained(str(out))
    return sorted(p.name for p in out.iterdir() if p.name in TOKENIZER_FILES)
  hf_tok = getattr(tokenizer, "hf_tokenizer", None)  # meshdistill.data.HFTokenizer
  if hf_tok is not None and hasattr(hf_tok, "save"):
    hf_tok.save(str(out / "tokenizer.json"))
    return ["tokenizer.json"]
  if hasattr(tokenizer, "to_str"):  # a `tokenizers.Tokenizer`
    (out / "tokenizer.json").write_text(tokenizer.to_str())
    return ["tokenizer.json"]
  raise TypeError(
      f"tokenizer of type {type(tokenizer).__name__} cannot be exported; pass a Hugging Face model directory, "
      "a transformers tokenizer or a tokenizers.Tokenizer"
  )


def export_hf(
    model: Decoder,
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    *,
    family: str | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
  """Writes ``model`` as a Hugging Face checkpoint directory loadable by transformers / vLLM / tunix.

  Args:
    model: a `Decoder` (sharded or not; weights are gathered to the host one at a time).
    out_dir: created if needed; receives ``config.json`` and ``model.safetensors``.
    tokenizer: optional; a Hugging Face model directory (its tokenizer files are copied),
      a transformers tokenizer, a `meshdistill.data` HF tokenizer or a `tokenizers.Tokenizer`.
    family: a registered family name (`meshdistill.models.families.names`: ``"llama"``, ``"qwen3"``,
      ``"qwen2"``, ...); default the family of the config's block (qwen3 with ``qk_norm``, qwen2 with
      ``qkv_bias``, else llama).
    dtype: dtype of the written weights: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    overwrite: replace a non-empty ``out_dir`` (only one holding nothing but checkpoint files:
      ``config.json``, ``*.safetensors``, the index, tokenizer files). Without it a non-empty
      ``out_dir`` is an error, raised before anything is written.

  Returns the output directory. In a multi-process run every process must call it; only
  process 0 writes.
  """
  from safetensors.numpy import save_file

  if dtype not in _DTYPES:
    raise ValueError(f"dtype={dtype!r}; choose one of {_DTYPES}")
  cfg: ModelConfig = model.cfg
  fam = families.default_for(cfg) if family is None else families.get(family)
  config = fam.to_hf(cfg, torch_dtype=dtype)
  target = np.dtype(jax.numpy.dtype(dtype))
  tensors = {}
  real = cfg.replace(vocab_multiple=1, replicate_kv=False, scan_layers=False)  # padding rows are not exported
  real_shapes = {k: tuple(v.get_value().shape) for k, v in nnx.to_flat_state(abstract_params(real)[1])}
  for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    stacked = _host_value(var.get_value())
    # scanned blocks: one stacked [L, ...] weight -> L per-layer tensors
    layers = [(("blocks", i, *key[1:]), stacked[i]) for i in range(cfg.n_layers)] if (
        cfg.scan_layers and key[0] == "blocks") else [(key, stacked)]
    for k, value in layers:
      name, transposed = fam.weight_name(k)
      value = value[tuple(slice(0, n) for n in real_shapes[k])]
      tensors[name] = np.ascontiguousarray(value.T if transposed else value, dtype=target)
  out = Path(out_dir)
  if jax.process_index() != 0:
    return out

  check_owned(str(out), export_kind(), overwrite=overwrite, flag="overwrite=True")
  with atomic_output_dir(str(out)) as tmp:  # a tokenizer read from out_dir is copied before out_dir is replaced
    tmp = Path(tmp)
    write_marker(str(tmp), export_kind(), {"architecture": config["architectures"][0], "dtype": dtype})
    save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    written = [] if tokenizer is None else _write_tokenizer(tokenizer, tmp)
  log.info("exported %s (%d tensors%s) to %s", config["architectures"][0], len(tensors),
           f", tokenizer {written}" if written else "", out)
  return out
