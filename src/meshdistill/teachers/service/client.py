"""The client of a served teacher (a ``meshdistill serve-teacher`` server, or a vLLM server): its identity and the
top-k of a batch of rows, with timeouts, retries and exponential backoff, every answer checked whole.

A request that fails by the network (refused connection, timeout) or by the server (5xx, 429, an answer that does
not hold every row or is not a distribution) is tried again after ``backoff_s * 2**attempt`` seconds, ``retries``
times; then `TeacherDown` says which url, what the last try got and that a rerun resumes. A 4xx other than 429 is
the request's fault: no retry, `TeacherRefused` with the server's message; an identity that is not what a client
reads is `TeacherRefused` naming the field. Each error carries the command's exit code (``exit_code``: 1 for a server
that failed, 2 for a refusal). A request given a ``cancel`` event ends its retries as soon as the event is set (the
prefetch of a run that stops).
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from meshdistill.teachers.service import protocol

httpx = None  # the `serve` extra, imported by the first `TeacherClient` (`_load_httpx`): importing this module does not


def _load_httpx() -> bool:
  """Imports httpx into this module once; False when the `serve` extra is missing."""
  global httpx  # pylint: disable=global-statement
  if httpx is None:
    try:
      import httpx as _httpx  # pylint: disable=g-import-not-at-top
    except ImportError:  # pragma: no cover - reported by `TeacherClient`
      return False
    httpx = _httpx
  return True

log = logging.getLogger(__name__)


class RemoteTeacherError(RuntimeError):
  """A served teacher that refused a request or cannot serve this run; ``exit_code``: the command's exit code."""

  exit_code = 1


class TeacherDown(RemoteTeacherError):
  """The server did not answer, or gave no usable answer, after every retry (exit 1: a rerun resumes)."""


class TeacherRefused(RemoteTeacherError):
  """The server refused the request (a 4xx: a wrong token, model or request) or tells an identity this client
  cannot read (exit 2: refused, nothing was trained on it)."""

  exit_code = 2


class Cancelled(RemoteTeacherError):
  """The request was cancelled (`TeacherClient.cancel`): the run that asked for it stops."""


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
    if not _load_httpx():
      raise RemoteTeacherError("teacher.source=remote needs httpx: pip install 'meshdistill[serve]'")
    self.url, self.retries, self.backoff_s, self.model = url.rstrip("/"), retries, backoff_s, model
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)
    self.failures = 0  # requests tried again (for the logs and tests)
    self.arrays = arrays

  def close(self) -> None:
    self._http.close()


  def _request(self, method: str, path: str, body: dict | None = None, read=None,
               cancel: threading.Event | None = None):
    """The decoded answer of ``path`` (``read(answer)`` applied), tried again on network or server failure; once
    ``cancel`` is set no try follows (`Cancelled`)."""
    cancel = cancel or threading.Event()
    last, unusable = "no answer", False
    for attempt in range(self.retries + 1):
      if attempt and cancel.wait(self.backoff_s * 2 ** (attempt - 1)):
        break
      if cancel.is_set():
        break
      try:
        r = self._http.request(method, path, json=body)
      except httpx.TransportError as e:  # connection refused or reset, timeouts
        last, unusable = f"{type(e).__name__}: {e}", False
      else:
        if r.status_code < 400:
          try:
            answer = r.json()
            return answer if read is None else read(answer)
          except (ValueError, protocol.AnswerError) as e:  # a partial or damaged answer is never trained on
            last, unusable = f"an unusable answer: {e}", True
        elif r.status_code in (429,) or r.status_code >= 500:
          last, unusable = f"HTTP {r.status_code}: {r.text[:200]}", False
        else:
          raise TeacherRefused(f"teacher server {self.url}{path} refused the request (HTTP {r.status_code}): "
                               f"{_message(r)}")
      self.failures += 1
      log.warning("teacher server %s%s: %s (try %d of %d)", self.url, path, last, attempt + 1, self.retries + 1)
    if cancel.is_set():
      raise Cancelled(f"the request to teacher server {self.url}{path} was cancelled (the run stopped)")
    if unusable:
      raise TeacherDown(
          f"teacher server {self.url} answered {method} {path} {self.retries + 1} times with nothing a step may train "
          f"on ({last}); nothing was trained on it. Check the server (and any proxy between it and this host), then "
          "rerun the same command: the run resumes from its last checkpoint")
    raise TeacherDown(
        f"teacher server {self.url} did not answer {method} {path} after {self.retries + 1} tries ({last}); nothing "
        "was trained on the missing answer. Start the server again (meshdistill serve-teacher) and rerun the same "
        "command: the run resumes from its last checkpoint")

  def identity(self) -> dict:
    """The server's identity: a meshdistill server's ``/v1/teacher``; for another (vLLM) server what ``/v1/models``
    says (``{"server": "vllm", "model", "max_len"}``; no tokenizer, vocabulary or temperature to compare)."""
    try:
      ident = self._identity("/v1/teacher", protocol.check_identity)
      self.arrays = True if self.arrays is None else self.arrays
      return ident
    except TeacherRefused as e:
      if "HTTP 404" not in str(e):
        raise
    listed = self._identity("/v1/models", protocol.check_models)
    names = [m["id"] for m in listed]
    model = self.model if self.model is not None else (names[0] if len(names) == 1 else None)
    if model not in names:
      raise TeacherRefused(f"teacher server {self.url} serves {names}; set teacher.model to one of them")
    entry = listed[names.index(model)]
    return {"server": "vllm", "model": model, "max_len": entry["max_model_len"] - 1}

  def _identity(self, path: str, check) -> dict | list:
    answer = self._request("GET", path)
    try:
      return check(answer)
    except protocol.AnswerError as e:  # not what a meshdistill (or vLLM) server answers: never retried
      raise TeacherRefused(f"teacher server {self.url}{path} answered an identity this client cannot read: {e}; "
                           "point teacher.url at a meshdistill serve-teacher or vLLM server") from None

  def topk(self, inputs_BxT: np.ndarray, last_B: np.ndarray, *, k: int, vocab: int,
           cancel: threading.Event | None = None):
    """``(ids [B, T, k] int32, logprobs [B, T, k] float32, tail [B, T] float32)``: the teacher's top-k at every
    position of rows ``inputs_BxT`` (sent as ``inputs + [last]``, see `protocol`); ``cancel``: see `_request`."""
    rows, length = inputs_BxT.shape
    prompts = np.concatenate([inputs_BxT, np.asarray(last_B).reshape(rows, 1)], axis=1).astype(np.int64).tolist()
    body = {"prompt": prompts, "prompt_logprobs": k, "max_tokens": 0 if self.model is None else 1}
    if self.model is not None:
      body["model"] = self.model
    if self.arrays:
      body["meshdistill_arrays"] = True
    return self._request("POST", "/v1/completions", body,
                         read=lambda a: protocol.read_completion(a, rows, length, k, vocab), cancel=cancel)


def _message(r) -> str:
  """The server's error message (vLLM's ``{"message": ...}``), else the body's first 500 characters."""
  try:
    body = r.json()
  except ValueError:
    return r.text[:500]
  return str(body["message"] if isinstance(body, dict) and "message" in body else r.text)[:500]
