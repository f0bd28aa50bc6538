"""Reliability, round three: the teacher server (`meshdistill serve-teacher`) checks every flag before it loads or
binds anything, says "listening" only once bound, never hangs on a dead batching thread, answers bad JSON with 400,
drops the work of clients that hung up, and keeps its token out of the process list
(`benchmarks/results/reliability.md`, items 5-9). A fake teacher program (numpy) stands behind the real Starlette
application and uvicorn; no JAX program is compiled here."""

import io
import logging
import os
import signal
import socket
import threading
import time

import warnings

import httpx
import numpy as np
import pytest

with warnings.catch_warnings():  # starlette's notice that its test client would rather use httpx2: not ours
  warnings.simplefilter("ignore")
  from starlette.testclient import TestClient

from meshdistill import cli, jobs
from meshdistill.config import ConfigError
from meshdistill.teachers.service import protocol, server
from meshdistill.teachers.service.batching import Batcher

K, VOCAB, MAX_LEN = 2, 16, 8
LIMITS = protocol.Limits(rows=64, tokens=1 << 20, bytes=4 << 20, vocab=VOCAB, max_len=MAX_LEN, k=K)
IDENTITY = protocol.identity_of(tokenizer="bytes", vocab=VOCAB, temperature=1.0, k=K, max_len=MAX_LEN,
                                served_name="t", teacher={"config": {"vocab_size": VOCAB}, "weights_sha256": "0" * 64})


def fake_teacher(tokens_BxL):
  """A teacher whose top-k is the next two ids after each token, at probabilities 0.5 and 0.25."""
  b, length = tokens_BxL.shape
  ids = np.stack([(tokens_BxL + 1) % VOCAB, (tokens_BxL + 2) % VOCAB], -1).astype(np.int32)
  lp = np.broadcast_to(np.log([0.5, 0.25]).astype(np.float32), (b, length, K))
  return ids, lp, np.full((b, length), np.log(0.25), np.float32)


def make_batcher(**kw):
  return Batcher(fake_teacher, max_rows=kw.pop("max_rows", 8), max_wait_ms=kw.pop("max_wait_ms", 1.0),
                 row_multiple=1, lengths=(MAX_LEN,), **kw)


def body(rows=1):
  return {"prompt": [[1, 2, 3]] * rows, "prompt_logprobs": K}


# ------------------------------------------------------------------------------------- item 5: numbers, a dead thread
@pytest.mark.parametrize("flag,value", [("max_wait_ms", float("nan")), ("max_wait_ms", float("inf")),
                                        ("max_wait_ms", -1.0), ("graceful_s", float("nan")), ("max_rows", 0),
                                        ("k", 0), ("max_tokens", 0), ("max_bytes", -5), ("port", 99999),
                                        ("port", -1), ("lengths", (0,)), ("lengths", (64, -8))])
def test_r3_every_numeric_serve_flag_is_checked_before_anything_is_loaded(flag, value):
  """Items 5-7: --max-wait-ms nan / inf started and never answered, --port 99999 bound nothing, --lengths 0 ended in
  ZeroDivisionError inside JAX: each is now refused at once naming the flag."""
  with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')} "):
    jobs.ServeSettings(**{flag: value})


def test_r3_serve_teacher_refuses_a_bad_flag_with_exit_2_before_it_loads_a_teacher(monkeypatch, capsys):
  def never(*a, **kw):
    raise AssertionError("the teacher server started with a flag that cannot work")

  monkeypatch.setattr(jobs, "serve_teacher", never)
  monkeypatch.setattr(jobs, "build_server", never)
  for flags in (["--max-wait-ms", "nan"], ["--max-wait-ms", "inf"], ["--port", "99999"], ["--lengths", "0"],
                ["--lengths", "64,x"]):
    assert cli.main(["serve-teacher", "--config", "tiny", *flags]) == 2, flags
    err = capsys.readouterr().err
    assert f"{flags[0]} " in err and "listening" not in err, err


def test_r3_a_dead_batching_thread_fails_health_and_every_request_at_once():
  """Item 5: with --max-wait-ms inf the batching thread died of OverflowError while /health said ok and requests
  waited for ever; now /health is 503 naming the error and waiting and new requests fail at once with 503."""
  batcher = make_batcher(max_wait_ms=1.0)
  batcher.max_wait = float("inf")  # what --max-wait-ms inf gave: Condition.wait(inf) raises OverflowError
  waiting = batcher.submit([[1, 2, 3]])
  with pytest.raises(RuntimeError, match="batching stopped.*OverflowError"):
    waiting.result(timeout=5)
  client = TestClient(server.make_app(batcher, IDENTITY, LIMITS), raise_server_exceptions=False)
  health = client.get("/health")
  assert health.status_code == 503 and health.json()["status"] == "failed"
  assert "OverflowError" in health.json()["error"]
  t0 = time.monotonic()
  r = client.post("/v1/completions", json=body())
  assert r.status_code == 503 and "restart the server" in r.json()["message"]
  assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------------------------- item 6: the port
def test_r3_listening_is_said_only_once_bound_and_a_port_in_use_is_a_named_refusal(monkeypatch):
  """Item 6: "listening" was printed before binding; a port in use then exited 3 (undocumented). Now a port in use is
  a ConfigError (exit 2) naming it, with "listening" never printed."""
  batcher = make_batcher()
  monkeypatch.setattr(jobs._serve, "build_server", lambda cfg, settings, stream=None: (
      server.make_app(batcher, IDENTITY, LIMITS), batcher, IDENTITY))
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    out = io.StringIO()
    with pytest.raises(ConfigError, match=f"--port {port} on 127.0.0.1 is in use"):
      jobs.serve_teacher(None, jobs.ServeSettings(port=port), stream=out)
    assert "listening" not in out.getvalue()


def test_r3_port_0_binds_a_free_port_says_which_and_serves_until_sigterm():
  batcher = make_batcher()
  said = []

  def stop_after_health():
    deadline = time.monotonic() + 30
    while not said and time.monotonic() < deadline:
      time.sleep(0.05)
    said.append(httpx.get(f"http://127.0.0.1:{said[0]}/health", timeout=5).status_code)
    os.kill(os.getpid(), signal.SIGTERM)

  threading.Thread(target=stop_after_health, daemon=True).start()
  server.serve(server.make_app(batcher, IDENTITY, LIMITS), host="127.0.0.1", port=0, graceful_s=1, ready=said.append)
  batcher.close()
  assert said[0] > 0 and said[1] == 200


# ------------------------------------------------------------------------------------- item 7: deep JSON
def test_r3_deeply_nested_json_is_a_400_not_a_recursion_traceback():
  client = TestClient(server.make_app(make_batcher(), IDENTITY, LIMITS), raise_server_exceptions=False)
  deep = "[" * 200_000 + "]" * 200_000
  r = client.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
  assert r.status_code == 400 and "nested too deep" in r.json()["message"]
  assert client.post("/v1/completions", json=body()).status_code == 200  # still serving


# ------------------------------------------------------------------------------------- item 8: clients that hung up
def _raw_request(port: int, payload: bytes, *, send_all=True) -> socket.socket:
  s = socket.create_connection(("127.0.0.1", port))
  head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          f"Content-Length: {len(payload)}\r\n\r\n").encode()
  s.sendall(head + (payload if send_all else payload[:len(payload) // 2]))
  return s


def test_r3_requests_of_clients_that_hung_up_are_dropped_with_one_log_line(caplog):
  """Item 8: 200 clients that disconnected still had their rows computed (the next honest requests waited 12 s),
  each with a ClientDisconnect traceback. Now a request whose client is gone before a call takes it is dropped, a
  body cut short is one log line, and nothing is logged as an error."""
  import json

  import uvicorn

  hold = threading.Event()
  batcher = make_batcher(max_wait_ms=0.0, max_rows=4, hold=hold.is_set)
  config = uvicorn.Config(server.make_app(batcher, IDENTITY, LIMITS), log_config=None, log_level="info",
                          access_log=False)
  uv = uvicorn.Server(config)
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  sock.listen(64)
  port = sock.getsockname()[1]
  thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
  caplog.set_level(logging.INFO)
  thread.start()
  try:
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
      time.sleep(0.02)
    payload = json.dumps(body(rows=2)).encode()
    hold.set()
    first = _raw_request(port, payload)  # taken by a call, held there
    while batcher.stats.held != 1 and time.monotonic() < deadline:
      time.sleep(0.02)
    gone = [_raw_request(port, payload) for _ in range(12)]  # queued behind the held call, then hung up
    cut = _raw_request(port, payload, send_all=False)  # hung up while sending its body
    time.sleep(0.3)
    for s in [first, *gone, cut]:
      s.close()
    while (sum("before its answer" in r.getMessage() for r in caplog.records) < 12
           and time.monotonic() < deadline):
      time.sleep(0.05)
    hold.clear()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body(rows=1), timeout=10)  # an honest request
    assert r.status_code == 200
    stats = batcher.stats.as_dict()
    assert stats["rows"] == 2 + 1, stats  # the held call's rows (already taken) and the honest request's only
    assert stats["dropped"] == 12, stats
  finally:
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()
    batcher.close()
  errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
  assert not errors, [r.getMessage() for r in errors]
  hung = [r.getMessage() for r in caplog.records if "hung up" in r.getMessage()]
  assert any("while sending" in m for m in hung) and sum("before its answer" in m for m in hung) >= 12, hung


# ------------------------------------------------------------------------------------- item 9: the token
def _captured(monkeypatch):
  seen = {}

  def fake_serve(cfg, settings, stream=None):
    seen["settings"] = settings
    return {"requests": 0, "calls": 0, "tokens": 0}

  monkeypatch.setattr(jobs, "serve_teacher", fake_serve)
  return seen


def test_r3_token_file_is_read_owner_only_and_a_token_flag_warns(tmp_path, monkeypatch, capsys):
  """Item 9: --token showed the secret in ps to every local user. --token-file (mode checked like an ssh key) and the
  environment variable keep it out; --token still works, with a warning."""
  seen = _captured(monkeypatch)
  monkeypatch.delenv("MESHDISTILL_TEACHER_TOKEN", raising=False)
  path = tmp_path / "token"
  path.write_text("s3cret\n")
  path.chmod(0o644)
  assert cli.main(["serve-teacher", "--config", "tiny", "--token-file", str(path)]) == 2
  assert f"chmod 600 {path}" in capsys.readouterr().err and "settings" not in seen
  path.chmod(0o600)
  assert cli.main(["serve-teacher", "--config", "tiny", "--token-file", str(path)]) == 0
  assert seen["settings"].token == "s3cret" and "warning" not in capsys.readouterr().err
  assert cli.main(["serve-teacher", "--config", "tiny", "--token", "s3cret"]) == 0
  assert "process list" in capsys.readouterr().err and seen["settings"].token == "s3cret"
  (tmp_path / "empty").write_text("\n")
  (tmp_path / "empty").chmod(0o600)
  assert cli.main(["serve-teacher", "--config", "tiny", "--token-file", str(tmp_path / "empty")]) == 2
  assert "is empty" in capsys.readouterr().err
