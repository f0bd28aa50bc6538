"""A teacher served over the network (``meshdistill serve-teacher``, ``teacher.source: remote``), against ONE real
server process on localhost: a run from it equals the run with the teacher in-process; concurrent clients are
batched and answered right; a killed server stops the run with a clear error and a rerun resumes to the same result;
a stalled server is retried; another teacher is refused; bad requests are 4xx and the server keeps serving."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from helpers import write_corpus

import meshdistill as md
from meshdistill import jobs
from meshdistill.config import ConfigError, load_config
from meshdistill.teachers.checkpoint import save_teacher
from meshdistill.teachers.kinds.remote import check_identity
from meshdistill.teachers.service.client import TeacherClient, TeacherDown

K, TAU, TOKEN, VOCAB = 4, 2.0, "s3cret", 264  # the tiny config's byte tokenizer
SRC = os.path.join(os.path.dirname(__file__), os.pardir, "src")
RUN = ["train.steps=5", "train.warmup=1", "train.eval_every=0", "train.log_every=1", "train.eval_batches=1"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  """``meshdistill serve-teacher`` in a process of its own; `start` again after `kill` (same port)."""

  def __init__(self, overrides, port, cache):
    self.port, self.url, self.proc, self.cache = port, f"http://127.0.0.1:{port}", None, cache
    self.hold = os.path.join(cache, os.pardir, "hold")  # while it exists, a teacher call waits (--hold-file)
    self.cmd = [sys.executable, "-m", "meshdistill", "serve-teacher", "--config", "tiny",
                *[a for o in overrides for a in ("--set", o)], "--port", str(port), "--k", str(K),
                "--token", TOKEN, "--max-rows", "16", "--max-wait-ms", "30", "--lengths", "8", "--max-bytes", "20000",
                "--hold-file", self.hold]

  def launch(self):
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC), "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": self.cache}  # a restarted server reuses its compiled program
    self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

  def wait_ready(self):
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise RuntimeError(f"serve-teacher exited {self.proc.returncode}: {self.proc.stderr.read()[-3000:]}")
      try:
        if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
          return
      except httpx.TransportError:
        time.sleep(0.2)
    raise RuntimeError("serve-teacher did not answer /health")

  def health(self) -> dict:
    r = httpx.get(f"{self.url}/health", timeout=5)
    assert r.status_code == 200
    return r.json()

  def kill(self):
    self.proc.kill()
    self.proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  root = tmp_path_factory.mktemp("served")
  corpus = write_corpus(root / "corpus", 12)
  common = [f"data.source={corpus}", "data.seq_len=8", "data.val_fraction=0.25", "data.max_chars=null",
            "teacher.max_len=16", "student.max_len=16", f"distill.temperature={TAU}", f"distill.top_k={K}",
            "mesh.backend=single", "mesh.data=1", "mesh.tensor=1", f"pretrain.cache_dir={root / 'cache'}"]
  cfg = load_config("tiny", common)
  data = jobs.load_data(cfg)
  teacher = md.init_model(cfg.teacher, seed=3)
  tdir = save_teacher(str(root / "teacher"), teacher, data.tokenizer)
  common.append(f"pretrain.teacher={tdir}")
  server = Server(common, _free_port(), str(root / "jax-cache"))
  server.launch()
  # the reference run, the teacher in-process (LogitKD top-k in the step), while the server starts beside it
  live = jobs.distill(load_config("tiny", [*common, *RUN, "checkpoint.every=0", f"run.run_dir={root / 'live'}"]))
  server.wait_ready()
  old = os.environ.get("MESHDISTILL_TEACHER_TOKEN")
  os.environ["MESHDISTILL_TEACHER_TOKEN"] = TOKEN
  inputs, last = _rows(16, seed=0)
  client = TeacherClient(server.url, timeout_s=60, retries=0, token=TOKEN, arrays=True)
  # all rows in one request, as base64 arrays (the run's test shows them equal to the teacher in-process)
  want = client.topk(inputs, last, k=K, vocab=VOCAB)
  client.close()
  yield dict(root=root, common=common, server=server, data=data, live=live, cfg=load_config("tiny", common),
             inputs=inputs, last=last, want=want)
  os.environ.pop("MESHDISTILL_TEACHER_TOKEN") if old is None else os.environ.update(MESHDISTILL_TEACHER_TOKEN=old)
  if server.proc.poll() is None:  # still serving (the SIGTERM test below stops it when it runs)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0  # graceful stop


def _rows(n, seed):
  rng = np.random.default_rng(seed)
  return rng.integers(0, VOCAB, (n, 8)).astype(np.int32), rng.integers(0, VOCAB, (n,)).astype(np.int32)


def _check_answer(got, want):
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- load
def test_concurrent_clients_get_their_own_answers_from_batched_calls(served):
  """Each client's answer (in vLLM's prompt_logprobs form) is its rows' part of the answer to all rows at once (as
  base64 arrays), whatever it was batched with."""
  server, inputs, last, want = served["server"], served["inputs"], served["last"], served["want"]
  before = server.health()
  n = len(inputs)  # one client per row
  got, errors = [None] * n, []

  def one(i):
    client = TeacherClient(server.url, timeout_s=30, retries=0, token=TOKEN)
    try:
      got[i] = client.topk(inputs[i:i + 1], last[i:i + 1], k=K, vocab=VOCAB)
    except Exception as e:  # noqa: BLE001 -- reported below
      errors.append(e)
    finally:
      client.close()

  threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  for i in range(n):
    _check_answer(got[i], tuple(w[i:i + 1] for w in want))
  after = server.health()
  requests, calls = after["requests"] - before["requests"], after["calls"] - before["calls"]
  assert requests == n and calls < requests  # gathered into fewer teacher calls
  assert {tuple(s) for s in after["shapes"]} <= {(8, 8), (16, 8)}  # the compiled shapes, never one per request


# --------------------------------------------------------------------------- faults
def test_a_stalled_server_times_out_and_the_retry_gets_the_answer(served):
  server, inputs, last = served["server"], served["inputs"][:8], served["last"][:8]
  client = TeacherClient(server.url, timeout_s=0.4, retries=4, backoff_s=0.1, token=TOKEN)
  server.proc.send_signal(signal.SIGSTOP)  # the server answers nothing for a while
  resume = threading.Timer(0.7, server.proc.send_signal, (signal.SIGCONT,))
  resume.start()
  try:
    got = client.topk(inputs, last, k=K, vocab=VOCAB)
  finally:
    resume.join()
    server.proc.send_signal(signal.SIGCONT)
    client.close()
  assert client.failures >= 1  # at least one try timed out
  _check_answer(got, tuple(w[:8] for w in served["want"]))


def test_a_server_of_another_teacher_is_refused_by_its_identity(served):
  server, cfg, data = served["server"], served["cfg"], served["data"]
  client = TeacherClient(server.url, timeout_s=10, retries=0, token=TOKEN)
  ident = client.identity()
  client.close()
  spec, identity = check_identity(ident, cfg, data.tokenizer, server.url)
  assert spec.k == K and spec.temperature == TAU and identity.startswith("remote teacher sha256:")
  other_tau = load_config("tiny", [*served["common"], "distill.temperature=1.0"])
  with pytest.raises(ConfigError, match=r"temperature 2.0, this run trains at distill.temperature=1.0"):
    check_identity(ident, other_tau, data.tokenizer, server.url)
  with pytest.raises(ConfigError, match=r"serves at most top-4, this run asks for 8"):
    check_identity(ident, load_config("tiny", [*served["common"], "teacher.source=remote",
                                               f"teacher.url={server.url}", "teacher.k=8"]), data.tokenizer, server.url)

  class OtherTokenizer:
    fingerprint = "0123456789abcdef"

  with pytest.raises(ConfigError, match="another tokenizer"):
    check_identity(ident, cfg, OtherTokenizer(), server.url)
  other = dict(ident, teacher={**ident["teacher"], "config": {**ident["teacher"]["config"], "vocab_size": 512}})
  with pytest.raises(ConfigError, match="vocab_size"):
    check_identity(other, cfg, data.tokenizer, server.url)


@pytest.mark.parametrize("body, headers, status, says", [
    (b"{not json", {}, 400, "not JSON"),
    (json.dumps({"prompt": "def f", "prompt_logprobs": 4}), {}, 400, "token-id lists"),
    (json.dumps({"prompt": [[1, 2, 3]], "prompt_logprobs": "4"}), {}, 400, "prompt_logprobs"),
    (json.dumps({"prompt": [[1, 2.5, 3]], "prompt_logprobs": 4}), {}, 400, "token ids are integers"),
    (json.dumps({"prompt": [[1, VOCAB, 3]], "prompt_logprobs": 4}), {}, 400, rf"\[0, {VOCAB}\)"),
    (json.dumps({"prompt": [[1, 2]], "prompt_logprobs": 4, "max_tokens": 16}), {}, 400, "max_tokens"),
    (json.dumps({"prompt": [[1, 2]], "prompt_logprobs": 4, "meshdistill_arrays": "yes"}), {}, 400, "true or false"),
    (json.dumps({"prompt": [[1, 2]] * 17, "prompt_logprobs": 4}), {}, 413, "at most 16"),
    (json.dumps({"prompt": [list(range(10))], "prompt_logprobs": 4}), {}, 413, "send 2 to 9"),
    (json.dumps({"prompt": [[1] * 8000], "prompt_logprobs": 4}), {}, 413, "at most 20000"),
    (json.dumps({"prompt": [[1, 2]], "prompt_logprobs": 4}), {"Authorization": ""}, 401, "bearer token"),
    (json.dumps({"prompt": [[1, 2]], "prompt_logprobs": 4}), {"Authorization": "Bearer nope"}, 401, "bearer token"),
])
def test_a_bad_request_is_a_4xx_and_the_server_keeps_serving(served, body, headers, status, says):
  server = served["server"]
  r = httpx.post(f"{server.url}/v1/completions", content=body,
                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", **headers},
                 timeout=10)
  assert r.status_code == status, r.text
  assert re.search(says, r.json()["message"])
  assert server.health()["status"] == "ok"


def test_a_run_from_the_served_teacher_equals_the_in_process_run_and_resumes_after_the_server_dies(served):
  root, server, common = served["root"], served["server"], served["common"]
  live = served["live"]

  remote = load_config("tiny", [*common, *RUN, f"run.run_dir={root / 'remote'}", "teacher.source=remote",
                                f"teacher.url={server.url}", "teacher.timeout=5", "teacher.retries=1",
                                "checkpoint.every=2"])

  class KillAtStep2:
    def write(self, text):
      m = re.search(r"\] (\d+)/5", text)
      if m and int(m.group(1)) == 2 and server.proc.poll() is None:
        server.kill()
        server.launch()  # restarted on the same port: it answers seconds later, the run has stopped by then

    def flush(self):
      pass

  with pytest.raises(TeacherDown, match=rf"teacher server {server.url} did not answer .* resumes from its last "
                     "checkpoint"):
    jobs.distill(remote, stream=KillAtStep2())
  stopped = _losses(root / "remote")
  assert 2 <= len(stopped) < 5  # stopped mid-run, before training on a batch without its answer
  server.wait_ready()
  resumed = jobs.distill(remote)
  assert resumed["step"] == 5
  got, want = _losses(root / "remote"), _losses(root / "live")
  assert sorted(got) == [1, 2, 3, 4, 5]
  np.testing.assert_allclose([got[s] for s in range(1, 6)], [want[s] for s in range(1, 6)], rtol=1e-5)
  np.testing.assert_allclose(resumed["student"]["loss"], live["student"]["loss"], rtol=1e-5)
  assert resumed["teacher_dir"].startswith("remote teacher sha256:")


def _losses(run_dir) -> dict:
  out = {}
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    rec = json.loads(line)
    if rec.get("split") == "train":
      out[rec["step"]] = rec["loss"]
  return out


def test_a_vllm_answer_is_read_as_its_top_k_with_the_tail_derived():
  """vLLM's prompt_logprobs: the prompt token's own entry added when outside the top-k, no tail field."""
  from meshdistill.teachers.service.protocol import AnswerError, read_completion

  p = np.array([0.5, 0.2, 0.1])
  entry = {"7": {"logprob": float(np.log(p[1])), "rank": 2, "decoded_token": "a"},
           "3": {"logprob": float(np.log(p[0])), "rank": 1, "decoded_token": "b"},
           "9": {"logprob": float(np.log(0.01)), "rank": 40, "decoded_token": "c"},  # the prompt token
           "5": {"logprob": float(np.log(p[2])), "rank": 3, "decoded_token": "d"}}
  answer = {"choices": [{"index": 0, "text": "x", "prompt_logprobs": [None, entry, entry]}]}
  ids, logprobs, tail = read_completion(answer, rows=1, length=2, k=3, vocab=16)
  np.testing.assert_array_equal(ids[0], [[3, 7, 5], [3, 7, 5]])
  np.testing.assert_allclose(logprobs[0, 0], np.log(p), rtol=1e-6)
  np.testing.assert_allclose(tail[0], np.log(1 - p.sum()), rtol=1e-5)
  with pytest.raises(AnswerError, match="1 choices for 2 prompts"):
    read_completion(answer, rows=2, length=2, k=3, vocab=16)
  with pytest.raises(AnswerError, match="3 entries for a prompt of 4 ids"):
    read_completion(answer, rows=1, length=3, k=3, vocab=16)
  with pytest.raises(AnswerError, match=r"outside \[0, 7\)"):
    read_completion(answer, rows=1, length=2, k=3, vocab=7)
  nan = {"choices": [{"index": 0, "prompt_logprobs": [None, {**entry, "3": {"logprob": float("nan"), "rank": 1}},
                                                           entry]}]}
  with pytest.raises(AnswerError, match="not finite"):
    read_completion(nan, rows=1, length=2, k=3, vocab=16)


def test_served_teachers_score_the_rows_a_student_generates_for_several_teachers(served):
  """On-policy with several teachers, a served one is asked for each batch's rows (`MultiTeacherData.score`): a
  route over two members served here gives each row the server's own answer for it."""
  from meshdistill.teachers import multi
  from meshdistill.teachers.kinds.remote import RemoteTeacherData

  server, cfg, data, inputs, last = served["server"], served["cfg"], served["data"], served["inputs"], served["last"]
  client = TeacherClient(server.url, timeout_s=30, retries=0, token=TOKEN)
  try:
    spec, _ = check_identity(client.identity(), cfg, data.tokenizer, server.url)
    remote = multi.FromBatches(RemoteTeacherData(None, client, spec))
    both = multi.MultiTeacherData(None, [remote, remote], k=K, route=[1, 0], weights=[1.0, 1.0])
    rows = {"inputs": inputs, "targets": np.concatenate([inputs[:, 1:], last[:, None]], 1),
            "mask": np.ones(inputs.shape, np.float32), "domain": np.arange(len(inputs)) % 2}
    scored = both.score(rows)
  finally:
    client.close()
  _check_answer(tuple(scored[key] for key in ("teacher_ids", "teacher_logprobs", "teacher_tail")), served["want"])
  np.testing.assert_array_equal(scored["teachers_rows"], np.eye(2)[1 - rows["domain"]])
  sets = [*served["common"], "data.corpora={a: /a, b: /b}", "distill.on_policy.lambda=1.0",
          "distill.on_policy.max_new_tokens=4",
          f"teachers={{sources: [{{name: r, source: remote, url: {server.url}, takes: [a]}}, "
          "{name: p, source: pretrained, takes: [b]}]}"]
  assert load_config("tiny", [s for s in sets if not s.startswith("pretrain.teacher")]).teachers.active


# --------------------------------------------------------------------------- last: it stops the server
def test_sigterm_answers_the_request_in_flight_then_exits_0(served):
  """A request held inside the server's batching loop (its test hook, --hold-file) when SIGTERM arrives is still
  answered, right, and the server then exits with status 0."""
  server, inputs, last = served["server"], served["inputs"][:4], served["last"][:4]
  open(server.hold, "w").close()
  got, errors = [], []

  def ask():
    client = TeacherClient(server.url, timeout_s=60, retries=0, token=TOKEN)
    try:
      got.append(client.topk(inputs, last, k=K, vocab=VOCAB))
    except Exception as e:  # noqa: BLE001 -- reported below
      errors.append(e)
    finally:
      client.close()

  asking = threading.Thread(target=ask)
  try:
    asking.start()
    deadline = time.monotonic() + 30
    while server.health()["held"] == 0:  # the request has reached the teacher call, which waits
      assert time.monotonic() < deadline, "the request never reached the batching loop"
      time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert server.proc.poll() is None and not got  # still finishing the held request
  finally:
    os.remove(server.hold)  # the call runs
  asking.join(timeout=60)
  assert not errors, errors
  _check_answer(got[0], tuple(w[:4] for w in served["want"]))
  assert server.proc.wait(timeout=30) == 0
