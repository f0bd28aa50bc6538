"""Records (one JSON object or dataset row each) as training rows: prompt/completion pairs and conversations.

``data.format`` says what a record of ``data.source`` holds (the column names TRL's trainers use):

``text``
  ``data.text_key``: plain text, packed into rows (`meshdistill.data._packing`); every source kind.
``prompt_completion``
  ``prompt`` and ``completion``. Strings: ``encode(prompt) + encode(completion) + EOS`` with no template, the loss on
  the completion and its EOS. Conversations (lists of ``{role, content}`` turns, the completion the assistant's
  reply): rendered together with the chat template (`meshdistill.data.chat`), the loss on the completion's assistant
  turns only.
``messages``
  ``messages``: a conversation ending with the assistant, the loss on every assistant turn (`meshdistill.data.chat`).
``auto``
  By the fields of the source's first record: ``data.text_key`` -> text, else ``messages`` -> messages, else
  ``prompt`` + ``completion`` -> prompt_completion; a source that is not JSONL or a dataset is text.

Records come from ``.jsonl`` files (a directory: its ``.jsonl`` files; a glob) and ``hf:<path>`` (a ``save_to_disk``
directory, a ``.parquet`` / ``.json`` / ``.jsonl`` / ``.arrow`` / ``.csv`` file), with keys like the corpus's
(``path:line``, ``hf:path#split/i``), which decide the train / validation split (by a hash, as documents).

Each record is one row of ``data.seq_len`` positions (`RecordRows`), right-padded, never packed with another (so it
attends to nothing but itself); a record longer than a row is cut at ``seq_len + 1`` tokens (logged), one left with
no trained token is dropped (logged).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Sequence

import numpy as np

from meshdistill.data import chat
from meshdistill.data._corpus import _HF_FILE_BUILDERS, Document, _unit, cap_documents, json_lines, source_entries

log = logging.getLogger(__name__)

FORMATS = ("auto", "text", "prompt_completion", "messages")
RECORD_FIELDS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion")}


@dataclasses.dataclass(frozen=True)
class Record:
  """One record: its stable ``key`` (which decides its split) and its ``fields``."""

  key: str
  fields: dict


def _is_jsonl(path: str) -> bool:
  return path.endswith(".jsonl")


def _jsonl_paths(entry: str) -> list[str]:
  path = os.path.expanduser(entry)
  if any(c in entry for c in "*?["):
    return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p) and _is_jsonl(p))
  if os.path.isdir(path):
    return sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names
                  if _is_jsonl(n) and not n.startswith("."))
  return [path] if os.path.isfile(path) and _is_jsonl(path) else []


def _first_fields(source) -> set[str] | None:
  """The fields of the first record of ``source`` (None: not a record source)."""
  entry = source_entries(source)[0]
  if entry.startswith("hf:"):
    return set(_hf_datasets(entry)[0][1].column_names)
  for path in _jsonl_paths(entry):
    with open(path, encoding="utf-8", errors="replace") as f:
      for line in f:
        if line.strip():
          try:
            obj = json.loads(line)
          except json.JSONDecodeError:
            return None  # the reader names the bad line
          return set(obj) if isinstance(obj, dict) else None
  return None


def resolve_format(fmt: str, source, text_key: str) -> str:
  """``fmt``, or for ``auto`` the format the fields of ``source``'s first record say (see the module)."""
  if fmt != "auto":
    return fmt
  fields = _first_fields(source)
  if fields is None or text_key in fields:
    return "text"
  for name, needs in RECORD_FIELDS.items():
    if set(needs) <= fields:
      log.info("data.format=auto: %s (fields %s)", name, sorted(fields))
      return name
  return "text"  # the text reader names the missing data.text_key and the fields it found


def _hf_datasets(entry: str) -> list:
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(f"data.source={entry!r} needs the 'datasets' package: pip install datasets") from None
  path = os.path.expanduser(entry[3:])
  if not os.path.exists(path):
    raise FileNotFoundError(f"data.source={entry!r}: no local dataset at {path!r} (only local paths are read)")
  if os.path.isdir(path):
    loaded = datasets.load_from_disk(path)
    return sorted(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
  builder = _HF_FILE_BUILDERS.get(os.path.splitext(path)[1])
  if builder is None:
    raise ValueError(f"data.source={entry!r}: cannot read {path!r} as a dataset; give a save_to_disk directory or a "
                     f"file ending in {sorted(_HF_FILE_BUILDERS)}")
  return [("", datasets.load_dataset(builder, data_files=path, split="train"))]


def _jsonl_records(path: str, key: str) -> list[Record]:
  out = []
  for n, obj in json_lines(path):
    if not isinstance(obj, dict):
      raise ValueError(f"data.source: {path}:{n} is a JSON {type(obj).__name__}; each line must be an object")
    out.append(Record(f"{key}:{n}", obj))
  return out


def load_records(source, fmt: str) -> list[Record]:
  """Every record of ``source`` (see the module docstring) that has the fields of ``fmt``.

  Raises:
    FileNotFoundError: a path that names nothing.
    ValueError: a source that holds no records, a malformed line, a record without the format's fields.
  """
  records: list[Record] = []
  for entry in source_entries(source):
    if entry.startswith("hf:"):
      for split, ds in _hf_datasets(entry):
        prefix = f"{entry}#{split}/" if split else f"{entry}#"
        records += [Record(f"{prefix}{i}", row) for i, row in enumerate(ds)]
      continue
    paths = [] if entry == "stdlib" else _jsonl_paths(entry)
    if not paths:
      if entry != "stdlib" and not os.path.exists(os.path.expanduser(entry)) and not any(c in entry for c in "*?["):
        raise FileNotFoundError(f"data.source: no file or directory at {entry!r}")
      raise ValueError(f"data.format={fmt!r} reads records (JSONL, or 'hf:<dataset path>'), but data.source entry "
                       f"{entry!r} holds no .jsonl file; use data.format=text for plain text")
    for p in paths:
      records += _jsonl_records(p, p.replace(os.sep, "/") if p != os.path.expanduser(entry) else entry)
  needs = RECORD_FIELDS[fmt]
  for r in records:
    missing = [k for k in needs if k not in r.fields]
    if missing:
      raise ValueError(f"data.source: record {r.key} has no {missing} (it has {sorted(r.fields)}); "
                       f"data.format={fmt!r} needs {list(needs)}")
  if not records:
    raise ValueError(f"data.source={source!r} holds no records")
  return records


def record_text(r: Record) -> str:
  """The text of a record's strings (for a trained BPE and the character cap)."""
  def strings(v):
    if isinstance(v, str):
      yield v
    elif isinstance(v, dict):
      for x in v.values():
        yield from strings(x)
    elif isinstance(v, (list, tuple)):
      for x in v:
        yield from strings(x)
  return "\n".join(strings([r.fields.get(k) for k in ("prompt", "completion", "messages")]))


def cap_records(records: list[Record], max_chars: int | None, max_docs: int | None) -> list[Record]:
  """A deterministic sample of whole records within the caps (`meshdistill.data.cap_documents`' order)."""
  if max_chars is None and max_docs is None:
    return records
  kept = {d.key for d in cap_documents([Document(r.key, record_text(r)) for r in records], max_chars=max_chars,
                                       max_docs=max_docs)}
  return [r for r in records if r.key in kept]


def split_records(records: list[Record], val_fraction: float) -> tuple[list[Record], list[Record]]:
  """(train, validation) by a hash of each key, as `meshdistill.data.split_documents` splits documents.

  Raises:
    ValueError: one record and ``val_fraction`` > 0.
  """
  if val_fraction == 0.0:
    return list(records), []
  if len(records) < 2:
    raise ValueError(f"data.source holds {len(records)} record; a validation split needs at least 2: add records or "
                     "set data.val_fraction=0")
  units = [_unit(r.key, "split") for r in records]
  is_val = [u < val_fraction for u in units]
  if not any(is_val):
    is_val[int(np.argmin(units))] = True
  if all(is_val):
    is_val[int(np.argmax(units))] = False
  return [r for r, v in zip(records, is_val) if not v], [r for r, v in zip(records, is_val) if v]


def encode_record(r: Record, fmt: str, tokenizer, chat_tok) -> chat.Rendered:
  """One record's token ids, loss mask and prompt length (``chat_tok``: the chat template's tokenizer, needed for
  conversations only)."""
  if fmt == "messages":
    return chat.render(_need(chat_tok), r.fields["messages"], where=f"data.source: record {r.key}")
  prompt, completion = r.fields["prompt"], r.fields["completion"]
  if isinstance(prompt, str) and isinstance(completion, str):
    p = tokenizer.encode(prompt)
    c = tokenizer.encode(completion) + [tokenizer.eos_id]
    if not p:
      raise ValueError(f"data.source: record {r.key} has an empty prompt; a prompt needs at least one token")
    return chat.Rendered(np.asarray(p + c, np.int32), np.asarray([0] * len(p) + [1] * len(c), np.int8), len(p))
  if isinstance(prompt, list) and isinstance(completion, list):
    return chat.render(_need(chat_tok), prompt + completion, train_from=len(prompt),
                       where=f"data.source: record {r.key}")
  raise ValueError(f"data.source: record {r.key}: 'prompt' and 'completion' must both be strings (plain) or both lists "
                   f"of {{role, content}} turns (conversational), got {type(prompt).__name__} and "
                   f"{type(completion).__name__}")


def _need(chat_tok):
  if isinstance(chat_tok, Exception):  # why there is no template, raised where a record needs one
    raise chat_tok
  return chat_tok


def needs_template(records: Sequence[Record], fmt: str) -> bool:
  """Whether any record is a conversation."""
  return fmt == "messages" or any(isinstance(r.fields.get("prompt"), list) for r in records)


class RecordRows:
  """One record per row of ``seq_len`` positions, right-padded: the `meshdistill.data.PackedSequences` interface
  (``len``, ``rows``, ``seq_len``, ``pad_id``, ``num_tokens``, ``num_docs``, ``num_targets``, ``tokens``) that the
  loader, validation batches and a teacher cache read.

  ``tokens`` [N, T + 1] int32 (``pad_id`` past each record), ``loss`` [N, T + 1] int8 (1: a token the loss covers),
  ``lengths`` [N], ``prompt_len`` [N]: each batch also carries ``prompt_len`` [B] (the on-policy student's prompt,
  `meshdistill.train.onpolicy`; the step does not read it).
  """

  def __init__(self, rendered: Sequence[chat.Rendered], seq_len: int, pad_id: int, *, what: str = "records"):
    n, width = len(rendered), seq_len + 1
    self.tokens = np.full((n, width), pad_id, np.int32)
    self.loss = np.zeros((n, width), np.int8)
    self.lengths = np.zeros((n,), np.int64)
    self.prompt_len = np.zeros((n,), np.int32)
    for i, r in enumerate(rendered):
      m = min(len(r.ids), width)
      self.tokens[i, :m], self.loss[i, :m], self.lengths[i] = r.ids[:m], r.mask[:m], m
      self.prompt_len[i] = min(max(r.prompt_len, 1), seq_len)
    self.seq_len, self.pad_id = seq_len, int(pad_id)
    self.num_tokens, self.num_docs = int(self.lengths.sum()), n
    self.num_targets = int(self.loss[:, 1:].sum())

  def __len__(self) -> int:
    return self.num_docs

  def rows(self, indices, *, segments: bool = False) -> dict[str, np.ndarray]:
    """Rows ``indices`` as ``{inputs, targets, mask, prompt_len}`` (+ ``segment_ids``, ``positions``): [B, T]."""
    idx_B = np.asarray(indices, np.int64).reshape(-1)
    tok_BxTp1 = self.tokens[idx_B]
    out = {
        "inputs": tok_BxTp1[:, :-1].copy(),
        "targets": tok_BxTp1[:, 1:].copy(),
        "mask": self.loss[idx_B, 1:].astype(np.float32),
        "prompt_len": self.prompt_len[idx_B],
    }
    if segments:
      t_T = np.arange(self.seq_len)
      real_BxT = t_T[None, :] < self.lengths[idx_B, None]
      out["segment_ids"] = real_BxT.astype(np.int32)
      out["positions"] = np.where(real_BxT, t_T[None, :], 0).astype(np.int32)
    return out

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    return {k: v[0] for k, v in self.rows([i]).items()}

  def arrays(self, *, segments: bool = False) -> dict[str, np.ndarray]:
    return self.rows(np.arange(len(self)), segments=segments)


def record_rows(records: Sequence[Record], fmt: str, tokenizer, chat_tok, seq_len: int, *, split: str) -> RecordRows:
  """`RecordRows` of ``records``; cut and dropped records are logged.

  Raises:
    ValueError: a malformed record (named), or no record with a token to train on.
  """
  rendered = [encode_record(r, fmt, tokenizer, chat_tok) for r in records]
  vocab = tokenizer.vocab_size
  for r, x in zip(records, rendered):
    if x.ids.size and (x.ids.min() < 0 or x.ids.max() >= vocab):
      raise ValueError(f"data.source: record {r.key} renders to token ids up to {x.ids.max()}, past the tokenizer's "
                       f"vocab_size {vocab}; the chat template's tokenizer and data.tokenizer must be one")
  cut = sum(len(x.ids) > seq_len + 1 for x in rendered)
  kept = [x for x in rendered if x.mask[1 : seq_len + 1].any()]
  if cut:
    log.warning("data: %d of %d %s records are longer than data.seq_len + 1 = %d tokens and were cut", cut,
                len(rendered), split, seq_len + 1)
  if len(kept) < len(rendered):
    log.warning("data: %d %s records have no trained token within data.seq_len=%d and were dropped",
                len(rendered) - len(kept), split, seq_len)
  if not kept:
    raise ValueError(f"data: no {split} record has a token to train on within data.seq_len={seq_len}; raise "
                     "data.seq_len or shorten the records")
  pad = getattr(tokenizer, "pad_id", None)
  return RecordRows(kept, seq_len, 0 if pad is None else pad)
