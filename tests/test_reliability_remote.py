"""Reliability, round three: a served teacher's answers are checked as distributions before a step may train on them,
a run whose remote teacher failed ends at once, and a malformed identity or error body is a named error, never a
traceback (`benchmarks/results/reliability.md`, items 1-4). No server process: `httpx.MockTransport` answers."""

import base64
import json
import threading
import time

import httpx
import numpy as np
import pytest

from meshdistill.teachers.service import protocol
from meshdistill.teachers.service.client import RemoteTeacherError, TeacherClient
from meshdistill.teachers.service.protocol import AnswerError, read_completion

URL = "http://teacher.invalid:8000"
ROWS, LENGTH, K, VOCAB = 3, 4, 3, 32


def _good(rows=ROWS, length=LENGTH, k=K, seed=0):
  """A well-formed top-k answer: ids distinct per position, log-probabilities sorted and below 0, exact tail."""
  rng = np.random.default_rng(seed)
  ids = np.stack([np.stack([rng.permutation(VOCAB)[:k] for _ in range(length)]) for _ in range(rows)]).astype(np.int32)
  p = rng.dirichlet(np.ones(VOCAB), size=(rows, length))
  top = -np.sort(-p, axis=-1)[..., :k]
  return ids, np.log(top).astype(np.float32), np.log1p(-top.sum(-1)).astype(np.float32)


def _answer(ids, logprobs, tail, *, arrays, indices=None):
  rows = ids.shape[0]
  prompts = [[0] * (ids.shape[1] + 1)] * rows
  out = protocol.completion(prompts, ids.shape[2], list(ids), list(logprobs), list(tail), "t", arrays=arrays)
  for n, i in enumerate(indices or range(rows)):
    out["choices"][n]["index"] = i
  return out


def _client(handler, **kw) -> TeacherClient:
  client = TeacherClient(URL, retries=kw.pop("retries", 0), backoff_s=kw.pop("backoff_s", 0.01), **kw)
  client._http = httpx.Client(base_url=URL, transport=httpx.MockTransport(handler))
  return client


# ----------------------------------------------------------------------------------------------- item 1: indices
@pytest.mark.parametrize("arrays", [True, False])
@pytest.mark.parametrize("indices", [[0, 0, 0], [0, 1, 1], [2, 0, 0], [0, 1, 5], [0, 1, True]])
def test_r3_choices_with_duplicate_or_missing_indices_are_refused(arrays, indices):
  """Item 1: a proxy that set every index to 0 was trained on (the unnamed rows stayed zero); now only 0..rows-1."""
  answer = _answer(*_good(), arrays=arrays, indices=indices)
  with pytest.raises(AnswerError, match=r"index .*distinct index in \[0, 3\)"):
    read_completion(answer, ROWS, LENGTH, K, VOCAB)
  shuffled = _answer(*_good(), arrays=arrays, indices=[2, 0, 1])  # any order, each index once: accepted
  ids, _, _ = read_completion(shuffled, ROWS, LENGTH, K, VOCAB)
  np.testing.assert_array_equal(ids[2], _good()[0][0])


# ----------------------------------------------------------------------------------------------- item 2: distributions
def _damage(kind):
  ids, lp, tail = _good()
  if kind == "positive":  # a proxy answering +5.0 everywhere
    lp[:] = 5.0
  elif kind == "repeated":
    ids[1, 2, 1] = ids[1, 2, 0]
  elif kind == "mass":
    tail[1, 2] = np.log(0.9)  # top-k mass plus tail far above 1
  elif kind == "unsorted":
    lp[1, 2] = lp[1, 2, ::-1]
  elif kind == "tail_positive":
    tail[1, 2] = 0.5
  return ids, lp, tail


@pytest.mark.parametrize("arrays", [True, False])
@pytest.mark.parametrize("kind,says", [("positive", "above 0"), ("repeated", "repeat one"),
                                       ("mass", "mass plus tail"), ("unsorted", "not sorted"),
                                       ("tail_positive", "above 0")])
def test_r3_an_answer_that_is_not_a_distribution_is_refused_naming_row_position_and_url(arrays, kind, says):
  """Item 2: log-probabilities above 0, a repeated id, mass off 1, unsorted: refused with the row, the position and
  (through the client) the url; a good answer passes unchanged."""
  ids, lp, tail = _damage(kind)
  answer = _answer(ids, lp, tail, arrays=arrays)
  if kind == "repeated" and not arrays:  # JSON keys are distinct strings; "07" and "7" still name one id
    answer = _answer(*_good(), arrays=False)
    entry = answer["choices"][1]["prompt_logprobs"][3]
    first, second = list(entry)[:2]
    entry["0" + first] = entry.pop(second)
  where = "choice 0, position 1" if kind == "positive" else "choice 1, position 3"
  with pytest.raises(AnswerError, match=f"{where}: .*{says}"):
    read_completion(answer, ROWS, LENGTH, K, VOCAB)

  def handler(request):
    return httpx.Response(200, json=answer)

  client = _client(handler, retries=1)
  with pytest.raises(RemoteTeacherError, match=f"{URL}.*nothing a step may train on.*{says}") as e:
    client.topk(np.zeros((ROWS, LENGTH), np.int32), np.zeros(ROWS, np.int32), k=K, vocab=VOCAB)
  assert e.value.exit_code == 1 and client.failures == 2  # retried, then refused


def test_r3_a_good_answer_and_a_vllm_style_answer_without_tail_pass_the_distribution_check():
  ids, lp, tail = _good()
  for arrays in (True, False):
    got = read_completion(_answer(ids, lp, tail, arrays=arrays), ROWS, LENGTH, K, VOCAB)
    np.testing.assert_array_equal(got[0], ids)
    np.testing.assert_allclose(got[1], lp, rtol=1e-6)
  vllm = _answer(ids, lp, tail, arrays=False)
  for c in vllm["choices"]:
    del c["prompt_logprobs_tail"]  # derived as log(1 - mass)
  np.testing.assert_allclose(read_completion(vllm, ROWS, LENGTH, K, VOCAB)[2], tail, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------- item 3: prompt exit
def test_r3_after_a_fatal_error_the_prefetch_stops_retrying_at_once():
  """Item 3: batch s's answer is refused (401) while batch s+1's fetch is retrying a 503 with long backoffs; closing
  the iterator (what `fit` does on any error) ends that fetch at once, and its thread never holds the process."""
  from meshdistill.teachers.kinds.remote import RemoteTeacherData

  calls = []

  def handler(request):
    calls.append(time.monotonic())
    if len(calls) == 1:
      return httpx.Response(401, json={"message": "missing or wrong bearer token"})
    return httpx.Response(503, text="busy")

  client = _client(handler, retries=4, backoff_s=5.0)

  class Batches:
    def __init__(self):
      self.n = 0

    def __next__(self):
      self.n += 1
      return {"inputs": np.zeros((ROWS, LENGTH), np.int32), "targets": np.zeros((ROWS, LENGTH), np.int32)}

    def get_state(self):
      return {"n": self.n}

    def close(self):
      pass

  class Bundle:
    def train_iterator(self, state=None, **kw):
      return Batches()

  spec = type("Spec", (), {"k": K, "vocab": VOCAB})()
  it = RemoteTeacherData(Bundle(), client, spec).train_iterator()
  with pytest.raises(RemoteTeacherError, match="HTTP 401") as e:
    next(it)
  time.sleep(0.3)  # the fetch of the next batch has failed once and waits 5 s before its next try
  t0 = time.monotonic()
  it.close()
  fetchers = [t for t in threading.enumerate() if t.name.startswith("remote-teacher")]
  for t in fetchers:
    t.join(timeout=2)
  assert all(t.daemon or not t.is_alive() for t in fetchers), "a fetch thread would keep the process alive"
  assert not any(t.is_alive() for t in fetchers), "the fetch of the next batch is still retrying after close"
  assert time.monotonic() - t0 < 2
  n = len(calls)
  time.sleep(0.5)
  assert len(calls) == n <= 3  # no try after close
  assert e.value.exit_code == 2  # a refusal: the documented exit code


# ----------------------------------------------------------------------------------------------- item 4: identity
IDENTITY = protocol.identity_of(tokenizer="bytes", vocab=VOCAB, temperature=1.0, k=K, max_len=16, served_name="t",
                                teacher={"config": {"vocab_size": VOCAB}, "weights_sha256": "ab" * 32})


@pytest.mark.parametrize("ident,field", [
    ([IDENTITY], "a JSON list"),
    ({k: v for k, v in IDENTITY.items() if k != "max_len"}, "'max_len' is None"),
    ({**IDENTITY, "teacher": {"config": {"vocab_size": VOCAB}, "weights_sha256": 12}},
     "'teacher.weights_sha256' is 12"),
    ({**IDENTITY, "vocab": "32"}, "'vocab' is '32'"),
    ({**IDENTITY, "temperature": float("nan")}, "'temperature' is nan"),
    ({**IDENTITY, "teacher": []}, "'teacher' is \\[\\]"),
])
def test_r3_a_malformed_identity_is_refused_naming_url_and_field(ident, field):
  """Item 4: `/v1/teacher` answering a list, no max_len, an integer weights hash: AttributeError / KeyError /
  TypeError tracebacks before; now a refusal (exit 2) naming the url, the field and what was expected."""

  def handler(request):
    return httpx.Response(200, content=json.dumps(ident, allow_nan=True).encode())

  with pytest.raises(RemoteTeacherError, match=f"{URL}/v1/teacher answered an identity .*{field}.*expected") as e:
    _client(handler).identity()
  assert e.value.exit_code == 2


def test_r3_a_malformed_vllm_model_list_is_refused_naming_the_field():
  def handler(request):
    if request.url.path == "/v1/teacher":
      return httpx.Response(404, json={"detail": "Not Found"})
    return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": "long"}]})

  with pytest.raises(RemoteTeacherError, match=r"/v1/models answered .*'data\[0\].max_model_len' is 'long'"):
    _client(handler).identity()


@pytest.mark.parametrize("body", [[1, 2], "just text", {"detail": "nope"}])
def test_r3_a_4xx_whose_body_is_not_an_error_object_is_reported_not_a_traceback(body):
  """Item 4: a 4xx whose body is a JSON list raised AttributeError in the message; now the body is quoted."""

  def handler(request):
    return httpx.Response(403, content=json.dumps(body).encode() if not isinstance(body, str) else body.encode())

  with pytest.raises(RemoteTeacherError, match=r"refused the request \(HTTP 403\)") as e:
    _client(handler).topk(np.zeros((1, 2), np.int32), np.zeros(1, np.int32), k=1, vocab=VOCAB)
  assert e.value.exit_code == 2


def test_r3_cli_exit_codes_of_a_remote_teacher_agree_with_the_docs(monkeypatch, capsys):
  """Item 4: a 401 exited 1 although the docs say 2 = refused; a server that stays down is 1 (a rerun resumes)."""
  from meshdistill import cli, jobs
  from meshdistill.teachers.service.client import TeacherDown, TeacherRefused

  for error, code in ((TeacherRefused(f"teacher server {URL}/v1/teacher refused the request (HTTP 401)"), 2),
                      (TeacherDown(f"teacher server {URL} did not answer"), 1)):
    def fail(*a, error=error, **kw):
      raise error
    monkeypatch.setattr(jobs, "distill", fail)
    monkeypatch.setattr(jobs, "prepare_devices", lambda cfg: cfg)
    assert cli.main(["distill", "--config", "tiny", "--set", "mesh.backend=single", "--set", "mesh.data=1",
                     "--set", "mesh.tensor=1"]) == code
    assert URL in capsys.readouterr().err
