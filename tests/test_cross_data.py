"""Cross-tokenizer data: token bytes, aligned spans on hand-made strings, rows cut where both tokenizers agree."""

import pathlib

import numpy as np
import pytest

from meshdistill.data import ByteTokenizer, train_bpe
from meshdistill.data import CROSS_KEYS, pack_texts
from meshdistill.data._cross import tokenize_side
from meshdistill.data.alignment import align_spans, matched_vocabulary, row_alignment, token_bytes

TEXTS = [
    "héllo wörld, the cat sat on the mat. " * 3,
    "naïve café  über\n\tdone 日本語 and   spaces",
    "def f(x):\n    return x + 1\n" * 2,
    "z",
]


@pytest.fixture(scope="module")
def bpe():
  return train_bpe(TEXTS * 10, 320)


def ends_of(pieces):
  """Byte end offsets of hand-made tokens (strings)."""
  return np.cumsum([len(p.encode("utf-8")) for p in pieces])


def spans_text(pieces, span_ids):
  """The text of each span from tokens and their span ids."""
  out = {}
  for p, s in zip(pieces, span_ids):
    out[int(s)] = out.get(int(s), "") + p
  return [out[k] for k in sorted(out)]


def test_spans_of_multibyte_characters_close_where_both_cut():
  student = ["h", "é", "l", "l", "o"]  # é is two bytes: one student token
  teacher = ["hé", "llo"]
  s, t, ends = align_spans(ends_of(student), ends_of(teacher))
  assert spans_text(student, s) == spans_text(teacher, t) == ["hé", "llo"]
  np.testing.assert_array_equal(ends, [3, 6])


def test_a_token_of_one_side_spanning_three_of_the_other_is_one_span():
  student = ["a", "b", "c", " ", "de"]
  teacher = ["abc", " d", "e"]
  s, t, ends = align_spans(ends_of(student), ends_of(teacher))
  np.testing.assert_array_equal(s, [0, 0, 0, 1, 1])
  np.testing.assert_array_equal(t, [0, 1, 1])
  assert spans_text(student, s) == spans_text(teacher, t) == ["abc", " de"]


def test_whitespace_and_a_character_split_inside_its_bytes():
  # a byte-level tokenizer may split the 3 bytes of 日 across tokens; whitespace runs group differently
  b = "日".encode()
  s_ends = np.cumsum([1, 1, 2, 1, 1, 1])  # " ", " ", b[:2], b[2:], "\n", "x"
  t_ends = np.cumsum([2, 1, 3, 1])  # "  ", b[:1], b[1:] + "\n", "x"
  s, t, ends = align_spans(s_ends, t_ends)
  np.testing.assert_array_equal(ends, [2, 6, 7])
  np.testing.assert_array_equal(s, [0, 0, 1, 1, 1, 2])
  np.testing.assert_array_equal(t, [0, 1, 1, 2])
  assert len(b) == 3


def test_row_alignment_marks_masked_spans_and_pads():
  student, teacher = ["a", "b", "c", " ", "de"], ["abc", " d", "e"]
  got = row_alignment(ends_of(student), ends_of(teacher), np.array([0, 1, 1, 1, 1]), np.ones(3),
                      student_len=7, teacher_len=4, spans=4)
  np.testing.assert_array_equal(got.student_span, [-1, -1, -1, 1, 1, -1, -1])  # span 0 holds a masked token
  np.testing.assert_array_equal(got.teacher_span, [-1, 1, 1, -1])
  np.testing.assert_array_equal(got.student_last[:2], [2, 4])
  np.testing.assert_array_equal(got.teacher_last[:2], [0, 2])
  np.testing.assert_array_equal(got.span_bytes, [0, 3, 0, 0])


def test_token_bytes_spell_every_text(bpe):
  for tok in (bpe, ByteTokenizer()):
    table = token_bytes(tok)
    for text in TEXTS:
      assert b"".join(table[i] for i in tok.encode(text)) == text.encode("utf-8")
  teacher_ids, student_ids = matched_vocabulary(bpe, ByteTokenizer())
  assert len(teacher_ids) == 256  # every single byte, nothing else
  assert all(token_bytes(bpe)[t] == bytes([s]) for t, s in zip(teacher_ids, student_ids))


def test_rows_cover_every_byte_once_with_the_same_bytes_on_both_sides(bpe):
  byte = ByteTokenizer()
  packed = pack_texts(TEXTS, byte, bpe, 16, 8)
  rows = packed.arrays()
  assert set(CROSS_KEYS) <= set(rows)
  s_bytes = token_bytes(byte)
  t_bytes = token_bytes(bpe)
  text_s, text_t, counted = b"", b"", 0
  for r in range(len(packed)):
    n_s, n_t = int((rows["targets"][r] != byte.pad_id).sum()), int((rows["teacher_targets"][r] != bpe.pad_id).sum())
    row_s = b"".join(s_bytes[i] or b"|" for i in rows["targets"][r][:n_s])
    row_t = b"".join(t_bytes[i] or b"|" for i in rows["teacher_targets"][r][:n_t])
    assert row_s == row_t  # a row is cut where both tokenizers cut
    assert n_s <= 16 and n_t <= 8
    text_s, text_t = text_s + row_s, text_t + row_t
    # every counted span has the same bytes on both sides
    for span in range(packed.spans):
      if rows["span_bytes"][r, span]:
        a = b"".join(s_bytes[i] or b"|" for i in rows["targets"][r][rows["student_span"][r] == span])
        b = b"".join(t_bytes[i] or b"|" for i in rows["teacher_targets"][r][rows["teacher_span"][r] == span])
        assert a == b and len(a) == rows["span_bytes"][r, span]
        counted += len(a)
  assert text_s == b"|".join(t.encode() for t in TEXTS) + b"|"  # every byte once, EOS after each document
  # inputs are the targets shifted by one, on both sides
  np.testing.assert_array_equal(rows["inputs"][1:, 0], rows["targets"][:-1, (rows["targets"][:-1] != 256).sum(1) - 1]
                                .diagonal())
  assert counted > 0.8 * len(text_s)


def test_a_document_first_token_is_masked_on_both_sides(bpe):
  packed = pack_texts(["ab cd", "ef gh"], ByteTokenizer(), bpe, 32, 32)
  row = packed[0]
  first_s = np.flatnonzero(row["inputs"] == ByteTokenizer.eos_id)
  first_t = np.flatnonzero(row["teacher_inputs"] == bpe.eos_id)
  assert row["mask"][first_s].sum() == 0 and row["teacher_mask"][first_t].sum() == 0
  assert (row["student_span"][first_s] == -1).all()


def test_rows_that_cannot_be_cut_name_the_settings(bpe):
  with pytest.raises(ValueError, match="data.seq_len=2"):
    pack_texts(["hello there"], ByteTokenizer(), bpe, 2, 2)


def test_a_tokenizer_that_does_not_spell_bytes_is_refused():
  class Lossy(ByteTokenizer):
    def encode_batch(self, texts):
      return [np.frombuffer(t.lower().encode()[:-1], np.uint8).astype(np.int32) for t in texts]

  with pytest.raises(ValueError, match="data.teacher_tokenizer"):
    tokenize_side(["Hello"], Lossy(), setting="data.teacher_tokenizer")


def test_build_data_with_a_teacher_tokenizer_gives_both_tokenizations(tmp_path):
  from helpers import write_corpus

  from meshdistill.data import DataConfig, PackedPairs, build_data

  write_corpus(tmp_path / "corpus", n_docs=12)
  cfg = DataConfig(source=str(tmp_path / "corpus"), val_fraction=0.2, seq_len=32, teacher_tokenizer="bpe",
                   bpe_vocab_size=300, teacher_seq_len=16)
  bundle = build_data(cfg, batch_size=4, process_index=0, process_count=1)
  assert isinstance(bundle.train, PackedPairs) and bundle.teacher_tokenizer.vocab_size > 256
  batch = next(bundle.train_iterator())
  assert batch["inputs"].shape == (4, 32) and batch["teacher_inputs"].shape == (4, 16)
  assert batch["span_bytes"].shape == (4, 16) and batch["span_bytes"].sum() > 0
  val = bundle.val_batches(max_batches=1)
  assert val and val[0]["teacher_targets"].shape == (4, 16)
  with pytest.raises(ValueError, match="data.teacher_seq_len"):
    DataConfig(teacher_tokenizer="bpe", teacher_seq_len=0)


def test_the_config_refuses_one_vocabulary_strategies_with_two_tokenizers_and_names_the_ones_that_align():
  from meshdistill.config import ConfigError, load_config

  for kind in ("logit_kd", "attention_transfer"):
    with pytest.raises(ConfigError, match=r"refused; choose distill.kind in \['byte_kl', 'span_kl', 'uld'\]"):
      load_config(None, ["data.teacher_tokenizer=bpe", f"distill.kind={kind}"])
  with pytest.raises(ConfigError, match="set data.teacher_tokenizer"):
    load_config(None, ["distill.kind=uld"])
  with pytest.raises(ConfigError, match="data.teacher_tokenizer"):
    load_config(None, ["teacher.vocab_size=1024"])
  with pytest.raises(ConfigError, match="teacher.max_len=128 is shorter"):
    load_config(None, ["data.teacher_tokenizer=bpe", "distill.kind=uld", "data.teacher_seq_len=256"])
  cfg = load_config(str(pathlib.Path(__file__).parents[1] / "configs" / "cross_tokenizer.yaml"))
  assert cfg.distill.kind == "byte_kl" and cfg.data.teacher_tokenizer == "bpe"


def test_teacher_rows_rebuilt_for_any_student_cover_the_same_bytes_and_cut_at_characters(bpe):
  """A cross-tokenizer cache's rows: cut on the teacher's tokens alone (at character starts), the student's side
  re-tokenized from the row's bytes; every byte a target once, both sides spelling the same bytes."""
  from meshdistill.data import StudentRows, cut_teacher_rows  # noqa: PLC0415

  stream = tokenize_side(TEXTS, bpe)
  rows = cut_teacher_rows(stream, bpe, 6)
  assert rows.bounds[0, 0] == 1 and (rows.bounds[1:, 0] == rows.bounds[:-1, 1]).all()  # no gap, no overlap
  assert rows.bounds[-1, 1] == stream.tokens.size
  spelled = token_bytes(bpe)
  for lo in rows.bounds[1:, 0]:  # a row starts where a character starts
    assert not 0x80 <= spelled[stream.tokens[lo]][0] < 0xC0 or stream.tokens[lo] == bpe.eos_id
  part = rows.rows(np.arange(len(rows)))
  for student in (ByteTokenizer(), train_bpe(TEXTS * 10, 280)):
    batch = StudentRows(bpe, student, 24).batch(part)
    assert set(CROSS_KEYS) <= set(batch) and batch["inputs"].shape == (len(rows), 24)
    s_bytes, eos = token_bytes(student), student.eos_id
    spell = lambda ids, table, end: b"".join(b"|" if t == end else table[t] or b"" for t in ids)  # noqa: E731
    for r in range(len(rows)):
      t_text = spell(batch["teacher_targets"][r], spelled, bpe.eos_id)
      s_text = spell(batch["targets"][r], s_bytes, eos)
      assert s_text and t_text.startswith(s_text), r  # the student spells the row's bytes (cut at its own length)
      assert batch["span_bytes"][r].sum() <= len(s_text)
      # the first input: the student's token of the character before the row (end of text after a document)
      prev = batch["teacher_inputs"][r][0]
      assert (batch["inputs"][r][0] == eos) == (prev == bpe.eos_id)
      assert (batch["mask"][r][0] == 0) == (prev == bpe.eos_id)  # a document's first token is masked
    assert batch["span_bytes"].sum() > 0.5 * sum(len(spell(t, spelled, bpe.eos_id)) for t in batch["teacher_targets"])
  with pytest.raises(ValueError, match="data.teacher_seq_len"):
    cut_teacher_rows(stream, bpe, 0)
