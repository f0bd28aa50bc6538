"""The teacher cache's storage format: bit-packed ids, shard and JSON files, settings checks, and reading a
finished cache (`TeacherCache`, `CachedTeacherData`). The layout of a cache directory is described in
`meshdistill.teachers.cache`."""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import numpy as np

from meshdistill import losses
from meshdistill.core.batch import TARGET_LOGPROB_KEY, TOPK_KEYS
from meshdistill.data import WrappedData
from meshdistill.train.teacher import TopKTeacher
from meshdistill.models import ModelConfig
from meshdistill.core.fsutil import write_file_atomic, write_text_atomic

FORMAT_VERSION = 2  # 2: the manifest names the teacher tokenizer; a cross-tokenizer cache's rows (``cross``)
READABLE_FORMATS = (1, 2)  # 1: a cache of one tokenizer's rows, written before the teacher tokenizer was named
PRECISIONS = {"float16": np.float16, "float32": np.float32}
MANIFEST = "manifest.json"


def _progress_name(process_index: int) -> str:
  return f"progress-{process_index}.json"


class CacheError(ValueError):
  """A teacher cache that cannot serve this run (other settings, missing or damaged files)."""


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


def encode_rows(topk: losses.TopK, bits: int, precision: str,
                teacher_rows: dict | None = None) -> dict[str, np.ndarray]:
  """Host arrays of one shard: packed ids, log-probs and tail in ``precision``; with ``teacher_rows`` (a
  cross-tokenizer cache) also `CROSS_ARRAYS`: the rows' teacher tokens and byte end offsets (int32) and each
  position's target log-probability (``precision``)."""
  ids_NxTxK = np.asarray(topk.indices)
  n, t, k = ids_NxTxK.shape
  dtype = PRECISIONS[precision]
  out = {
      "ids": pack_ids(ids_NxTxK.reshape(n, t * k), bits),
      "logprobs": np.asarray(topk.logprobs, np.float32).astype(dtype),
      "tail": np.asarray(topk.tail, np.float32).astype(dtype),
  }
  if teacher_rows is not None:
    out |= {"tokens": np.asarray(teacher_rows["teacher_tokens"], np.int32),
            "ends": np.asarray(teacher_rows["teacher_ends"], np.int32),
            "target_logprobs": np.asarray(teacher_rows[TARGET_LOGPROB_KEY], np.float32).astype(dtype)}
  return out


# A cross-tokenizer shard's arrays beside the top-k, and the batch keys they are read into.
CROSS_ARRAYS = {"tokens": "teacher_tokens", "ends": "teacher_ends", "target_logprobs": TARGET_LOGPROB_KEY}


# --------------------------------------------------------------------------- files
def _file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _write_json(path: str, obj: dict) -> None:
  write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


def _read_json(path: str) -> dict | None:
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _save_shard(path: str, arrays: dict[str, np.ndarray]) -> None:
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  write_file_atomic(path, lambda tmp: save_file(arrays, tmp, metadata={"format": str(FORMAT_VERSION)}))


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
# the manifest entries `TeacherCache` reads: key -> JSON type
_MANIFEST_KEYS = {"k": int, "seq_len": int, "rows": int, "rows_per_shard": int, "id_bits": int, "vocab": int,
                  "temperature": (int, float), "precision": str, "teacher": dict, "data": dict, "shards": list}
_REBUILD = "rebuild the cache with `meshdistill cache-teacher --out DIR` into a fresh directory"


def _read_manifest(path: str, given: str) -> dict | None:
  """The manifest of the cache directory ``path`` (None when it has none), checked for the entries it must hold;
  `CacheError` naming the file otherwise. ``given``: the directory as the user named it."""
  file = os.path.join(path, MANIFEST)
  if not os.path.isfile(file):
    return None
  try:
    with open(file, encoding="utf-8") as f:
      manifest = json.load(f)
  except (ValueError, OSError) as e:  # JSON or UTF-8 errors
    raise CacheError(f"teacher.cache={given!r}: {file} cannot be read as JSON ({e}); {_REBUILD}") from None
  if not isinstance(manifest, dict):
    raise CacheError(f"teacher.cache={given!r}: {file} holds a {type(manifest).__name__}, not the JSON object of a "
                     f"teacher cache manifest; {_REBUILD}")
  if manifest.get("format") not in READABLE_FORMATS:
    raise CacheError(f"teacher.cache={given!r} has format {manifest.get('format')!r}; this version reads "
                     f"{list(READABLE_FORMATS)}: rewrite it with `meshdistill cache-teacher`")
  for key, kind in _MANIFEST_KEYS.items():
    if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
      what = "has no" if key not in manifest else f"has a {type(manifest[key]).__name__} as its"
      raise CacheError(f"teacher.cache={given!r}: {file} {what} {key!r} entry (damaged or not written by "
                       f"`meshdistill cache-teacher`); {_REBUILD}")
  problem = _manifest_values(manifest)
  if problem:
    raise CacheError(f"teacher.cache={given!r}: {file} has {problem} (damaged or not written by `meshdistill "
                     f"cache-teacher`); {_REBUILD}")
  for shard in manifest["shards"]:
    name = shard.get("name") if isinstance(shard, dict) else None
    if not (isinstance(name, str) and name and name == os.path.basename(name) and name not in (".", "..")):
      raise CacheError(f"teacher.cache={given!r}: {file} lists shard {name if name is not None else shard!r}, "
                       f"which is not a file name inside {path} (shards are plain file names there); {_REBUILD}")
    if not (isinstance(shard.get("bytes"), int) and shard["bytes"] >= 0 and isinstance(shard.get("sha256"), str)):
      raise CacheError(f"teacher.cache={given!r}: {file} gives shard {name!r} no bytes / sha256 entry; {_REBUILD}")
  return manifest


def _manifest_values(m: dict) -> str | None:
  """What is wrong with the values of a manifest whose entries have their types (None: nothing): each entry in its
  range, the ids' bits enough for the vocabulary, one shard per ``rows_per_shard`` rows."""
  for key, low in (("k", 1), ("seq_len", 1), ("rows", 1), ("rows_per_shard", 1), ("vocab", 1)):
    if m[key] < low:
      return f"{key}: {m[key]}, where an integer >= {low} is expected"
  if not 1 <= m["id_bits"] <= 32 or 2 ** m["id_bits"] < m["vocab"]:
    return (f"id_bits: {m['id_bits']}, where {id_bits(m['vocab'])} to 32 bits are expected (ids over a vocabulary "
            f"of {m['vocab']})")
  if m["k"] > m["vocab"]:
    return f"k: {m['k']}, more than its vocab of {m['vocab']} tokens"
  if not (math.isfinite(m["temperature"]) and m["temperature"] > 0):
    return f"temperature: {m['temperature']}, where a finite number > 0 is expected"
  if m["precision"] not in PRECISIONS:
    return f"precision: {m['precision']!r}, where one of {sorted(PRECISIONS)} is expected"
  shards = -(-m["rows"] // m["rows_per_shard"])
  if len(m["shards"]) != shards:
    return (f"{len(m['shards'])} shards listed for {m['rows']} rows of {m['rows_per_shard']} per shard ({shards} "
            "expected)")
  config = m["teacher"].get("config")
  if not isinstance(config, dict):
    return f"teacher.config: {config!r}, where the teacher's model config (an object) is expected"
  return None


class TeacherCache:
  """A finished cache directory, opened for reading.

  Every shard is checked for size when the cache is opened, and against its SHA-256 in the manifest when it is
  first read (``verify``: all of them now), so a damaged shard is never trained on.

  Raises:
    CacheError: no manifest (an unfinished cache: rerun ``meshdistill cache-teacher``), a manifest that is not
      one (malformed, entries missing, a shard name outside the directory), a missing or truncated shard, or a
      shard whose content changed (when it is opened with ``verify``, else when it is first read).
  """

  def __init__(self, path: str, *, verify: bool = False):
    self.path = os.path.abspath(os.path.expanduser(path))
    manifest = _read_manifest(self.path, path)
    if manifest is None:
      unfinished = any(n.startswith("progress-") for n in os.listdir(self.path)) if os.path.isdir(self.path) else False
      raise CacheError(
          f"teacher.cache={path!r} is " + ("an unfinished teacher cache (progress files, no manifest.json); rerun "
                                          "`meshdistill cache-teacher` with the same settings to finish it"
                                          if unfinished else "not a teacher cache (no manifest.json); write one "
                                          "with `meshdistill cache-teacher --out PATH`")
      )
    self.manifest = manifest
    for shard in manifest["shards"]:
      file = os.path.join(self.path, shard["name"])
      size = os.path.getsize(file) if os.path.isfile(file) else None
      if size != shard["bytes"]:
        what = "is missing" if size is None else f"has {size} bytes, the manifest says {shard['bytes']} (truncated?)"
        raise CacheError(f"teacher cache shard {file} {what}; rerun `meshdistill cache-teacher` into a fresh "
                         "directory (or restore the file)")
    self.k, self.seq_len, self.num_rows = manifest["k"], manifest["seq_len"], manifest["rows"]
    # a cross-tokenizer cache: rows cut on the teacher's tokens, with their tokens and byte offsets (format 2)
    self.cross = bool(manifest.get("cross", False))
    self.teacher_tokenizer = manifest.get("teacher_tokenizer")  # {"setting", "fingerprint", "vocab_size"}; v1: None
    self._handles: dict[int, Any] = {}
    self._verified: set[int] = set()  # shards whose SHA-256 matched
    if verify:
      for i in range(len(manifest["shards"])):
        self._verify(i)

  def _verify(self, i: int) -> None:
    """Raises `CacheError` unless shard ``i`` matches its SHA-256 in the manifest (hashed once)."""
    if i in self._verified:
      return
    shard = self.manifest["shards"][i]
    if _file_sha256(os.path.join(self.path, shard["name"])) != shard["sha256"]:
      raise CacheError(f"teacher cache shard {shard['name']} in {self.path} does not match its SHA-256 in "
                       f"{MANIFEST} (damaged); nothing was trained on it: {_REBUILD}, then distil from that")
    self._verified.add(i)

  def spec(self) -> TopKTeacher:
    """The teacher as a `TopKTeacher` (for `meshdistill.Distiller`)."""
    m = self.manifest
    try:
      cfg = ModelConfig(**m["teacher"]["config"])
    except (TypeError, ValueError) as e:
      raise CacheError(f"teacher cache {self.path}: {MANIFEST} holds a teacher.config that is not a model config "
                       f"({e}); {_REBUILD}") from None
    return TopKTeacher(cfg=cfg, k=m["k"], temperature=m["temperature"], vocab=m["vocab"],
                       source=f"teacher cache {self.path}", cross=self.cross)

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

      self._verify(i)  # before its first read
      self._handles[i] = safe_open(os.path.join(self.path, self.manifest["shards"][i]["name"]), framework="numpy")
    return self._handles[i]

  def rows(self, row_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The teacher top-k of packed rows ``row_ids`` [N]: `TOPK_KEYS` -> ids / log-probs ``[N, T, K]``
    (int32 / float32) and tail ``[N, T]`` float32; a cross-tokenizer cache adds ``teacher_tokens`` [N, 1 + T],
    ``teacher_ends`` [N, T] (int32) and ``teacher_target_logprobs`` [N, T] float32 (`CROSS_ARRAYS`)."""
    row_ids = np.asarray(row_ids, np.int64).reshape(-1)
    if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= self.num_rows):
      raise CacheError(f"rows {row_ids.min()}..{row_ids.max()} asked of teacher cache {self.path}, which holds "
                       f"{self.num_rows} rows; the data is not the data the cache was made from")
    r, t, k, bits = self.manifest["rows_per_shard"], self.seq_len, self.k, self.manifest["id_bits"]
    ids, logprobs, tail = [], [], []
    extra = {key: [] for key in (CROSS_ARRAYS if self.cross else ())}
    for row in row_ids:
      f, j = self._shard(int(row) // r), int(row) % r
      ids.append(unpack_ids(f.get_slice("ids")[j:j + 1], bits, t * k).reshape(t, k))
      logprobs.append(f.get_slice("logprobs")[j:j + 1][0].astype(np.float32))
      tail.append(f.get_slice("tail")[j:j + 1][0].astype(np.float32))
      for name, got in extra.items():
        got.append(f.get_slice(name)[j:j + 1][0])
    out = dict(zip(TOPK_KEYS, (np.stack(ids), np.stack(logprobs), np.stack(tail))))
    for name, got in extra.items():  # a cross-tokenizer cache: the rows' teacher tokens, offsets, target log-probs
      out[CROSS_ARRAYS[name]] = np.stack(got).astype(np.float32 if name == "target_logprobs" else np.int32)
    return out

  def bytes_per_token(self) -> float:
    """Bytes of shard files per cached token (headers included)."""
    return sum(s["bytes"] for s in self.manifest["shards"]) / (self.num_rows * self.seq_len)


class CachedTeacherData(WrappedData):
  """A `meshdistill.data.DataBundle` whose training batches also carry the teacher's top-k from a cache.

  Validation batches, tokenizers and stats are the bundle's (`meshdistill.data.WrappedData`); the iterator's
  state is the bundle iterator's, so checkpoints and resume work unchanged.
  """

  def __init__(self, bundle, cache: TeacherCache):
    super().__init__(bundle)
    self.cache = cache

  def train_iterator(self, state: dict | None = None, **kw) -> _CachedIterator:
    return _CachedIterator(self.bundle.train_iterator(state, row_ids=True, **kw), self.cache)


class RowIdData(WrappedData):
  """A `meshdistill.data.DataBundle` whose training batches carry their packed rows' ids (``row_ids`` [B]) instead
  of their top-k: the on-policy path reads a cache by them only for the batches it trains on as they are
  (`meshdistill.train.onpolicy.OnPolicyDistiller` with ``cache``). Validation batches, tokenizers and stats are the
  bundle's (`meshdistill.data.WrappedData`)."""

  def __init__(self, bundle, cache: TeacherCache):
    super().__init__(bundle)
    self.cache = cache

  def train_iterator(self, state: dict | None = None, **kw):
    return self.bundle.train_iterator(state, row_ids=True, **kw)


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
