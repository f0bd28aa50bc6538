"""The teacher server: a Starlette application on uvicorn answering top-k requests through a `Batcher`.

Endpoints (`meshdistill.teachers.service.protocol` holds the formats):

* ``GET /health`` -- ``{"status": "ok", "requests", "calls", "rows", "tokens", "shapes", "dropped"}`` (no token
  needed); 503 with ``"status": "failed"`` and the error once the batching thread has died (every request then fails
  at once with 503);
* ``GET /v1/models`` -- vLLM's model list (the served name and ``max_model_len``);
* ``GET /v1/teacher`` -- the identity a client checks (tokenizer fingerprint, vocabulary, temperature, k, the
  teacher's config and weights hash);
* ``POST /v1/completions`` -- token-id prompts with ``prompt_logprobs`` (the vLLM subset).

With a token every endpoint but ``/health`` needs ``Authorization: Bearer <token>`` (401 otherwise). Bodies over
``Limits.bytes`` are refused (413) before they are read whole; bad JSON, fields or ids are 400, too many rows or
tokens 413 (JSON nested too deep to read is bad JSON). A request whose client hung up before its answer is dropped
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

from meshdistill.teachers.service import protocol
from meshdistill.teachers.service.batching import Batcher, BatcherFailed

# starlette and uvicorn (the `serve` extra), imported by `require` on first use: a job that serves nothing (distill,
# eval, ...) never loads the HTTP stack
uvicorn = Starlette = ClientDisconnect = Request = JSONResponse = Response = Route = None


def _load_web() -> bool:
  """Imports starlette and uvicorn into this module once; False when the `serve` extra is missing."""
  global uvicorn, Starlette, ClientDisconnect, Request, JSONResponse, Response, Route  # pylint: disable=global-statement
  if Starlette is None:
    try:
      import uvicorn as _uvicorn  # pylint: disable=g-import-not-at-top
      from starlette import applications, requests, responses, routing  # pylint: disable=g-import-not-at-top
    except ImportError:  # pragma: no cover - reported by `require`
      return False
    uvicorn, Starlette, Route = _uvicorn, applications.Starlette, routing.Route
    ClientDisconnect, Request = requests.ClientDisconnect, requests.Request
    JSONResponse, Response = responses.JSONResponse, responses.Response
  return True

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


def make_app(batcher: Batcher, identity: dict, limits: protocol.Limits, token: str | None = None):
  """The Starlette application answering with ``batcher`` (its ``identity`` from `protocol.identity_of`)."""
  require()
  name = identity["model"]
  expected = None if not token else f"Bearer {token}".encode()

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
    if size is not None and (not size.isdigit() or int(size) > limits.bytes):
      return _error(413, f"a body of {size} bytes; at most {limits.bytes} (the server's --max-bytes)")
    body = bytearray()
    try:
      async for chunk in request.stream():
        body += chunk
        if len(body) > limits.bytes:
          return _error(413, f"a body over {limits.bytes} bytes (the server's --max-bytes)")
    except ClientDisconnect:
      log.info("a client hung up while sending its request (%d bytes read); nothing computed", len(body))
      return Response(status_code=499)
    try:
      prompts, k, arrays = protocol.parse_request(json.loads(body), limits, name)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return _error(400, f"the body is not JSON ({e})")
    except RecursionError:
      return _error(400, "the body is not JSON this server reads: nested too deep (a prompt is a list of id lists)")
    except protocol.RequestError as e:
      return _error(e.status, str(e))
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
    ids, logprobs, tails = zip(*answers)
    text = await asyncio.to_thread(
        lambda: json.dumps(protocol.completion(prompts, k, ids, logprobs, tails, name, arrays=arrays)))
    return Response(text, media_type="application/json")

  return Starlette(routes=[
      Route("/health", health), Route("/v1/models", models), Route("/v1/teacher", teacher),
      Route("/v1/completions", completions, methods=["POST"]),
  ])


def bind(host: str, port: int) -> socket.socket:
  """A listening socket on ``host:port`` (``port`` 0: any free one); `BindError` naming the address otherwise."""
  try:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
  except (OSError, OverflowError) as e:
    raise BindError(f"--host {host} --port {port}: cannot bind ({e}); give an address of this host") from None
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
  except (OSError, OverflowError) as e:
    sock.close()
    what = "is in use by another process" if getattr(e, "errno", None) == errno.EADDRINUSE else f"cannot be bound ({e})"
    raise BindError(f"--port {port} on {host} {what}; choose another --port (0: any free port) or stop what holds "
                    "it") from None
  return sock


def serve(app, *, host: str, port: int, graceful_s: float = 30.0, ready: Callable[[int], None] | None = None) -> None:
  """Runs ``app`` until SIGTERM / SIGINT; the requests in flight are answered first (up to ``graceful_s``), then it
  returns (call from the main thread). The port is bound first (`BindError` when it cannot be); ``ready(port)`` is
  called once it is, with the port bound (the one chosen when ``port`` is 0)."""
  require()
  sock = bind(host, port)
  if ready is not None:
    ready(sock.getsockname()[1])
  config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_s, access_log=False)
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
