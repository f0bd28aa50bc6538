"""Corpora: where the documents come from, and a deterministic train/validation split.

A corpus is a list of `Document` (a stable ``key`` and its ``text``). Sources, by the
``data.source`` string (several may be joined with commas):

``"stdlib"``
  The ``*.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), one document per file, in sorted path order.
  Skipped: ``site-packages`` / ``dist-packages``, ``__pycache__``, and test directories
  (``test``, ``tests``, ``idle_test``), which hold deliberately malformed and non-UTF-8 files.
  On CPython 3.11 that is ~730 files, ~12 M characters. Same Python, same corpus.
``path/to/file.txt`` (any extension but ``.jsonl``)
  One document: the file's UTF-8 text.
``path/to/file.jsonl``
  One document per line: the JSON object's ``data.text_key`` field (blank lines skipped).
``path/to/dir``
  Every non-hidden file below it, recursively, in sorted order; ``.jsonl`` files as above,
  others as text; files that are not UTF-8 are skipped with a warning.
``glob/**/*.txt``
  Any pattern with ``*``, ``?`` or ``[``: the matching files, sorted.
``"hf:<local path>"``
  A Hugging Face ``datasets`` dataset from the local disk only: a directory written by
  ``save_to_disk`` (every split of a ``DatasetDict``), or a ``.parquet``/``.csv``/``.json``/
  ``.jsonl``/``.arrow`` file; one document per row, column ``data.text_key``. Needs the
  optional ``datasets`` package. Nothing is ever downloaded.

The split is by document: a document goes to validation when a SHA-256 hash of its key,
read as a number in [0, 1), is below ``val_fraction``. It depends on nothing but the key, so
it is the same on every run and machine, and a document never moves when others are added or
capped. Keys are names as written in ``data.source`` (``stdlib/json/decoder.py``,
``data/a.jsonl:17``, ``corpus_dir/sub/b.txt``, ``hf:ds#train/5``), so write the same source
string to get the same split.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import sysconfig

log = logging.getLogger(__name__)

_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_HF_FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}


@dataclasses.dataclass(frozen=True)
class Document:
  """One document: ``key`` (stable, relative name that decides its split) and ``text``."""

  key: str
  text: str


def _unit(key: str, salt: str) -> float:
  """A number in [0, 1) from a SHA-256 of ``salt:key`` (identical on every machine and run)."""
  digest = hashlib.sha256(f"{salt}:{key}".encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64


def stdlib_root() -> str:
  """Directory of the running interpreter's standard library."""
  return sysconfig.get_paths()["stdlib"]


def stdlib_documents(root: str | None = None) -> list[Document]:
  """The standard library's ``*.py`` files (no tests, no site-packages), sorted by path."""
  root = root or stdlib_root()
  docs = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and d not in _TEST_DIRS)
    for name in sorted(filenames):
      if not name.endswith(".py"):
        continue
      path = os.path.join(dirpath, name)
      rel = os.path.relpath(path, root).replace(os.sep, "/")
      try:
        with open(path, encoding="utf-8") as f:
          docs.append(Document(f"stdlib/{rel}", f.read()))
      except (UnicodeDecodeError, OSError) as e:
        log.warning("stdlib corpus: skipping %s (%s)", rel, e)
  docs.sort(key=lambda d: d.key)
  return docs


def json_lines(path: str):
  """``(line number, value)`` of each non-blank line of the JSONL file ``data.source`` names, each line checked to
  be UTF-8 and JSON (a `ValueError` naming the file and line otherwise)."""
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"data.source: {path}:{lineno} is not UTF-8 text (byte {e.start} of the line: {e.reason}); "
                         "JSONL data must be UTF-8 (re-encode it, e.g. iconv -f latin1 -t utf-8)") from None
      if not line.strip():
        continue
      try:
        value = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"data.source: {path}:{lineno} is not valid JSON ({e})") from None
      yield lineno, value


def _jsonl_documents(path: str, key: str, text_key: str) -> list[Document]:
  docs = []
  for lineno, obj in json_lines(path):
    if not isinstance(obj, dict) or text_key not in obj:
      have = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
      raise ValueError(
          f"data.source: {path}:{lineno} has no field data.text_key={text_key!r} (it has {have}); "
          "set data.text_key to the field holding the text"
      )
    text = obj[text_key]
    if not isinstance(text, str):
      raise ValueError(f"data.source: {path}:{lineno} field {text_key!r} is {type(text).__name__}, not a string")
    docs.append(Document(f"{key}:{lineno}", text))
  return docs


def _file_documents(path: str, key: str, text_key: str, *, skip_binary: bool) -> list[Document]:
  if path.endswith(".jsonl"):
    return _jsonl_documents(path, key, text_key)
  try:
    with open(path, encoding="utf-8") as f:
      return [Document(key, f.read())]
  except UnicodeDecodeError:
    if not skip_binary:
      raise ValueError(f"data.source: {path!r} is not UTF-8 text") from None
    log.warning("data.source: skipping %s (not UTF-8 text)", path)
    return []


def _dir_documents(root: str, entry: str, text_key: str) -> list[Document]:
  docs = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    for name in sorted(filenames):
      if name.startswith("."):
        continue
      path = os.path.join(dirpath, name)
      rel = os.path.relpath(path, root).replace(os.sep, "/")
      docs += _file_documents(path, f"{entry.rstrip('/')}/{rel}", text_key, skip_binary=True)
  return docs


def _hf_documents(path: str, entry: str, text_key: str) -> list[Document]:
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(f"data.source={entry!r} needs the 'datasets' package: pip install datasets") from None
  if not os.path.exists(path):
    raise FileNotFoundError(f"data.source={entry!r}: no local dataset at {path!r} (only local paths are read)")
  if os.path.isdir(path):
    loaded = datasets.load_from_disk(path)
    splits = sorted(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
  else:
    builder = _HF_FILE_BUILDERS.get(os.path.splitext(path)[1])
    if builder is None:
      raise ValueError(
          f"data.source={entry!r}: cannot read {path!r} as a dataset; give a save_to_disk directory or a "
          f"file ending in {sorted(_HF_FILE_BUILDERS)}"
      )
    splits = [("", datasets.load_dataset(builder, data_files=path, split="train"))]
  docs = []
  for split, ds in splits:
    if text_key not in ds.column_names:
      raise ValueError(
          f"data.source={entry!r}{'[' + split + ']' if split else ''} has no column data.text_key={text_key!r}; "
          f"columns: {ds.column_names}"
      )
    prefix = f"{entry}#{split}/" if split else f"{entry}#"
    docs += [Document(f"{prefix}{i}", t) for i, t in enumerate(ds[text_key]) if isinstance(t, str)]
  return docs


def source_entries(source: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
  """Splits a ``data.source`` value into entries (commas separate entries in a string)."""
  items = source.split(",") if isinstance(source, str) else list(source)
  return tuple(s.strip() for s in items if s and s.strip())


def load_documents(source: str | tuple[str, ...] | list[str], *, text_key: str = "text") -> list[Document]:
  """All documents of ``source`` (see the module docstring), empty texts dropped.

  Raises:
    FileNotFoundError: a path or glob names nothing.
    ValueError: no documents, or a malformed JSONL line / missing ``text_key``.
  """
  entries = source_entries(source)
  if not entries:
    raise ValueError(f"data.source={source!r} names no corpus; use 'stdlib', a file, directory or glob, or 'hf:<path>'")
  docs: list[Document] = []
  for entry in entries:
    if entry == "stdlib":
      docs += stdlib_documents()
    elif entry.startswith("hf:"):
      docs += _hf_documents(os.path.expanduser(entry[3:]), entry, text_key)
    elif any(c in entry for c in "*?["):
      paths = sorted(p for p in glob.glob(os.path.expanduser(entry), recursive=True) if os.path.isfile(p))
      if not paths:
        raise FileNotFoundError(f"data.source: the pattern {entry!r} matches no file")
      for p in paths:
        docs += _file_documents(p, p.replace(os.sep, "/"), text_key, skip_binary=True)
    else:
      path = os.path.expanduser(entry)
      if os.path.isdir(path):
        docs += _dir_documents(path, entry, text_key)
      elif os.path.isfile(path):
        docs += _file_documents(path, entry, text_key, skip_binary=False)
      else:
        raise FileNotFoundError(
            f"data.source: no file or directory at {entry!r} (use 'stdlib', a .txt/.jsonl file, a directory, "
            "a glob, or 'hf:<local dataset path>')"
        )
  docs = [d for d in docs if d.text]
  if not docs:
    raise ValueError(f"data.source={source!r}: the corpus is empty (no document with any text)")
  return docs


def cap_documents(docs: list[Document], *, max_chars: int | None = None, max_docs: int | None = None) -> list[Document]:
  """A deterministic sample of ``docs`` within the caps (for quick runs).

  Documents are taken in an order fixed by a hash of their keys (a sample spread over the whole
  corpus, not its alphabetical head) until ``max_docs`` documents or ``max_chars`` characters;
  the last one is cut to fit. The result keeps the input order.
  """
  if max_chars is None and max_docs is None:
    return docs
  order = sorted(range(len(docs)), key=lambda i: _unit(docs[i].key, "order"))
  keep: dict[int, Document] = {}
  chars = 0
  for i in order:
    if max_docs is not None and len(keep) >= max_docs:
      break
    if max_chars is not None and chars >= max_chars:
      break
    d = docs[i]
    if max_chars is not None and chars + len(d.text) > max_chars:
      d = Document(d.key, d.text[: max_chars - chars])
    keep[i] = d
    chars += len(d.text)
  return [keep[i] for i in sorted(keep)]


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
  """Splits ``docs`` into (train, validation) by a hash of each key; see the module docstring.

  When the hash puts no document in validation although ``val_fraction`` > 0, the document with
  the smallest hash goes there. When a split would be empty all the same (a single document, e.g.
  one big text file), every document is cut instead: its last ``val_fraction`` of characters
  (from a line start when there is one near) is validation and the rest training.

  Raises:
    ValueError: ``val_fraction`` is not in [0, 1).
  """
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"data.val_fraction={val_fraction!r} must be in [0, 1), e.g. 0.05 (0 = no validation)")
  if val_fraction == 0.0:
    return list(docs), []
  units = [_unit(d.key, "split") for d in docs]
  is_val = [u < val_fraction for u in units]
  if not any(is_val):
    is_val[min(range(len(docs)), key=units.__getitem__)] = True
  if all(is_val) and len(docs) > 1:
    is_val[max(range(len(docs)), key=units.__getitem__)] = False
  if all(is_val):
    log.info("data: one document; splitting it by position (last %.1f%% is validation)", 100 * val_fraction)
    return _split_by_position(docs, val_fraction)
  train = [d for d, v in zip(docs, is_val) if not v]
  val = [d for d, v in zip(docs, is_val) if v]
  return train, val


def _split_by_position(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
  train, val = [], []
  for d in docs:
    cut = len(d.text) - max(1, round(len(d.text) * val_fraction))
    line = d.text.rfind("\n", 0, cut + 1)
    if line > 0 and cut - line < 1000:
      cut = line + 1
    if cut <= 0:
      raise ValueError(
          f"data: document {d.key!r} has {len(d.text)} characters, too few to split into training and "
          "validation; add documents or set data.val_fraction=0"
      )
    train.append(Document(f"{d.key}@train", d.text[:cut]))
    val.append(Document(f"{d.key}@val", d.text[cut:]))
  return train, val
