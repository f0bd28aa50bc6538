"""Safetensors files onto the mesh: `read_onto_mesh` fills an abstract NNX state from a Hugging Face directory,
each device reading only its own window of each tensor (``safe_open(...).get_slice(name)[...]`` inside
`jax.make_array_from_callback`); `weight_map` lists which file holds which tensor (single file or index).

Reading is defensive: a malformed index or safetensors file is reported with its path, and an index whose
``weight_map`` names a file outside the model directory (an absolute path, ``..``) is refused. Files are opened
through links, as the Hugging Face hub cache's ``snapshots/<rev>/*`` (links to ``../../blobs/``) need.
Used by `meshdistill.models.hf` (the built-in decoder) and `meshdistill.models.tunix_adapter`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from meshdistill.core.fsutil import read_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


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


def weight_map(path: Path, file: str = SINGLE_FILE) -> dict[str, Path]:
  """Tensor name -> safetensors file, from the index or the single ``file``."""
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
  single = path / file
  if single.is_file():
    with _safe_open(single) as f:
      return {n: single for n in f.keys()}
  raise FileNotFoundError(f"{path} holds neither {file} nor {INDEX_FILE}")


def _hf_shape(shape: tuple, layout: str) -> tuple:
  """The Hugging Face shape of a weight of ``shape`` stored in ``layout`` (see `read_onto_mesh`)."""
  if layout.startswith("experts_"):  # [E, ...] <- E tensors of one expert each
    return _hf_shape(shape[1:], layout[len("experts_"):])
  if layout == "same":
    return shape
  if layout == "T":
    return shape[::-1]
  if layout == "in_heads":  # [D, N, H] <- [N*H, D]
    return (shape[1] * shape[2], shape[0])
  if layout == "out_heads":  # [N, H, D] <- [D, N*H]
    return (shape[2], shape[0] * shape[1])
  raise ValueError(f"unknown layout {layout!r}")


# the side of the square tiles `transposed` copies: a tile of each array stays in the CPU's cache
TILE = 256


def transposed(b: np.ndarray) -> np.ndarray:
  """``b.T`` of a 2-D block as a new contiguous array, copied tile by tile. numpy copies a whole transposed view
  element by element across rows, which leaves the cache on every element: on a 6144 x 2048 bfloat16 weight about
  five times slower than the tiles."""
  n, m = b.shape
  out = np.empty((m, n), b.dtype)
  for i in range(0, n, TILE):
    for j in range(0, m, TILE):
      out[j:j + TILE, i:i + TILE] = b[i:i + TILE, j:j + TILE].T
  return out


def _window(index: tuple, shape: tuple, layout: str):
  """(Hugging Face window, fix(block) -> our block) for the device-local ``index`` into ``shape``."""
  if layout == "same":
    return tuple(index), lambda b: b
  if layout == "T":
    return tuple(index[::-1]), transposed
  heads, hd = (shape[1], shape[2]) if layout == "in_heads" else (shape[0], shape[1])
  s_n = index[1] if layout == "in_heads" else index[0]
  n0, n1, _ = s_n.indices(heads)
  rows = slice(n0 * hd, n1 * hd)  # head-dim axis is never split, so the window is contiguous
  if layout == "in_heads":
    return (rows, index[0]), lambda b: transposed(b).reshape(b.shape[1], n1 - n0, hd)
  return (index[2], rows), lambda b: transposed(b).reshape(n1 - n0, hd, b.shape[0])


def read_onto_mesh(path: str | os.PathLike, abstract: nnx.State, shardings: Any, names, param_dtype: str = "float32",
                   real_shapes: dict | None = None, file: str = SINGLE_FILE):
  """Fills an abstract NNX state from a Hugging Face directory, each device reading only its window.

  ``names(key) -> (hf_name, layout)`` for every parameter path; layout ``"same"``, ``"T"``
  (HF [out, in] -> [in, out]), ``"in_heads"`` (HF [N*H, D] -> [D, N, H]) or ``"out_heads"``
  (HF [D, N*H] -> [N, H, D]), or ``"experts_same"`` / ``"experts_T"``: a stacked ``[E, ...]`` weight whose
  ``hf_name`` holds ``{e}`` for the expert index, each expert a tensor of its own in the first two layouts. ``shardings``: a state of `NamedSharding` like ``abstract``
  or ``None`` (one device). ``real_shapes``: parameter path -> the checkpoint's shape (in our
  layout) where ``abstract`` is larger (vocabulary padding): the extra rows are zeros, never read. ``file``: the
  single safetensors file read when there is no index.
  Returns ``(state, weight_map, used_names)``.
  """
  path = Path(path)
  where = weight_map(path, file)
  flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  target = np.dtype(jax.numpy.dtype(param_dtype))
  used = set()
  leaves = []
  with contextlib.ExitStack() as stack:
    handles: dict[Path, Any] = {}
    for key, var in nnx.to_flat_state(abstract):
      name, layout = names(key)
      shape = tuple(var.get_value().shape)
      if layout.startswith("experts_"):
        sharding = flat_shardings.get(key)
        sharding = sharding.get_value() if hasattr(sharding, "get_value") else sharding
        value = _read_experts(path, where, handles, stack, name, layout, shape, sharding, target)
        used.update(name.format(e=e) for e in range(shape[0]))
        leaves.append((key, var.replace(value)))
        continue
      if name not in where:
        raise ValueError(f"tensor {name!r} (for {'.'.join(map(str, key))}) is not in the checkpoint at {path}; "
                         f"config.json describes a model that needs it")
      used.add(name)
      file = where[name]
      if file not in handles:
        handles[file] = stack.enter_context(_safe_open(file))
      sl = handles[file].get_slice(name)
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


def _read_experts(path: Path, where: dict, handles: dict, stack, name: str, layout: str, shape: tuple, sharding,
                  target) -> jax.Array:
  """A stacked expert weight ``[E, ...]`` from the ``E`` tensors ``name.format(e=...)``, each device reading the
  experts and the window of its shard only."""
  inner = layout[len("experts_"):]
  slices = []
  for e in range(shape[0]):
    one = name.format(e=e)
    if one not in where:
      raise ValueError(f"tensor {one!r} is not in the checkpoint at {path}; config.json describes {shape[0]} experts")
    if where[one] not in handles:
      handles[where[one]] = stack.enter_context(_safe_open(where[one]))
    sl = handles[where[one]].get_slice(one)
    if tuple(sl.get_shape()) != _hf_shape(shape[1:], inner):
      raise ValueError(f"tensor {one!r} in {where[one].name} has shape {list(sl.get_shape())} but config.json implies "
                       f"{list(_hf_shape(shape[1:], inner))}; the config does not match the weights")
    slices.append(sl)

  def read(index):
    window, fix = _window(tuple(index[1:]), shape[1:], inner)
    return np.stack([np.asarray(fix(np.asarray(slices[e][window])), dtype=target)
                     for e in range(*index[0].indices(shape[0]))])

  return jax.make_array_from_callback(shape, sharding or SingleDeviceSharding(jax.devices()[0]), read)
