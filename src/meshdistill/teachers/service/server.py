"""The teacher server: a Starlette application on uvicorn answering top-k requests through a `Batcher`.

Endpoints (`meshdistill.teachers.service.protocol` holds the formats):

* ``GET /health`` -- ``{"status": "ok", "requests", "calls", "rows", "tokens", "shapes", "dropped"}`` (no token
  needed); 503 with ``"status": "failed"`` and the error once the batching thread has died (every request then fails
  at once with 503);
* ``GET /v1/models`` -- vLLM's model list (the served name and ``max_model_len``);
* ``GET /v1/teacher`` -- the identity a client checks (tokenizer fingerprint, vocabulary, temperature, k, the
  teacher's config and weights hash);
* ``POST /v1/completions`` -- token-id prompts with ``prompt_logprobs`` (the vLLM subset).

With a token every endpoint but ``/health`` needs ``Authorization: Bearer <token>`` (401 otherwise). A body over
`protocol.Limits.body_bytes` (what ``--max-rows`` prompts of the longest row can take, or ``--max-bytes`` when less)
is refused (413) by its Content-Length, or once that many bytes have come, before any of it is parsed; at most
``BODIES_AT_ONCE`` bodies are read and parsed at a time (the others wait unread, uvicorn's flow control keeping each
to a few kB). Bad JSON, fields or ids are 400, too many rows or tokens 413 (JSON nested too deep to read is bad
JSON). An answer holds the ``k`` a request asked for, the teacher's other ``--k - k`` joined to the tail (`narrow`).

Connections (`connections`): a client has ``read_timeout_s`` to send a request's head (from its connection, or the
end of its previous answer) or the connection is closed, and as long again for its body once it is read (408
otherwise); at most ``max_connections`` are open, a new one closing the longest-idle one that has not sent a head
(or, with every one busy with a request, itself). A request whose client hung up before its answer is dropped
(never computed once the client is gone), with one log line. SIGTERM / SIGINT: uvicorn stops accepting connections
and finishes the requests in flight (at most ``graceful_s`` seconds), then the batcher answers what it holds and
stops.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import signal
import socket
from collections.abc import Callable

import numpy as np

from meshdistill import losses
from meshdistill.teachers.service import protocol
from meshdistill.teachers.service.batching import Batcher, BatcherFailed

# starlette and uvicorn (the `serve` extra), imported by `require` on first use: a job that serves nothing (distill,
# eval, ...) never loads the HTTP stack
uvicorn = H11Protocol = Starlette = ClientDisconnect = Request = JSONResponse = Response = Route = None


def _load_web() -> bool:
  """Imports starlette and uvicorn into this module once; False when the `serve` extra is missing."""
  global uvicorn, H11Protocol, Starlette, Route  # pylint: disable=global-statement
  global ClientDisconnect, Request, JSONResponse, Response  # pylint: disable=global-statement
  if Starlette is None:
    try:
      import uvicorn as _uvicorn  # pylint: disable=g-import-not-at-top
      from starlette import applications, requests, responses, routing  # pylint: disable=g-import-not-at-top
      from uvicorn.protocols.http.h11_impl import H11Protocol as _H11Protocol  # pylint: disable=g-import-not-at-top
    except ImportError:  # pragma: no cover - reported by `require`
      return False
    uvicorn, H11Protocol, Starlette, Route = _uvicorn, _H11Protocol, applications.Starlette, routing.Route
    ClientDisconnect, Request = requests.ClientDisconnect, requests.Request
    JSONResponse, Response = responses.JSONResponse, responses.Response
  return True

# request bodies read and parsed at a time (each at most `protocol.Limits.body_bytes`); the others wait unread
BODIES_AT_ONCE = 4

log = logging.getLogger(__name__)


class BindError(OSError):
  """The server's address could not be bound (a port in use, an address not of this host); nothing was served."""


def _error(status: int, message: str) -> JSONResponse:
  # vLLM's error object
  return JSONResponse({"object": "error", "message": message, "type": "BadRequestError", "code": status},
                      status_code=status)


def require() -> None:
  """Raises, naming the extra to install, when starlette or uvicorn is missing."""
  if not _load_web():
    raise RuntimeError("the teacher server needs starlette and uvicorn: pip install 'meshdistill[serve]'")


def narrow(answers: list[tuple[np.ndarray, np.ndarray, np.ndarray]], k: int):
  """``(ids, logprobs, tails)``, one per prompt, of the batcher's top-``K`` ``answers`` (each ``(ids [n, K],
  logprobs [n, K], tail [n])``) kept to the first ``k <= K``: the other ``K - k`` join the tail, exactly as a cached
  top-k is narrowed for a smaller ``distill.top_k`` (`meshdistill.losses.narrow_topk`), so the answer's top-k mass
  plus tail is 1 at every ``k``."""
  ids, logprobs, tails = zip(*answers)
  if ids[0].shape[-1] == k:
    return ids, logprobs, tails
  ends = np.cumsum([len(t) for t in tails])[:-1]
  kept = losses.narrow_topk(losses.TopK(*(np.concatenate(x) for x in (ids, logprobs, tails))), k)  # numpy: on host
  return tuple(np.split(x, ends) for x in kept)


def make_app(batcher: Batcher, identity: dict, limits: protocol.Limits, token: str | None = None,
             read_timeout_s: float = 30.0):
  """The Starlette application answering with ``batcher`` (its ``identity`` from `protocol.identity_of`); a request's
  body must arrive within ``read_timeout_s`` of its head (408 otherwise)."""
  require()
  name = identity["model"]
  expected = None if not token else f"Bearer {token}".encode()
  cap = limits.body_bytes
  bodies = asyncio.Semaphore(BODIES_AT_ONCE)

  def authorised(request: Request) -> bool:
    if expected is None:
      return True
    return hmac.compare_digest(request.headers.get("authorization", "").encode(), expected)

  async def health(request: Request):
    del request
    if batcher.failed is not None:
      return JSONResponse({"status": "failed", "error": batcher.failed, **batcher.stats.as_dict()}, status_code=503)
    return JSONResponse({"status": "ok", **batcher.stats.as_dict()})

  async def hung_up(request: Request) -> None:
    """Returns once the client of ``request`` (its body read) has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
      pass

  async def models(request: Request):
    if not authorised(request):
      return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
    return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "meshdistill",
                                                     "max_model_len": identity["max_len"] + 1}]})

  async def teacher(request: Request):
    if not authorised(request):
      return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
    return JSONResponse(identity)

  async def completions(request: Request):
    if not authorised(request):
      return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > cap):
      return _error(413, f"a body of {size} bytes; at most {cap} ({limits.describe_body_bytes()})")
    async with bodies:  # the bodies held in memory at once: BODIES_AT_ONCE, each at most `cap` bytes
      body = bytearray()
      try:
        async with asyncio.timeout(read_timeout_s):
          async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
              return _error(413, f"a body over {cap} bytes ({limits.describe_body_bytes()})")
      except ClientDisconnect:
        log.info("a client hung up while sending its request (%d bytes read); nothing computed", len(body))
        return Response(status_code=499)
      except TimeoutError:
        log.info("a client sent %d bytes of its body in %g s (the server's --read-timeout-s); answered 408",
                 len(body), read_timeout_s)
        return _error(408, f"the body did not arrive within {read_timeout_s:g} s (the server's --read-timeout-s)")
      try:
        prompts, k, arrays = await asyncio.to_thread(
            lambda: protocol.parse_request(json.loads(body), limits, name))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error(400, f"the body is not JSON ({e})")
      except RecursionError:
        return _error(400, "the body is not JSON this server reads: nested too deep (a prompt is a list of id lists)")
      except protocol.RequestError as e:
        return _error(e.status, str(e))
      finally:
        del body
    try:
      future = batcher.submit(prompts)
    except BatcherFailed as e:  # shutting down, or the batching thread died
      return _error(503, str(e))
    answer, gone = asyncio.wrap_future(future), asyncio.ensure_future(hung_up(request))
    try:
      await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
    if not answer.done():  # the client is gone: its rows are dropped unless a teacher call already holds them
      future.cancel()
      answer.cancel()
      log.info("a client hung up before its answer: %d rows dropped", len(prompts))
      return Response(status_code=499)
    try:
      answers = answer.result()
    except BatcherFailed as e:  # the batching thread died
      return _error(503, str(e))
    except Exception as e:  # noqa: BLE001 -- the teacher call failed (logged by the batcher with its traceback)
      return _error(500, f"the teacher call failed ({type(e).__name__}: {e})")
    text = await asyncio.to_thread(
        lambda: json.dumps(protocol.completion(prompts, k, *narrow(answers, k), name, arrays=arrays)))
    return Response(text, media_type="application/json")

  return Starlette(routes=[
      Route("/health", health), Route("/v1/models", models), Route("/v1/teacher", teacher),
      Route("/v1/completions", completions, methods=["POST"]),
  ])


def bind(host: str, port: int) -> socket.socket:
  """A socket bound to ``host:port`` (``port`` 0: any free one), not yet listening (a client is refused until `serve`
  listens): taken before the teacher is loaded, so a port in use or an address not of this host is reported at once.
  `BindError` naming the address otherwise."""
  try:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
  except (OSError, OverflowError) as e:
    raise BindError(f"--host {host} --port {port}: cannot bind ({e}); give an address of this host") from None
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
  except (OSError, OverflowError) as e:
    sock.close()
    raise _bind_error(host, port, e) from None
  return sock


def _bind_error(host: str, port: int, e: BaseException) -> BindError:
  what = "is in use by another process" if getattr(e, "errno", None) == errno.EADDRINUSE else f"cannot be bound ({e})"
  return BindError(f"--port {port} on {host} {what}; choose another --port (0: any free port) or stop what holds it")


# the longest request head (request line and headers) read: h11's own default, said here
HEAD_BYTES = 16 << 10


def connections(*, max_connections: int, read_timeout_s: float):
  """uvicorn's HTTP/1.1 protocol (h11) with two bounds uvicorn lacks, for `serve`'s ``http``:

  * a client has ``read_timeout_s`` to send a whole request head, from its connection or from the end of its
    previous answer (uvicorn's keep-alive timer stops at the first byte, so a head sent a byte at a time, or never
    finished, held a connection for ever); the connection is closed then;
  * at most ``max_connections`` are open: a new one beyond closes the one idle longest that has not sent a head
    since (a half-sent head holds no place an honest request needs), or, every one busy with a request, itself.
  """
  require()
  told = []

  class Connections(H11Protocol):
    _late = None
    _armed = None  # the request cycle when the head timer was armed: a head read since makes a new one
    idle_since = 0.0

    def _arm(self) -> None:
      if self._late is not None:
        self._late.cancel()
      self.idle_since, self._armed = self.loop.time(), self.cycle
      self._late = self.loop.call_later(read_timeout_s, self._head_late)

    def waiting(self) -> bool:
      """No request head since the connection or the last answer."""
      return self.cycle is self._armed and not self.transport.is_closing()

    def _head_late(self) -> None:
      self._late = None
      if self.waiting():
        log.info("a connection sent no whole request head in %g s (--read-timeout-s); closed", read_timeout_s)
        self.transport.close()

    def connection_made(self, transport) -> None:
      super().connection_made(transport)
      self._arm()
      live = [c for c in self.connections if not c.transport.is_closing()]
      if len(live) > max_connections:
        idle = [c for c in live if c is not self and c.waiting()]
        (min(idle, key=lambda c: c.idle_since) if idle else self).transport.close()
        if not told:
          told.append(True)
          log.warning("more than --max-connections %d connections: the idle ones are closed first", max_connections)

    def on_response_complete(self) -> None:
      self._arm()  # first: a pipelined head that the call below reads makes a new cycle
      super().on_response_complete()

    def connection_lost(self, exc) -> None:
      if self._late is not None:
        self._late.cancel()
      super().connection_lost(exc)

  return Connections


def uvicorn_config(app, *, graceful_s: float = 30.0, max_connections: int = 256, read_timeout_s: float = 30.0,
                   log_level: str = "warning"):
  """The uvicorn settings `serve` runs ``app`` with: h11 with `connections`' bounds, heads of at most
  ``HEAD_BYTES``, no access log."""
  require()
  return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_s, access_log=False,
                        http=connections(max_connections=max_connections, read_timeout_s=read_timeout_s),
                        h11_max_incomplete_event_size=HEAD_BYTES)


def serve(app, *, host: str, port: int, sock: socket.socket | None = None, graceful_s: float = 30.0,
          max_connections: int = 256, read_timeout_s: float = 30.0,
          ready: Callable[[int], None] | None = None) -> None:
  """Runs ``app`` until SIGTERM / SIGINT; the requests in flight are answered first (up to ``graceful_s``), then it
  returns (call from the main thread). It listens on ``sock`` (from `bind`), or binds ``host:port`` first
  (`BindError` when it cannot); ``ready(port)`` is called once it listens, with the port bound (the one chosen when
  ``port`` is 0). Connections are bounded as `connections` says."""
  require()
  sock = bind(host, port) if sock is None else sock
  try:
    sock.listen(2048)
  except OSError as e:
    sock.close()
    raise _bind_error(host, port, e) from None
  if ready is not None:
    ready(sock.getsockname()[1])
  config = uvicorn_config(app, graceful_s=graceful_s, max_connections=max_connections, read_timeout_s=read_timeout_s)
  # uvicorn raises the signal it stopped on again once the requests in flight are answered; caught here, that ends
  # the serving and the caller's clean-up runs (the batcher is closed, the stats reported)
  caught = (signal.SIGINT, signal.SIGTERM)
  previous = {sig: signal.signal(sig, lambda *_: None) for sig in caught}
  try:
    uvicorn.Server(config).run(sockets=[sock])
  finally:
    sock.close()
    for sig, handler in previous.items():
      signal.signal(sig, handler)
