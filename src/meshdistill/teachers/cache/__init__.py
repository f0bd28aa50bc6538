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
  finished shards (with sizes and SHA-256), rewritten atomically after each shard; a rerun, on any
  number of processes, skips every shard any of them lists (resume after a kill);
* ``manifest.json`` -- written last: teacher (config and a hash of its weights), tokenizer
  fingerprint, data (sources, ``seq_len``, row count, a hash of the packed tokens), ``k``,
  ``temperature``, ``vocab``, ``precision``, the shards and a content hash over them.

`TeacherCache` reads a finished cache: each shard's size is checked when it is opened and its SHA-256 before its
first read (a damaged shard is an error naming it, never trained on); shard names are plain file names inside
the directory.

At k=32 and V=128k a token costs 32 x 17 bits of ids (68 B) + 32 x 2 B of float16 log-probs +
2 B of tail = 134 B (``benchmarks/teacher_cache.py`` measures it and the error float16 costs).
`write_cache` splits the shards over writers (``i % process_count == process_index``, each with its
own progress file; after a barrier process 0 merges them into the manifest). ``meshdistill
cache-teacher`` in a job of N processes runs one writer per process: each process runs the teacher
alone on its own rows of the mesh (`process_mesh`; the teacher's parameters there without a copy,
`on_process_mesh`), with the same per-device program and rows per device as one process on the
whole mesh, so the shards -- and the manifest's content hash -- are those of a one-process cache.

A cross-tokenizer cache (``cache-teacher`` with ``data.teacher_tokenizer``; format 2, manifest ``cross: true``,
``teacher_tokenizer``: its setting, fingerprint and vocabulary size) cuts its rows on the teacher's tokens alone
(`meshdistill.data._teacher_rows`) and stores per TEACHER token the top-k, the tail and the actual next token's
log-probability, plus each row's teacher tokens and byte end offsets (``tokens`` ``[rows, 1 + T]``, ``ends``
``[rows, T]`` int32, ``target_logprobs`` ``[rows, T]``), so students of any tokenizer read it (`_cross`). Every
manifest written now is format 2 and names the teacher tokenizer; format 1 caches (one tokenizer) still load.

Modules: `_program` (the teacher model as a top-k program: `TeacherTopK`; the top-k teacher it gives, `TopKTeacher`, is
`meshdistill.train.teacher`'s, public here), `_format` (the storage
format: bit-packed ids, shard and JSON files, settings checks, the `TeacherCache` reader and
`CachedTeacherData`), `_write` (identity hashes and `write_cache`), `_cross` (a cross-tokenizer cache's rows rebuilt
for a student tokenizer: `CachedCrossData`, its checks).
"""

from meshdistill.teachers.cache._format import (
    FORMAT_VERSION,
    MANIFEST,
    READABLE_FORMATS,
    PRECISIONS,
    CacheError,
    CachedTeacherData,
    RowIdData,
    TeacherCache,
    encode_rows,
    id_bits,
    pack_ids,
    unpack_ids,
)
from meshdistill.teachers.cache._program import TeacherTopK, on_process_mesh, process_mesh
from meshdistill.teachers.cache._write import (
    data_identity,
    teacher_identity,
    teacher_rows_identity,
    weights_hash,
    write_cache,
)
from meshdistill.teachers.cache._cross import (
    CachedCrossData,
    check_cross,
    check_not_cross,
    open_cross,
    teacher_rows_of,
    tokenizer_identity,
)
from meshdistill.train.teacher import TopKTeacher  # defined below the teachers, in train; its public name is here

__all__ = [
    "CacheError",
    "CachedCrossData",
    "CachedTeacherData",
    "RowIdData",
    "FORMAT_VERSION",
    "MANIFEST",
    "READABLE_FORMATS",
    "check_cross",
    "check_not_cross",
    "open_cross",
    "teacher_rows_identity",
    "teacher_rows_of",
    "tokenizer_identity",
    "PRECISIONS",
    "TeacherCache",
    "TeacherTopK",
    "TopKTeacher",
    "data_identity",
    "encode_rows",
    "id_bits",
    "on_process_mesh",
    "pack_ids",
    "process_mesh",
    "teacher_identity",
    "unpack_ids",
    "weights_hash",
    "write_cache",
]
