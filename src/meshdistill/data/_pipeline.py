"""The data entry point for the trainer: `DataConfig` -> `build_data` -> `DataBundle`.

``build_data`` reads the corpus, splits it by document, builds (or takes) the tokenizer,
tokenizes both splits and packs them into rows of ``seq_len``. With a cache directory the
trained BPE tokenizer and the token streams are stored there (`meshdistill.data._token_cache`), keyed by a digest of
the split's documents (keys and texts) and the tokenizer, so a cached result is reused only for identical
input; the stdlib corpus is ~12 M characters: byte-level tokenizing takes well under a second,
BPE training + tokenizing ~20 s on two cores, a cache hit ~1 s.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Any

import numpy as np

from meshdistill.data import chat
from meshdistill.data._cross import PackedPairs, pack_texts
from meshdistill.data._corpus import Document, cap_documents, load_documents, split_documents
from meshdistill.data._data_config import DataConfig
from meshdistill.data._domains import PackedCorpora
from meshdistill.data._records import RecordRows, cap_records, load_records, needs_template, record_rows
from meshdistill.data._records import record_text, resolve_format, split_records
from meshdistill.data._loader import TrainIterator, process_slice, validation_batches
from meshdistill.data._packing import PackedSequences, pack
from meshdistill.data._token_cache import cached_stream, resolve_tokenizer
from meshdistill.data._tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class DataBundle:
  """Everything the trainer needs from the data; built by `build_data`.

  Attributes:
    config: the settings it was built from.
    tokenizer: the `Tokenizer`; the models' ``vocab_size`` must equal ``tokenizer.vocab_size``.
    train, val: packed rows, or one record a row (`RecordRows`, ``data.format`` other than text); ``val`` is None
      when ``val_fraction`` is 0.
    global_batch_size: B, rows per step over all processes.
    process_index, process_count: which slice of every batch this process reads.
    stats: counts (documents, tokens, rows, trained targets per split, batches per epoch, seconds).
    teacher_tokenizer: the teacher's own `Tokenizer` (``config.teacher_tokenizer``); then ``train`` / ``val`` are
      `meshdistill.data._cross.PackedPairs`. None: one tokenizer.
  """

  config: DataConfig
  tokenizer: Tokenizer
  train: PackedSequences | PackedPairs | RecordRows
  val: PackedSequences | PackedPairs | RecordRows | None
  global_batch_size: int
  process_index: int
  process_count: int
  stats: dict[str, Any]
  teacher_tokenizer: Tokenizer | None = None

  @property
  def domains(self) -> tuple[str, ...] | None:
    """The corpus names of ``data.corpora`` (a batch's ``domain`` indexes them), or None for one corpus."""
    return None if self.config.corpora is None else tuple(self.config.corpora)

  @property
  def local_batch_size(self) -> int:
    """Rows per batch on this process: ``global_batch_size / process_count``."""
    return self.global_batch_size // self.process_count

  @property
  def segments(self) -> bool:
    """Whether batches carry ``segment_ids`` and ``positions`` (``data.packing: documents``)."""
    return self.config.packing == "documents"

  def train_iterator(
      self, state: dict[str, Any] | None = None, *, segments: bool | None = None, row_ids: bool = False
  ) -> TrainIterator:
    """A fresh training iterator, positioned at ``state`` (from ``TrainIterator.get_state``) if given; ``segments``
    (batches carry ``segment_ids`` and ``positions``) defaults to ``data.packing: documents``."""
    it = TrainIterator(
        self.train,
        global_batch_size=self.global_batch_size,
        seed=self.config.seed,
        num_epochs=self.config.num_epochs,
        process_index=self.process_index,
        process_count=self.process_count,
        segments=self.segments if segments is None else segments,
        row_ids=row_ids,
    )
    if state is not None:
      it.set_state(state)
    return it

  def teacher_side(self) -> DataBundle:
    """The data a teacher of its own tokenizer is obtained (pretrained) on: the same documents through
    ``teacher_tokenizer`` alone (single-tokenizer rows), at this bundle's batch size and process slice; the bundle
    itself when the teacher shares the tokenizer."""
    if self.teacher_tokenizer is None:
      return self
    own = self.config.replace(tokenizer=self.config.teacher_tokenizer, teacher_tokenizer=None, teacher_seq_len=None)
    return build_data(own, self.global_batch_size, tokenizer=self.teacher_tokenizer, process_index=self.process_index,
                      process_count=self.process_count)

  def val_batches(
      self, max_batches: int | None = None, *, segments: bool | None = None
  ) -> list[dict[str, np.ndarray]]:
    """The fixed validation batches (this process's rows); ``[]`` when there is no validation split. ``segments`` as
    in `train_iterator`."""
    if self.val is None:
      return []
    return validation_batches(
        self.val,
        self.global_batch_size,
        process_index=self.process_index,
        process_count=self.process_count,
        max_batches=max_batches,
        segments=self.segments if segments is None else segments,
    )


def build_data(
    cfg: DataConfig,
    batch_size: int,
    *,
    tokenizer: Tokenizer | None = None,
    cache_dir: str | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> DataBundle:
  """Reads, splits, tokenizes and packs the corpus of ``cfg``.

  Args:
    cfg: the data settings.
    batch_size: the GLOBAL batch size (rows per step over all processes).
    tokenizer: use this tokenizer instead of building ``cfg.tokenizer`` (e.g. the one saved in a
      run directory, when resuming).
    cache_dir: overrides ``cfg.cache_dir``.
    process_index, process_count: this process's share of each batch (default: JAX's).

  Raises:
    ValueError: bad settings (named), an empty corpus, a batch size the processes cannot share,
      or token ids outside the tokenizer's ``vocab_size``.
    FileNotFoundError: a source or tokenizer path that does not exist.
  """
  t0 = time.perf_counter()
  lo, hi = process_slice(batch_size, process_index, process_count)
  process_count = batch_size // (hi - lo)
  process_index = lo // (hi - lo)
  cache_dir = cache_dir if cache_dir is not None else cfg.cache_dir
  if cfg.corpora is not None:
    return _build_corpora(cfg, batch_size, tokenizer, cache_dir, process_index, process_count, t0)
  fmt = resolve_format(cfg.format, cfg.source, cfg.text_key)
  if fmt != "text":
    return _build_records(cfg, fmt, batch_size, tokenizer, cache_dir, process_index, process_count, t0)
  docs = load_documents(cfg.source, text_key=cfg.text_key)
  docs = cap_documents(docs, max_chars=cfg.max_chars, max_docs=cfg.max_docs)
  train_docs, val_docs = split_documents(docs, cfg.val_fraction)
  log.info("data: %d documents -> %d train, %d validation", len(docs), len(train_docs), len(val_docs))
  tok = tokenizer if tokenizer is not None else resolve_tokenizer(cfg, train_docs, cache_dir)
  train_stream, hit_train = cached_stream(train_docs, tok, cache_dir)
  val_stream, hit_val = cached_stream(val_docs, tok, cache_dir) if val_docs else (None, False)
  for name, s in (("train", train_stream), ("validation", val_stream)):
    if s is not None and s.tokens.size and (s.tokens.min() < 0 or s.tokens.max() >= tok.vocab_size):
      raise ValueError(
          f"{name} tokens span ids {s.tokens.min()}..{s.tokens.max()} but the tokenizer's vocab_size is "
          f"{tok.vocab_size}; the tokenizer or cache is inconsistent (clear data.cache_dir)"
      )
  train = pack(train_stream, cfg.seq_len, tok.pad_id)
  val = pack(val_stream, cfg.seq_len, tok.pad_id) if val_stream is not None and val_stream.tokens.size >= 2 else None
  teacher_tok = None
  if cfg.teacher_tokenizer is not None:  # two tokenizations of the same texts, cut where both agree
    try:
      teacher_tok = resolve_tokenizer(cfg.replace(tokenizer=cfg.teacher_tokenizer), train_docs, cache_dir)
    except (FileNotFoundError, ValueError) as e:  # named for the setting that gave the path
      said = str(e).replace("data.tokenizer", "data.teacher_tokenizer")
      raise (FileNotFoundError(said) if isinstance(e, FileNotFoundError) else ValueError(said)) from None
    pair = lambda docs: pack_texts([d.text for d in docs], tok, teacher_tok, cfg.seq_len, cfg.teacher_seq_len)  # noqa: E731
    train = pair(train_docs)
    val = pair(val_docs) if val is not None else None
  stats = {
      "train_docs": train.num_docs,
      "val_docs": 0 if val is None else val.num_docs,
      "train_tokens": train.num_tokens,
      "val_tokens": 0 if val is None else val.num_tokens,
      "train_rows": len(train),
      "val_rows": 0 if val is None else len(val),
      "train_targets": train.num_targets,
      "val_targets": 0 if val is None else val.num_targets,
      "batches_per_epoch": len(train) / batch_size,
      "vocab_size": tok.vocab_size,
      "cache_hit": hit_train and (hit_val or not val_docs),
      "seconds": round(time.perf_counter() - t0, 3),
  }
  log.info("data: %s", stats)
  return DataBundle(
      config=cfg,
      tokenizer=tok,
      train=train,
      val=val,
      global_batch_size=batch_size,
      process_index=process_index,
      process_count=process_count,
      stats=stats,
      teacher_tokenizer=teacher_tok,
  )


def _build_corpora(cfg: DataConfig, batch_size, tokenizer, cache_dir, process_index, process_count, t0) -> DataBundle:
  """`build_data` of ``data.corpora``: each corpus read, capped, split and packed on its own (`PackedCorpora`)."""
  splits = []
  for name, src in cfg.corpora.items():
    docs = cap_documents(load_documents(src, text_key=cfg.text_key), max_chars=cfg.max_chars, max_docs=cfg.max_docs)
    splits.append(split_documents(docs, cfg.val_fraction))
    log.info("data: corpus %s: %d documents -> %d train, %d validation", name, len(docs), *map(len, splits[-1]))
  tok = tokenizer if tokenizer is not None else resolve_tokenizer(cfg, [d for tr, _ in splits for d in tr], cache_dir)

  def packed(which: int) -> PackedCorpora | None:
    parts, domains = [], []
    for i, split in enumerate(splits):
      stream = cached_stream(split[which], tok, cache_dir)[0] if split[which] else None
      if stream is not None and stream.tokens.size >= 2:
        parts.append(pack(stream, cfg.seq_len, tok.pad_id))
        domains.append(i)
    return PackedCorpora(parts, domains, tuple(cfg.corpora)) if parts else None

  train, val = packed(0), packed(1)
  if train is None:
    raise ValueError(f"data.corpora={cfg.corpora!r} holds no training text; add text to the corpora")
  missing = sorted(set(cfg.corpora) - {tuple(cfg.corpora)[d] for d in train.domains})
  if missing:
    raise ValueError(f"data.corpora: {missing} give no training rows (all their documents went to validation, or "
                     "they are empty); add text or lower data.val_fraction")
  stats = {
      "train_docs": train.num_docs, "val_docs": 0 if val is None else val.num_docs,
      "train_tokens": train.num_tokens, "val_tokens": 0 if val is None else val.num_tokens,
      "train_rows": len(train), "val_rows": 0 if val is None else len(val),
      "train_targets": train.num_targets, "val_targets": 0 if val is None else val.num_targets,
      "batches_per_epoch": len(train) / batch_size, "vocab_size": tok.vocab_size,
      "domains": {name: int(np.sum(train.domain_rows() == i)) for i, name in enumerate(cfg.corpora)},
      "cache_hit": False, "seconds": round(time.perf_counter() - t0, 3),
  }
  log.info("data: %s", stats)
  return DataBundle(config=cfg, tokenizer=tok, train=train, val=val, global_batch_size=batch_size,
                    process_index=process_index, process_count=process_count, stats=stats)


def _build_records(cfg: DataConfig, fmt: str, batch_size, tokenizer, cache_dir, process_index, process_count,
                   t0) -> DataBundle:
  """`build_data` of prompt/completion or conversation records: one record a row (`meshdistill.data._records`)."""
  if cfg.teacher_tokenizer is not None:
    raise ValueError(f"data.format={fmt!r} with data.teacher_tokenizer (a teacher of another tokenizer) is not "
                     "supported: its rows are cut from packed text; use data.format=text or drop data.teacher_tokenizer")
  records = cap_records(load_records(cfg.source, fmt), cfg.max_chars, cfg.max_docs)
  train_r, val_r = split_records(records, cfg.val_fraction)
  log.info("data: %d %s records -> %d train, %d validation", len(records), fmt, len(train_r), len(val_r))
  tok = tokenizer if tokenizer is not None else resolve_tokenizer(
      cfg, [Document(r.key, record_text(r)) for r in train_r], cache_dir)
  chat_tok = None
  if needs_template(records, fmt):
    try:
      chat_tok = chat.load_chat_tokenizer(cfg.tokenizer, cfg.chat_template)
    except chat.NoChatTemplate as e:
      chat_tok = e  # raised by the first record that needs a template
    eos = getattr(chat_tok, "eos_token_id", None)
    if eos is not None and eos != tok.eos_id:  # conversations end with the end-of-turn token: generation stops there
      tok = copy.copy(tok)
      tok.eos_id = int(eos)
      log.info("data: end of a conversation (the sampler's stop token) = the chat tokenizer's eos %r (id %d)",
               chat_tok.eos_token, eos)
  train = record_rows(train_r, fmt, tok, chat_tok, cfg.seq_len, split="train")
  val = record_rows(val_r, fmt, tok, chat_tok, cfg.seq_len, split="validation") if val_r else None
  stats = {
      "format": fmt, "train_docs": train.num_docs, "val_docs": 0 if val is None else val.num_docs,
      "train_tokens": train.num_tokens, "val_tokens": 0 if val is None else val.num_tokens,
      "train_rows": len(train), "val_rows": 0 if val is None else len(val),
      "train_targets": train.num_targets, "val_targets": 0 if val is None else val.num_targets,
      "batches_per_epoch": len(train) / batch_size, "vocab_size": tok.vocab_size,
      "cache_hit": False, "seconds": round(time.perf_counter() - t0, 3),
  }
  log.info("data: %s", stats)
  return DataBundle(config=cfg, tokenizer=tok, train=train, val=val, global_batch_size=batch_size,
                    process_index=process_index, process_count=process_count, stats=stats)
