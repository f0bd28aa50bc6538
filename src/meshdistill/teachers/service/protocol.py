"""The wire format of a served teacher: the subset of vLLM's OpenAI-compatible ``/v1/completions`` that distillation
clients use, as pure functions (no HTTP, no JAX) that both the server and the client call.

Request (``POST /v1/completions``, JSON)::

  {"model": "<served name>", "prompt": [[id, ...], ...], "prompt_logprobs": K, "max_tokens": 0}

Response: vLLM's completion object; choice ``i`` answers prompt ``i`` and holds vLLM's ``prompt_logprobs`` --
a list as long as the prompt whose entry ``0`` is ``null`` (no distribution precedes the first token) and whose
entry ``j >= 1`` maps token ids (JSON object keys, strings) to ``{"logprob", "rank", "decoded_token"}``: the
teacher's ``K`` most likely tokens after ``prompt[:j]``. A meshdistill server adds ``prompt_logprobs_tail`` (the
same length, entry 0 ``null``): the exact log-mass of the tokens outside the top-K (`meshdistill.losses.topk_tail`);
a client talking to another server derives it as ``log(1 - sum exp(logprob))``.

A meshdistill client may add ``"meshdistill_arrays": true`` to the request (another server ignores the field, as
vLLM ignores unknown ones): each choice then holds ``prompt_topk`` -- ``ids`` (int32 ``[n - 1, K]``), ``logprobs``
(float32 ``[n - 1, K]``) and ``tail`` (float32 ``[n - 1]``), each the base64 of its little-endian bytes -- in place
of ``prompt_logprobs`` (``null``): the same numbers, bit for bit, at a fraction of the JSON's size and time.

A meshdistill server also adds ``meshdistill_digest`` to each choice (in both forms; another client ignores it):
`answer_digest` of the prompt's token ids as the server read them and the numbers it answers. Its identity says so
(``answer_digest: "sha256/1"``); a client then recomputes it from the ids it sent and the numbers it read, and
refuses a choice that does not match (an answer for other ids: rows or ids permuted or changed on the way).

A training row ``inputs [T]`` is sent as the prompt ``inputs + [targets[-1]]`` (``T + 1`` ids): its entries
``1..T`` are the teacher's top-K at the row's positions ``0..T-1``, what the step trains on.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import math
import time
import uuid
from typing import Any

import numpy as np

# The request fields a meshdistill server reads; any other field is ignored (as vLLM ignores unknown ones).
REQUEST_FIELDS = ("model", "prompt", "prompt_logprobs", "max_tokens", "n", "stream", "echo", "logprobs",
                  "meshdistill_arrays")


class RequestError(ValueError):
  """A request the server refuses: ``status`` (400, 404, 413) and a message naming the field."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


class AnswerError(ValueError):
  """A server's answer a client must not train on (missing rows, wrong shapes, values that are not finite)."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may hold: ``rows`` prompts, ``tokens`` ids in all, ``bytes`` of body; ``vocab``: ids lie in
  ``[0, vocab)``; ``max_len``: ids per prompt; ``k``: the largest ``prompt_logprobs``."""

  rows: int = 256
  tokens: int = 1 << 20
  bytes: int = 16 << 20
  vocab: int = 0
  max_len: int = 0
  k: int = 1

  @property
  def body_bytes(self) -> int:
    """The most bytes of body a request may send, known before any of it is parsed: what the largest request these
    limits accept takes as JSON -- ``min(rows x (max_len + 1), tokens)`` ids, each at most ``ID_BYTES`` more than the
    digits of ``vocab - 1`` (its separator and white space), ``PROMPT_BYTES`` per prompt, ``OTHER_BYTES`` for the
    other fields -- or ``bytes`` (``--max-bytes``) when less."""
    ids = min(self.rows * (self.max_len + 1), self.tokens)
    digits = len(str(max(self.vocab - 1, 0)))
    return min(self.bytes, ids * (digits + ID_BYTES) + self.rows * PROMPT_BYTES + OTHER_BYTES)

  def describe_body_bytes(self) -> str:
    """Where `body_bytes` comes from, for a refusal."""
    if self.body_bytes == self.bytes:
      return "the server's --max-bytes"
    return (f"the largest request the server accepts: --max-rows {self.rows} prompts of up to {self.max_len + 1} ids "
            f"below {self.vocab}, as JSON")


# What `Limits.body_bytes` allows beyond the ids' digits: per id (a separator and white space), per prompt (its
# brackets and separator) and for the other fields (model, prompt_logprobs, ... and any white space around them).
ID_BYTES = 3
PROMPT_BYTES = 8
OTHER_BYTES = 1 << 20


def parse_request(body: Any, limits: Limits, served_name: str) -> tuple[list[list[int]], int, bool]:
  """``(prompts, k, arrays)`` of a decoded JSON ``body``, or `RequestError` naming the field and what would work."""
  if not isinstance(body, dict):
    raise RequestError(400, "the body must be a JSON object with prompt (a list of token-id lists) and prompt_logprobs")
  model = body.get("model")
  if model is not None and model != served_name:
    raise RequestError(404, f"model={model!r} is not served here; this server serves {served_name!r}")
  for key, ok in (("n", 1), ("stream", False), ("echo", False), ("logprobs", 0)):
    v = body.get(key)
    if v is not None and (type(v) is not type(ok) or v != ok):
      raise RequestError(400, f"{key}={v!r} is not supported; leave it out (or send {key}={ok!r})")
  arrays = body.get("meshdistill_arrays", False)
  if not isinstance(arrays, bool):
    raise RequestError(400, f"meshdistill_arrays={arrays!r} must be true or false")
  max_tokens = body.get("max_tokens", 0)
  if isinstance(max_tokens, bool) or max_tokens not in (0, 1):
    raise RequestError(400, f"max_tokens={max_tokens!r}: this server generates nothing; send max_tokens 0 or 1")
  k = body.get("prompt_logprobs")
  if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= limits.k:
    raise RequestError(400, f"prompt_logprobs={k!r} must be an integer in [1, {limits.k}] (the server's --k)")
  prompts = body.get("prompt")
  if isinstance(prompts, list) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
    prompts = [prompts]  # one prompt given as a flat list of ids
  if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) for p in prompts):
    raise RequestError(400, "prompt must be a non-empty list of token-id lists (text prompts are not supported)")
  if len(prompts) > limits.rows:
    raise RequestError(413, f"{len(prompts)} prompts in one request; at most {limits.rows} (the server's --max-rows)")
  total = sum(len(p) for p in prompts)
  if total > limits.tokens:
    raise RequestError(413, f"{total} token ids in one request; at most {limits.tokens} (the server's --max-tokens)")
  for i, p in enumerate(prompts):
    if not 2 <= len(p) <= limits.max_len + 1:
      raise RequestError(400 if len(p) < 2 else 413, f"prompt[{i}] has {len(p)} ids; send 2 to {limits.max_len + 1} "
                         "(the teacher's max_len, plus the last token, whose distribution is not asked for)")
    bad = [t for t in p if type(t) is not int or not 0 <= t < limits.vocab]
    if bad:
      raise RequestError(400, f"prompt[{i}] holds {bad[0]!r}; token ids are integers in [0, {limits.vocab})")
  return prompts, k, arrays


def _b64(x: np.ndarray, dtype) -> str:
  return base64.b64encode(np.ascontiguousarray(x, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()).decode()


def _unb64(text: Any, dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
  try:
    x = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.dtype(dtype).newbyteorder("<"))
  except (TypeError, ValueError) as e:
    raise AnswerError(f"{what} is not base64 ({e})") from None
  if x.size != math.prod(shape):
    raise AnswerError(f"{what} holds {x.size} values, {shape} expected")
  return x.reshape(shape)


# The answer digest a meshdistill server sends (`answer_digest`), as its identity names it (``answer_digest``)
DIGEST = "sha256/1"


def answer_digest(prompt, ids: np.ndarray, logprobs: np.ndarray, tail: np.ndarray) -> str:
  """The hex SHA-256 of one choice: its prompt's ``n`` token ids as the server read them, then the answer's ``ids
  [n - 1, k]``, ``logprobs [n - 1, k]`` and ``tail [n - 1]`` as sent (int32 / float32, little-endian, after their
  shape). A client recomputes it from the ids it sent and the numbers it read: an answer computed for other ids (rows
  or ids permuted, changed or mixed with another request's on the way), or numbers moved between positions, does not
  match. It is a check value, not a signature: whatever can rewrite the traffic can recompute it."""
  digest = hashlib.sha256(b"meshdistill.answer/1")
  ids = np.asarray(ids)
  digest.update(np.asarray([len(prompt), ids.shape[-1]], np.dtype("<i4")).tobytes())
  for x, dtype in ((prompt, np.int32), (ids, np.int32), (logprobs, np.float32), (tail, np.float32)):
    digest.update(np.ascontiguousarray(x, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())
  return digest.hexdigest()


# The most bytes a client reads of an answer (`answer_bytes`): per top-k entry of a position (vLLM's JSON form takes
# about 76 bytes an entry with ``decoded_token`` null; 192 leaves a decoded token of 100 bytes), per position (its
# null or tail, brackets), per choice (index, text, finish_reason, digest ...) and for the rest (id, model, usage).
ENTRY_BYTES = 192
POSITION_BYTES = 64
CHOICE_BYTES = 4096
ANSWER_BYTES = 1 << 20
# The most bytes a client reads of an identity (``/v1/teacher``, ``/v1/models``)
IDENTITY_BYTES = 1 << 20


def answer_bytes(rows: int, length: int, k: int) -> int:
  """The most bytes of an answer to ``rows`` prompts of ``length + 1`` ids with ``k`` log-probabilities asked at each
  position, in either form: ``k + 1`` entries of ``ENTRY_BYTES`` per position (vLLM adds the prompt token's own entry
  when it is outside the top-k) plus ``POSITION_BYTES``, ``CHOICE_BYTES`` per choice, ``ANSWER_BYTES`` in all. A
  base64 answer takes about a tenth of it."""
  return ANSWER_BYTES + rows * (CHOICE_BYTES + (length + 1) * (POSITION_BYTES + (k + 1) * ENTRY_BYTES))


def completion(prompts: list[list[int]], k: int, ids: list[np.ndarray], logprobs: list[np.ndarray],
               tails: list[np.ndarray], served_name: str, arrays: bool = False) -> dict:
  """vLLM's completion object for ``prompts``: ``ids[i] [n_i - 1, k]`` (int), ``logprobs[i]`` the same shape and
  ``tails[i] [n_i - 1]`` -- the teacher's top-k after each prefix of prompt ``i``, most likely first, and the mass
  of every other token (a top-K with K > k is narrowed first: the tail of K tokens is not the tail of k; the
  server's `narrow`). ``arrays``: each choice holds ``prompt_topk`` (base64 arrays) instead of
  ``prompt_logprobs``."""
  shapes = {x.shape[-1] for x in (*ids, *logprobs)}
  if shapes != {k}:
    raise ValueError(f"an answer for prompt_logprobs={k} holds top-{sorted(shapes)} arrays; narrow them to {k} first "
                     "(their tail must hold the mass of every token outside the k)")
  choices = []
  for i, prompt in enumerate(prompts):
    if arrays:
      topk = {"ids": _b64(ids[i], np.int32), "logprobs": _b64(logprobs[i], np.float32),
              "tail": _b64(tails[i], np.float32)}
      choices.append({"index": i, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                      "prompt_logprobs": None, "prompt_topk": topk,
                      "meshdistill_digest": answer_digest(prompt, ids[i], logprobs[i], tails[i])})
      continue
    entries: list[dict | None] = [None]
    for ids_K, lp_K in zip(ids[i].tolist(), logprobs[i].tolist()):
      entries.append({str(t): {"logprob": lp, "rank": r + 1, "decoded_token": None}
                      for r, (t, lp) in enumerate(zip(ids_K, lp_K))})
    choices.append({"index": i, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                    "prompt_logprobs": entries, "prompt_logprobs_tail": [None, *tails[i].tolist()],
                    "meshdistill_digest": answer_digest(prompt, ids[i], logprobs[i], tails[i])})
  n = sum(len(p) for p in prompts)
  return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
          "model": served_name, "choices": choices,
          "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}}


# How far an answer may stray from a distribution before it is refused (float32 rounding and a bfloat16 teacher's
# log-softmax stay far inside both): a log-probability above ``LOGPROB_SLACK``, top-k mass plus tail off 1 by more than
# ``MASS_TOLERANCE``, or a log-probability above its predecessor's by more than ``LOGPROB_SLACK`` (not sorted).
LOGPROB_SLACK = 1e-3
MASS_TOLERANCE = 1e-2


def read_completion(answer: Any, rows: int, length: int, k: int, vocab: int, prompts: np.ndarray | None = None,
                    require_digest: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(ids [rows, length, k] int32, logprobs [rows, length, k] float32, tail [rows, length] float32)`` of a
  completion answering ``rows`` prompts of ``length + 1`` ids each; `AnswerError` unless the choices' indices are
  exactly ``0 .. rows - 1``, every row, position and top-k entry is there and every position is a distribution
  (`check_distribution`): a step never trains on less. With ``prompts [rows, length + 1]`` (the ids sent), a choice's
  ``meshdistill_digest`` must be `answer_digest` of its prompt and what was read (`AnswerError` naming the row
  otherwise); with ``require_digest`` also, a choice without one is refused."""
  choices = answer.get("choices") if isinstance(answer, dict) else None
  if not isinstance(choices, list) or len(choices) != rows:
    got = len(choices) if isinstance(choices, list) else "no"
    raise AnswerError(f"the answer holds {got} choices for {rows} prompts")
  ids = np.zeros((rows, length, k), np.int32)
  logprobs = np.zeros((rows, length, k), np.float32)
  tail = np.zeros((rows, length), np.float32)
  seen: dict[int, int] = {}
  for n, choice in enumerate(choices):
    i = choice.get("index") if isinstance(choice, dict) else None
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < rows:
      raise AnswerError(f"choices[{n}] has index {i!r}; each of the {rows} choices must have a distinct index in "
                        f"[0, {rows}) (choice i answers prompt i)")
    if i in seen:
      raise AnswerError(f"choices[{n}] and choices[{seen[i]}] both have index {i}; each of the {rows} choices must "
                        f"have a distinct index in [0, {rows}) (choice i answers prompt i)")
    seen[i] = n
    packed = choice.get("prompt_topk")
    if isinstance(packed, dict):
      where = f"choice {i}: prompt_topk"
      ids[i] = _unb64(packed.get("ids"), np.int32, (length, k), f"{where}.ids")
      logprobs[i] = _unb64(packed.get("logprobs"), np.float32, (length, k), f"{where}.logprobs")
      tail[i] = _unb64(packed.get("tail"), np.float32, (length,), f"{where}.tail")
      continue
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != length + 1:
      raise AnswerError(f"choice {i!r}: prompt_logprobs of {len(entries) if isinstance(entries, list) else 'no'} "
                        f"entries for a prompt of {length + 1} ids")
    tails = choice.get("prompt_logprobs_tail")
    for j, entry in enumerate(entries[1:]):
      if not isinstance(entry, dict) or len(entry) < k:
        raise AnswerError(f"choice {i}, position {j + 1}: {len(entry) if isinstance(entry, dict) else 'no'} "
                          f"log-probabilities, {k} asked for")
      try:
        # vLLM adds the prompt token's own entry when it is not among the top-k: keep the k best ranks
        ranked = sorted(((v.get("rank") or 0, -float(v["logprob"]), int(t), float(v["logprob"]))
                         for t, v in entry.items()), key=lambda r: (r[0] if r[0] else math.inf, r[1]))[:k]
      except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise AnswerError(f"choice {i}, position {j + 1}: malformed entry ({e})") from None
      ids[i, j] = [r[2] for r in ranked]
      logprobs[i, j] = [r[3] for r in ranked]
      if isinstance(tails, list) and len(tails) == length + 1 and isinstance(tails[j + 1], (int, float)):
        tail[i, j] = tails[j + 1]
      else:
        mass = float(np.sum(np.exp(np.asarray(logprobs[i, j], np.float64))))
        tail[i, j] = math.log(max(1.0 - mass, 1e-30))
  check_distribution(ids, logprobs, tail, vocab)
  if prompts is not None:
    check_digests(choices, prompts, ids, logprobs, tail, require_digest)
  return ids, logprobs, tail


def check_digests(choices: list, prompts: np.ndarray, ids: np.ndarray, logprobs: np.ndarray, tail: np.ndarray,
                  require: bool) -> None:
  """`AnswerError` naming the first choice (row) whose ``meshdistill_digest`` is not `answer_digest` of ``prompts[i]``
  (the ids sent) and the numbers read for it, or (``require``) that holds none."""
  for n, choice in enumerate(choices):
    i, sent = choice["index"], choice.get("meshdistill_digest")
    if sent is None:
      if require:
        raise AnswerError(f"choice {i} holds no meshdistill_digest, and this client requires one (teacher."
                          "require_digest, or a server whose identity says it sends them): a proxy that drops it "
                          "cannot be told from one that changed the rows")
      continue
    if sent != answer_digest(prompts[i], ids[i], logprobs[i], tail[i]):
      raise AnswerError(f"choice {i} (choices[{n}]): its meshdistill_digest does not match row {i} as sent (its "
                        f"{len(prompts[i])} token ids) and the answer read for it: "
                        "the answer is for other ids (rows or ids permuted or changed between this client and the "
                        "server, or another request's answer)")


def check_distribution(ids: np.ndarray, logprobs: np.ndarray, tail: np.ndarray, vocab: int) -> None:
  """`AnswerError` naming the first row (choice) and prompt position whose top-k is not a distribution: values not
  finite, ids outside ``[0, vocab)`` or repeated within a position, a log-probability above 0 (beyond
  ``LOGPROB_SLACK``), log-probabilities not sorted most likely first, or top-k mass plus tail mass off 1 by more than
  ``MASS_TOLERANCE``. ``ids`` / ``logprobs [rows, length, k]``, ``tail [rows, length]``; position ``j`` of a row is
  prompt position ``j + 1``."""
  lp = np.asarray(logprobs, np.float64)
  tl = np.asarray(tail, np.float64)

  def refuse(bad_RxL: np.ndarray, what: str) -> None:
    if bad_RxL.any():
      i, j = (int(v) for v in np.argwhere(bad_RxL)[0])
      raise AnswerError(f"choice {i}, position {j + 1}: {what(i, j)}; a teacher's answer must be a distribution "
                        f"(log-probabilities <= 0, most likely first, distinct ids in [0, {vocab}), top-k mass plus "
                        f"tail within {MASS_TOLERANCE} of 1)")

  refuse(~(np.isfinite(lp).all(-1) & np.isfinite(tl)), lambda i, j: "log-probabilities that are not finite "
         f"({lp[i, j].tolist()}, tail {tl[i, j]})")
  refuse(((ids < 0) | (ids >= vocab)).any(-1), lambda i, j: f"token ids {ids[i, j].tolist()} outside [0, {vocab})")
  ordered = np.sort(ids, axis=-1)
  refuse((ordered[..., 1:] == ordered[..., :-1]).any(-1), lambda i, j: f"token ids {ids[i, j].tolist()} repeat one")
  refuse((lp > LOGPROB_SLACK).any(-1) | (tl > LOGPROB_SLACK),
         lambda i, j: f"log-probabilities above 0 ({lp[i, j].tolist()}, tail {tl[i, j]})")
  refuse((lp[..., 1:] > lp[..., :-1] + LOGPROB_SLACK).any(-1),
         lambda i, j: f"log-probabilities not sorted most likely first ({lp[i, j].tolist()})")
  mass = np.exp(lp).sum(-1) + np.exp(tl)
  refuse(np.abs(mass - 1.0) > MASS_TOLERANCE,
         lambda i, j: f"top-k mass plus tail {mass[i, j]:.6f} ({lp[i, j].tolist()}, tail {tl[i, j]})")


# ``GET /v1/teacher``'s fields a client reads, each with the types it may have and what it is
IDENTITY_FIELDS = {
    "server": ((str,), "a string (\"meshdistill\")"),
    "model": ((str,), "the served name, a string"),
    "tokenizer": ((str,), "the tokenizer's fingerprint, a string"),
    "vocab": ((int,), "the vocabulary range, an integer >= 1"),
    "temperature": ((int, float), "a number > 0"),
    "k": ((int,), "the largest top-k served, an integer >= 1"),
    "max_len": ((int,), "the longest row in tokens, an integer >= 1"),
    "teacher": ((dict,), "an object with the teacher's config and weights_sha256"),
}


def check_identity(ident: Any) -> dict:
  """``ident`` (a decoded ``/v1/teacher`` answer) when every field a client reads is there with its type and range;
  `AnswerError` naming the first field that is not and what was expected."""
  if not isinstance(ident, dict):
    raise AnswerError(f"the identity is a JSON {type(ident).__name__}, an object with the fields "
                      f"{', '.join(IDENTITY_FIELDS)} expected")
  for key, (types, expected) in IDENTITY_FIELDS.items():
    v = ident.get(key)
    ok = isinstance(v, types) and not isinstance(v, bool)
    if ok and key in ("vocab", "k", "max_len"):
      ok = v >= 1
    if ok and key == "temperature":
      ok = math.isfinite(v) and v > 0
    if not ok:
      raise AnswerError(f"field {key!r} is {v!r}; expected {expected}")
  teacher = ident["teacher"]
  if not isinstance(teacher.get("weights_sha256"), str):
    raise AnswerError(f"field 'teacher.weights_sha256' is {teacher.get('weights_sha256')!r}; expected the teacher's "
                      "weights hash, a hex string")
  config = teacher.get("config")
  if config is not None and not isinstance(config, dict):
    raise AnswerError(f"field 'teacher.config' is {config!r}; expected an object (the teacher's ModelConfig)")
  t_vocab = (config or {}).get("vocab_size", 0)
  if isinstance(t_vocab, bool) or not isinstance(t_vocab, int) or t_vocab < 0:
    raise AnswerError(f"field 'teacher.config.vocab_size' is {t_vocab!r}; expected an integer >= 1")
  return ident


def check_models(listing: Any) -> list[dict]:
  """The model entries of a ``/v1/models`` answer (vLLM), each with a string ``id`` and an integer
  ``max_model_len`` >= 2; `AnswerError` naming the field otherwise."""
  data = listing.get("data") if isinstance(listing, dict) else None
  if not isinstance(data, list):
    raise AnswerError(f"field 'data' is {data!r}; expected the list of served models")
  for n, m in enumerate(data):
    if not isinstance(m, dict) or not isinstance(m.get("id"), str):
      raise AnswerError(f"field 'data[{n}]' is {m!r}; expected an object with the model's name in 'id'")
    size = m.get("max_model_len")
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
      raise AnswerError(f"field 'data[{n}].max_model_len' is {size!r}; expected an integer >= 2 (the longest prompt)")
  return data


def identity_of(*, tokenizer: str, vocab: int, temperature: float, k: int, teacher: dict, max_len: int,
                served_name: str) -> dict:
  """What ``GET /v1/teacher`` answers: the facts a client checks before its first step."""
  return {"server": "meshdistill", "model": served_name, "tokenizer": tokenizer, "vocab": int(vocab),
          "temperature": float(temperature), "k": int(k), "max_len": int(max_len), "teacher": teacher,
          "answer_digest": DIGEST}
