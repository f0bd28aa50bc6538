"""``teacher.source: remote``: a teacher served over the network (``meshdistill serve-teacher``, or a vLLM server)
at ``teacher.url``; the student receives its top-k per token, fetched one batch ahead by a background thread while
the step runs (the sub-mesh teacher's contract: `meshdistill.teachers.mesh`).

Before the first step the server's identity is checked against the run: its tokenizer fingerprint, vocabulary
range, temperature and k (a meshdistill server); a vLLM server tells only its model and length, so there the
temperature must be 1 (vLLM's prompt log-probabilities are the model's own) and the answers' ids are checked
against the vocabulary. Every answer is checked whole (rows, positions, k entries, finite values) before a step may
use it; a server that stays down stops the run with an error naming the url (a rerun resumes from the last
checkpoint). The identity checkpoints record names the teacher's weights, not the url: a restarted server, at any
address, resumes the run.

``teacher.timeout`` is the deadline of one try of a request (`meshdistill.teachers.service.client`); a stop request
(SIGTERM / SIGINT) while the loop waits for an answer ends the wait at once (`_FetchAheadIterator.ready`): the run
checkpoints its last finished step and the fetch under way is cancelled, its connection shut. A ``teacher.url`` that
holds credentials (``http://user:secret@host``) is refused before anything is written: the url is recorded in
config.yaml and the logs; the token travels through ``teacher.token_env``.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import urllib.parse
from typing import Any, ClassVar

from meshdistill.core.typed_yaml import ConfigError
from meshdistill.data import WrappedData
from meshdistill.strategies import Strategy
from meshdistill.teachers.ahead import AheadIterator
from meshdistill.teachers.cache import TopKTeacher
from meshdistill.teachers.kinds._base import TOPK, Prepared, TeacherSource, option, register, topk_refusal
from meshdistill.train.teacher import TeacherKind
from meshdistill.teachers.service.client import TeacherClient
from meshdistill.core.vocab import resolve_shared_vocab
from meshdistill.core.batch import TOPK_KEYS

TOKEN_ENV = "MESHDISTILL_TEACHER_TOKEN"


@register
class Remote(TeacherSource):
  """a teacher served over the network, e.g. teacher.url: http://teacher-host:8000 (meshdistill serve-teacher)"""

  name: ClassVar[str] = "remote"
  gives: ClassVar[TeacherKind] = TOPK
  # url: the server; k: top-k asked for (default distill.top_k); timeout: the deadline of one try, seconds; retries:
  # tries after a failure (exponential backoff); token_env: the environment variable holding the bearer token
  # (default MESHDISTILL_TEACHER_TOKEN; the token itself never enters config.yaml); model: the served model name;
  # require_digest: refuse answers without the server's answer digest (and a server that sends none)
  settings: ClassVar[tuple[str, ...]] = ("url", "k", "timeout", "retries", "token_env", "model", "require_digest")
  required: ClassVar[tuple[str, ...]] = ("url",)

  @classmethod
  def check_settings(cls, values):
    url = values.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
      raise ConfigError(f"teacher.url={url!r} must be the server's address, e.g. http://127.0.0.1:8000")
    check_no_credentials(url)
    for key, low in (("k", 1), ("retries", 0)):
      v = values.get(key)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
        raise ConfigError(f"teacher.{key}={v!r} must be an integer >= {low}")
    t = values.get("timeout")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
      raise ConfigError(f"teacher.timeout={t!r} must be a positive number of seconds, e.g. 60")
    for key in ("token_env", "model"):
      if values.get(key) is not None and not isinstance(values[key], str):
        raise ConfigError(f"teacher.{key}={values[key]!r} must be a string")
    if values.get("require_digest") is not None and not isinstance(values["require_digest"], bool):
      raise ConfigError(f"teacher.require_digest={values['require_digest']!r} must be true or false")

  def accepts(self, strategy: type[Strategy], distill: Any) -> str | None:
    return topk_refusal(self.name, strategy, distill, "teacher.url sends the student the teacher's top-k only")

  def check(self):
    super().check()
    if self.cfg.data.teacher_tokenizer is not None:
      raise ConfigError("data.teacher_tokenizer runs a teacher of its own tokenizer live in the step; "
                        "teacher.source=remote serves top-k over the run's tokens: remove one of them")
    if self.cfg.models.student_init.from_teacher:
      raise ConfigError("student.init.from_teacher copies the teacher's weights, but teacher.source=remote has none "
                        "here; remove student.init")

  def client(self) -> TeacherClient:
    cfg = self.cfg
    token = os.environ.get(option(cfg, "token_env") or TOKEN_ENV) or None
    return TeacherClient(option(cfg, "url"), timeout_s=float(option(cfg, "timeout", 60.0)),
                         retries=int(option(cfg, "retries", 3)), token=token, model=option(cfg, "model"),
                         require_digest=bool(option(cfg, "require_digest", False)))

  def prepare(self, data, mesh, teacher_mesh, services):
    del mesh, teacher_mesh
    client = self.client()
    spec, identity = check_identity(client.identity(), self.cfg, data.tokenizer, client.url)
    services.report(f"teacher: {identity} served at {client.url}, top-{spec.k} at temperature {spec.temperature}")
    return Prepared(RemoteTeacherData(data, client, spec), spec, identity)


def check_no_credentials(url: str) -> None:
  """`ConfigError` when ``url`` holds a user or password (``http://user:secret@host``), quoting it without them: a
  run writes its url into config.yaml and its logs, so a secret in it would be kept in both."""
  parts = urllib.parse.urlsplit(url)
  if "@" in parts.netloc:
    shown = urllib.parse.urlunsplit(parts._replace(netloc="<credentials>@" + parts.netloc.rpartition("@")[2]))
    raise ConfigError(f"teacher.url={shown} holds credentials; they would be written to the run's config.yaml and "
                      "logs. Give the url without them, and the token through the environment: start the server "
                      f"with serve-teacher --token-file FILE and set ${TOKEN_ENV} (or the variable teacher.token_env "
                      "names) to the file's content here")


def check_identity(ident: dict, cfg, tokenizer, url: str) -> tuple[TopKTeacher, str]:
  """``(the teacher as the Distiller sees it, its identity for checkpoints)`` of a server's ``ident``; a
  `ConfigError` naming the first fact that differs from this run (tokenizer, vocabulary, temperature, k, length)."""
  tau = float(cfg.distill.value("temperature"))
  top_k = cfg.distill.value("top_k")
  k = option(cfg, "k") or top_k
  where = f"the teacher server at {url}"
  if ident.get("server") == "vllm":
    if tau != 1.0:
      raise ConfigError(f"{where} is a vLLM server, whose prompt log-probabilities are at temperature 1; set "
                        f"distill.temperature=1.0 (got {tau})")
    vocab = cfg.student.vocab_size
    spec_cfg = cfg.teacher.replace(max_len=max(ident["max_len"], 1))
    identity = f"remote vLLM model {ident['model']}"
  else:
    teacher = ident.get("teacher") or {}
    t_vocab = int((teacher.get("config") or {}).get("vocab_size", 0))
    if ident.get("tokenizer") != tokenizer.fingerprint:
      raise ConfigError(f"{where} serves a teacher of another tokenizer (fingerprint {ident.get('tokenizer')!r}, this "
                        f"run {tokenizer.fingerprint!r}); serve a teacher of this run's data.tokenizer, or point "
                        "teacher.url at one")
    try:
      vocab = resolve_shared_vocab(t_vocab, cfg.student.vocab_size) or t_vocab
    except ValueError as e:
      raise ConfigError(f"{where}: {e}") from None
    if ident.get("vocab") != vocab:
      raise ConfigError(f"{where} ranks tokens over [0, {ident.get('vocab')}), this run compares [0, {vocab}); serve "
                        "the teacher with a config whose student.vocab_size is this run's")
    if float(ident.get("temperature", -1)) != tau:
      raise ConfigError(f"{where} serves log-probabilities at temperature {ident.get('temperature')}, this run trains "
                        f"at distill.temperature={tau}; set it to {ident.get('temperature')}, or serve the teacher at "
                        f"{tau} (serve-teacher --set distill.temperature={tau})")
    if int(ident.get("k", 0)) < k:
      raise ConfigError(f"{where} serves at most top-{ident.get('k')}, this run asks for {k}; set teacher.k (and "
                        f"distill.top_k) to at most {ident.get('k')}, or serve with --k {k}")
    spec_cfg = cfg.teacher.replace(vocab_size=t_vocab, max_len=int(ident["max_len"]))
    identity = f"remote teacher sha256:{teacher.get('weights_sha256', '?')[:16]}"
  if spec_cfg.max_len < cfg.data.seq_len:
    raise ConfigError(f"{where} takes rows of at most {spec_cfg.max_len} tokens, this run's data.seq_len is "
                      f"{cfg.data.seq_len}")
  spec = TopKTeacher(cfg=spec_cfg, k=k, temperature=tau, vocab=vocab, source=f"teacher.url={url}")
  return spec, identity


class RemoteTeacherData(WrappedData):
  """A `meshdistill.data.DataBundle` whose training batches carry a served teacher's top-k, fetched one batch
  ahead; the iterator's state is the position of the next batch it hands out (resume as with the plain data).
  Validation batches, tokenizers and statistics are the bundle's (`meshdistill.data.WrappedData`); `fetch` asks the
  teacher for any rows."""

  def __init__(self, bundle, client: TeacherClient, spec: TopKTeacher):
    super().__init__(bundle)
    self.client, self.spec = client, spec
    self.wait_log: list[tuple[int, float]] = []  # (batch index, seconds the loop waited for its answer)

  def fetch(self, batch: dict, cancel: threading.Event | None = None) -> dict:
    """The top-k of ``batch``'s rows under `TOPK_KEYS` (blocking; ``cancel`` set: no further try)."""
    got = self.client.topk(batch["inputs"], batch["targets"][:, -1], k=self.spec.k, vocab=self.spec.vocab,
                           cancel=cancel)
    return dict(zip(TOPK_KEYS, got))

  def train_iterator(self, state: dict | None = None, **kw) -> _FetchAheadIterator:
    return _FetchAheadIterator(self.bundle.train_iterator(state, **kw), self)


class _FetchAheadIterator(AheadIterator):
  """Each batch's fetch runs in a daemon thread of its own, after the fetch before it has ended (one request at a
  time, in order); `close` cancels them, so a fetch still retrying after the run stopped (a fatal error, a
  signal) ends at once and never holds the process open."""

  def __init__(self, it, owner: RemoteTeacherData):
    super().__init__(it)
    self._owner = owner
    self._stop = threading.Event()
    self._last: concurrent.futures.Future | None = None

  def dispatch(self, batch: dict, index: int) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    before, self._last = self._last, future

    def fetch():
      if before is not None:
        concurrent.futures.wait([before])
      if not future.set_running_or_notify_cancel():
        return
      try:
        future.set_result(self._owner.fetch(batch, self._stop))
      except BaseException as e:  # noqa: BLE001 -- handed to `collect`
        future.set_exception(e)

    threading.Thread(target=fetch, name=f"remote-teacher-{index}", daemon=True).start()
    return future

  def ready(self, timeout_s: float) -> bool:
    """Whether the next batch's answer is there, waiting at most ``timeout_s`` for it (the loop asks between its
    stop checks, `meshdistill.train.loop.stopping.wait_for`: a stop request while a fetch is blocked is seen at
    once); the first call reads that batch and starts its fetch."""
    if self._ahead is None:
      self._ahead = self._read()
      if self._ahead is None:  # the data has ended
        return True
    return not concurrent.futures.wait([self._ahead[3]], timeout=timeout_s).not_done

  def collect(self, batch: dict, work: concurrent.futures.Future, index: int) -> dict:
    t0 = time.perf_counter()
    topk = work.result()  # raises the client's error: the batch is never handed out without its answer
    self._owner.wait_log.append((index, time.perf_counter() - t0))
    return {**batch, **topk}

  def close(self):
    self._stop.set()
    if self._ahead is not None:
      self._ahead[3].cancel()
    super().close()
