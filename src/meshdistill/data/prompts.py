"""Prompt / completion data: files, batches whose loss mask covers completion tokens only, and the
re-layout of generated completions into such batches.

A prompt/completion batch is an ordinary train batch ``{inputs, targets, mask}: [B, T]`` plus
``prompt_len: [B]``. Each row holds ``prompt + completion`` from position 0 (right-padded), so the
training forward pass sees every row exactly as it would alone; ``mask`` is 1 on the targets that
are completion tokens and 0 on prompt tokens and padding, so prompt tokens never count in a loss.

Sources:

* `read_prompts`: a JSONL file with a ``prompt`` field (and optional ``completion``), or plain text
  with one prompt a line;
* `pair_batch`: tokenized (prompt, completion) pairs -> a batch;
* `cut_prompts`: packed training rows -> a batch whose first ``prompt_len`` tokens are the prompt
  and the rest the completion (the main job's prompts, cut from its documents).

`prompts_of` takes the prompts back out, left-padded for `meshdistill.models.generate.generate`, and
`completion_batch` lays generated completions out as a batch again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np


def non_utf8_line(path: str) -> str:
  """``line N`` of the first line of ``path`` that is not UTF-8 (for an error message)."""
  with open(path, "rb") as f:
    for n, raw in enumerate(f, 1):
      try:
        raw.decode("utf-8")
      except UnicodeDecodeError:
        return f"line {n}"
  return "a multi-byte character split across lines"


def read_prompts(path: str, *, need_completion: bool = False) -> list[dict]:
  """``[{"prompt": str, "completion": str | None}]`` from a JSONL file or a text file (one prompt a line).

  A file whose first non-blank line starts with ``{`` is read as JSONL.

  Raises:
    FileNotFoundError: no file at ``path``.
    ValueError: a line that is not JSON, lacks the ``prompt`` field (or ``completion`` when
      ``need_completion``), or a field that is not a string; named by file and line.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"prompts file {path!r} does not exist")
  try:
    with open(path, encoding="utf-8") as f:
      lines = [(i + 1, line.rstrip("\n")) for i, line in enumerate(f) if line.strip()]
  except UnicodeDecodeError as e:
    raise ValueError(f"prompts file {path!r} is not UTF-8 text ({non_utf8_line(path)}: {e.reason}); re-encode "
                     "it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
  if not lines:
    raise ValueError(f"prompts file {path!r} has no prompts")
  if not lines[0][1].lstrip().startswith("{"):
    return [{"prompt": text, "completion": None} for _, text in lines]
  rows = []
  example = '{"prompt": "def add(a, b):", "completion": " return a + b"}'
  for n, line in lines:
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      msg = f"prompts file {path!r} line {n}: not JSON ({e.msg}); each line must be like {example}"
      raise ValueError(msg) from None
    if not isinstance(obj, dict) or "prompt" not in obj:
      raise ValueError(f"prompts file {path!r} line {n} has no 'prompt' field; each line must be like {example}")
    if need_completion and "completion" not in obj:
      raise ValueError(f"prompts file {path!r} line {n} has no 'completion' field (training data needs one): {example}")
    for field in ("prompt", "completion"):
      if obj.get(field) is not None and not isinstance(obj[field], str):
        raise ValueError(f"prompts file {path!r} line {n}: '{field}' must be a string, got {type(obj[field]).__name__}")
    rows.append({"prompt": obj["prompt"], "completion": obj.get("completion")})
  return rows


def pair_batch(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, pad_id: int = 0) -> dict:
  """A prompt/completion batch of ``seq_len`` positions from token-id pairs (completions cut to fit).

  Raises:
    ValueError: a prompt without tokens or one leaving no room for a completion token.
  """
  B = len(pairs)
  seq = np.full((B, seq_len + 1), pad_id, np.int32)
  comp = np.zeros((B, seq_len + 1), np.float32)
  prompt_len = np.zeros((B,), np.int32)
  for r, (prompt, completion) in enumerate(pairs):
    if not 1 <= len(prompt) <= seq_len:
      raise ValueError(
          f"prompt {r} has {len(prompt)} tokens; prompts need 1 to seq_len={seq_len} tokens (a longer one leaves "
          "no room for its completion: raise data.seq_len or shorten it)"
      )
    row = (list(prompt) + list(completion))[: seq_len + 1]
    seq[r, : len(row)] = row
    comp[r, len(prompt) : len(row)] = 1.0
    prompt_len[r] = len(prompt)
  return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "mask": comp[:, 1:], "prompt_len": prompt_len}


def cut_prompts(batch: dict, prompt_len: int) -> dict:
  """A packed batch as prompt/completion rows: the first ``prompt_len`` tokens of each row are its prompt.

  The targets inside the prompt stop counting (the mask keeps its zeros elsewhere).
  """
  T = np.shape(batch["inputs"])[1]
  if not 1 <= prompt_len <= T:
    raise ValueError(f"prompt_len={prompt_len} must be in [1, {T}] for rows of {T} tokens")
  mask = np.array(batch["mask"], np.float32, copy=True)
  mask[:, : prompt_len - 1] = 0.0
  rows = np.shape(mask)[0]
  return {**batch, "mask": mask, "prompt_len": np.full((rows,), prompt_len, np.int32)}


def prompts_of(batch: dict, width: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """The prompts of a prompt/completion batch, left-padded to ``width``: ``(tokens_BxP, mask_BxP)``."""
  inputs = np.asarray(batch["inputs"])
  lens = np.asarray(batch["prompt_len"])
  if lens.max() > width:
    raise ValueError(
        f"a prompt has {lens.max()} tokens, more than the {width} that generation leaves in a row "
        "(data.seq_len + 1 - distill.on_policy.max_new_tokens): shorten the prompts, lower max_new_tokens "
        "or raise data.seq_len"
    )
  tokens = np.full((len(lens), width), pad_id, np.int32)
  mask = np.zeros((len(lens), width), bool)
  for r, n in enumerate(lens):
    tokens[r, width - n :] = inputs[r, :n]
    mask[r, width - n :] = True
  return tokens, mask


def completion_batch(prompts_BxP, prompt_mask_BxP, tokens_BxN, mask_BxN, seq_len: int, pad_id: int = 0) -> dict:
  """Left-padded prompts and their generated completions as a prompt/completion batch of ``seq_len``.

  Each row becomes ``prompt + completion`` from position 0; completion tokens past ``seq_len + 1``
  are dropped (``seq_len = P + N - 1`` keeps all of them).
  """
  prompts_BxP, prompt_mask_BxP = np.asarray(prompts_BxP), np.asarray(prompt_mask_BxP, bool)
  tokens_BxN, mask_BxN = np.asarray(tokens_BxN), np.asarray(mask_BxN, bool)
  pairs = [
      (prompts_BxP[r][prompt_mask_BxP[r]], tokens_BxN[r][mask_BxN[r]]) for r in range(prompts_BxP.shape[0])
  ]
  return pair_batch(pairs, seq_len, pad_id)


class PromptData:
  """Prompt/completion pairs as a training source for `meshdistill.train.loop.trainer.fit` (a single-process stand-in
  for `meshdistill.data.DataBundle`): shuffled batches per epoch with a resumable position, fixed
  validation batches. Completions end with the tokenizer's EOS, so a student learns to stop.

  Args:
    rows: ``[{"prompt": str, "completion": str}]`` (`read_prompts` with ``need_completion=True``).
    tokenizer: encodes both fields; ``eos_id`` closes each completion.
    seq_len: positions per row (prompt + completion, cut to fit).
    batch_size: rows per step.
    val_fraction: share of the pairs held out (at least one batch when > 0).
    val_rows: held-out pairs given apart (a task's held-out split, `meshdistill.data.tasks`); then ``rows`` all
      train and ``val_fraction`` is not used.
  """

  teacher_tokenizer = None  # one tokenizer (`meshdistill.data.TrainingData`)

  def __init__(self, rows, tokenizer, *, seq_len: int, batch_size: int, val_fraction: float = 0.1, seed: int = 0,
               val_rows=None):
    pad = getattr(tokenizer, "pad_id", None) or 0
    eos = [tokenizer.eos_id]
    def encode(rs):
      return [(tokenizer.encode(r["prompt"]), tokenizer.encode(r["completion"] or "") + eos) for r in rs]

    pairs = encode(rows)
    order = np.random.default_rng(seed).permutation(len(pairs))
    n_val = 0 if val_fraction <= 0 else max(batch_size, int(round(val_fraction * len(pairs))))
    if val_rows is not None:  # the held-out pairs given, in their order, then the train pairs shuffled
      n_val = len(val_rows)
      order = np.concatenate([np.arange(n_val), n_val + order])
      pairs = encode(val_rows) + pairs
    if len(pairs) - n_val < batch_size:
      raise ValueError(
          f"{len(pairs)} prompt/completion pairs leave {len(pairs) - n_val} for training after {n_val} held out; "
          f"need at least batch_size={batch_size}: add pairs, lower the batch size or data.val_fraction"
      )
    self.tokenizer, self.global_batch_size, self.seed = tokenizer, batch_size, seed
    self.val = pair_batch([pairs[i] for i in order[:n_val]], seq_len, pad) if n_val else None
    self.train = pair_batch([pairs[i] for i in order[n_val:]], seq_len, pad)
    count = lambda b: 0 if b is None else int(b["mask"].sum())  # noqa: E731
    self.stats = {"train_tokens": count(self.train), "val_tokens": count(self.val), "pairs": len(pairs)}

  def train_iterator(self, state: dict | None = None, *, row_ids: bool = False) -> "PairIterator":
    """Shuffled train batches; ``row_ids``: each also carries ``row_ids`` [B], its rows' indices in `train_rows`
    (what `meshdistill.teachers.cache.CachedTeacherData` reads a teacher cache by)."""
    return PairIterator(self.train, self.global_batch_size, self.seed, state, row_ids=row_ids)

  def train_rows(self) -> "PairRows":
    """The train pairs as indexed rows (a teacher cache is written over them:
    `meshdistill.teachers.cache.write_cache`)."""
    return PairRows(self.train, int(getattr(self.tokenizer, "pad_id", None) or 0))

  def val_batches(self, max_batches: int | None = None) -> list[dict]:
    if self.val is None:
      return []
    B, n = self.global_batch_size, len(self.val["inputs"])
    out = [{k: v[i : i + B] for k, v in self.val.items()} for i in range(0, n - B + 1, B)]
    return out if max_batches is None else out[:max_batches]


class PairIterator:
  """Batches of prompt/completion rows, reshuffled every epoch; ``get_state()`` is ``{"index": batches read}``."""

  def __init__(self, rows: dict, batch_size: int, seed: int, state: dict | None = None, *, row_ids: bool = False):
    self.rows, self.B, self.seed, self.row_ids = rows, batch_size, seed, row_ids
    self.per_epoch = len(rows["inputs"]) // batch_size
    self.index = int(state["index"]) if state else 0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    epoch, within = divmod(self.index, self.per_epoch)
    perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows["inputs"]))
    take = np.sort(perm[within * self.B : (within + 1) * self.B])
    self.index += 1
    batch = {k: v[take] for k, v in self.rows.items()}
    if self.row_ids:
      batch["row_ids"] = take.astype(np.int64)
    return batch

  def get_state(self) -> dict:
    return {"index": self.index}

  def set_state(self, state: dict) -> None:
    self.index = int(state["index"])

  def close(self) -> None:
    pass


class PairRows:
  """Prompt/completion rows by index, in the form a teacher cache is written over (``len``, ``seq_len``,
  ``pad_id``, ``tokens`` ``[N, seq_len + 1]``, ``rows(idx)``), like `meshdistill.data.PackedSequences`."""

  def __init__(self, rows: dict, pad_id: int = 0):
    self._rows, self.pad_id = rows, pad_id
    self.seq_len = int(np.shape(rows["inputs"])[1])
    self.tokens = np.concatenate([rows["inputs"], rows["targets"][:, -1:]], axis=1)

  def __len__(self) -> int:
    return int(np.shape(self._rows["inputs"])[0])

  def rows(self, idx) -> dict:
    return {k: v[np.asarray(idx)] for k, v in self._rows.items()}
