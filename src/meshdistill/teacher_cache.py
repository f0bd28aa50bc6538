"""An offline teacher: its top-k per token, computed once, stored compactly, read by `distill`.

`write_cache` runs the teacher over every packed training row (the rows `distill` trains on:
same corpus, tokenizer and ``seq_len``) and stores, per token, the teacher's ``k`` most likely
token ids, their log-probabilities at ``temperature`` and the log-mass of the other tokens (the
tail bin of `meshdistill.losses.topk_divergence`). The cache is indexed by packed row, so any
batch size, seed or number of epochs of a later run reads it (`CachedTeacherData` adds the rows'
teacher top-k to every training batch).

Layout of a cache directory:

* ``shard-00000.safetensors`` ... -- ``rows_per_shard`` rows each: ``ids`` (uint8, every id packed
  into ``ceil(log2 vocab)`` bits, row by row), ``logprobs`` ``[rows, T, K]`` and ``tail`` ``[rows, T]``
  in the cache's precision (``float16``: 2 bytes; ``float32``: exact). Each shard is written to a
  temporary file and renamed, so a shard on disk is whole;
* ``progress-P.json`` -- while writing, one per process ``P``: the settings and that process's
  finished shards (with sizes and SHA-256), rewritten atomically after each shard; a rerun skips
  them (resume after a kill);
* ``manifest.json`` -- written last: teacher (config and a hash of its weights), tokenizer
  fingerprint, data (sources, ``seq_len``, row count, a hash of the packed tokens), ``k``,
  ``temperature``, ``vocab``, ``precision``, the shards and a content hash over them.

At k=32 and V=128k a token costs 32 x 17 bits of ids (68 B) + 32 x 2 B of float16 log-probs +
2 B of tail = 134 B (``benchmarks/teacher_cache.py`` measures it and the error float16 costs).
`write_cache` can split the shards over writers (``i % process_count == process_index``, each with
its own progress file; after a barrier process 0 merges them into the manifest) when each writer
runs its own teacher program. ``meshdistill cache-teacher`` runs as one process: its teacher
program spans the mesh, so the processes of one job could not each compute different shards.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshdistill import losses
from meshdistill.mesh import DATA, host_to_global, param_shardings
from meshdistill.step import TOPK_KEYS

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PRECISIONS = {"float16": np.float16, "float32": np.float32}
MANIFEST = "manifest.json"


def _progress_name(process_index: int) -> str:
  return f"progress-{process_index}.json"


class CacheError(ValueError):
  """A teacher cache that cannot serve this run (other settings, missing or damaged files)."""


# --------------------------------------------------------------------------- the teacher as top-k
@dataclasses.dataclass(frozen=True, kw_only=True)
class TopKTeacher:
  """A teacher known only by its top-k (no weights): what a `Distiller` needs to train from it.

  Attributes:
    cfg: the teacher's `ModelConfig` (vocabulary and length; its weights are not loaded).
    k: tokens kept per position.
    temperature: the temperature its log-probabilities were taken at.
    vocab: the token range ``[0, vocab)`` the top-k was taken over.
    source: where it comes from (a cache directory, a sub-mesh), for messages.
  """

  cfg: Any
  k: int
  temperature: float
  vocab: int
  source: str = "top-k teacher"

  def check_strategy(self, strategy: Any) -> None:
    """Raises a clear error unless ``strategy`` can train from this teacher's top-k alone."""
    from meshdistill.strategies import LogitKD  # pylint: disable=g-import-not-at-top

    if type(strategy) is not LogitKD:  # pylint: disable=unidiomatic-typecheck
      raise ValueError(
          f"{self.source} gives the teacher's top-{self.k} tokens only, but strategy {type(strategy).__name__} needs "
          "a live teacher (its logits, hidden states, attention maps or LM head); use distill.kind=logit_kd with "
          f"distill.top_k <= {self.k}, or a live teacher (remove teacher.cache)"
      )
    if strategy.top_k is None or strategy.top_k > self.k:
      raise ValueError(
          f"{self.source} holds the teacher's top-{self.k}, but LogitKD.top_k={strategy.top_k}; set distill.top_k to "
          f"an integer in [1, {self.k}] (the full-vocabulary loss needs a live teacher)"
      )
    if callable(strategy.temperature) or float(strategy.temperature) != float(self.temperature):
      raise ValueError(
          f"{self.source} holds log-probabilities at temperature {self.temperature}, but LogitKD.temperature="
          f"{strategy.temperature!r}; set distill.temperature={self.temperature} (a constant), or write a cache at "
          "the temperature you want"
      )


def _topk_rows(teacher_params, inputs_BxT, *, teacher_def, k, temperature, vocab):
  """Per-device: the teacher's `TopK` for rows ``inputs_BxT`` (as a live `LogitKD(top_k=k)` computes it)."""
  teacher = nnx.merge(teacher_def, teacher_params)
  logits_BxTxV = jax.lax.stop_gradient(teacher(inputs_BxT).logits)[..., :vocab]

  def one(logits_TxV):
    ids_TxK, logprobs_TxK = losses.teacher_topk(logits_TxV, k, temperature)
    return losses.TopK(ids_TxK, logprobs_TxK, losses.topk_tail(logits_TxV, ids_TxK, temperature))

  return jax.vmap(one)(logits_BxTxV)


class TeacherTopK:
  """A teacher placed on ``mesh`` (or one device) and compiled to return its `TopK` for a batch of rows.

  The program is the one a live top-k step runs for its teacher: `jax.shard_map` manual over ``data``,
  the vocabulary split over ``tensor`` (vocabulary-parallel top-k selection). Calls dispatch
  asynchronously; the result stays on ``mesh``, rows split over ``data``.
  """

  def __init__(self, teacher, *, k: int, temperature: float = 1.0, vocab: int | None = None,
               mesh: Mesh | None = None):
    vocab = teacher.cfg.vocab_size if vocab is None else vocab
    if not 1 <= k <= vocab:
      raise ValueError(f"k={k} must be in [1, {vocab}] (the teacher's vocabulary range)")
    self.cfg, self.k, self.temperature, self.vocab, self.mesh = teacher.cfg, k, float(temperature), vocab, mesh
    graphdef, params = nnx.split(teacher)
    if mesh is None:
      self.params = jax.device_put(params, jax.devices()[0])
    else:
      teacher.cfg.check_tensor_split(mesh.shape["tensor"])
      self.params = jax.device_put(params, param_shardings(nnx.get_partition_spec(params), mesh))
    fn = functools.partial(_topk_rows, teacher_def=graphdef, k=k, temperature=self.temperature, vocab=vocab)
    if mesh is None:
      self._fn = jax.jit(fn)
    else:
      self._fn = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(DATA)), out_specs=P(DATA),
                                       axis_names={DATA}, check_vma=False))

  def __call__(self, inputs_BxT) -> losses.TopK:
    """The teacher's top-k of host or device rows ``[B, T]`` (B a multiple of the mesh's ``data``)."""
    if self.mesh is None:
      inputs_BxT = jax.device_put(inputs_BxT, jax.devices()[0])
    elif not isinstance(inputs_BxT, jax.Array) or inputs_BxT.sharding.mesh != self.mesh:
      inputs_BxT = host_to_global(np.asarray(inputs_BxT), self.mesh)
    return self._fn(self.params, inputs_BxT)

  def spec(self, source: str) -> TopKTeacher:
    return TopKTeacher(cfg=self.cfg, k=self.k, temperature=self.temperature, vocab=self.vocab, source=source)


# --------------------------------------------------------------------------- encoding
def id_bits(vocab: int) -> int:
  """Bits one token id of a ``vocab``-token range needs: ``ceil(log2 vocab)`` (at least 1)."""
  return max(1, math.ceil(math.log2(vocab)))


def pack_ids(ids_NxM: np.ndarray, bits: int) -> np.ndarray:
  """Each row's ids (< 2**bits) as ``bits``-bit fields, big-endian, in ``ceil(M * bits / 8)`` bytes."""
  ids = np.asarray(ids_NxM, np.uint32)
  n, m = ids.shape
  all_bits = np.unpackbits(ids.astype(">u4").view(np.uint8).reshape(n, m, 4), axis=-1)  # [N, M, 32]
  return np.packbits(all_bits[..., 32 - bits:].reshape(n, m * bits), axis=-1)


def unpack_ids(packed_NxB: np.ndarray, bits: int, m: int) -> np.ndarray:
  """The inverse of `pack_ids`: ``[N, m]`` int32."""
  n = packed_NxB.shape[0]
  fields = np.unpackbits(packed_NxB, axis=-1, count=m * bits).reshape(n, m, bits)
  full = np.concatenate([np.zeros((n, m, 32 - bits), np.uint8), fields], axis=-1)
  return np.packbits(full, axis=-1).view(">u4").reshape(n, m).astype(np.int32)


def encode_rows(topk: losses.TopK, bits: int, precision: str) -> dict[str, np.ndarray]:
  """Host arrays of one shard: packed ids, log-probs and tail in ``precision``."""
  ids_NxTxK = np.asarray(topk.indices)
  n, t, k = ids_NxTxK.shape
  dtype = PRECISIONS[precision]
  return {
      "ids": pack_ids(ids_NxTxK.reshape(n, t * k), bits),
      "logprobs": np.asarray(topk.logprobs, np.float32).astype(dtype),
      "tail": np.asarray(topk.tail, np.float32).astype(dtype),
  }


# --------------------------------------------------------------------------- identity
def weights_hash(params: Any) -> str:
  """SHA-256 over a parameter tree's paths, dtypes, shapes and values (names a teacher's weights)."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    x = np.asarray(jax.device_get(leaf))
    h.update(f"{jax.tree_util.keystr(path)}:{x.dtype}:{x.shape}".encode())
    h.update(np.ascontiguousarray(x).tobytes())
  return h.hexdigest()


def teacher_identity(teacher) -> dict:
  """What names a teacher `Decoder`: its config and `weights_hash`."""
  return {"config": dataclasses.asdict(teacher.cfg), "weights_sha256": weights_hash(nnx.state(teacher))}


def data_identity(packed, tokenizer, sources: Any = None) -> dict:
  """What names the training rows: their packed tokens' hash, ``seq_len``, row count, tokenizer, sources."""
  h = hashlib.sha256(np.ascontiguousarray(packed.tokens).tobytes())
  h.update(f"{packed.seq_len}:{packed.pad_id}".encode())
  return {
      "tokens_sha256": h.hexdigest(),
      "seq_len": int(packed.seq_len),
      "rows": len(packed),
      "tokenizer": tokenizer.fingerprint,
      "sources": None if sources is None else list(sources) if isinstance(sources, (list, tuple)) else [sources],
  }


def _file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _write_json(path: str, obj: dict) -> None:
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


# --------------------------------------------------------------------------- writing
def write_cache(
    teacher_topk: TeacherTopK,
    packed,
    out: str,
    *,
    identity: dict,
    precision: str = "float16",
    rows_per_shard: int = 1024,
    batch_size: int = 8,
    process_index: int = 0,
    process_count: int = 1,
    stop_after_shards: int | None = None,
    barrier: Any = None,
) -> dict:
  """Writes (or finishes) the top-k cache of ``teacher_topk`` over all rows of ``packed`` into ``out``.

  Args:
    teacher_topk: the placed, compiled teacher (`TeacherTopK`).
    packed: the training rows (`meshdistill.data.PackedSequences`).
    out: the cache directory (created).
    identity: ``{"teacher": ..., "data": ...}`` naming the teacher (`weights_hash`, config) and the
      data (`data_identity`); stored in the manifest, and a rerun must match it.
    precision: ``float16`` (compact) or ``float32`` (exact log-probabilities).
    rows_per_shard: rows per shard file; batch_size: rows per teacher call (a multiple of ``data``).
    process_index, process_count: this process's shards (``i % process_count == process_index``).
    stop_after_shards: stop after writing this many shards (as if killed; for tests).
    barrier: with several processes, a function every process calls after its shards (a sync point).

  Returns:
    The manifest (``{}`` when stopped early, or when another process still has shards to write).

  Raises:
    CacheError: ``out`` holds a cache (finished or not) of other settings.
  """
  if precision not in PRECISIONS:
    raise ValueError(f"precision={precision!r}; choose one of {sorted(PRECISIONS)}")
  for name, v in (("rows_per_shard", rows_per_shard), ("batch_size", batch_size)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"{name}={v!r} must be a positive integer")
  n, seq_len = len(packed), packed.seq_len
  settings = {
      "format": FORMAT_VERSION, **identity, "k": teacher_topk.k, "temperature": teacher_topk.temperature,
      "vocab": teacher_topk.vocab, "id_bits": id_bits(teacher_topk.vocab), "precision": precision,
      "rows": n, "seq_len": seq_len, "rows_per_shard": rows_per_shard,
  }
  settings = json.loads(json.dumps(settings))  # as it reads back from JSON
  os.makedirs(out, exist_ok=True)
  done = _read_json(os.path.join(out, MANIFEST))
  if done is not None:
    _check_same(done, settings, out)
    log.info("teacher cache %s is complete (%d shards); nothing to do", out, len(done["shards"]))
    return done
  progress_path = os.path.join(out, _progress_name(process_index))
  progress = _read_json(progress_path)
  if progress is not None:
    _check_same(progress["settings"], settings, out)
  else:
    progress = {"settings": settings, "shards": {}}
  n_shards = -(-n // rows_per_shard)
  bits = settings["id_bits"]
  written = 0
  t0 = time.perf_counter()
  for i in range(process_index, n_shards, process_count):
    name = f"shard-{i:05d}.safetensors"
    path = os.path.join(out, name)
    entry = progress["shards"].get(name)
    if entry is not None and os.path.isfile(path) and os.path.getsize(path) == entry["bytes"]:
      continue  # finished before an interruption
    if stop_after_shards is not None and written >= stop_after_shards:
      log.info("teacher cache: stopping after %d shards (as asked)", written)
      return {}
    lo, hi = i * rows_per_shard, min((i + 1) * rows_per_shard, n)
    arrays = encode_rows(_teacher_rows(teacher_topk, packed, lo, hi, batch_size), bits, precision)
    _save_shard(path, arrays)
    progress["shards"][name] = {"rows": [lo, hi], "bytes": os.path.getsize(path), "sha256": _file_sha256(path)}
    _write_json(progress_path, progress)
    written += 1
  log.info("teacher cache: wrote %d shards in %.1fs", written, time.perf_counter() - t0)
  if process_count > 1 and barrier is not None:
    barrier()
  if process_index != 0:
    return {}
  finished = {}
  for p in range(process_count):
    part = _read_json(os.path.join(out, _progress_name(p)))
    finished.update({} if part is None else part["shards"])
  missing = [i for i in range(n_shards) if f"shard-{i:05d}.safetensors" not in finished]
  if missing:
    log.info("teacher cache: %d shards still missing (other processes); rerun to finish", len(missing))
    return {}
  shards = [{"name": f"shard-{i:05d}.safetensors", **finished[f"shard-{i:05d}.safetensors"]} for i in range(n_shards)]
  content = hashlib.sha256("".join(s["sha256"] for s in shards).encode()).hexdigest()
  manifest = {**settings, "shards": shards, "content_sha256": content}
  _write_json(os.path.join(out, MANIFEST), manifest)
  for p in range(process_count):
    if os.path.isfile(os.path.join(out, _progress_name(p))):
      os.remove(os.path.join(out, _progress_name(p)))
  return manifest


def _teacher_rows(teacher_topk: TeacherTopK, packed, lo: int, hi: int, batch_size: int) -> losses.TopK:
  """The teacher's top-k of rows ``[lo, hi)``, host arrays; the last batch is filled with repeated rows."""
  parts = []
  for a in range(lo, hi, batch_size):
    idx = np.arange(a, a + batch_size)
    idx = np.minimum(idx, hi - 1)
    out = teacher_topk(packed.rows(idx)["inputs"])
    parts.append(jax.tree.map(lambda x, m=min(batch_size, hi - a): np.asarray(jax.device_get(x))[:m], out))
  return losses.TopK(*(np.concatenate(xs) for xs in zip(*parts)))


def _save_shard(path: str, arrays: dict[str, np.ndarray]) -> None:
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
  os.close(fd)
  try:
    save_file(arrays, tmp, metadata={"format": str(FORMAT_VERSION)})
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _check_same(saved: dict, now: dict, where: str) -> None:
  """Raises `CacheError` naming the first setting in which ``saved`` differs from ``now``."""
  for key, value in now.items():
    if saved.get(key) != value:
      detail = _first_difference(key, saved.get(key), value)
      raise CacheError(
          f"the teacher cache in {where} was made with other settings ({detail}); use a fresh cache directory, "
          "or the teacher, tokenizer, data and top-k settings that wrote it"
      )


def _first_difference(key: str, a: Any, b: Any) -> str:
  if isinstance(a, dict) and isinstance(b, dict):
    for k in [*b, *(k for k in a if k not in b)]:
      if a.get(k) != b.get(k):
        return _first_difference(f"{key}.{k}", a.get(k), b.get(k))
  return f"{key}: cache {a!r}, this run {b!r}"


# --------------------------------------------------------------------------- reading
class TeacherCache:
  """A finished cache directory, opened for reading (its shards checked for size; ``verify`` hashes them).

  Raises:
    CacheError: no manifest (an unfinished cache: rerun ``meshdistill cache-teacher``), a missing or
      truncated shard, or (``verify``) a shard whose content changed.
  """

  def __init__(self, path: str, *, verify: bool = False):
    self.path = os.path.abspath(os.path.expanduser(path))
    manifest = _read_json(os.path.join(self.path, MANIFEST))
    if manifest is None:
      unfinished = any(n.startswith("progress-") for n in os.listdir(self.path)) if os.path.isdir(self.path) else False
      raise CacheError(
          f"teacher.cache={path!r} is " + ("an unfinished teacher cache (progress files, no manifest.json); rerun "
                                          "`meshdistill cache-teacher` with the same settings to finish it"
                                          if unfinished else "not a teacher cache (no manifest.json); write one "
                                          "with `meshdistill cache-teacher --out PATH`")
      )
    if manifest.get("format") != FORMAT_VERSION:
      raise CacheError(f"teacher.cache={path!r} has format {manifest.get('format')!r}; this version reads "
                       f"{FORMAT_VERSION}: rewrite it with `meshdistill cache-teacher`")
    self.manifest = manifest
    for shard in manifest["shards"]:
      file = os.path.join(self.path, shard["name"])
      size = os.path.getsize(file) if os.path.isfile(file) else None
      if size != shard["bytes"]:
        what = "is missing" if size is None else f"has {size} bytes, the manifest says {shard['bytes']} (truncated?)"
        raise CacheError(f"teacher cache shard {file} {what}; rerun `meshdistill cache-teacher` into a fresh "
                         "directory (or restore the file)")
      if verify and _file_sha256(file) != shard["sha256"]:
        raise CacheError(f"teacher cache shard {file} does not match its SHA-256 in the manifest (damaged); "
                         "rewrite the cache")
    self.k, self.seq_len, self.num_rows = manifest["k"], manifest["seq_len"], manifest["rows"]
    self._handles: dict[int, Any] = {}

  def spec(self) -> TopKTeacher:
    """The teacher as a `TopKTeacher` (for `meshdistill.Distiller`)."""
    from meshdistill.models import ModelConfig  # pylint: disable=g-import-not-at-top

    m = self.manifest
    return TopKTeacher(cfg=ModelConfig(**m["teacher"]["config"]), k=m["k"], temperature=m["temperature"],
                       vocab=m["vocab"], source=f"teacher cache {self.path}")

  def check(self, *, data: dict | None = None, teacher: dict | None = None, vocab: int | None = None) -> None:
    """Raises `CacheError` naming the setting when the cache was made for other data, teacher or vocabulary.

    ``data``: `data_identity` of this run's rows; ``teacher``: the part of the manifest's ``teacher``
    entry to compare (e.g. ``{"config": ...}``); ``vocab``: the student's vocabulary size.
    """
    where = f"teacher.cache={self.path}"
    if data is not None:
      saved = {k: v for k, v in self.manifest["data"].items() if k != "sources"}
      now = {k: v for k, v in data.items() if k != "sources"}
      if saved.get("tokenizer") != now.get("tokenizer"):
        raise CacheError(f"{where} was made with another tokenizer (fingerprint {saved.get('tokenizer')!r}, this run "
                         f"{now.get('tokenizer')!r}); set data.tokenizer as when the cache was written, or rewrite it")
      _check_same({"data": saved}, {"data": now}, where)
    if teacher is not None:
      _check_same({"teacher": {k: self.manifest["teacher"].get(k) for k in teacher}}, {"teacher": teacher}, where)
    if vocab is not None and self.manifest["vocab"] > vocab:
      raise CacheError(f"{where} holds top-k ids over a vocabulary of {self.manifest['vocab']} tokens, but the "
                       f"student's vocab_size is {vocab}; distil into a student with vocab_size >= "
                       f"{self.manifest['vocab']} (the same tokenizer), or rewrite the cache for this vocabulary")

  def _shard(self, i: int):
    if i not in self._handles:
      from safetensors import safe_open  # pylint: disable=g-import-not-at-top

      self._handles[i] = safe_open(os.path.join(self.path, self.manifest["shards"][i]["name"]), framework="numpy")
    return self._handles[i]

  def rows(self, row_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The teacher top-k of packed rows ``row_ids`` [N]: `TOPK_KEYS` -> ids / log-probs ``[N, T, K]``
    (int32 / float32) and tail ``[N, T]`` float32."""
    row_ids = np.asarray(row_ids, np.int64).reshape(-1)
    if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= self.num_rows):
      raise CacheError(f"rows {row_ids.min()}..{row_ids.max()} asked of teacher cache {self.path}, which holds "
                       f"{self.num_rows} rows; the data is not the data the cache was made from")
    r, t, k, bits = self.manifest["rows_per_shard"], self.seq_len, self.k, self.manifest["id_bits"]
    ids, logprobs, tail = [], [], []
    for row in row_ids:
      f, j = self._shard(int(row) // r), int(row) % r
      ids.append(unpack_ids(f.get_slice("ids")[j:j + 1], bits, t * k).reshape(t, k))
      logprobs.append(f.get_slice("logprobs")[j:j + 1][0].astype(np.float32))
      tail.append(f.get_slice("tail")[j:j + 1][0].astype(np.float32))
    return dict(zip(TOPK_KEYS, (np.stack(ids), np.stack(logprobs), np.stack(tail))))

  def bytes_per_token(self) -> float:
    """Bytes of shard files per cached token (headers included)."""
    return sum(s["bytes"] for s in self.manifest["shards"]) / (self.num_rows * self.seq_len)


class CachedTeacherData:
  """A `meshdistill.data.DataBundle` whose training batches also carry the teacher's top-k from a cache.

  Everything else (validation batches, tokenizer, stats, iterator state) is the bundle's; the iterator's
  state is the bundle iterator's, so checkpoints and resume work unchanged.
  """

  def __init__(self, bundle, cache: TeacherCache):
    self.bundle, self.cache = bundle, cache

  def __getattr__(self, name):
    return getattr(self.bundle, name)

  def train_iterator(self, state: dict | None = None, **kw) -> _CachedIterator:
    return _CachedIterator(self.bundle.train_iterator(state, row_ids=True, **kw), self.cache)


class _CachedIterator:
  def __init__(self, it, cache: TeacherCache):
    self._it, self._cache = it, cache

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = dict(next(self._it))
    batch.update(self._cache.rows(batch.pop("row_ids")))
    return batch

  def get_state(self):
    return self._it.get_state()

  def set_state(self, state):
    self._it.set_state(state)

  def close(self):
    self._it.close()
