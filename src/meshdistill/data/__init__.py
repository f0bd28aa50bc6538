"""Data: corpora, tokenizers, packing into ``[N, T]`` rows, and grain loaders split over processes.

The trainer's entry point::

  bundle = build_data(DataConfig(source="stdlib", seq_len=128), batch_size=32)
  it = bundle.train_iterator()               # or bundle.train_iterator(saved_state)
  batch = next(it)                           # {"inputs", "targets", "mask"}: [B/P, T] numpy
  state = it.get_state()                     # JSON-serializable; store it with the checkpoint
  evals = bundle.val_batches(max_batches=8)  # fixed, finite list of batches

Modules: `_corpus` (sources and the split by document), `_tokenizer` (byte-level and BPE), `_packing` (rows, targets and
the loss mask), `alignment` (token bytes, spans two tokenizations agree on), `_cross` (rows of two tokenizations of one
text, for a teacher with its own tokenizer), `_teacher_rows` (rows cut on a teacher's tokens alone, a student's side
rebuilt from their bytes: a cross-tokenizer cache's), `_loader` (grain: shuffling, epochs, process shards, state),
`_data_config` (`DataConfig`, the ``data`` section), `_pipeline` (`build_data`, `DataBundle`), `_token_cache` (the
tokenizer and token streams cached in ``pretrain.cache_dir``), `_batch_list` (batches already in memory), `_records`
(``data.format``: prompt/completion and conversation records, one a row), `chat` (conversations in a chat template, the
loss on the assistant's tokens), `_preference` (preference rows and pairs), `_wrapped` (`TrainingData`: what a run
trains from, one Protocol; `WrappedData`: a bundle whose batches are another's with something added).
"""

from meshdistill.data._batch_list import BatchList, BatchListIterator
from meshdistill.data._cross import CROSS_KEYS, PackedPairs, pack_texts
from meshdistill.data._corpus import Document, cap_documents, load_documents, split_documents, stdlib_documents
from meshdistill.data._domains import DOMAIN_KEY
from meshdistill.data._loader import TrainIterator, process_slice, validation_batches
from meshdistill.data._packing import (
    PackedSequences,
    TokenStream,
    join_documents,
    pack,
    pack_documents,
    tokenize_documents,
)
from meshdistill.data._data_config import DataConfig
from meshdistill.data._pipeline import DataBundle, build_data
from meshdistill.data._preference import PreferencePairs, own_pairs, preference_batch, read_preferences
from meshdistill.data._teacher_rows import StudentRows, TeacherRows, cut_teacher_rows
from meshdistill.data._token_cache import resolve_tokenizer
from meshdistill.data._tokenizer import (
    VOCAB_MULTIPLE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_file,
    train_bpe,
)
from meshdistill.data._wrapped import TrainingData, WrappedData

__all__ = [
    "CROSS_KEYS",
    "DOMAIN_KEY",
    "StudentRows",
    "TeacherRows",
    "cut_teacher_rows",
    "tokenizer_file",
    "PackedPairs",
    "pack_texts",
    "BatchList",
    "BatchListIterator",
    "PreferencePairs",
    "own_pairs",
    "preference_batch",
    "read_preferences",
    "TrainingData",
    "WrappedData",
    "VOCAB_MULTIPLE",
    "ByteTokenizer",
    "DataBundle",
    "DataConfig",
    "Document",
    "HFTokenizer",
    "PackedSequences",
    "TokenStream",
    "Tokenizer",
    "TrainIterator",
    "build_data",
    "cap_documents",
    "join_documents",
    "load_documents",
    "load_tokenizer",
    "pack",
    "pack_documents",
    "process_slice",
    "resolve_tokenizer",
    "split_documents",
    "stdlib_documents",
    "tokenize_documents",
    "train_bpe",
    "validation_batches",
]
