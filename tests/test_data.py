"""Data pipeline: corpora and split, tokenizers, packing and mask, grain loader state and sharding."""

import json
import os

import numpy as np
import pytest

from meshdistill import data as mdd
from meshdistill.data import (
    ByteTokenizer,
    DataConfig,
    Document,
    TrainIterator,
    build_data,
    cap_documents,
    load_documents,
    load_tokenizer,
    pack,
    pack_documents,
    split_documents,
    train_bpe,
    validation_batches,
)

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "Zürich — naïve café 🙂\nsecond line\n",
    "import os\nprint(os.getcwd())\n",
    "a",
    "class A:\n    pass\n" * 5,
    "<|eos|> is literal text here\n",
]


@pytest.fixture(scope="module")
def stdlib_docs():
  return load_documents("stdlib")


def _random_packed(seed=0, n_docs=40, seq_len=16, max_len=30):
  rng = np.random.default_rng(seed)
  docs = [rng.integers(0, 200, rng.integers(1, max_len)) for _ in range(n_docs)]
  return pack_documents(docs, seq_len, eos_id=258, pad_id=256), docs


# ---------------------------------------------------------------- corpora and split


def test_stdlib_split_is_deterministic_disjoint_by_file_and_nonempty(stdlib_docs):
  keys = [d.key for d in stdlib_docs]
  assert len(keys) == len(set(keys)) > 100
  assert all(k.startswith("stdlib/") and k.endswith(".py") for k in keys)
  assert not any("/site-packages/" in k or "/test/" in k or "/tests/" in k for k in keys)
  train1, val1 = split_documents(stdlib_docs, 0.05)
  train2, val2 = split_documents(load_documents("stdlib"), 0.05)
  assert [d.key for d in train1] == [d.key for d in train2] and [d.key for d in val1] == [d.key for d in val2]
  assert train1 and val1
  assert not {d.key for d in train1} & {d.key for d in val1}
  assert len(train1) + len(val1) == len(stdlib_docs)
  assert 0.02 < len(val1) / len(stdlib_docs) < 0.10


def test_split_of_a_document_does_not_depend_on_the_others(stdlib_docs):
  _, val_all = split_documents(stdlib_docs, 0.2)
  subset = stdlib_docs[::3]
  _, val_sub = split_documents(subset, 0.2)
  assert {d.key for d in val_sub} == {d.key for d in val_all} & {d.key for d in subset}


def test_cap_documents_is_deterministic_and_within_limits(stdlib_docs):
  a = cap_documents(stdlib_docs, max_chars=50_000)
  b = cap_documents(stdlib_docs, max_chars=50_000)
  assert a == b and sum(len(d.text) for d in a) == 50_000
  assert [d.key for d in a] == sorted(d.key for d in a)  # input order kept
  assert len(cap_documents(stdlib_docs, max_docs=7)) == 7


def test_single_document_is_split_by_position():
  doc = Document("one.txt", "".join(f"line {i}\n" for i in range(200)))
  train, val = split_documents([doc], 0.1)
  assert len(train) == len(val) == 1
  assert train[0].text + val[0].text == doc.text
  assert val[0].text.startswith("line ") and 0.05 < len(val[0].text) / len(doc.text) < 0.15


def test_text_jsonl_directory_and_glob_sources(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "a.txt").write_text("alpha text", encoding="utf-8")
  (tmp_path / "sub" / "b.md").write_text("beta text", encoding="utf-8")
  (tmp_path / "sub" / "bin.dat").write_bytes(b"\xff\xfe\x00\x80")  # not UTF-8: skipped in a directory
  rows = [{"body": "first"}, {"body": ""}, {"body": "third", "x": 1}]
  (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")

  assert [d.text for d in load_documents(str(tmp_path / "a.txt"))] == ["alpha text"]
  jsonl = load_documents(str(tmp_path / "c.jsonl"), text_key="body")
  assert [d.text for d in jsonl] == ["first", "third"]  # the empty document is dropped
  assert [d.key for d in jsonl] == [f"{tmp_path / 'c.jsonl'}:1", f"{tmp_path / 'c.jsonl'}:3"]
  both = load_documents(f"{tmp_path / 'a.txt'},{tmp_path / 'c.jsonl'}", text_key="body")
  assert [d.text for d in both] == ["alpha text", "first", "third"]
  in_dir = load_documents(str(tmp_path / "sub"))
  assert [(d.key, d.text) for d in in_dir] == [(f"{tmp_path / 'sub'}/b.md", "beta text")]
  globbed = load_documents(str(tmp_path / "**" / "*.txt"))
  assert [d.text for d in globbed] == ["alpha text"]


def test_jsonl_without_the_text_key_names_the_setting(tmp_path):
  (tmp_path / "c.jsonl").write_text('{"content": "x"}\n', encoding="utf-8")
  with pytest.raises(ValueError, match=r"data.text_key='text'.*content"):
    load_documents(str(tmp_path / "c.jsonl"))


def test_missing_path_empty_corpus_and_unmatched_glob_raise(tmp_path):
  with pytest.raises(FileNotFoundError, match="data.source.*nope.txt"):
    load_documents(str(tmp_path / "nope.txt"))
  with pytest.raises(FileNotFoundError, match="matches no file"):
    load_documents(str(tmp_path / "*.txt"))
  (tmp_path / "empty.txt").write_text("", encoding="utf-8")
  with pytest.raises(ValueError, match="corpus is empty"):
    load_documents(str(tmp_path / "empty.txt"))
  with pytest.raises(ValueError, match="names no corpus"):
    load_documents(" , ")


def test_hf_dataset_from_local_disk(tmp_path):
  datasets = pytest.importorskip("datasets")
  ds = datasets.Dataset.from_dict({"text": ["one doc", "two doc", ""], "n": [1, 2, 3]})
  ds.save_to_disk(str(tmp_path / "saved"))
  docs = load_documents(f"hf:{tmp_path / 'saved'}")
  assert [d.text for d in docs] == ["one doc", "two doc"]
  assert docs[0].key == f"hf:{tmp_path / 'saved'}#0"
  with pytest.raises(ValueError, match="data.text_key='body'"):
    load_documents(f"hf:{tmp_path / 'saved'}", text_key="body")
  with pytest.raises(FileNotFoundError, match="only local paths"):
    load_documents(f"hf:{tmp_path / 'missing'}")


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_and_reserves_special_ids(tmp_path):
  tok = ByteTokenizer()
  assert tok.vocab_size == 264 and tok.vocab_size % 8 == 0
  assert {tok.pad_id, tok.bos_id, tok.eos_id} <= set(range(256, tok.vocab_size))
  for text in TEXTS:
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    np.testing.assert_array_equal(tok.encode_batch([text])[0], ids)
  assert tok.decode([104, tok.eos_id, 105, tok.pad_id]) == "hi"
  assert isinstance(load_tokenizer(tok.save(tmp_path)), ByteTokenizer)
  assert isinstance(tok, mdd.Tokenizer)


def test_bpe_train_save_load_round_trip(tmp_path):
  corpus = TEXTS * 20
  tok = train_bpe(corpus, 300)
  assert tok.vocab_size % 8 == 0 and tok.base_vocab_size <= tok.vocab_size
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  for text in TEXTS + ["never seen: ẞ ∑ 漢字"]:
    assert tok.decode(tok.encode(text)) == text
  assert tok.eos_id not in tok.encode("<|eos|>")  # special strings in text are text
  assert len(tok.encode("def f(x):")) < len("def f(x):")  # merges learned
  path = tok.save(tmp_path / "run")
  assert path.endswith("tokenizer.json")
  loaded = load_tokenizer(tmp_path / "run")
  assert loaded.vocab_size == tok.vocab_size and loaded.eos_id == tok.eos_id and loaded.fingerprint == tok.fingerprint
  for text in TEXTS:
    assert loaded.encode(text) == tok.encode(text)
  assert train_bpe(corpus, 300).fingerprint == tok.fingerprint  # training is deterministic


def test_tokenizer_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="data.tokenizer"):
    load_tokenizer(tmp_path / "missing.json")
  (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
  with pytest.raises(ValueError, match="not valid JSON"):
    load_tokenizer(tmp_path / "bad.json")
  with pytest.raises(ValueError, match="bpe_vocab_size"):
    train_bpe(TEXTS, 100)


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("seq_len,max_len", [(1, 4), (5, 3), (16, 30), (64, 200)])
def test_packing_shifts_masks_padding_and_boundaries_and_covers_every_token_once(seq_len, max_len):
  packed, docs = _random_packed(seed=seq_len, seq_len=seq_len, max_len=max_len)
  a = packed.arrays()
  N = len(packed)
  stream = np.concatenate([np.append(d, 258) for d in docs])
  L = stream.size
  assert a["inputs"].shape == a["targets"].shape == a["mask"].shape == (N, seq_len)
  assert (a["inputs"].dtype, a["targets"].dtype, a["mask"].dtype) == (np.int32, np.int32, np.float32)
  assert N == -(-(L - 1) // seq_len)
  # targets are the inputs shifted by one, across rows too
  flat_in = a["inputs"].reshape(-1)
  flat_tg = a["targets"].reshape(-1)
  np.testing.assert_array_equal(flat_in[1:], flat_tg[:-1])
  np.testing.assert_array_equal(flat_in[: L - 1], stream[:-1])
  # padding is never trained on
  pos = np.arange(N * seq_len) + 1  # stream position of each target
  assert (a["mask"].reshape(-1)[pos >= L] == 0).all()
  assert (flat_tg[pos >= L] == 256).all()
  # the first token of every document is masked; every other real token is trained exactly once
  starts = np.cumsum([0] + [d.size + 1 for d in docs])[:-1]
  expected = sorted(set(range(1, L)) - set(starts.tolist()))
  trained = pos[a["mask"].reshape(-1) == 1]
  assert trained.tolist() == expected
  assert packed.num_targets == len(expected) == L - len(docs)
  # a target whose input is EOS is never trained
  assert (a["mask"][a["inputs"] == 258] == 0).all()


def test_segment_ids_and_positions():
  packed = pack_documents([[5, 6, 7], [8], [9, 9]], 4, eos_id=258, pad_id=256)
  # stream: 5 6 7 E 8 E 9 9 E (L=9) -> rows of 4 with one overlap
  a = packed.arrays(segments=True)
  np.testing.assert_array_equal(a["inputs"], [[5, 6, 7, 258], [8, 258, 9, 9]])
  np.testing.assert_array_equal(a["targets"], [[6, 7, 258, 8], [258, 9, 9, 258]])
  np.testing.assert_array_equal(a["mask"], [[1, 1, 1, 0], [1, 0, 1, 1]])
  np.testing.assert_array_equal(a["segment_ids"], [[1, 1, 1, 1], [1, 1, 2, 2]])
  np.testing.assert_array_equal(a["positions"], [[0, 1, 2, 3], [0, 1, 0, 1]])
  tail = pack_documents([[5, 6, 7, 8]], 3, eos_id=258, pad_id=256).arrays(segments=True)
  np.testing.assert_array_equal(tail["inputs"], [[5, 6, 7], [8, 258, 256]])
  np.testing.assert_array_equal(tail["targets"], [[6, 7, 8], [258, 256, 256]])
  np.testing.assert_array_equal(tail["mask"], [[1, 1, 1], [1, 0, 0]])
  np.testing.assert_array_equal(tail["segment_ids"], [[1, 1, 1], [1, 1, 0]])
  np.testing.assert_array_equal(tail["positions"], [[0, 1, 2], [0, 1, 0]])


def test_pack_rejects_bad_seq_len_and_too_little_text():
  stream = mdd.join_documents([[1, 2, 3]], eos_id=9)
  with pytest.raises(ValueError, match="data.seq_len=0"):
    pack(stream, 0, 0)
  with pytest.raises(ValueError, match="at least 2"):
    pack(mdd.join_documents([], eos_id=9), 4, 0)


# ---------------------------------------------------------------- grain loader


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(xs, ys):
  assert len(xs) == len(ys)
  for x, y in zip(xs, ys):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_loader_is_deterministic_by_seed_and_seeds_differ():
  packed, _ = _random_packed(n_docs=60)
  kw = {"global_batch_size": 4, "process_index": 0, "process_count": 1}
  a = _take(TrainIterator(packed, seed=1, **kw), 5)
  _assert_same(a, _take(TrainIterator(packed, seed=1, **kw), 5))
  b = _take(TrainIterator(packed, seed=2, **kw), 5)
  assert any((x["inputs"] != y["inputs"]).any() for x, y in zip(a, b))
  assert all(x["inputs"].shape == (4, 16) for x in a)


def test_each_epoch_visits_every_row_once_in_a_new_order():
  packed, _ = _random_packed(n_docs=30, seq_len=8)
  rows = {tuple(r) for r in packed.arrays()["inputs"]}
  n = len(packed)
  it = TrainIterator(packed, global_batch_size=1, seed=0, num_epochs=2, process_index=0, process_count=1)
  assert it.num_batches == 2 * n
  seen = [tuple(b["inputs"][0]) for b in it]  # finite: stops after two epochs
  assert len(seen) == 2 * n
  assert set(seen[:n]) == set(seen[n:]) == rows and len(set(seen[:n])) == len(rows)
  assert seen[:n] != seen[n:]


def test_state_restore_mid_epoch_gives_the_same_following_batches():
  packed, _ = _random_packed(n_docs=50)
  kw = {"global_batch_size": 4, "seed": 3, "process_index": 0, "process_count": 1}
  it = TrainIterator(packed, **kw)
  _take(it, 7)
  state = json.loads(json.dumps(it.get_state()))  # survives a JSON checkpoint
  assert state["next_batch"] == 7
  expected = _take(it, 6)
  fresh = TrainIterator(packed, **kw)
  fresh.set_state(state)
  _assert_same(_take(fresh, 6), expected)
  other, _ = _random_packed(seed=9, n_docs=50)
  with pytest.raises(ValueError, match="does not match this data"):
    TrainIterator(other, **kw).set_state(state)
  with pytest.raises(ValueError, match="global_batch_size"):
    TrainIterator(packed, **{**kw, "global_batch_size": 8}).set_state(state)


def test_process_shards_are_disjoint_slices_of_the_global_batch():
  packed, _ = _random_packed(n_docs=80)
  whole = _take(TrainIterator(packed, global_batch_size=8, seed=5, process_index=0, process_count=1), 3)
  parts = [_take(TrainIterator(packed, global_batch_size=8, seed=5, process_index=p, process_count=4), 3)
           for p in range(4)]
  for step in range(3):
    for k in ("inputs", "targets", "mask"):
      np.testing.assert_array_equal(np.concatenate([parts[p][step][k] for p in range(4)]), whole[step][k])
    rows = [tuple(r) for p in range(4) for r in parts[p][step]["inputs"]]
    assert len(set(rows)) == 8
  with pytest.raises(ValueError, match="not divisible by the 3 processes"):
    TrainIterator(packed, global_batch_size=8, process_index=0, process_count=3)


def test_validation_batches_cover_every_row_once_with_masked_padding_rows():
  packed, _ = _random_packed(n_docs=20, seq_len=8)
  n = len(packed)
  batches = validation_batches(packed, 8, process_index=0, process_count=1)
  assert len(batches) == -(-n // 8)
  _assert_same(batches, validation_batches(packed, 8, process_index=0, process_count=1))  # fixed
  inputs = np.concatenate([b["inputs"] for b in batches])
  mask = np.concatenate([b["mask"] for b in batches])
  assert inputs.shape == (len(batches) * 8, 8)
  assert sorted(map(tuple, inputs[:n])) == sorted(map(tuple, packed.arrays()["inputs"]))
  assert (mask[n:] == 0).all() and (inputs[n:] == packed.pad_id).all()
  assert mask.sum() == packed.num_targets
  halves = [validation_batches(packed, 8, process_index=p, process_count=2) for p in range(2)]
  np.testing.assert_array_equal(np.concatenate([halves[0][0]["inputs"], halves[1][0]["inputs"]]), batches[0]["inputs"])
  assert len(validation_batches(packed, 8, process_index=0, process_count=1, max_batches=1)) == 1


# ---------------------------------------------------------------- build_data


def test_build_data_on_the_stdlib_gives_byte_batches():
  bundle = build_data(DataConfig(max_chars=100_000, seq_len=32), 4, process_index=0, process_count=1)
  assert bundle.tokenizer.vocab_size == 264 and bundle.stats["vocab_size"] == 264
  batch = next(bundle.train_iterator())
  assert set(batch) == {"inputs", "targets", "mask"} and batch["inputs"].shape == (4, 32)
  assert bundle.stats["train_docs"] > 0 and bundle.stats["val_docs"] > 0
  sample = cap_documents(load_documents("stdlib"), max_chars=100_000)
  n_bytes = sum(len(d.text.encode("utf-8")) for d in sample)
  assert bundle.stats["train_tokens"] + bundle.stats["val_tokens"] == n_bytes + len(sample)  # bytes + one EOS each
  assert len(bundle.val_batches(max_batches=2)) == 2


def test_build_data_bpe_with_cache_and_resume_state(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(30):
    (corpus / f"doc{i:02d}.txt").write_text(TEXTS[i % len(TEXTS)] * (i % 4 + 1), encoding="utf-8")
  cfg = DataConfig(source=str(corpus), tokenizer="bpe", bpe_vocab_size=300, seq_len=8, val_fraction=0.2,
                   cache_dir=str(tmp_path / "cache"))
  first = build_data(cfg, 4, process_index=0, process_count=1)
  second = build_data(cfg, 4, process_index=0, process_count=1)
  assert not first.stats["cache_hit"] and second.stats["cache_hit"]
  assert second.tokenizer.fingerprint == first.tokenizer.fingerprint
  np.testing.assert_array_equal(first.train.tokens, second.train.tokens)
  it = first.train_iterator()
  _take(it, 3)
  state = it.get_state()
  _assert_same(_take(second.train_iterator(state), 4), _take(it, 4))
  # resuming with the run directory's saved tokenizer
  first.tokenizer.save(tmp_path / "run")
  third = build_data(cfg, 4, tokenizer=load_tokenizer(tmp_path / "run"), process_index=0, process_count=1)
  np.testing.assert_array_equal(third.train.tokens, first.train.tokens)
  assert {os.path.splitext(f)[1] for f in os.listdir(tmp_path / "cache")} == {".json", ".npz"}


def test_build_data_without_validation():
  bundle = build_data(DataConfig(max_chars=20_000, val_fraction=0.0), 2, process_index=0, process_count=1)
  assert bundle.val is None and bundle.val_batches() == [] and bundle.stats["val_docs"] == 0


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"seq_len": 0}, "data.seq_len=0"),
        ({"val_fraction": 1.0}, r"data.val_fraction=1.0 must be in \[0, 1\)"),
        ({"bpe_vocab_size": 100}, "data.bpe_vocab_size=100"),
        ({"max_chars": 0}, "data.max_chars=0"),
        ({"num_epochs": 0}, "data.num_epochs=0"),
        ({"source": ""}, "data.source"),
        ({"text_key": ""}, "data.text_key"),
        ({"tokenizer": ""}, "data.tokenizer"),
    ],
)
def test_data_config_rejects_bad_settings(overrides, match):
  with pytest.raises(ValueError, match=match):
    DataConfig(**overrides)


def test_build_data_errors_name_the_problem(tmp_path):
  with pytest.raises(ValueError, match="not divisible by the 3 processes"):
    build_data(DataConfig(max_chars=1000), 4, process_index=0, process_count=3)
  with pytest.raises(FileNotFoundError, match="data.source"):
    build_data(DataConfig(source=str(tmp_path / "missing")), 4, process_index=0, process_count=1)
  with pytest.raises(FileNotFoundError, match="data.tokenizer"):
    build_data(DataConfig(max_chars=1000, tokenizer=str(tmp_path / "tok.json")), 4, process_index=0, process_count=1)
  assert DataConfig(source=["a.txt", "b.jsonl"]).source == ("a.txt", "b.jsonl")
  with pytest.raises(ValueError, match="data.seq_len=-1"):
    DataConfig().replace(seq_len=-1)
