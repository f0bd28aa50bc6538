"""Tokenizers: a byte-level default, and Hugging Face ``tokenizers`` BPE (trained here or loaded).

Every tokenizer follows the `Tokenizer` protocol. ``vocab_size`` is the size the model's
embedding must have: it is rounded UP to a multiple of ``VOCAB_MULTIPLE`` (8) so that the
vocabulary axis divides a ``tensor`` mesh axis of 1, 2, 4 or 8; ids past the tokenizer's own
vocabulary are never produced.

Byte-level ids (`ByteTokenizer`)::

  0..255   the UTF-8 bytes of the text
  256      PAD   (padding; always masked out of the loss)
  257      BOS   (reserved; the packer does not insert it)
  258      EOS   (ends every document)
  259..263 unused, so that vocab_size = 264 = 8 * 33

BPE (`train_bpe`) is byte-level (GPT-2 style byte alphabet), so every text has an encoding and
nothing maps to an unknown token. Its special tokens come first: ``<|pad|>`` = 0,
``<|bos|>`` = 1, ``<|eos|>`` = 2.

Special-token strings that occur in the corpus text (say a literal ``<|eos|>``) are encoded as
plain text, never as the special id: documents are separated by the packer, not by markers in
the text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

log = logging.getLogger(__name__)

VOCAB_MULTIPLE = 8
BYTE_FORMAT = "meshdistill.byte_tokenizer"
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
# Names other tokenizers use for end-of-text / padding, tried in order when loading a tokenizer.json.
EOS_CANDIDATES = (EOS_TOKEN, "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
PAD_CANDIDATES = (PAD_TOKEN, "<pad>", "<|padding|>", "[PAD]")
BOS_CANDIDATES = (BOS_TOKEN, "<s>", "<bos>", "<|begin_of_text|>", "[CLS]")


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of ``multiple`` that is >= ``n``."""
  return -(-n // multiple) * multiple


@runtime_checkable
class Tokenizer(Protocol):
  """What the data pipeline and the trainer need from a tokenizer."""

  vocab_size: int  # model vocabulary size (a multiple of VOCAB_MULTIPLE); every id is < vocab_size
  eos_id: int  # appended after every document
  pad_id: int  # fills the final partial sequence; always masked
  bos_id: int | None

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added)."""

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """``encode`` of many texts, as int32 arrays (may run in parallel)."""

  def decode(self, ids: Iterable[int]) -> str:
    """Text of ``ids``; special and unused ids are dropped."""

  def save(self, path: str | os.PathLike) -> str:
    """Writes the tokenizer to ``path`` (a file, or a directory that receives ``tokenizer.json``)."""

  @property
  def fingerprint(self) -> str:
    """A digest that changes whenever encoding would change (used as a cache key)."""


def tokenizer_file(path: str | os.PathLike) -> str:
  """The ``tokenizer.json`` a path names: the path itself if it names a ``.json`` file, else that file in the
  directory."""
  path = os.fspath(path)
  if os.path.isdir(path) or not path.endswith(".json"):
    return os.path.join(path, "tokenizer.json")
  return path


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, plus PAD=256, BOS=257, EOS=258; ``vocab_size`` = 264."""

  pad_id = 256
  bos_id: int | None = 257  # the protocol's type: other tokenizers may have none
  eos_id = 258
  vocab_size = round_up(259, VOCAB_MULTIPLE)

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

  def save(self, path: str | os.PathLike) -> str:
    out = tokenizer_file(path)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
      json.dump({"format": BYTE_FORMAT, "version": 1, "vocab_size": self.vocab_size}, f, indent=2)
    return out

  @property
  def fingerprint(self) -> str:
    return "byte-v1"

  def __repr__(self) -> str:
    return f"ByteTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
  """A Hugging Face ``tokenizers.Tokenizer`` behind the `Tokenizer` protocol.

  Args:
    tok: the ``tokenizers.Tokenizer``.
    vocab_multiple: ``vocab_size`` is the tokenizer's size rounded up to this multiple.

  Raises:
    ValueError: the vocabulary has no end-of-text token (one of ``EOS_CANDIDATES``).
  """

  def __init__(self, tok, *, vocab_multiple: int = VOCAB_MULTIPLE):
    if not isinstance(vocab_multiple, int) or vocab_multiple < 1:
      raise ValueError(f"vocab_multiple={vocab_multiple!r} must be a positive integer (e.g. 8 or 128)")
    self._tok = tok
    tok.encode_special_tokens = True  # a literal "<|eos|>" in the corpus is text, not a separator
    eos = _first_id(tok, EOS_CANDIDATES)
    if eos is None:
      raise ValueError(
          f"tokenizer has none of the end-of-text tokens {list(EOS_CANDIDATES)}; the packer needs one to "
          "separate documents. Add one as a special token, or use tokenizer='byte' / 'bpe'."
      )
    self.eos_id = eos
    pad = _first_id(tok, PAD_CANDIDATES)
    self.pad_id = eos if pad is None else pad  # padding is always masked, so sharing EOS is harmless
    self.bos_id = _first_id(tok, BOS_CANDIDATES)
    self.base_vocab_size = tok.get_vocab_size(with_added_tokens=True)
    self.vocab_size = round_up(self.base_vocab_size, vocab_multiple)
    self._fingerprint = hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()[:16]

  @property
  def hf_tokenizer(self):
    """The wrapped ``tokenizers.Tokenizer``."""
    return self._tok

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, np.int32) for e in encs]

  def decode(self, ids: Iterable[int]) -> str:
    ids = [int(i) for i in ids if 0 <= int(i) < self.base_vocab_size]
    return self._tok.decode(ids, skip_special_tokens=True)

  def save(self, path: str | os.PathLike) -> str:
    out = tokenizer_file(path)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    self._tok.save(out)
    return out

  @property
  def fingerprint(self) -> str:
    return self._fingerprint

  def __repr__(self) -> str:
    return f"HFTokenizer(vocab_size={self.vocab_size}, base={self.base_vocab_size}, eos_id={self.eos_id})"


def _first_id(tok, names: Sequence[str]) -> int | None:
  for name in names:
    i = tok.token_to_id(name)
    if i is not None:
      return i
  return None


def train_bpe(texts: Iterable[str], vocab_size: int, *, vocab_multiple: int = VOCAB_MULTIPLE) -> HFTokenizer:
  """Trains a byte-level BPE tokenizer on ``texts``.

  Args:
    texts: training documents (use the training split only).
    vocab_size: target size including the 256-byte alphabet and 3 special tokens; a small corpus
      may stop short of it (no pair left to merge). The returned ``vocab_size`` is the trained size
      rounded up to ``vocab_multiple``.

  Raises:
    ValueError: ``vocab_size`` < 259 (256 bytes + PAD/BOS/EOS).
  """
  from tokenizers import Tokenizer as _HFTok  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers

  minimum = 256 + 3
  if not isinstance(vocab_size, int) or vocab_size < minimum:
    raise ValueError(
        f"data.bpe_vocab_size={vocab_size!r} must be an integer >= {minimum} "
        "(256 byte tokens + PAD/BOS/EOS); e.g. 1024 or 4096"
    )
  tok = _HFTok(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  out = HFTokenizer(tok, vocab_multiple=vocab_multiple)
  log.info("trained byte-level BPE: %d tokens (vocab_size %d)", out.base_vocab_size, out.vocab_size)
  return out


def load_tokenizer(path: str | os.PathLike, *, vocab_multiple: int = VOCAB_MULTIPLE) -> Tokenizer:
  """Loads a tokenizer saved by ``save`` or any Hugging Face ``tokenizer.json``.

  ``path`` is the JSON file or a directory holding ``tokenizer.json``.

  Raises:
    FileNotFoundError: nothing at ``path``.
    ValueError: the file is not a tokenizer.
  """
  file = tokenizer_file(path)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"data.tokenizer: no tokenizer file at {file!r} (give a tokenizer.json or its directory)")
  with open(file, encoding="utf-8") as f:
    try:
      spec = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"data.tokenizer: {file!r} is not valid JSON ({e})") from None
  if isinstance(spec, dict) and spec.get("format") == BYTE_FORMAT:
    return ByteTokenizer()
  from tokenizers import Tokenizer as _HFTok  # pylint: disable=g-import-not-at-top

  try:
    tok = _HFTok.from_file(file)
  except Exception as e:  # tokenizers raises a bare Exception on malformed files
    raise ValueError(f"data.tokenizer: {file!r} is not a Hugging Face tokenizer.json ({e})") from None
  return HFTokenizer(tok, vocab_multiple=vocab_multiple)
