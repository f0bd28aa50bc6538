"""Reliability, round four: the teacher server (`meshdistill serve-teacher`) answers a request for fewer
log-probabilities than its ``--k`` with the tail of the k asked, reads its token only from a regular file, bounds a
request's body before parsing it and the bodies read at once, closes connections that send no head in time and caps
how many are open, refuses a non-loopback ``--host`` without a token, and checks ``--max-rows`` and the address before
anything is loaded (`benchmarks/results/reliability.md`, round four, items 1, 9, 12, 13, 15, 16). A numpy teacher
stands behind the real Starlette application and uvicorn; no JAX program is compiled here."""

import contextlib
import json
import os
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

K, VOCAB, MAX_LEN = 8, 32, 8
LIMITS = protocol.Limits(rows=64, tokens=1 << 20, bytes=4 << 20, vocab=VOCAB, max_len=MAX_LEN, k=K)
IDENTITY = protocol.identity_of(tokenizer="bytes", vocab=VOCAB, temperature=1.0, k=K, max_len=MAX_LEN,
                                served_name="t", teacher={"config": {"vocab_size": VOCAB}, "weights_sha256": "0" * 64})


def logprobs_of(tokens):
  """A full distribution over VOCAB after each token, float64 ``[..., VOCAB]`` (logits from a fixed table)."""
  table = np.random.default_rng(0).normal(0.0, 1.5, (VOCAB, VOCAB))
  logits = table[tokens]
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def topk_teacher(tokens_BxL):
  """The top-K of `logprobs_of` and the exact tail, as the compiled teacher program returns them (float32)."""
  lp = logprobs_of(tokens_BxL)
  ids = np.argsort(-lp, axis=-1, kind="stable")[..., :K]
  top = np.take_along_axis(lp, ids, -1)
  tail = np.log1p(-np.exp(top).sum(-1))
  return ids.astype(np.int32), top.astype(np.float32), tail.astype(np.float32)


def make_batcher(**kw):
  return Batcher(topk_teacher, max_rows=kw.pop("max_rows", 8), max_wait_ms=kw.pop("max_wait_ms", 1.0),
                 row_multiple=1, lengths=(MAX_LEN,), **kw)


@pytest.fixture(scope="module")
def batcher():
  b = make_batcher()
  yield b
  b.close()


def client_of(batcher, limits=LIMITS, **kw):
  return TestClient(server.make_app(batcher, IDENTITY, limits, **kw), raise_server_exceptions=False)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8]]


# ------------------------------------------------------------------------------------- item 1: the tail of the k asked
@pytest.mark.parametrize("arrays", [True, False])
def test_r4_an_answer_for_k_below_the_servers_k_holds_the_tail_of_the_k_asked(batcher, arrays):
  """Item 1: `serve-teacher --k 8` answering prompt_logprobs 4 sent the first 4 log-probabilities with the tail of all
  8 (mass + tail 0.927 at 4, 0.852 at 1). Now every k from 1 to --k is a distribution: the first k of the top-K and
  the other K - k joined to the tail."""
  client = client_of(batcher)
  full = None
  # float32 rounding: each of the k + 1 values carries a relative error of eps32 in its log, |lp| eps32 in its
  # probability; joining K - k + 1 values in float32 adds K eps32 more
  eps = float(np.finfo(np.float32).eps)
  for k in range(K, 0, -1):
    r = client.post("/v1/completions", json={"prompt": PROMPTS, "prompt_logprobs": k, "meshdistill_arrays": arrays})
    assert r.status_code == 200, r.text
    for row, prompt in enumerate(PROMPTS):
      n = len(prompt) - 1
      choice = {**r.json()["choices"][row], "index": 0}
      ids, lp, tail = protocol.read_completion({"choices": [choice]}, 1, n, k, VOCAB)
      ids, lp, tail = ids[0], lp[0].astype(np.float64), tail[0].astype(np.float64)
      if k == K:
        full = full or {}
        full[row] = ids, lp
      np.testing.assert_array_equal(ids, full[row][0][:, :k])
      np.testing.assert_array_equal(lp, full[row][1][:, :k])
      mass = np.exp(lp).sum(-1) + np.exp(tail)
      tol = eps * (np.abs(lp).max() * (k + 1) + np.abs(tail).max() + 2 * K)
      assert np.abs(mass - 1.0).max() <= tol, (k, mass, tol)
      # and the tail is the exact mass outside the k (float64 reference)
      exact = logprobs_of(np.asarray(prompt[:-1]))
      outside = np.log1p(-np.exp(np.sort(exact, -1)[:, ::-1][:, :k]).sum(-1))
      np.testing.assert_allclose(tail, outside, atol=tol / np.exp(outside).min(), rtol=0)


def test_r4_narrowing_host_arrays_equals_narrowing_device_arrays():
  """The server narrows with the step's own `narrow_topk`, on the host: numpy in, numpy out, the same numbers."""
  import jax.numpy as jnp

  from meshdistill import losses

  topk = losses.TopK(*topk_teacher(np.arange(VOCAB).reshape(4, 8)))
  eps = float(np.finfo(np.float32).eps)  # a log-sum-exp of n <= K + 1 float32 terms: n eps absolute in the log
  for k in range(1, K + 1):
    host = losses.narrow_topk(topk, k)
    device = losses.narrow_topk(losses.TopK(*(jnp.asarray(x) for x in topk)), k)
    assert all(isinstance(x, np.ndarray) for x in host)
    for h, d in zip(host, device):
      assert h.dtype == d.dtype
      np.testing.assert_allclose(h, np.asarray(d), rtol=eps, atol=(K + 1) * eps)


def test_r4_the_completion_object_refuses_arrays_wider_than_the_k_asked():
  """The answer builder takes top-k arrays of exactly the k asked: wider ones (whose tail is another k's) are refused
  instead of cut."""
  ids, lp, tail = topk_teacher(np.asarray([[1, 2, 3]]))
  with pytest.raises(ValueError, match="narrow them to 4"):
    protocol.completion([[1, 2, 3, 4]], 4, [ids[0]], [lp[0]], [tail[0]], "t")


# ------------------------------------------------------------------------------------- item 9: the token file
def _captured(monkeypatch):
  seen = {}

  def fake_serve(cfg, settings, stream=None):
    seen["settings"] = settings
    return {"requests": 0, "calls": 0, "tokens": 0}

  monkeypatch.setattr(jobs, "serve_teacher", fake_serve)
  return seen


def test_r4_a_token_file_that_is_a_fifo_or_a_directory_is_refused_at_once(tmp_path, monkeypatch, capsys):
  """Item 9: --token-file naming a FIFO waited for a writer with no output; a directory said
  "[Errno 21] Is a directory: 3". Both are now named refusals (exit 2) within a second, nothing served."""
  seen = _captured(monkeypatch)
  fifo = tmp_path / "token.fifo"
  os.mkfifo(fifo, 0o600)
  folder = tmp_path / "tokens"
  folder.mkdir(mode=0o700)
  for path, kind in ((fifo, "is a FIFO"), (folder, "is a directory")):
    done = []
    t = threading.Thread(target=lambda p=path: done.append(
        cli.main(["serve-teacher", "--config", "tiny", "--token-file", str(p)])), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(timeout=10)
    if t.is_alive():  # the old code waits for a writer: give it one so the thread ends, then fail
      os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
      t.join(timeout=10)
      pytest.fail(f"--token-file {path} hung")
    assert done == [2] and time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert f"--token-file {path} {kind}; give a regular file" in err, err
  assert "settings" not in seen


# ------------------------------------------------------------------------------------- item 12: bodies before parsing
def test_r4_a_body_beyond_what_max_rows_prompts_take_is_refused_before_it_is_parsed(batcher, monkeypatch):
  """Item 12: the row limit was checked after json.loads, so each body up to --max-bytes (64 MiB) was parsed whole
  first. Now a body longer than the largest request --max-rows allows as JSON is a 413 by its Content-Length, or
  once that many bytes have come (chunked), and json.loads never sees it."""
  limits = protocol.Limits(rows=2, tokens=1 << 20, bytes=64 << 20, vocab=VOCAB, max_len=MAX_LEN, k=K)
  assert limits.body_bytes < 2 << 20 < limits.bytes
  parsed = []
  real = json.loads
  monkeypatch.setattr(server.json, "loads", lambda text: parsed.append(len(text)) or real(text))
  client = client_of(batcher, limits)
  big = json.dumps({"prompt": [[1, 2, 3]] * 200_000, "prompt_logprobs": 2}).encode()
  assert limits.body_bytes < len(big) < limits.bytes
  r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
  assert r.status_code == 413 and "--max-rows 2" in r.json()["message"], r.text
  r = client.post("/v1/completions", content=(big[i:i + 65536] for i in range(0, len(big), 65536)))  # chunked
  assert r.status_code == 413 and "--max-rows 2" in r.json()["message"], r.text
  assert max(parsed, default=0) < limits.body_bytes  # (json.loads is the module's: small answers count too)
  r = client.post("/v1/completions", json={"prompt": PROMPTS, "prompt_logprobs": 2})
  assert r.status_code == 200


def test_r4_the_body_cap_holds_the_largest_request_the_limits_accept():
  """The cap is never below an honest request: --max-rows prompts of the longest row, every id of the most digits,
  in JSON with ", " separators (Python's default) fits."""
  for vocab, rows, max_len in ((VOCAB, 64, MAX_LEN), (151_936, 64, 4095), (264, 1, 31)):
    limits = protocol.Limits(rows=rows, vocab=vocab, max_len=max_len, k=1, tokens=1 << 30, bytes=1 << 40)
    largest = {"model": "meshdistill-teacher", "prompt": [[vocab - 1] * (max_len + 1)] * rows, "prompt_logprobs": 1,
               "max_tokens": 0, "meshdistill_arrays": True}
    assert len(json.dumps(largest).encode()) <= limits.body_bytes


@contextlib.contextmanager
def running(app, **kw):
  """``app`` on uvicorn with `serve`'s settings, in a thread, on a free loopback port (yields the port)."""
  import uvicorn

  uv = uvicorn.Server(server.uvicorn_config(app, **kw))
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  sock.listen(256)
  thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  try:
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
      time.sleep(0.02)
    assert uv.started
    yield sock.getsockname()[1]
  finally:
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _send_head(port: int, body_bytes: int) -> socket.socket:
  s = socket.create_connection(("127.0.0.1", port), timeout=20)
  s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             f"Content-Length: {body_bytes}\r\n\r\n").encode())
  return s


def _closed(s: socket.socket, wait_s: float = 10.0) -> bool:
  """Whether the server closed ``s`` (within ``wait_s``) without answering."""
  s.settimeout(wait_s)
  try:
    return s.recv(1) == b""
  except ConnectionResetError:
    return True
  except TimeoutError:
    return False


def _status(s: socket.socket) -> int:
  got = b""
  while b"\r\n" not in got:
    chunk = s.recv(4096)
    if not chunk:
      break
    got += chunk
  return int(got.split(b" ")[1]) if got.startswith(b"HTTP/1.1 ") else -1


def test_r4_at_most_bodies_at_once_are_read_the_others_wait_unread(batcher, monkeypatch):
  """Item 12: six concurrent 60 MiB bodies were all read (and parsed) at once: 355 MiB -> 1.78 GiB. Now at most
  BODIES_AT_ONCE bodies are read and parsed at a time; the others wait in the socket, unread, and are answered
  after."""
  from starlette.requests import Request

  active, peak, lock = [0], [0], threading.Lock()
  real = Request.stream

  async def counted(self):
    with lock:
      active[0] += 1
      peak[0] = max(peak[0], active[0])
    try:
      async for chunk in real(self):
        yield chunk
    finally:
      with lock:
        active[0] -= 1

  monkeypatch.setattr(Request, "stream", counted)
  payload = json.dumps({"prompt": PROMPTS, "prompt_logprobs": 2, "padding": "x" * 4000}).encode()
  n = 2 * server.BODIES_AT_ONCE + 2
  with running(server.make_app(batcher, IDENTITY, LIMITS)) as port:
    clients = [_send_head(port, len(payload)) for _ in range(n)]
    for s in clients:
      s.sendall(payload[:len(payload) // 2])  # every body half sent: a server reading them all holds them all
    deadline = time.monotonic() + 20
    while peak[0] < 1 and time.monotonic() < deadline:  # reading has started ...
      time.sleep(0.05)
    time.sleep(1.0)  # ... and every other body had time to be started on
    seen = peak[0]
    for s in clients:
      s.sendall(payload[len(payload) // 2:])
    codes = [_status(s) for s in clients]
    for s in clients:
      s.close()
  assert 1 <= seen <= server.BODIES_AT_ONCE, seen
  assert codes == [200] * n, codes


# ------------------------------------------------------------------------------------- item 13: idle connections
def test_r4_a_head_not_sent_within_the_read_timeout_closes_the_connection(batcher):
  """Item 13: a half-sent head was kept open for ever (uvicorn's keep-alive timer stops at the first byte). Now a
  connection whose head is not whole within --read-timeout-s is closed, also one sending a byte at a time, and also
  after an answer on a kept-alive connection; a body not sent within it is a 408."""
  timeout = 0.5
  with running(server.make_app(batcher, IDENTITY, LIMITS, read_timeout_s=timeout), read_timeout_s=timeout) as port:
    t0 = time.monotonic()
    half = socket.create_connection(("127.0.0.1", port), timeout=20)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    drip = socket.create_connection(("127.0.0.1", port), timeout=20)
    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
      try:
        drip.send(bytes([byte]))
      except OSError:
        break
      time.sleep(0.05)
    assert _closed(half) and time.monotonic() - t0 < 10
    assert _closed(drip)
    kept = socket.create_connection(("127.0.0.1", port), timeout=20)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _status(kept) == 200
    kept.sendall(b"GET /health HTTP/1.1\r\n")
    rest = b""
    while chunk := kept.recv(4096):
      rest += chunk
    assert b"HTTP/1.1" not in rest.split(b"\r\n\r\n", 1)[-1]  # closed without a second answer
    slow = _send_head(port, 100)
    slow.sendall(b"{")
    assert _status(slow) == 408
    for s in (half, drip, kept, slow):
      s.close()


def test_r4_connections_beyond_the_cap_close_the_idle_ones_and_an_honest_request_is_answered(batcher):
  """Item 13: 20,000 idle connections made an honest request fail. Now at most --max-connections are open: a new
  one closes the longest-idle one that has sent no head, so idle connections cannot crowd out a request."""
  cap = 4
  with running(server.make_app(batcher, IDENTITY, LIMITS), max_connections=cap, read_timeout_s=60) as port:
    idle = []
    for _ in range(3 * cap):
      s = socket.create_connection(("127.0.0.1", port), timeout=20)
      s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
      idle.append(s)
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": PROMPTS, "prompt_logprobs": 2},
                   timeout=20)
    assert r.status_code == 200
    closed = sum(_closed(s, 0.5) for s in idle)  # those closed are closed already: the cap acts on connecting
    for s in idle:
      s.close()
  assert closed >= len(idle) - (cap - 1), closed


# ------------------------------------------------------------------------------------- item 15: a token off loopback
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10"])
def test_r4_a_non_loopback_host_without_a_token_is_refused_unless_insecure_no_token(host):
  """Item 15: --host 0.0.0.0 with no token served everyone without a word. Now it is refused, naming the ways out;
  a token or --insecure-no-token lets it through."""
  with pytest.raises(ConfigError, match=f"--host {host} serves every machine.*--insecure-no-token"):
    jobs.ServeSettings(host=host)
  jobs.ServeSettings(host=host, token="s3cret")
  jobs.ServeSettings(host=host, insecure_no_token=True)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_r4_a_loopback_host_needs_no_token(host):
  assert jobs.ServeSettings(host=host).token is None


def test_r4_serve_teacher_on_0_0_0_0_without_a_token_exits_2_before_loading(monkeypatch, capsys):
  seen = _captured(monkeypatch)
  monkeypatch.delenv("MESHDISTILL_TEACHER_TOKEN", raising=False)
  assert cli.main(["serve-teacher", "--config", "tiny", "--host", "0.0.0.0"]) == 2
  assert "--insecure-no-token" in capsys.readouterr().err and "settings" not in seen
  assert cli.main(["serve-teacher", "--config", "tiny", "--host", "0.0.0.0", "--insecure-no-token"]) == 0
  assert seen["settings"].insecure_no_token


# ------------------------------------------------------------------------------------- item 16: flags and the address
@pytest.mark.parametrize("flag,value,bound", [("max_rows", 100_000, r"\[1, 4096\]"), ("max_connections", 0, "1"),
                                              ("read_timeout_s", 0.0, "> 0"),
                                              ("read_timeout_s", float("nan"), "finite")])
def test_r4_max_rows_and_the_connection_flags_have_named_bounds(flag, value, bound):
  """Item 16: --max-rows 100000 ended in "INTERNAL: YNNPACK operation failed" at warm-up. Now it is refused with
  the bound named, as are the new connection flags."""
  with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')} .*{bound}"):
    jobs.ServeSettings(**{flag: value})


def test_r4_max_rows_100000_exits_2_before_anything_is_loaded(monkeypatch, capsys):
  seen = _captured(monkeypatch)
  assert cli.main(["serve-teacher", "--config", "tiny", "--max-rows", "100000"]) == 2
  assert "--max-rows 100000 must be an integer in [1, 4096]" in capsys.readouterr().err and "settings" not in seen


def test_r4_a_port_in_use_or_an_address_not_of_this_host_is_reported_before_the_teacher_is_loaded(monkeypatch):
  """Item 16: a port in use or a bad --host was reported only after 15-20 s of loading and compiling the teacher.
  Now the address is bound first: the refusal comes before the teacher is built."""
  built = []
  monkeypatch.setattr(jobs._serve, "build_server", lambda *a, **kw: built.append(1) or pytest.fail("built"))
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    with pytest.raises(ConfigError, match=f"--port {port} on 127.0.0.1 is in use"):
      jobs.serve_teacher(None, jobs.ServeSettings(port=port))
  with pytest.raises(ConfigError, match="on 192.0.2.10 cannot be bound"):  # TEST-NET-1: no host's address
    jobs.serve_teacher(None, jobs.ServeSettings(host="192.0.2.10", port=0, token="s3cret"))
  assert not built


def test_serve_teacher_buckets_reach_the_rows_the_config_sends_not_the_teachers_positional_bound(monkeypatch):
  """A teacher whose ``max_len`` is far above the config's rows (a Hugging Face teacher's is its config.json's: 40,960
  for Qwen3) is served, and warmed up, at the rows the students send; ``--lengths`` serves longer prompts."""
  import io

  import meshdistill as md
  from meshdistill.config import load_config

  cfg = load_config("tiny", ["teacher.max_len=256"])  # data.seq_len 32
  monkeypatch.setattr(jobs._serve, "obtain_teacher",  # a random teacher of the config's shape: nothing pretrained
                      lambda cfg, data, mesh, **kw: (md.init_model(cfg.teacher, seed=0, mesh=mesh), "random"))
  assert cfg.data.seq_len == 32
  for settings, lengths in ((jobs.ServeSettings(k=4, warm_up=False), (32,)),
                            (jobs.ServeSettings(k=4, warm_up=False, lengths=(64, 256)), (64, 256))):
    said = io.StringIO()
    _, batcher, served = jobs.build_server(cfg, settings, stream=said)
    batcher.close()
    assert batcher.lengths == lengths and served["max_len"] == lengths[-1], (batcher.lengths, served)
    assert f"x {lengths}" in said.getvalue(), said.getvalue()
