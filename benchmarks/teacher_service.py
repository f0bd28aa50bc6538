"""A teacher served over the network: the server's requests/s and tokens/s at 1, 4 and 16 concurrent clients, and
the student's step time with the remote teacher (fetched one batch ahead) against the teacher in the step.

Two measurements, one run, on the main job's tiny config (``configs/tiny.yaml``: byte vocabulary; its teacher with
random weights -- speed does not depend on them):

* server: ``meshdistill serve-teacher`` in its own process on the tiny config's mesh (simulated CPU devices),
  ``--k``, ``--max-rows 64``, ``--max-wait-ms 5``. For each number of clients C, C threads each send requests of
  ``--rows`` rows of ``seq_len + 1`` ids for ``--seconds`` seconds; reported: answered requests/s, scored tokens/s
  (rows x seq_len), the median request latency and the teacher calls the server made for them (from ``/health``: the
  dynamic batching); with answers as base64 arrays (what ``teacher.source: remote`` asks a meshdistill server for) and
  in vLLM's ``prompt_logprobs`` form (what a vLLM client reads), whose cost alone is also timed.
* step: the same student trained ``--steps`` steps from the same batches with the teacher in the step
  (``LogitKD(top_k=k)``, the teacher on the student's mesh) and with the remote teacher (`RemoteTeacherData`: the
  answer for batch s+1 fetched by a background thread while step s runs); the two step in turn
  (`bench.harness.interleave`). Reported: median time per step (the batch read, for the remote run its wait for
  the answer, and the step, waited for); then ``--steps`` more remote steps alone (in the interleaved rounds the
  fetch also overlaps the other arm's step): their median time and median wait for the answer, and the median time
  of one request alone -- what the prefetch hides is the request time minus the wait.

Run: ``python benchmarks/teacher_service.py [--seconds 5 --steps 30]``; writes
``benchmarks/results/teacher_service.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench import harness

import meshdistill as md

md.simulate_cpu_devices(8)

import httpx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshdistill import jobs  # noqa: E402
from meshdistill.config import load_config  # noqa: E402
from meshdistill.strategies import LogitKD  # noqa: E402
from meshdistill.teachers.checkpoint import save_teacher  # noqa: E402
from meshdistill.teachers.kinds.remote import RemoteTeacherData, check_identity  # noqa: E402
from meshdistill.teachers.service import protocol  # noqa: E402
from meshdistill.teachers.service.client import TeacherClient  # noqa: E402

RESULT = pathlib.Path(__file__).parent / "results" / "teacher_service.md"
SRC = pathlib.Path(__file__).parents[1] / "src"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(overrides: list[str], k: int, seq: int) -> tuple[subprocess.Popen, str, float]:
  port = _free_port()
  cmd = [sys.executable, "-m", "meshdistill", "serve-teacher", "--config", "tiny",
         *[a for o in overrides for a in ("--set", o)], "--port", str(port), "--k", str(k), "--max-rows", "64",
         "--max-wait-ms", "5", "--lengths", str(seq)]
  env = {**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"}
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  while True:
    if proc.poll() is not None:
      raise RuntimeError(f"serve-teacher exited {proc.returncode}")
    try:
      if httpx.get(f"{url}/health", timeout=1).status_code == 200:
        return proc, url, time.perf_counter() - t0
    except httpx.TransportError:
      time.sleep(0.2)


def load_clients(url: str, clients: int, seconds: float, rows: int, seq: int, k: int, vocab: int, arrays: bool) -> dict:
  """C threads sending requests for ``seconds``: requests/s, tokens/s, median latency, teacher calls; ``arrays``:
  answers as base64 arrays (what ``teacher.source: remote`` asks for) or in vLLM's prompt_logprobs form."""
  before = httpx.get(f"{url}/health").json()
  latencies: list[float] = []
  stop = time.perf_counter() + seconds
  lock = threading.Lock()

  def one(seed):
    rng = np.random.default_rng(seed)
    client = TeacherClient(url, timeout_s=120, retries=0, arrays=arrays)
    while time.perf_counter() < stop:
      x = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
      t0 = time.perf_counter()
      client.topk(x[:, :-1], x[:, -1], k=k, vocab=vocab)
      with lock:
        latencies.append(time.perf_counter() - t0)
    client.close()

  t0 = time.perf_counter()
  threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  wall = time.perf_counter() - t0
  after = httpx.get(f"{url}/health").json()
  n = len(latencies)
  return {"form": "base64 arrays" if arrays else "vLLM prompt_logprobs", "clients": clients, "requests": n,
          "requests_s": n / wall, "tokens_s": n * rows * seq / wall,
          "latency_ms": 1000 * statistics.median(latencies), "calls": after["calls"] - before["calls"],
          "served": after["requests"] - before["requests"]}


def step_times(cfg, data, teacher, client, spec, steps: int, k: float, tau: float) -> dict:
  """Per-step times of the teacher in the step and of the remote teacher, stepping in turn."""
  mesh = jobs.build_mesh(cfg)
  strategy = LogitKD(top_k=k, temperature=tau, alpha=0.5)
  student = md.init_model(cfg.student, seed=1, mesh=mesh)
  live = md.Distiller(student, teacher, mesh=mesh, strategy=strategy)
  remote_data = RemoteTeacherData(data, client, spec)
  remote = md.Distiller(student, spec, mesh=mesh, strategy=strategy)
  runs = {"teacher in the step": (live, data.train_iterator()), "remote teacher": (remote,
                                                                                   remote_data.train_iterator())}
  states = {name: d.init_state() for name, (d, _) in runs.items()}

  def stepper(name):
    distiller, it = runs[name]

    def one(_):
      states[name], m = distiller.step(states[name], next(it))
      jax.block_until_ready(m["loss"])
    return one

  timing = harness.interleave({name: stepper(name) for name in runs}, range(steps), warmup=2)
  # the remote arm alone: in the rounds above its fetch also overlaps the other arm's step
  first = len(remote_data.wait_log)
  alone_steps = [harness.timed(lambda: stepper("remote teacher")(None))[0] for _ in range(steps - 2)]
  for _, it in runs.values():
    it.close()
  waits = [w for _, w in remote_data.wait_log[first:]]
  probe = data.train_iterator()
  alone = []
  for _ in range(5):
    b = next(probe)
    t0 = time.perf_counter()
    client.topk(b["inputs"], b["targets"][:, -1], k=spec.k, vocab=spec.vocab)
    alone.append(time.perf_counter() - t0)
  probe.close()
  med = harness.medians(timing["times"])
  return {"median_s": med, "wait_s": statistics.median(waits), "remote_alone_s": statistics.median(alone_steps),
          "request_s": statistics.median(alone),
          "compile_s": timing["compile_s"], "paired": harness.paired(timing["times"], "remote teacher",
                                                                      ("teacher in the step",)),
          "spread": harness.spread(timing["times"], "remote teacher", ("teacher in the step",))}


def format_cost(rows: int, seq: int, k: int, vocab: int, arrays: bool, calls: int = 5) -> dict:
  """Median ms of writing (server: the completion object and its JSON) and reading (client: JSON and the checked
  arrays) one answer of ``rows`` x ``seq`` positions x top-``k`` in vLLM's ``prompt_logprobs`` form, and its bytes."""
  rng = np.random.default_rng(0)
  ids = [np.stack([rng.permutation(vocab)[:k] for _ in range(seq)]) for _ in range(rows)]
  logprobs = [np.sort(np.log(rng.random((seq, k))), axis=-1)[:, ::-1].astype(np.float32) for _ in range(rows)]
  tails = [lp[:, -1] for lp in logprobs]
  prompts = [list(range(seq + 1))] * rows
  write, read = [], []
  for _ in range(calls):
    t0 = time.perf_counter()
    text = json.dumps(protocol.completion(prompts, k, ids, logprobs, tails, "teacher", arrays=arrays))
    t1 = time.perf_counter()
    protocol.read_completion(json.loads(text), rows, seq, k, vocab)
    read.append(time.perf_counter() - t1)
    write.append(t1 - t0)
  return {"write_ms": 1000 * statistics.median(write), "read_ms": 1000 * statistics.median(read),
          "bytes": len(text)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seconds", type=float, default=5.0, help="load per number of clients")
  p.add_argument("--rows", type=int, default=8, help="rows per request")
  p.add_argument("--steps", type=int, default=30, help="student steps per arm (2 more to compile)")
  p.add_argument("--k", type=int, default=32)
  args = p.parse_args()
  load0 = harness.load()
  root = tempfile.mkdtemp(prefix="teacher-service-")
  overrides = [f"pretrain.cache_dir={root}/cache", "distill.temperature=2.0", f"distill.top_k={args.k}"]
  cfg = load_config("tiny", overrides)
  jobs.prepare_devices(cfg)
  mesh = jobs.build_mesh(cfg)
  data = jobs.load_data(cfg, mesh=mesh)
  teacher = md.init_model(cfg.teacher, seed=0, mesh=mesh)
  tdir = save_teacher(os.path.join(root, "teacher"), teacher, data.tokenizer)
  overrides.append(f"pretrain.teacher={tdir}")
  seq, vocab = cfg.data.seq_len, data.tokenizer.vocab_size
  proc, url, start_s = start_server(overrides, args.k, seq)
  try:
    loads = [load_clients(url, c, args.seconds, args.rows, seq, args.k, vocab, arrays)
             for arrays in (True, False) for c in (1, 4, 16)]
    client = TeacherClient(url, timeout_s=120, retries=2)
    spec, _ = check_identity(client.identity(), load_config("tiny", overrides), data.tokenizer, url)
    steps = step_times(cfg, data, teacher, client, spec, args.steps + 2, args.k, 2.0)
    client.close()
  finally:
    proc.terminate()
    proc.wait()
  fmt = {arrays: format_cost(args.rows, seq, args.k, vocab, arrays) for arrays in (False, True)}
  load1 = harness.load()

  lines = ["# A teacher served over the network", "",
           f"`python benchmarks/teacher_service.py --seconds {args.seconds:g} --rows {args.rows} --steps {args.steps} "
           f"--k {args.k}` on {harness.machine()}; load average {load0[0]:.1f} before, {load1[0]:.1f} after (the "
           "machine is shared: other jobs ran beside this one, and server, clients and student share its cores).", "",
           f"Tiny config (`configs/tiny.yaml`): teacher d_model {cfg.teacher.d_model}, {cfg.teacher.n_layers} layers, "
           f"vocabulary {vocab}; rows of {seq} tokens; top-{args.k} at temperature 2.0; the server on a "
           f"{cfg.mesh.data}x{cfg.mesh.tensor} mesh of simulated CPU devices, --max-rows 64, --max-wait-ms 5; it "
           f"answered /health {start_s:.1f} s after it was started (imports, teacher load, compiling its buckets).", "",
           "## Server: concurrent clients", "",
           f"Each client sends requests of {args.rows} rows x {seq + 1} ids, one after another, for "
           f"{args.seconds:g} s.", "",
           "| answer form | clients | requests/s | tokens/s | median latency (ms) | requests | teacher calls |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for r in loads:
    lines.append(f"| {r['form']} | {r['clients']} | {r['requests_s']:.1f} | {r['tokens_s']:,.0f} | "
                 f"{r['latency_ms']:.1f} | "
                 f"{r['served']} | {r['calls']} |")
  lines += ["", f"The answer's form, measured alone in this process for {args.rows} x {seq} positions x "
            f"top-{args.k}:", "",
            "| form | write (server, ms) | read and check (client, ms) | bytes | bytes per (position, token) |",
            "|---|---:|---:|---:|---:|"]
  for arrays, name in ((False, "vLLM prompt_logprobs (JSON objects)"), (True, "base64 arrays (meshdistill_arrays)")):
    f = fmt[arrays]
    lines.append(f"| {name} | {f['write_ms']:.1f} | {f['read_ms']:.1f} | {f['bytes']:,} | "
                 f"{f['bytes'] / (args.rows * seq * args.k):.1f} |")
  med = steps["median_s"]
  lines += ["", "## Student step: remote teacher vs the teacher in the step", "",
            f"{args.steps} steps each (after 2 to compile), stepping in turn; batch {cfg.train.batch_size} x {seq} "
            f"tokens, student on the {cfg.mesh.data}x{cfg.mesh.tensor} mesh.", "",
            "| | median time per step (ms) |", "|---|---:|"]
  for name, s in med.items():
    lines.append(f"| {name} | {1000 * s:.1f} |")
  hidden = steps["request_s"] - steps["wait_s"]
  lines += ["", f"Remote / in the step, paired per round: {steps['paired']:.2f}x ({steps['spread']}).", "",
            f"Prefetch overlap, the remote arm alone ({args.steps} steps): {1000 * steps['remote_alone_s']:.1f} ms per "
            f"step (median); one request for a batch's top-k takes {1000 * steps['request_s']:.1f} ms alone (median "
            f"of 5), and the loop waited {1000 * steps['wait_s']:.1f} ms per step (median) for the answer fetched "
            f"while the previous step ran: {1000 * max(hidden, 0):.1f} ms of each request "
            f"({100 * max(hidden, 0) / steps['request_s']:.0f}%) was hidden behind the step.", ""]
  RESULT.write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
