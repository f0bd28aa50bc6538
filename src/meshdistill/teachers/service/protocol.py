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

A training row ``inputs [T]`` is sent as the prompt ``inputs + [targets[-1]]`` (``T + 1`` ids): its entries
``1..T`` are the teacher's top-K at the row's positions ``0..T-1``, what the step trains on.
"""

from __future__ import annotations

import base64
import dataclasses
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


def completion(prompts: list[list[int]], k: int, ids: list[np.ndarray], logprobs: list[np.ndarray],
               tails: list[np.ndarray], served_name: str, arrays: bool = False) -> dict:
  """vLLM's completion object for ``prompts``: ``ids[i] [n_i - 1, K]`` (int), ``logprobs[i]`` the same shape and
  ``tails[i] [n_i - 1]`` -- the teacher's top-K after each prefix of prompt ``i``, most likely first. ``arrays``:
  each choice holds ``prompt_topk`` (base64 arrays) instead of ``prompt_logprobs``."""
  choices = []
  for i, prompt in enumerate(prompts):
    if arrays:
      topk = {"ids": _b64(ids[i][:, :k], np.int32), "logprobs": _b64(logprobs[i][:, :k], np.float32),
              "tail": _b64(tails[i], np.float32)}
      choices.append({"index": i, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                      "prompt_logprobs": None, "prompt_topk": topk})
      continue
    entries: list[dict | None] = [None]
    for ids_K, lp_K in zip(ids[i][:, :k].tolist(), logprobs[i][:, :k].tolist()):
      entries.append({str(t): {"logprob": lp, "rank": r + 1, "decoded_token": None}
                      for r, (t, lp) in enumerate(zip(ids_K, lp_K))})
    choices.append({"index": i, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                    "prompt_logprobs": entries, "prompt_logprobs_tail": [None, *tails[i].tolist()]})
  n = sum(len(p) for p in prompts)
  return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
          "model": served_name, "choices": choices,
          "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}}


def read_completion(answer: Any, rows: int, length: int, k: int,
                    vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(ids [rows, length, k] int32, logprobs [rows, length, k] float32, tail [rows, length] float32)`` of a
  completion answering ``rows`` prompts of ``length + 1`` ids each; `AnswerError` unless every row, position and
  top-k entry is there, ids lie in ``[0, vocab)`` and every value is finite (a step never trains on less)."""
  choices = answer.get("choices") if isinstance(answer, dict) else None
  if not isinstance(choices, list) or len(choices) != rows:
    got = len(choices) if isinstance(choices, list) else "no"
    raise AnswerError(f"the answer holds {got} choices for {rows} prompts")
  ids = np.zeros((rows, length, k), np.int32)
  logprobs = np.zeros((rows, length, k), np.float32)
  tail = np.zeros((rows, length), np.float32)
  for choice in choices:
    i = choice.get("index") if isinstance(choice, dict) else None
    packed = choice.get("prompt_topk") if isinstance(choice, dict) else None
    if isinstance(packed, dict) and isinstance(i, int) and 0 <= i < rows:
      where = f"choice {i}: prompt_topk"
      ids[i] = _unb64(packed.get("ids"), np.int32, (length, k), f"{where}.ids")
      logprobs[i] = _unb64(packed.get("logprobs"), np.float32, (length, k), f"{where}.logprobs")
      tail[i] = _unb64(packed.get("tail"), np.float32, (length,), f"{where}.tail")
      continue
    entries = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
    if not isinstance(i, int) or not 0 <= i < rows or not isinstance(entries, list) or len(entries) != length + 1:
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
  if not (np.isfinite(logprobs).all() and np.isfinite(tail).all()):
    raise AnswerError("the answer holds log-probabilities that are not finite")
  if ids.min() < 0 or ids.max() >= vocab:
    raise AnswerError(f"the answer holds token ids outside [0, {vocab})")
  return ids, logprobs, tail


def identity_of(*, tokenizer: str, vocab: int, temperature: float, k: int, teacher: dict, max_len: int,
                served_name: str) -> dict:
  """What ``GET /v1/teacher`` answers: the facts a client checks before its first step."""
  return {"server": "meshdistill", "model": served_name, "tokenizer": tokenizer, "vocab": int(vocab),
          "temperature": float(temperature), "k": int(k), "max_len": int(max_len), "teacher": teacher}
