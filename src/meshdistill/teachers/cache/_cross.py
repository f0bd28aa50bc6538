"""Reading a cross-tokenizer teacher cache: its rows (cut on the teacher's tokens, `meshdistill.data._teacher_rows`)
rebuilt for the run's student tokenizer and aligned on the fly, with the teacher's top-k per teacher token.

A cache written with ``data.teacher_tokenizer`` set (manifest ``cross: true``) holds, per row, the teacher's tokens
(the one before the row and its targets), their byte END offsets from the row's first byte, and per teacher
position the top-k, the tail log-mass and the log-probability of the actual next token. Nothing in it depends on a
student: `CachedCrossData` re-tokenizes each row's bytes with the run's student tokenizer (`StudentRows`), computes
the alignment, and adds the cached arrays, so any student tokenizer distils from the same cache.
"""

from __future__ import annotations

import numpy as np

from meshdistill.data import StudentRows, TeacherRows, TrainIterator, WrappedData, cut_teacher_rows
from meshdistill.teachers.cache._format import CacheError, TeacherCache, _check_same


def tokenizer_identity(tokenizer, setting: str | None) -> dict:
  """What names a teacher tokenizer in a manifest: the setting that gave it (``byte``, ``bpe`` or a path), its
  content fingerprint and vocabulary size."""
  return {"setting": setting, "fingerprint": tokenizer.fingerprint, "vocab_size": int(tokenizer.vocab_size)}


def check_cross(cache: TeacherCache, teacher_tokenizer, setting: str | None) -> None:
  """Raises `CacheError` unless ``cache`` holds rows of teacher tokens (byte offsets) for ``teacher_tokenizer``
  (``data.teacher_tokenizer``, given as ``setting``)."""
  where = f"teacher.cache={cache.path}"
  if not cache.cross:
    raise CacheError(
        f"{where} holds the teacher's top-k per token of one tokenizer (format {cache.manifest['format']}, no byte "
        f"offsets), but data.teacher_tokenizer={setting!r} gives the student another tokenizer than the teacher; "
        "rewrite the cache with `meshdistill cache-teacher` and data.teacher_tokenizer set (its rows then carry the "
        "teacher's tokens and byte offsets), or drop data.teacher_tokenizer to distil a student of the cache's "
        "tokenizer"
    )
  saved = cache.teacher_tokenizer or {}
  if saved.get("fingerprint") != teacher_tokenizer.fingerprint:
    raise CacheError(
        f"{where} was written for the teacher tokenizer {saved.get('setting')!r} (fingerprint "
        f"{saved.get('fingerprint')!r}), but data.teacher_tokenizer={setting!r} gives "
        f"{teacher_tokenizer.fingerprint!r}; set data.teacher_tokenizer to the tokenizer that wrote the cache (and "
        "the same data for a trained 'bpe'), or rewrite the cache with `meshdistill cache-teacher` for this one"
    )


def check_not_cross(cache: TeacherCache) -> None:
  """Raises `CacheError` for a cross-tokenizer cache in a run without ``data.teacher_tokenizer``."""
  if cache.cross:
    setting = (cache.teacher_tokenizer or {}).get("setting")
    raise CacheError(
        f"teacher.cache={cache.path} holds the top-k of a teacher of its own tokenizer ({setting!r}) per teacher "
        f"token; set data.teacher_tokenizer={setting!r} and distill.kind to byte_kl, span_kl or uld to distil from it"
    )


class CachedCrossRows:
  """A cross-tokenizer cache's rows as `meshdistill.data.TrainIterator` reads packed rows: ``rows(indices)`` gives
  the student's ``inputs`` / ``targets`` / ``mask`` [B, Ts], `meshdistill.train.step.CROSS_KEYS` and the cached
  top-k (`TOPK_KEYS`, ``teacher_target_logprobs``) per teacher token."""

  def __init__(self, cache: TeacherCache, student: StudentRows):
    self.cache, self.student = cache, student
    self.seq_len = student.seq_len

  def __len__(self) -> int:
    return self.cache.num_rows

  @property
  def num_tokens(self) -> int:
    return self.cache.num_rows * self.cache.seq_len

  def rows(self, indices, *, segments: bool = False) -> dict[str, np.ndarray]:
    if segments:
      raise ValueError("segment ids are not produced for a cross-tokenizer teacher cache's rows")
    cached = self.cache.rows(np.asarray(indices, np.int64).reshape(-1))
    batch = self.student.batch(cached)
    batch.update({k: v for k, v in cached.items() if k not in ("teacher_tokens", "teacher_ends")})
    return batch


class CachedCrossData(WrappedData):
  """A `meshdistill.data.DataBundle` (of two tokenizations) whose training batches are a cross-tokenizer cache's rows
  rebuilt for the bundle's student tokenizer (`CachedCrossRows`); validation, tokenizers and stats are the bundle's
  (`meshdistill.data.WrappedData`). Iterator state is a `TrainIterator`'s over the cache's rows (resume works as with
  packed rows)."""

  def __init__(self, bundle, cache: TeacherCache):
    super().__init__(bundle)
    self.cache = cache
    self.rows = CachedCrossRows(cache, StudentRows(bundle.teacher_tokenizer, bundle.tokenizer, bundle.config.seq_len))

  def train_iterator(self, state: dict | None = None, **kw) -> TrainIterator:
    del kw
    b = self.bundle
    it = TrainIterator(self.rows, global_batch_size=b.global_batch_size, seed=b.config.seed,
                       num_epochs=b.config.num_epochs, process_index=b.process_index, process_count=b.process_count)
    if state is not None:
      it.set_state(state)
    return it


def teacher_rows_of(bundle, seq_len: int) -> TeacherRows:
  """The teacher rows of ``bundle``'s training documents (its `meshdistill.data.PackedPairs` teacher stream), each at
  most ``seq_len`` teacher tokens: the rows a cross-tokenizer cache of that length is written over."""
  return cut_teacher_rows(bundle.train.teacher, bundle.teacher_tokenizer, seq_len)


def open_cross(bundle, cache: TeacherCache, setting: str | None, data_identity: dict) -> CachedCrossData:
  """``bundle`` with its training batches read from the cross-tokenizer ``cache`` (checked: teacher tokenizer, and
  ``data_identity`` of the teacher rows against the manifest's)."""
  check_cross(cache, bundle.teacher_tokenizer, setting)
  saved = {k: v for k, v in cache.manifest["data"].items() if k != "sources"}
  now = {k: v for k, v in data_identity.items() if k != "sources"}
  _check_same({"data": saved}, {"data": now}, f"teacher.cache={cache.path}")
  return CachedCrossData(bundle, cache)
