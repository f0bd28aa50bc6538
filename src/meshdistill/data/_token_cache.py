"""The data cache: a trained BPE tokenizer and tokenized documents stored in ``pretrain.cache_dir``, keyed by a digest
of the documents (keys and texts) and the tokenizer, so a cached result is reused only for identical input. Files
are written whole (a temporary file renamed), so a crash never leaves a partial entry; an unreadable entry is
ignored and written again."""

from __future__ import annotations

import hashlib
import logging
import os
import time

import numpy as np

from meshdistill.core.fsutil import write_file_atomic
from meshdistill.data._corpus import Document
from meshdistill.data._data_config import DataConfig
from meshdistill.data._packing import TokenStream, tokenize_documents
from meshdistill.data._tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

log = logging.getLogger(__name__)

_CACHE_VERSION = "1"


def _digest(*parts: str) -> str:
  h = hashlib.sha256()
  for p in parts:
    b = p.encode("utf-8")
    h.update(len(b).to_bytes(8, "little"))
    h.update(b)
  return h.hexdigest()[:24]


def documents_digest(docs: list[Document]) -> str:
  """A digest of the documents' keys and texts (cache key)."""
  return _digest(*(x for d in docs for x in (d.key, d.text)))


def resolve_tokenizer(cfg: DataConfig, train_docs: list[Document], cache_dir: str | None = None) -> Tokenizer:
  """The tokenizer ``cfg.tokenizer`` names; ``"bpe"`` is trained on ``train_docs`` (cached)."""
  if cfg.tokenizer == "byte":
    return ByteTokenizer()
  if cfg.tokenizer != "bpe":
    return load_tokenizer(cfg.tokenizer, vocab_multiple=cfg.vocab_multiple)
  import tokenizers  # pylint: disable=g-import-not-at-top

  path = None
  if cache_dir:
    key = _digest(_CACHE_VERSION, documents_digest(train_docs), str(cfg.bpe_vocab_size), tokenizers.__version__)
    path = os.path.join(cache_dir, f"bpe-{key}.json")
    if os.path.isfile(path):
      log.info("data: BPE tokenizer from cache %s", path)
      return load_tokenizer(path, vocab_multiple=cfg.vocab_multiple)
  t0 = time.perf_counter()
  tok = train_bpe((d.text for d in train_docs), cfg.bpe_vocab_size, vocab_multiple=cfg.vocab_multiple)
  log.info("data: trained BPE (%d tokens) in %.1fs", tok.base_vocab_size, time.perf_counter() - t0)
  if path:
    write_file_atomic(path, lambda tmp: tok.hf_tokenizer.save(tmp))
  return tok


def cached_stream(docs: list[Document], tokenizer: Tokenizer, cache_dir: str | None) -> tuple[TokenStream, bool]:
  """``docs`` tokenized by ``tokenizer``, from the cache in ``cache_dir`` where it holds them (then True) or
  tokenized now and stored there (False)."""
  path = None
  if cache_dir:
    key = _digest(_CACHE_VERSION, documents_digest(docs), tokenizer.fingerprint)
    path = os.path.join(cache_dir, f"tokens-{key}.npz")
    if os.path.isfile(path):
      try:
        with np.load(path) as z:
          return TokenStream(z["tokens"], z["doc_lengths"]), True
      except (OSError, ValueError, KeyError) as e:
        log.warning("data: ignoring unreadable cache file %s (%s)", path, e)
  stream = tokenize_documents([d.text for d in docs], tokenizer)
  if path:

    def write(tmp):
      with open(tmp, "wb") as f:
        np.savez(f, tokens=stream.tokens, doc_lengths=stream.doc_lengths)

    write_file_atomic(path, write)
  return stream, False
