"""Hugging Face safetensors checkpoints straight onto the mesh, and back out.

`load_hf(path, mesh)` reads a local Hugging Face directory (``config.json`` plus
``model.safetensors``, or sharded ``model-0000x-of-0000n.safetensors`` with
``model.safetensors.index.json``) of a causal LM of a registered family (Llama, Qwen3, Qwen2, Mistral,
Gemma 2, Gemma 3 text, Qwen3-MoE, Mixtral: `meshdistill.models.families`) into the built-in `Decoder`, its weights split over the mesh
axis ``tensor`` exactly as `init_model` would split them. Every device reads only its own
slice of each tensor from disk (``safe_open(...).get_slice(name)[...]`` inside
`jax.make_array_from_callback`), so no device and no host buffer ever holds a full
tensor-split weight.

`export_hf(model, out_dir)` writes a decoder as a checkpoint that transformers (and so
vLLM) loads: ``config.json``, ``model.safetensors`` and, when given, tokenizer files. It writes
into a fresh temporary sibling and renames it into place (`meshdistill.core.fsutil.atomic_output_dir`):
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

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshdistill.core.fsutil import atomic_output_dir, read_json
from meshdistill.core.ownership import OutputKind, check_owned, write_marker
from meshdistill.parallel.rules import split_ways
from meshdistill.models._build import abstract_params
from meshdistill.models import families
from meshdistill.models._hf_config import SUPPORTED, config_from_hf, hf_config
from meshdistill.models.families._moe import EXPERT
from meshdistill.models._safetensors import INDEX_FILE, SINGLE_FILE, read_onto_mesh, transposed
from meshdistill.models.decoder import Decoder, ModelConfig
from meshdistill.models.stacking import to_scanned

log = logging.getLogger(__name__)

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


def load_hf(
    path: str | os.PathLike,
    mesh: Mesh | None = None,
    *,
    dtype: str = "auto",
    param_dtype: str = "auto",
    max_len: int | None = None,
    scan_layers: bool | str = "auto",
) -> Decoder:
  """Loads a Hugging Face causal-LM directory of a registered family (Llama, Qwen3, Qwen2, Qwen3-MoE, Mixtral) into a
  `Decoder`.

  Args:
    path: local directory with ``config.json`` and safetensors weights (single file or
      sharded with ``model.safetensors.index.json``).
    mesh: a ``(data, tensor)`` mesh; each weight is created split over ``tensor`` and
      replicated over ``data``, each device reading only its slice from disk. ``None``:
      one device.
    dtype: compute dtype of activations (`ModelConfig.dtype`; ``auto``: bfloat16 on a TPU, float32 elsewhere).
    param_dtype: dtype the weights are stored in on device (`ModelConfig.param_dtype` of the returned model):
      ``"float32"``, or ``"bfloat16"`` / ``"float16"`` for a frozen teacher (half the memory); ``auto``: float32,
      and a `Distiller` stores its teacher in the teacher's compute dtype (`ModelConfig.frozen`).
    max_len: longest sequence the model accepts (default ``max_position_embeddings``).
    scan_layers: stack the blocks for ``nnx.scan`` (`ModelConfig.scan_layers`; ``auto``: on an accelerator, as
      ``mesh``'s devices or the default backend say); the layers are read one by one as usual and then stacked, so
      the device briefly holds the block weights twice.

  Raises:
    FileNotFoundError: a missing ``config.json`` or shard file (named).
    ValueError: unsupported architecture, or a tensor whose shape disagrees with
      ``config.json`` (names the tensor, the file and both shapes), or a missing tensor.
  """
  path = Path(path)
  model, extra = read_checkpoint(path, mesh, dtype=dtype, param_dtype=param_dtype, max_len=max_len)
  if extra:
    ignorable = {"lm_head.weight"} if model.cfg.tie_embeddings else set()
    odd = [n for n in extra if n not in ignorable and not n.endswith("rotary_emb.inv_freq")]
    if odd:
      log.warning("%s: %d tensors not used by the decoder: %s", path, len(odd), odd[:8])
  return to_scanned(model) if model.cfg.replace(scan_layers=scan_layers).with_scan_on(mesh).scan_layers else model


def read_checkpoint(path: str | os.PathLike, mesh: Mesh | None = None, *, dtype: str = "auto",
                    param_dtype: str = "auto", max_len: int | None = None,
                    file: str = SINGLE_FILE) -> tuple[Decoder, list[str]]:
  """(the unrolled `Decoder` of the checkpoint at ``path``, the names of its tensors no parameter read) -- `load_hf`
  without its warnings; ``file``: the single safetensors file (when there is no index). Every tensor is read as
  ``param_dtype``, whatever its stored dtype."""
  path = Path(path)
  if param_dtype not in _DTYPES + ("auto",):
    raise ValueError(f"param_dtype={param_dtype!r}; choose one of {_DTYPES + ('auto',)}")
  hf, config_file = read_hf_config(path), str(path / "config.json")
  family = families.family_for(hf, config_file)
  cfg = family.from_hf(hf, max_len=max_len, dtype=dtype, where=config_file)
  # the model's config says how its weights are stored; read per layer (`load_hf` stacks them when asked to)
  cfg = cfg.replace(param_dtype=param_dtype, scan_layers=False)
  real_shapes = None
  if mesh is not None:  # a vocabulary `tensor` does not divide gets zero padding rows, not read from disk
    fitted = cfg.for_tensor(split_ways(mesh, "vocab"))
    if fitted.padded_vocab != cfg.padded_vocab:
      real_shapes = {k: tuple(v.get_value().shape) for k, v in nnx.to_flat_state(abstract_params(cfg)[1])}
    cfg = fitted
  graphdef, abstract, shardings = abstract_params(cfg, mesh)
  state, where, used = read_onto_mesh(path, abstract, shardings, _layouts(family), cfg.weight_dtype.name, real_shapes,
                                      file)
  log.info("loaded %d layers, d_model=%d, vocab %d from %s", cfg.n_layers, cfg.d_model, cfg.vocab_size, path)
  return nnx.merge(graphdef, state), sorted(set(where) - used)


def _layouts(family: families.Family):
  """``key -> (Hugging Face name, layout)`` of ``family``'s weight-name map (see `read_onto_mesh`)."""

  def names(key: tuple) -> tuple[str, str]:
    name, transposed = family.weight_name(key)
    layout = "T" if transposed else "same"
    return name, (f"experts_{layout}" if EXPERT in name else layout)

  return names


def is_checkpoint_file(name: str) -> bool:
  """Whether ``name`` is a file an export (or a Hugging Face download) puts in a model directory."""
  return name in ("config.json", INDEX_FILE, *TOKENIZER_FILES) or name.endswith(".safetensors")


def export_kind():
  """An export directory: replaced only when its owner marker proves `export_hf` wrote it (a marker-less
  directory of these files may be a downloaded model: never replaced)."""

  return OutputKind("export", "export directory", is_checkpoint_file,
                    lambda path: "an export without an owner marker looks like a downloaded model")


def host_value(x: jax.Array) -> np.ndarray:
  """``x`` whole on the host (gathered from every process in a multi-process run)."""
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
  if dtype not in _DTYPES:
    raise ValueError(f"dtype={dtype!r}; choose one of {_DTYPES}")
  fam = families.default_for(model.cfg) if family is None else families.get(family)
  config = fam.to_hf(model.cfg, torch_dtype=dtype)
  tensors = hf_tensors(model, fam, dtype)
  return write_checkpoint(out_dir, tensors, config, tokenizer, overwrite=overwrite,
                          identity={"architecture": config["architectures"][0], "dtype": dtype})


def hf_tensors(model: Decoder, fam: families.Family, dtype: str = "float32") -> dict[str, np.ndarray]:
  """``{Hugging Face name: host array in dtype}`` of every parameter of ``model`` as ``fam`` names it: scanned
  blocks one tensor per layer, stacked experts one per expert, vocabulary padding and replicated key/value heads
  cut off (the checkpoint's shapes)."""
  cfg: ModelConfig = model.cfg
  target = np.dtype(jax.numpy.dtype(dtype))
  tensors = {}
  real = cfg.replace(vocab_multiple=1, replicate_kv=False, scan_layers=False)  # padding rows are not exported
  real_shapes = {k: tuple(v.get_value().shape) for k, v in nnx.to_flat_state(abstract_params(real)[1])}
  for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    stacked = host_value(var.get_value())
    # scanned blocks: one stacked [L, ...] weight -> L per-layer tensors
    layers = [(("blocks", i, *key[1:]), stacked[i]) for i in range(cfg.n_layers)] if (
        cfg.scan_layers and key[0] == "blocks") else [(key, stacked)]
    for k, value in layers:
      name, flip = fam.weight_name(k)
      value = value[tuple(slice(0, n) for n in real_shapes[k])]
      # a stacked expert weight [E, ...] -> one tensor per expert
      per_tensor = [(name.format(e=e), value[e]) for e in range(value.shape[0])] if EXPERT in name else [(name, value)]
      for one, v in per_tensor:
        tensors[one] = np.ascontiguousarray(transposed(v) if flip else v, dtype=target)
  return tensors


def write_checkpoint(out_dir: str | os.PathLike, tensors: dict[str, np.ndarray], config: dict, tokenizer: Any = None,
                     *, overwrite: bool = False, identity: dict | None = None, file: str = SINGLE_FILE,
                     metadata: dict[str, str] | None = None, save_file=None) -> Path:
  """Writes ``config.json``, ``tensors`` into ``file`` (safetensors, with ``metadata``; default ``{"format": "pt"}``)
  and the tokenizer files into ``out_dir``, atomically, with an export's owner marker (``identity`` in it); a
  non-empty ``out_dir`` only with ``overwrite`` and only when an export wrote it. Only process 0 writes.
  ``save_file(tensors, path, metadata=)``: the safetensors writer (default: safetensors' numpy one; tensors of a
  dtype numpy lacks, float8, need safetensors' torch one)."""
  if save_file is None:
    from safetensors.numpy import save_file

  out = Path(out_dir)
  if jax.process_index() != 0:
    return out

  check_owned(str(out), export_kind(), overwrite=overwrite, flag="overwrite=True")
  with atomic_output_dir(str(out)) as tmp:  # a tokenizer read from out_dir is copied before out_dir is replaced
    tmp = Path(tmp)
    write_marker(str(tmp), export_kind(), identity)
    save_file(tensors, str(tmp / file), metadata=metadata or {"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    written = [] if tokenizer is None else _write_tokenizer(tokenizer, tmp)
  log.info("exported %s (%d tensors%s) to %s", config["architectures"][0], len(tensors),
           f", tokenizer {written}" if written else "", out)
  return out
