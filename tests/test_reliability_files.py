"""Reliability, round three: teacher-cache manifests checked value by value, and the cases no one had tried with a
user's files (`benchmarks/results/reliability.md`, items 10-11)."""

import json
import math

import pytest

from meshdistill.teachers import cache as tc


def _manifest(tmp_path, **change):
  """A hand-written cache directory: a manifest whose every entry has its type, one shard file of 64 bytes."""
  (tmp_path / "shard-00000.safetensors").write_bytes(b"\0" * 64)
  m = {"format": 2, "k": 2, "seq_len": 4, "rows": 4, "rows_per_shard": 4, "id_bits": 5, "vocab": 32,
       "temperature": 1.0, "precision": "float16", "teacher": {"config": {"vocab_size": 32}}, "data": {},
       "shards": [{"name": "shard-00000.safetensors", "bytes": 64, "sha256": "0" * 64}]}
  m.update(change)
  (tmp_path / tc.MANIFEST).write_text(json.dumps(m, allow_nan=True))
  return str(tmp_path)


@pytest.mark.parametrize("change,says", [
    ({"rows_per_shard": 0}, "rows_per_shard: 0"),
    ({"rows_per_shard": -4}, "rows_per_shard: -4"),
    ({"rows_per_shard": True}, "a bool as its 'rows_per_shard' entry"),
    ({"k": 0}, "k: 0"),
    ({"seq_len": 0}, "seq_len: 0"),
    ({"rows": 0, "shards": []}, "rows: 0"),
    ({"vocab": 0}, "vocab: 0"),
    ({"id_bits": 0}, "id_bits: 0"),
    ({"id_bits": 3}, "id_bits: 3"),  # 8 ids for a vocabulary of 32
    ({"k": 40}, "k: 40, more than its vocab"),
    ({"temperature": 0}, "temperature: 0"),
    ({"temperature": math.nan}, "temperature: nan"),
    ({"precision": "int3"}, "precision: 'int3'"),
    ({"rows": 8}, "1 shards listed for 8 rows"),
    ({"teacher": {"config": [1]}}, "teacher.config"),
])
def test_r3_every_manifest_value_is_checked_with_a_named_cache_error(tmp_path, change, says):
  """Item 10: `rows_per_shard: 0` ended in ZeroDivisionError at the first row read; every manifest entry is now checked
  for its range when the cache is opened, naming the file, the entry and what was expected."""
  with pytest.raises(tc.CacheError, match=f"manifest.json has {says}.*cache-teacher") as e:
    cache = tc.TeacherCache(_manifest(tmp_path, **change))
    cache.rows([0])
  assert "teacher.cache=" in str(e.value)


def test_r3_a_hand_written_manifest_with_sound_values_opens(tmp_path):
  assert tc.TeacherCache(_manifest(tmp_path)).num_rows == 4
