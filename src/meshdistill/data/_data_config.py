"""`DataConfig`: where the text comes from and how it becomes training rows (the config's ``data`` section), with
its checks; `build_data` (`meshdistill.data._pipeline`) reads it."""

from __future__ import annotations

import dataclasses

from meshdistill.data._corpus import source_entries
from meshdistill.data._records import FORMATS
from meshdistill.data._tokenizer import VOCAB_MULTIPLE

# `DataConfig.packing` values: how the documents packed into one row see each other.
PACKING = {
    "stream": "rows cut from one stream; a token attends to the earlier documents of its row",
    "documents": "rows carry segment ids and positions; attention stays within a document, RoPE restarts at each",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """Where the text comes from and how it becomes training rows.

  Attributes:
    source: ``"stdlib"`` (the Python standard library's source), a ``.txt``/``.jsonl`` file, a
      directory, a glob, or ``"hf:<local dataset path>"``; several joined by commas (or a tuple).
    text_key: JSONL field / dataset column holding the text.
    format: what a record of ``source`` holds (`meshdistill.data._records`): ``text`` (``text_key``, packed),
      ``prompt_completion`` (``prompt`` / ``completion``: strings, or conversations rendered with the chat template),
      ``messages`` (conversations; the loss on every assistant turn, `meshdistill.data.chat`), or ``auto`` (by the
      fields of the first record, as TRL detects them). Records are one row each, never packed together.
    chat_template: a ``.jinja`` file whose chat template replaces the tokenizer's (e.g. one with ``{% generation %}``
      markers); None = the template in ``tokenizer``'s directory (``tokenizer_config.json`` / ``chat_template.jinja``).
    val_fraction: share of documents held out for validation, by a hash of their names; 0 = none.
    max_chars, max_docs: cap the corpus (a deterministic sample) for quick runs; None = all.
    tokenizer: ``"byte"`` (264 ids), ``"bpe"`` (byte-level BPE trained on the training split), or
      a path to a ``tokenizer.json`` (or its directory).
    bpe_vocab_size: target vocabulary of ``"bpe"`` (>= 259).
    vocab_multiple: the model vocabulary is the tokenizer's rounded up to this (divides ``tensor``).
    seq_len: T, tokens per row (must not exceed the models' ``max_len``).
    seed: shuffling seed of the training batches.
    num_epochs: passes over the training rows; None = repeat forever (the trainer's step count ends it).
    cache_dir: where tokenizers and token streams are cached; None = no cache.
    teacher_tokenizer: a teacher with its own tokenizer (``"byte"``, ``"bpe"`` or a tokenizer.json path, as
      ``tokenizer``); None = the teacher shares ``tokenizer``. Set, every text is tokenized by both and the rows
      carry the teacher's tokens and the alignment (`meshdistill.data._cross`; cross-tokenizer strategies).
    teacher_seq_len: the teacher's tokens per row with ``teacher_tokenizer``; None = ``seq_len``.
    corpora: several named corpora instead of ``source`` (``{python: stdlib, prose: /usr/share/common-licenses}``,
      each value a source as ``source`` takes it; the caps apply to each): each is split and packed on its own,
      one tokenizer over all, and every batch carries ``domain`` [B], its rows' corpus (index in this mapping's
      order; `meshdistill.data._domains`). None = ``source``.
    packing: how documents share a row (`PACKING`). ``"stream"`` (default): rows are cut from one stream of
      documents and a token attends to the documents before it in its row (standard causal-LM packing; the
      target after a document's end is still masked). ``"documents"``: every batch also carries ``segment_ids`` and
      ``positions`` (`meshdistill.core.batch.SEGMENT_KEYS`): both models attend within a document only and RoPE
      restarts at each, so a row computes what its documents compute one by one (docs/training.md).
  """

  source: str | tuple[str, ...] = "stdlib"
  text_key: str = "text"
  format: str = "auto"
  chat_template: str | None = None
  val_fraction: float = 0.05
  max_chars: int | None = None
  max_docs: int | None = None
  tokenizer: str = "byte"
  bpe_vocab_size: int = 1024
  vocab_multiple: int = VOCAB_MULTIPLE
  seq_len: int = 128
  seed: int = 0
  num_epochs: int | None = None
  cache_dir: str | None = None
  teacher_tokenizer: str | None = None
  teacher_seq_len: int | None = None
  corpora: dict | None = None
  packing: str = "stream"

  def __post_init__(self):
    if isinstance(self.source, list):
      object.__setattr__(self, "source", tuple(self.source))
    if not isinstance(self.source, (str, tuple)) or not source_entries(self.source):
      raise ValueError(
          f"data.source={self.source!r} must name a corpus: 'stdlib', a .txt/.jsonl file, a directory, a glob, "
          "or 'hf:<local dataset path>' (several separated by commas)"
      )
    if not isinstance(self.text_key, str) or not self.text_key:
      raise ValueError(f"data.text_key={self.text_key!r} must be a non-empty string, e.g. 'text'")
    if self.format not in FORMATS:
      raise ValueError(f"data.format={self.format!r}; choose one of {list(FORMATS)}")
    if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
      raise ValueError(f"data.chat_template={self.chat_template!r} must be the path of a .jinja file, or None (the "
                       "tokenizer's own template)")
    if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)) or not (
        0.0 <= self.val_fraction < 1.0
    ):
      raise ValueError(f"data.val_fraction={self.val_fraction!r} must be in [0, 1), e.g. 0.05 (0 = no validation)")
    for name in ("max_chars", "max_docs", "num_epochs"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"data.{name}={v!r} must be a positive integer or None (no limit)")
    if not isinstance(self.tokenizer, str) or not self.tokenizer:
      raise ValueError(f"data.tokenizer={self.tokenizer!r} must be 'byte', 'bpe' or a path to a tokenizer.json")
    if isinstance(self.bpe_vocab_size, bool) or not isinstance(self.bpe_vocab_size, int) or self.bpe_vocab_size < 259:
      raise ValueError(
          f"data.bpe_vocab_size={self.bpe_vocab_size!r} must be an integer >= 259 (256 bytes + PAD/BOS/EOS), e.g. 1024"
      )
    for name in ("seq_len", "vocab_multiple"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"data.{name}={v!r} must be a positive integer" + (", e.g. 128" if name == "seq_len" else ""))
    if self.teacher_tokenizer is not None and (not isinstance(self.teacher_tokenizer, str) or not self.teacher_tokenizer):
      raise ValueError(f"data.teacher_tokenizer={self.teacher_tokenizer!r} must be 'byte', 'bpe', a path to a "
                       "tokenizer.json, or None (the teacher shares data.tokenizer)")
    v = self.teacher_seq_len
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
      raise ValueError(f"data.teacher_seq_len={v!r} must be a positive integer or None (= data.seq_len)")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f"data.seed={self.seed!r} must be an integer")
    self._check_corpora()
    if self.packing not in PACKING:
      raise ValueError(f"data.packing={self.packing!r}; choose one of {tuple(PACKING)}: "
                       + "; ".join(f"{k}: {v}" for k, v in PACKING.items()))
    if self.packing == "documents" and self.teacher_tokenizer is not None:
      raise ValueError("data.packing=documents and data.teacher_tokenizer exclude each other (rows of two "
                       "tokenizations carry no segment ids yet); use data.packing=stream, or drop "
                       "data.teacher_tokenizer")

  def _check_corpora(self) -> None:
    if self.corpora is None:
      return
    example = "e.g. {python: stdlib, prose: /usr/share/common-licenses}"
    if not isinstance(self.corpora, dict) or not self.corpora:
      raise ValueError(f"data.corpora={self.corpora!r} must map corpus names to sources, {example}")
    for name, src in self.corpora.items():
      if not isinstance(name, str) or not name:
        raise ValueError(f"data.corpora: the corpus name {name!r} must be a non-empty string, {example}")
      if not isinstance(src, (str, list, tuple)) or not source_entries(src):
        raise ValueError(f"data.corpora.{name}={src!r} must name a corpus as data.source does ('stdlib', a file, a "
                         "directory, a glob, 'hf:<path>')")
    if self.format not in ("auto", "text"):
      raise ValueError(f"data.corpora takes text corpora; data.format={self.format!r} reads records from data.source: "
                       "set data.format=text or drop data.corpora")
    if self.teacher_tokenizer is not None:
      raise ValueError("data.corpora and data.teacher_tokenizer exclude each other (rows of two tokenizations are "
                       "not split by corpus yet); remove one of them")

  def replace(self, **kw) -> DataConfig:
    """A copy with ``kw`` changed (validated again)."""
    return dataclasses.replace(self, **kw)
