"""The ``serve-teacher`` job: the run's teacher (the model its ``teacher.source`` runs; ``teacher.quantize``d) on
this host's mesh, answering top-k requests over HTTP (`meshdistill.teachers.service`) until SIGTERM / SIGINT."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import os
import socket
from typing import IO

import numpy as np

from meshdistill.config import Config, ConfigError
from meshdistill.jobs._setup import build_mesh, load_data, stream_reporter
from meshdistill.jobs._teacher import obtain_teacher
from meshdistill.parallel.backends import make_layout
from meshdistill.teachers import cache as tc
from meshdistill.teachers import kinds
from meshdistill.teachers.service import protocol, server
from meshdistill.teachers.service.batching import Batcher, length_buckets
from meshdistill.teachers.sources import quantized_teacher
from meshdistill.core.vocab import resolve_shared_vocab

log = logging.getLogger("meshdistill.jobs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeSettings:
  """How the server listens and batches (the ``serve-teacher`` flags)."""

  host: str = "127.0.0.1"
  port: int = 8000
  k: int = 32
  token: str | None = None
  max_rows: int = 64
  max_wait_ms: float = 5.0
  lengths: tuple[int, ...] | None = None  # padded lengths; None: powers of two from 64 up to the run's rows (below)
  max_tokens: int = 1 << 20
  max_bytes: int = 64 << 20
  graceful_s: float = 30.0
  max_connections: int = 256
  read_timeout_s: float = 30.0
  insecure_no_token: bool = False  # serve a non-loopback --host without a token (anyone reaching it is answered)
  served_name: str = "meshdistill-teacher"
  warm_up: bool = True
  hold_file: str | None = None  # testing: while this file exists a teacher call waits before it runs

  def __post_init__(self):
    check_serve_settings(self)


# the largest --max-wait-ms: a request held longer than a minute outlives a client's default timeout (60 s)
MAX_WAIT_MS = 60_000.0
# the most rows one teacher call is compiled for (--max-rows): the batcher compiles every row bucket up to it before
# the first request, and one call holds [rows, length, vocab] logits -- 100,000 rows of the tiny config's 32 tokens
# already failed inside XLA's CPU kernels (YNNPACK) at warm-up
MAX_ROWS = 4096
# the most open connections (--max-connections): each holds a file descriptor, and a process may open 1024 by default
MAX_CONNECTIONS = 100_000


def is_loopback(host: str) -> bool:
  """Whether every address ``host`` names is a loopback one (127.0.0.0/8, ::1, localhost): only this machine's
  processes reach it. `ConfigError` when ``host`` names no address (a name that does not resolve)."""
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    pass
  try:
    found = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
  except (OSError, UnicodeError) as e:
    raise ConfigError(f"--host {host!r} is not an address of this host ({e}); give one, e.g. 127.0.0.1 (this "
                      "machine only) or 0.0.0.0 (every interface)") from None
  return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def check_serve_settings(s: ServeSettings) -> None:
  """A `ConfigError` naming the first ``serve-teacher`` flag whose value cannot work (a port outside 0..65535, a
  wait that is not a finite number of milliseconds, a size below 1 or above its bound, a non-loopback ``--host``
  without a token or ``--insecure-no-token``), before anything is loaded or bound."""

  def integer(flag: str, v, low: int, high: int | None = None, hint: str = ""):
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
      where = f"in [{low}, {high}]" if high is not None else f">= {low}"
      raise ConfigError(f"{flag} {v!r} must be an integer {where}{hint}")

  def seconds(flag: str, v, high: float, unit: str):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= high:
      raise ConfigError(f"{flag} {v!r} must be a finite number of {unit} in [0, {high:g}]")

  if not isinstance(s.host, str) or not s.host:
    raise ConfigError(f"--host {s.host!r} must be an address to bind, e.g. 127.0.0.1 or 0.0.0.0")
  integer("--port", s.port, 0, 65535, " (0: any free port, the one bound is printed)")
  integer("--k", s.k, 1)
  integer("--max-rows", s.max_rows, 1, MAX_ROWS, " (the most rows one teacher call is compiled for)")
  integer("--max-connections", s.max_connections, 1, MAX_CONNECTIONS)
  integer("--max-tokens", s.max_tokens, 1)
  integer("--max-bytes", s.max_bytes, 1)
  seconds("--max-wait-ms", s.max_wait_ms, MAX_WAIT_MS, "milliseconds")
  seconds("--graceful-s", s.graceful_s, 24 * 3600.0, "seconds")
  seconds("--read-timeout-s", s.read_timeout_s, 3600.0, "seconds")
  if s.read_timeout_s <= 0:
    raise ConfigError(f"--read-timeout-s {s.read_timeout_s!r} must be > 0: a client needs time to send its request")
  if s.lengths is not None:
    if not s.lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in s.lengths):
      raise ConfigError(f"--lengths {','.join(map(str, s.lengths))}: each padded length must be an integer >= 1, "
                        "e.g. --lengths 64,128 (default: powers of two from 64 up to data.seq_len)")
  if s.token is not None and (not isinstance(s.token, str) or not s.token.strip()):
    raise ConfigError("the bearer token is empty; give a non-empty one (--token-file, $MESHDISTILL_TEACHER_TOKEN) "
                      "or none")
  if not isinstance(s.served_name, str) or not s.served_name:
    raise ConfigError(f"--served-name {s.served_name!r} must be a non-empty name")
  if s.token is None and not s.insecure_no_token and not is_loopback(s.host):
    raise ConfigError(f"--host {s.host} serves every machine that reaches it, and no bearer token is set: give one "
                      "(--token-file PATH, chmod 600, or $MESHDISTILL_TEACHER_TOKEN), bind 127.0.0.1, or pass "
                      "--insecure-no-token to serve anyone without one")


def build_server(cfg: Config, settings: ServeSettings, *, stream: IO[str] | None = None):
  """``(app, batcher, identity)``: the teacher of ``cfg`` placed on its mesh behind a `Batcher`, and the Starlette
  application answering with it."""
  server.require()  # before any teacher is loaded
  source = kinds.for_config(cfg)  # teacher.source, as in every job
  if source.gives != kinds.MODEL:
    runs = sorted(n for n in kinds.names() if kinds.get(n).gives == kinds.MODEL)
    raise ConfigError(f"serve-teacher runs a teacher model (a teacher.source that runs one: {runs}, optionally "
                      f"teacher.quantize); teacher.source={source.name} runs none here")
  reason = kinds.temperature_refusal(cfg.distill, "a served teacher answers with its log-probabilities")
  if reason:
    raise ConfigError(reason)
  tau = cfg.distill.value("temperature")
  say = stream_reporter(stream)
  mesh = build_mesh(cfg)
  data = load_data(cfg, mesh=mesh)  # the tokenizer (its fingerprint is the identity's) and a teacher to pretrain on
  teacher, _ = obtain_teacher(cfg, data, mesh, stream=stream, report=say)
  teacher = quantized_teacher(cfg, teacher, mesh)  # teacher.quantize
  vocab = resolve_shared_vocab(teacher.cfg.vocab_size, cfg.student.vocab_size) or teacher.cfg.vocab_size
  if not 1 <= settings.k <= vocab:
    raise ConfigError(f"--k {settings.k} must be in [1, {vocab}] (the teacher's vocabulary range)")
  program_mesh = make_layout(cfg.mesh.backend, mesh).eval_mesh
  program = tc.TeacherTopK(teacher, k=settings.k, temperature=float(tau), vocab=vocab, mesh=program_mesh)
  max_len = teacher.cfg.max_len
  # by default the rows the run's students send (data.seq_len, or data.teacher_seq_len with the teacher's own
  # tokenizer), not the teacher's positional bound: a Hugging Face teacher's is its config.json's (40,960 for Qwen3),
  # and warming every bucket up to it would run the teacher on max_rows x 40,960 tokens before the first request
  rows_len = cfg.data.teacher_seq_len or cfg.data.seq_len
  lengths = tuple(sorted(settings.lengths)) if settings.lengths else length_buckets(min(max_len, rows_len))
  if lengths[-1] > max_len:
    raise ConfigError(f"--lengths {','.join(map(str, lengths))}: the longest exceeds the teacher's max_len={max_len}")
  rows = 1 if program_mesh is None else program_mesh.shape["data"]

  def run(tokens_BxL: np.ndarray):
    return tuple(np.asarray(x) for x in program(tokens_BxL))

  hold = None if settings.hold_file is None else (lambda: os.path.exists(settings.hold_file))
  batcher = Batcher(run, max_rows=settings.max_rows, max_wait_ms=settings.max_wait_ms, row_multiple=rows,
                    lengths=lengths, hold=hold)
  if settings.warm_up:
    batcher.warm_up()
  identity = protocol.identity_of(tokenizer=data.tokenizer.fingerprint, vocab=vocab, temperature=float(tau),
                                  k=settings.k, teacher=tc.teacher_identity(teacher), max_len=lengths[-1],
                                  served_name=settings.served_name)
  limits = protocol.Limits(rows=settings.max_rows, tokens=settings.max_tokens, bytes=settings.max_bytes, vocab=vocab,
                           max_len=lengths[-1], k=settings.k)
  app = server.make_app(batcher, identity, limits, token=settings.token, read_timeout_s=settings.read_timeout_s)
  say(f"teacher server: top-{settings.k} at temperature {float(tau)}, vocabulary {vocab}, rows up to "
      f"{lengths[-1]} tokens, batches of up to {settings.max_rows} rows (wait {settings.max_wait_ms} ms), buckets "
      f"{batcher.row_buckets} x {lengths}; weights sha256 {identity['teacher']['weights_sha256'][:16]}")
  return app, batcher, identity


def serve_teacher(cfg: Config, settings: ServeSettings, *, stream: IO[str] | None = None) -> dict:
  """Serves the teacher of ``cfg`` until SIGTERM / SIGINT (requests in flight are answered); returns its stats.
  The address is bound first, before the teacher is loaded and compiled: a port that cannot be bound (in use, an
  address not of this host) is a `ConfigError` naming it at once, and nothing was loaded or served. "listening" is
  reported once the socket listens, after every flag was checked and the teacher compiled."""
  try:
    sock = server.bind(settings.host, settings.port)
  except server.BindError as e:
    raise ConfigError(str(e)) from None
  try:
    app, batcher, _ = build_server(cfg, settings, stream=stream)
  except BaseException:
    sock.close()
    raise
  say = stream_reporter(stream)

  def ready(port: int) -> None:
    say(f"teacher server: listening on http://{settings.host}:{port}"
        + (" (bearer token required)" if settings.token else ""))

  try:
    server.serve(app, host=settings.host, port=settings.port, sock=sock, graceful_s=settings.graceful_s,
                 max_connections=settings.max_connections, read_timeout_s=settings.read_timeout_s, ready=ready)
  except server.BindError as e:
    raise ConfigError(str(e)) from None
  finally:
    batcher.close()
  return batcher.stats.as_dict()
