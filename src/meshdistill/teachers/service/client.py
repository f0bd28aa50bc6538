"""The client of a served teacher (a ``meshdistill serve-teacher`` server, or a vLLM server): its identity and the
top-k of a batch of rows, with timeouts, retries and exponential backoff, every answer checked whole.

A request that fails by the network (refused connection, timeout) or by the server (5xx, 429, an answer that does
not hold every row) is tried again after ``backoff_s * 2**attempt`` seconds, ``retries`` times; then
`TeacherDown` says which url and that a rerun resumes. A 4xx other than 429 is the request's fault: no retry,
`RemoteTeacherError` with the server's message.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from meshdistill.teachers.service import protocol

try:  # the `serve` extra
  import httpx
except ImportError:  # pragma: no cover - reported by `TeacherClient`
  httpx = None

log = logging.getLogger(__name__)


class RemoteTeacherError(RuntimeError):
  """A served teacher that refused a request or cannot serve this run."""


class TeacherDown(RemoteTeacherError):
  """The server did not answer after every retry."""


class TeacherClient:
  """Talks to the teacher server at ``url`` (``http://host:port``).

  Args:
    timeout_s: seconds one request may take (connect, send, answer).
    retries: tries after the first one fails; ``backoff_s``: the first wait, doubled each time.
    token: sent as ``Authorization: Bearer <token>`` when given.
    model: the served model name (vLLM: which of its models); None: the server's only one.
    arrays: ask for the answer as base64 arrays (``meshdistill_arrays``); None: once `identity` has found a
      meshdistill server. False: vLLM's ``prompt_logprobs`` form always.
  """

  def __init__(self, url: str, *, timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5,
               token: str | None = None, model: str | None = None, arrays: bool | None = None):
    if httpx is None:
      raise RemoteTeacherError("teacher.source=remote needs httpx: pip install 'meshdistill[serve]'")
    self.url, self.retries, self.backoff_s, self.model = url.rstrip("/"), retries, backoff_s, model
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)
    self.failures = 0  # requests tried again (for the logs and tests)
    self.arrays = arrays

  def close(self) -> None:
    self._http.close()

  def _request(self, method: str, path: str, body: dict | None = None, read=None):
    """The decoded answer of ``path`` (``read(answer)`` applied), tried again on network or server failure."""
    last = "no answer"
    for attempt in range(self.retries + 1):
      if attempt:
        time.sleep(self.backoff_s * 2 ** (attempt - 1))
      try:
        r = self._http.request(method, path, json=body)
      except httpx.TransportError as e:  # connection refused or reset, timeouts
        last = f"{type(e).__name__}: {e}"
      else:
        if r.status_code < 400:
          try:
            answer = r.json()
            return answer if read is None else read(answer)
          except (ValueError, protocol.AnswerError) as e:  # a partial or damaged answer is never trained on
            last = f"an unusable answer: {e}"
        elif r.status_code in (429,) or r.status_code >= 500:
          last = f"HTTP {r.status_code}: {r.text[:200]}"
        else:
          raise RemoteTeacherError(f"teacher server {self.url}{path} refused the request (HTTP {r.status_code}): "
                                   f"{_message(r)}")
      self.failures += 1
      log.warning("teacher server %s%s: %s (try %d of %d)", self.url, path, last, attempt + 1, self.retries + 1)
    raise TeacherDown(
        f"teacher server {self.url} did not answer {method} {path} after {self.retries + 1} tries ({last}); nothing "
        "was trained on the missing answer. Start the server again (meshdistill serve-teacher) and rerun the same "
        "command: the run resumes from its last checkpoint")

  def identity(self) -> dict:
    """The server's identity: a meshdistill server's ``/v1/teacher``; for another (vLLM) server what ``/v1/models``
    says (``{"server": "vllm", "model", "max_len"}``; no tokenizer, vocabulary or temperature to compare)."""
    try:
      ident = self._request("GET", "/v1/teacher")
      self.arrays = True if self.arrays is None else self.arrays
      return ident
    except RemoteTeacherError as e:
      if "HTTP 404" not in str(e):
        raise
    listed = self._request("GET", "/v1/models").get("data") or []
    names = [m.get("id") for m in listed if isinstance(m, dict)]
    model = self.model if self.model is not None else (names[0] if len(names) == 1 else None)
    if model not in names:
      raise RemoteTeacherError(f"teacher server {self.url} serves {names}; set teacher.model to one of them")
    entry = listed[names.index(model)]
    return {"server": "vllm", "model": model, "max_len": int(entry.get("max_model_len") or 0) - 1}

  def topk(self, inputs_BxT: np.ndarray, last_B: np.ndarray, *, k: int, vocab: int):
    """``(ids [B, T, k] int32, logprobs [B, T, k] float32, tail [B, T] float32)``: the teacher's top-k at every
    position of rows ``inputs_BxT`` (sent as ``inputs + [last]``, see `protocol`)."""
    rows, length = inputs_BxT.shape
    prompts = np.concatenate([inputs_BxT, np.asarray(last_B).reshape(rows, 1)], axis=1).astype(np.int64).tolist()
    body = {"prompt": prompts, "prompt_logprobs": k, "max_tokens": 0 if self.model is None else 1}
    if self.model is not None:
      body["model"] = self.model
    if self.arrays:
      body["meshdistill_arrays"] = True
    return self._request("POST", "/v1/completions", body,
                         read=lambda a: protocol.read_completion(a, rows, length, k, vocab))


def _message(r) -> str:
  try:
    return str(r.json().get("message", r.text))[:500]
  except ValueError:
    return r.text[:500]
