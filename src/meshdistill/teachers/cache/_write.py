"""Writing a teacher cache: the identity hashes that name a teacher and its data, and `write_cache`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshdistill import losses
from meshdistill.parallel.distributed import agree_on
from meshdistill.train.loop.stopping import Stopped, requested
from meshdistill.teachers.cache._format import (
    FORMAT_VERSION,
    CacheError,
    MANIFEST,
    PRECISIONS,
    _check_same,
    _file_sha256,
    _progress_name,
    _read_json,
    _save_shard,
    _write_json,
    encode_rows,
    id_bits,
)
from meshdistill.teachers.cache._program import TeacherTopK
from meshdistill.core.batch import TARGET_LOGPROB_KEY

log = logging.getLogger(__name__)


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
  return _identity(h, packed, tokenizer, sources)


def _identity(h, rows, tokenizer, sources: Any) -> dict:
  """The identity dict of ``rows`` (anything with ``seq_len`` and a length) whose tokens ``h`` has hashed."""
  return {
      "tokens_sha256": h.hexdigest(),
      "seq_len": int(rows.seq_len),
      "rows": len(rows),
      "tokenizer": tokenizer.fingerprint,
      "sources": None if sources is None else list(sources) if isinstance(sources, (list, tuple)) else [sources],
  }


def teacher_rows_identity(rows, tokenizer, sources: Any = None) -> dict:
  """What names a cross-tokenizer cache's rows (`meshdistill.data._teacher_rows.TeacherRows`): the teacher stream's
  tokens and the row bounds hashed, ``seq_len``, row count, the teacher tokenizer's fingerprint, sources."""
  h = hashlib.sha256(np.ascontiguousarray(rows.stream.tokens).tobytes())
  h.update(np.ascontiguousarray(rows.bounds).tobytes())
  h.update(f"{rows.seq_len}:{rows.pad_id}".encode())
  return _identity(h, rows, tokenizer, sources)


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
      data (`data_identity`); stored in the manifest, and a rerun must match it. A cross-tokenizer cache adds
      ``"cross": True`` and ``"teacher_tokenizer"`` (`meshdistill.teachers.cache.tokenizer_identity`); ``packed`` is
      then `meshdistill.data._teacher_rows.TeacherRows` (rows of teacher tokens, `teacher_rows_identity`) and every
      shard also holds the rows' teacher tokens, byte offsets and target log-probabilities.
    precision: ``float16`` (compact) or ``float32`` (exact log-probabilities).
    rows_per_shard: rows per shard file; batch_size: rows per teacher call (a multiple of ``data``).
    process_index, process_count: this writer's shards (``i % process_count == process_index``); each writer
      runs its own ``teacher_topk`` (e.g. on its process's `process_mesh`) and records its finished shards in
      ``progress-<process_index>.json``. A rerun skips every shard any progress file lists (whatever the
      process count that wrote it), so a cache resumes on another number of processes too.
    stop_after_shards: stop after writing this many shards (as if killed; for tests). A stop request
      (`meshdistill.train.loop.stopping.requested`, SIGTERM or SIGINT under `stop_on_signals`) is honoured between shards:
      `meshdistill.train.loop.stopping.Stopped` is raised with every finished shard recorded, so a rerun resumes.
    barrier: with several processes, ``barrier(name)`` waits for every process (`meshdistill.parallel.distributed.barrier`):
      after the shards (then process 0 merges the progress files into the manifest) and after the manifest.

  Returns:
    The manifest (``{}`` when stopped early, or when a writer's shards are still missing).

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
  # Every process must take the same path (the shard loop has barriers): process 0's reading decides,
  # even where a shared file system shows a fresh manifest to some processes later than to others.
  found = agree_on(int(done is not None), "teacher cache: manifest found")
  if not found:
    done = None
  elif done is None:
    done = _read_json(os.path.join(out, MANIFEST))
    if done is None:
      raise CacheError(f"{out}: process 0 found {MANIFEST} but this process cannot read it; check the shared file system")
  if done is not None:
    _check_same(done, settings, out)
    log.info("teacher cache %s is complete (%d shards); nothing to do", out, len(done["shards"]))
    return done
  progress_path = os.path.join(out, _progress_name(process_index))
  progress = _read_json(progress_path) or {"settings": settings, "shards": {}}
  finished = _finished_shards(out, settings)  # by any writer, of this run or an earlier one (any process count)
  n_shards = -(-n // rows_per_shard)
  bits = settings["id_bits"]
  written = kept = 0
  t0 = time.perf_counter()
  for i in range(process_index, n_shards, process_count):
    name = _shard_name(i)
    path = os.path.join(out, name)
    entry = finished.get(name)
    if entry is not None and os.path.isfile(path) and os.path.getsize(path) == entry["bytes"]:
      kept += 1
      continue  # finished before an interruption
    if requested() is not None:  # SIGTERM / SIGINT under `stop_on_signals`: the finished shards are recorded
      raise Stopped(requested(), written, None, detail=f"after writing {written} of this writer's shards "
                    f"(the cache has {n_shards}; the finished ones are listed in {progress_path})")
    if stop_after_shards is not None and written >= stop_after_shards:
      log.info("teacher cache: stopping after %d shards (as asked)", written)
      return {}
    lo, hi = i * rows_per_shard, min((i + 1) * rows_per_shard, n)
    topk, extra = _teacher_rows(teacher_topk, packed, lo, hi, batch_size, bool(settings.get("cross")))
    arrays = encode_rows(topk, bits, precision, extra)
    _save_shard(path, arrays)
    progress["shards"][name] = {"rows": [lo, hi], "bytes": os.path.getsize(path), "sha256": _file_sha256(path)}
    _write_json(progress_path, progress)
    written += 1
  log.info("teacher cache: process %d of %d wrote %d shards in %.1fs (%d written before)", process_index,
           process_count, written, time.perf_counter() - t0, kept)
  if process_count > 1 and barrier is not None:
    barrier("teacher-cache-shards")  # every writer has finished its shards
  if process_index == 0:
    _write_manifest(out, settings, n_shards)
  if process_count > 1 and barrier is not None:
    barrier("teacher-cache-manifest")  # process 0 has written the manifest (or found shards missing)
  return _read_json(os.path.join(out, MANIFEST)) or {}


def _shard_name(i: int) -> str:
  return f"shard-{i:05d}.safetensors"


def _progress_files(out: str) -> list[str]:
  return sorted(os.path.join(out, f) for f in os.listdir(out) if f.startswith("progress-") and f.endswith(".json"))


def _finished_shards(out: str, settings: dict) -> dict:
  """``{shard name: entry}`` of every progress file in ``out`` (each checked against ``settings``)."""
  finished = {}
  for path in _progress_files(out):
    part = _read_json(path)
    _check_same(part["settings"], settings, out)
    finished.update(part["shards"])
  return finished


def _write_manifest(out: str, settings: dict, n_shards: int) -> None:
  """Merges the writers' progress files into ``manifest.json`` (and removes them), once every shard is listed."""
  finished = _finished_shards(out, settings)
  missing = [i for i in range(n_shards) if _shard_name(i) not in finished]
  if missing:
    log.info("teacher cache: %d shards still missing (other writers); rerun to finish", len(missing))
    return
  shards = [{"name": _shard_name(i), **finished[_shard_name(i)]} for i in range(n_shards)]
  content = hashlib.sha256("".join(s["sha256"] for s in shards).encode()).hexdigest()
  _write_json(os.path.join(out, MANIFEST), {**settings, "shards": shards, "content_sha256": content})
  for path in _progress_files(out):
    os.remove(path)


def _teacher_rows(teacher_topk: TeacherTopK, packed, lo: int, hi: int, batch_size: int,
                  cross: bool = False) -> tuple[losses.TopK, dict | None]:
  """The teacher's top-k of rows ``[lo, hi)``, host arrays; the last batch is filled with repeated rows. ``cross``:
  also the rows' teacher tokens, byte offsets and target log-probabilities (else None)."""
  parts, extra = [], []
  for a in range(lo, hi, batch_size):
    idx = np.arange(a, a + batch_size)
    idx = np.minimum(idx, hi - 1)
    rows, m = packed.rows(idx), min(batch_size, hi - a)
    host = lambda x, m=m: np.asarray(jax.device_get(x))[:m]  # noqa: E731
    if cross:
      out, own = teacher_topk.with_targets(rows["inputs"], rows["targets"])
      extra.append({"teacher_tokens": rows["teacher_tokens"][:m], "teacher_ends": rows["teacher_ends"][:m],
                    TARGET_LOGPROB_KEY: host(own)})
    else:
      out = teacher_topk(rows["inputs"])
    parts.append(jax.tree.map(host, out))
  topk = losses.TopK(*(np.concatenate(xs) for xs in zip(*parts)))
  return topk, ({k: np.concatenate([e[k] for e in extra]) for k in extra[0]} if cross else None)

