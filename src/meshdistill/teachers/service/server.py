"""The teacher server: a Starlette application on uvicorn answering top-k requests through a `Batcher`.

Endpoints (`meshdistill.teachers.service.protocol` holds the formats):

* ``GET /health`` -- ``{"status": "ok", "requests", "calls", "rows", "tokens", "shapes"}`` (no token needed);
* ``GET /v1/models`` -- vLLM's model list (the served name and ``max_model_len``);
* ``GET /v1/teacher`` -- the identity a client checks (tokenizer fingerprint, vocabulary, temperature, k, the
  teacher's config and weights hash);
* ``POST /v1/completions`` -- token-id prompts with ``prompt_logprobs`` (the vLLM subset).

With a token every endpoint but ``/health`` needs ``Authorization: Bearer <token>`` (401 otherwise). Bodies over
``Limits.bytes`` are refused (413) before they are read whole; bad JSON, fields or ids are 400, too many rows or
tokens 413. SIGTERM / SIGINT: uvicorn stops accepting connections and finishes the requests in flight (at most
``graceful_s`` seconds), then the batcher answers what it holds and stops.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal

from meshdistill.teachers.service import protocol
from meshdistill.teachers.service.batching import Batcher

try:  # the `serve` extra
  import uvicorn
  from starlette.applications import Starlette
  from starlette.requests import Request
  from starlette.responses import JSONResponse, Response
  from starlette.routing import Route
except ImportError:  # pragma: no cover - reported by `serve`
  uvicorn = Starlette = None

log = logging.getLogger(__name__)


def _error(status: int, message: str) -> JSONResponse:
  # vLLM's error object
  return JSONResponse({"object": "error", "message": message, "type": "BadRequestError", "code": status},
                      status_code=status)


def require() -> None:
  """Raises, naming the extra to install, when starlette or uvicorn is missing."""
  if Starlette is None:
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
    return JSONResponse({"status": "ok", **batcher.stats.as_dict()})

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
    async for chunk in request.stream():
      body += chunk
      if len(body) > limits.bytes:
        return _error(413, f"a body over {limits.bytes} bytes (the server's --max-bytes)")
    try:
      prompts, k, arrays = protocol.parse_request(json.loads(body), limits, name)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return _error(400, f"the body is not JSON ({e})")
    except protocol.RequestError as e:
      return _error(e.status, str(e))
    try:
      answers = await asyncio.wrap_future(batcher.submit(prompts))
    except RuntimeError as e:  # shutting down
      return _error(503, str(e))
    ids, logprobs, tails = zip(*answers)
    text = await asyncio.to_thread(
        lambda: json.dumps(protocol.completion(prompts, k, ids, logprobs, tails, name, arrays=arrays)))
    return Response(text, media_type="application/json")

  return Starlette(routes=[
      Route("/health", health), Route("/v1/models", models), Route("/v1/teacher", teacher),
      Route("/v1/completions", completions, methods=["POST"]),
  ])


def serve(app, *, host: str, port: int, graceful_s: float = 30.0) -> None:
  """Runs ``app`` until SIGTERM / SIGINT; the requests in flight are answered first (up to ``graceful_s``), then it
  returns (call from the main thread)."""
  config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=graceful_s,
                          access_log=False)
  # uvicorn raises the signal it stopped on again once the requests in flight are answered; caught here, that ends
  # the serving and the caller's clean-up runs (the batcher is closed, the stats reported)
  caught = (signal.SIGINT, signal.SIGTERM)
  previous = {sig: signal.signal(sig, lambda *_: None) for sig in caught}
  try:
    uvicorn.Server(config).run()
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
