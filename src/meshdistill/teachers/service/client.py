"""The client of a served teacher (a ``meshdistill serve-teacher`` server, or a vLLM server): its identity and the
top-k of a batch of rows, with timeouts, retries and exponential backoff, every answer checked whole.

A request that fails by the network (refused connection, timeout) or by the server (5xx, 429, an answer that does
not hold every row or is not a distribution) is tried again after ``backoff_s * 2**attempt`` seconds, ``retries``
times; then `TeacherDown` says which url, what the last try got and that a rerun resumes. A 4xx other than 429 is
the request's fault: no retry, `TeacherRefused` with the server's message; an identity that is not what a client
reads is `TeacherRefused` naming the field. Each error carries the command's exit code (``exit_code``: 1 for a server
that failed, 2 for a refusal). A request given a ``cancel`` event ends its retries as soon as the event is set (the
prefetch of a run that stops).

``timeout_s`` is a deadline for the whole of one try -- connecting, sending, waiting and reading every byte -- not a
bound on each read: a watcher shuts the try's connection when the deadline passes (or ``cancel`` is set), so a read
blocked on a peer that sends one byte a second returns at once. Each try opens its own connection (no keep-alive),
so the connection shut is that try's alone. An answer is read as it arrives and refused once it passes
`protocol.answer_bytes` of the rows, positions and k asked for (an identity: `protocol.IDENTITY_BYTES`), never read
whole first. When the server's identity names the answer digest (`protocol.answer_digest`), or ``require_digest``,
every choice's digest is checked against the ids sent.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

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


class _Watch:
  """One try of a request, watched: once ``deadline`` (`time.monotonic`) passes or ``cancel`` is set, the try's
  connection is shut down (`socket.SHUT_RDWR`): a read blocked on it returns at once, whatever the peer does.
  ``trace`` is the request's httpx ``trace`` extension, through which the connection is learnt when it is made."""

  POLL_S = 0.05

  def __init__(self, deadline: float, cancel: threading.Event):
    self.deadline, self.cancel, self.why = deadline, cancel, None
    self._stream, self._lock, self._done = None, threading.Lock(), threading.Event()
    threading.Thread(target=self._watch, name="teacher-request-watch", daemon=True).start()

  def trace(self, event: str, info: dict) -> None:
    if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
      with self._lock:
        self._stream = info.get("return_value")
        if self.why is not None:
          self._shut()

  def _watch(self) -> None:
    while not self._done.wait(self.POLL_S):
      why = "cancelled" if self.cancel.is_set() else "deadline" if time.monotonic() >= self.deadline else None
      if why is not None:
        with self._lock:
          self.why = why
          self._shut()
        return

  def _shut(self) -> None:
    sock = self._stream.get_extra_info("socket") if self._stream is not None else None
    if sock is not None:
      try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's: a TLS one's reader then sees its end
      except OSError:  # already closed
        pass

  def close(self) -> None:
    self._done.set()


class _TooLarge(Exception):
  """An answer past the bytes this client reads of it."""


def _read_body(r, cap: int) -> bytes:
  """The body of response ``r``, read as it arrives; `_TooLarge` as soon as it (or its Content-Length) passes
  ``cap`` bytes."""
  size = r.headers.get("content-length", "")
  if size.isdigit() and int(size) > cap:
    raise _TooLarge(f"its Content-Length is {int(size)} bytes")
  body = bytearray()
  for chunk in r.iter_bytes():
    body += chunk
    if len(body) > cap:
      raise _TooLarge(f"more than {cap} bytes came")
  return bytes(body)


class TeacherClient:
  """Talks to the teacher server at ``url`` (``http://host:port``).

  Args:
    timeout_s: the deadline of one try of a request, in seconds: connecting, sending, waiting for and reading the
      whole answer.
    retries: tries after the first one fails; ``backoff_s``: the first wait, doubled each time.
    token: sent as ``Authorization: Bearer <token>`` when given.
    model: the served model name (vLLM: which of its models); None: the server's only one.
    arrays: ask for the answer as base64 arrays (``meshdistill_arrays``); None: once `identity` has found a
      meshdistill server. False: vLLM's ``prompt_logprobs`` form always.
    require_digest: refuse every answer whose choices hold no answer digest (`protocol.answer_digest`), and a server
      whose identity names none; without it the digests are checked once the identity names them.
  """

  # bytes read of an error's body (a 4xx / 5xx), of which the first 500 characters are quoted
  ERROR_BYTES = 1 << 16

  def __init__(self, url: str, *, timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5,
               token: str | None = None, model: str | None = None, arrays: bool | None = None,
               require_digest: bool = False):
    if not _load_httpx():
      raise RemoteTeacherError("teacher.source=remote needs httpx: pip install 'meshdistill[serve]'")
    self.url, self.retries, self.backoff_s, self.model = url.rstrip("/"), retries, backoff_s, model
    self.timeout_s, self.require_digest = float(timeout_s), require_digest
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers,
                              limits=httpx.Limits(max_keepalive_connections=0))  # a connection per try: see _Watch
    self.failures = 0  # requests tried again (for the logs and tests)
    self.arrays = arrays
    self.digests = require_digest  # whether every answer's choices must hold a digest (the identity may say so)

  def close(self) -> None:
    self._http.close()

  def _request(self, method: str, path: str, body: dict | None = None, read=None,
               cancel: threading.Event | None = None, cap: int = protocol.IDENTITY_BYTES):
    """The decoded answer of ``path`` (``read(answer)`` applied), tried again on network or server failure, each try
    within the deadline ``timeout_s`` and its answer within ``cap`` bytes; once ``cancel`` is set no try follows
    (`Cancelled`) and the one under way ends at once."""
    cancel = cancel or threading.Event()
    last, unusable = "no answer", False
    for attempt in range(self.retries + 1):
      if attempt and cancel.wait(self.backoff_s * 2 ** (attempt - 1)):
        break
      if cancel.is_set():
        break
      watch = _Watch(time.monotonic() + self.timeout_s, cancel)
      status, text, last = None, b"", None
      try:
        with self._http.stream(method, path, json=body, timeout=self.timeout_s,
                               extensions={"trace": watch.trace}) as r:
          status = r.status_code
          if status < 400:
            text = _read_body(r, cap)
          else:  # an error's message: its first bytes
            for chunk in r.iter_bytes():
              text += chunk
              if len(text) >= self.ERROR_BYTES:
                break
      except httpx.TransportError as e:  # connection refused or reset, timeouts, a connection the watch shut
        status, last, unusable = None, f"{type(e).__name__}: {e}", False
      except _TooLarge as e:  # never read whole: refused as it passes the cap
        status, last, unusable = None, (f"an answer over {cap} bytes, the most an answer to this request takes "
                                        f"(protocol.answer_bytes): {e}"), True
      finally:
        watch.close()
      if status is not None and status < 400:
        try:
          answer = json.loads(text)
          return answer if read is None else read(answer)
        except (ValueError, protocol.AnswerError) as e:  # a partial or damaged answer is never trained on
          last, unusable = f"an unusable answer: {e}", True
      elif status in (429,) or (status is not None and status >= 500):
        last, unusable = f"HTTP {status}: {text[:200].decode(errors='replace')}", False
      elif status is not None:
        raise TeacherRefused(f"teacher server {self.url}{path} refused the request (HTTP {status}): "
                             f"{_message(text)}")
      if watch.why == "cancelled":
        break
      if watch.why == "deadline" and not (unusable and status is None):  # a connection the watch shut, or cut short
        last, unusable = (f"no whole answer within teacher.timeout={self.timeout_s:g} s, the deadline of one try "
                          f"(connecting, sending, waiting and reading; {last})"), False
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
      if ident.get("answer_digest") == protocol.DIGEST:
        self.digests = True
      elif self.require_digest:
        raise TeacherRefused(f"teacher server {self.url} names no answer digest this client checks (its identity's "
                             f"answer_digest is {ident.get('answer_digest')!r}, {protocol.DIGEST!r} expected), and "
                             "teacher.require_digest is set: serve the teacher with this version of meshdistill "
                             "serve-teacher, or leave teacher.require_digest out")
      return ident
    except TeacherRefused as e:
      if "HTTP 404" not in str(e):
        raise
    if self.require_digest:
      raise TeacherRefused(f"teacher server {self.url} is not a meshdistill server (no /v1/teacher): it sends no "
                           "answer digest, and teacher.require_digest is set; leave teacher.require_digest out to "
                           "use it")
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
    sent = np.asarray(prompts, np.int64) if self.digests else None  # digests of another scheme are not read
    return self._request("POST", "/v1/completions", body, cancel=cancel,
                         read=lambda a: protocol.read_completion(a, rows, length, k, vocab, prompts=sent,
                                                                 require_digest=self.digests),
                         cap=protocol.answer_bytes(rows, length, k))


def _message(text: bytes) -> str:
  """The server's error message (vLLM's ``{"message": ...}``) of a body ``text``, else its first 500 characters."""
  try:
    body = json.loads(text)
  except ValueError:
    return text[:500].decode(errors="replace")
  return str(body["message"] if isinstance(body, dict) and "message" in body
             else text.decode(errors="replace"))[:500]
