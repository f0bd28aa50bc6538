"""The main job as several processes on one machine (JAX's multi-controller runtime, gloo on CPU).

Every run here is a real ``meshdistill distill --config tiny`` subprocess (4 steps, a checkpoint
every 2): 2 processes x 4 CPU devices on a 2x4 mesh (through ``meshdistill launch``) against
1 process x 8 devices; a 1-process resume of the 2-process checkpoint; and a 2-process resume of
the 1-process checkpoint whose second process is then killed; ``meshdistill cache-teacher`` as 2
writers against 1. A random teacher written once by this module replaces the tiny config's teacher
pretraining (it only costs compile time here).
"""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import meshdistill as md
from meshdistill.parallel import distributed
from meshdistill.teachers.checkpoint import save_teacher
from meshdistill.config import load_config
from meshdistill.teachers.cache import TeacherCache

STEPS = 4
TIMEOUT_S = 600  # a whole run on a loaded 2-core machine; a hang fails instead of blocking CI


def _args(run_dir, teacher, *extra):
  sets = {
      "run.run_dir": run_dir, "pretrain.teacher": teacher, "train.steps": STEPS, "checkpoint.every": 2,
      "checkpoint.keep": 5, "train.log_every": 1, "train.eval_every": 0, "train.eval_batches": 1,
  }
  out = ["distill", "--config", "tiny"]
  for k, v in sets.items():
    out += ["--set", f"{k}={v}"]
  return out + list(extra)


def _env(tmp):
  env = dict(os.environ)
  env["MESHDISTILL_CACHE"] = str(tmp / "cache")
  src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(md.__file__))))
  env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
  return env


def _train_losses(run_dir):
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8")]
  train = [r for r in rows if r["split"] == "train"]
  steps = [r["step"] for r in train]
  assert len(steps) == len(set(steps)), f"a step was written twice (by two processes?): {steps}"
  return {r["step"]: r["loss"] for r in train}


def _load_state(run_dir, step):
  """The saved train state of ``step`` as numpy arrays (whatever layout and process count wrote it)."""
  path = os.path.join(run_dir, "checkpoints", str(step), "state")
  ckptr = ocp.PyTreeCheckpointer()
  tree = ckptr.metadata(path).item_metadata.tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))


def _progress_losses(output, prefix):
  """``{step: loss}`` of the progress lines one process printed (what that process read from its devices)."""
  pat = re.compile(rf"^{re.escape(prefix)}distill \[[#-]+\] (\d+)/\d+ .*?\| loss ([\d.]+)")
  return {int(m.group(1)): m.group(2) for m in map(pat.match, output.splitlines()) if m}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
  cfg = load_config("tiny")
  path = str(tmp_path_factory.mktemp("teacher") / "teacher")
  save_teacher(path, md.init_model(cfg.teacher, seed=0), md.data.ByteTokenizer(), {"note": "random, for tests"})
  return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, teacher):
  """The same 4-step job as 2 processes x 4 devices (``meshdistill launch``) and as 1 process x 8 devices; then the
  2-process run's step-2 checkpoint resumed by 1 process, started here and read by its test after the 1 -> 2 process
  one, so that it runs beside that test (which waits seconds for a killed peer's missed heartbeats)."""
  tmp = tmp_path_factory.mktemp("runs")
  env = _env(tmp)
  two, one = str(tmp / "two"), str(tmp / "one")
  launch = [sys.executable, "-m", "meshdistill", "launch", "--processes", "2", "--", "meshdistill",
            *_args(two, teacher)]
  single = [sys.executable, "-m", "meshdistill", *_args(one, teacher)]
  # Both jobs at once: the machine's cores are shared either way, and the waits overlap.
  p2 = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  p1 = subprocess.Popen(single, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  out2, _ = p2.communicate(timeout=TIMEOUT_S)
  out1, _ = p1.communicate(timeout=TIMEOUT_S)
  assert p2.returncode == 0, out2[-3000:]
  assert p1.returncode == 0, out1[-3000:]
  resumed = str(tmp / "resumed")
  shutil.copytree(os.path.join(two, "checkpoints", "2"), os.path.join(resumed, "checkpoints", "2"))
  with open(tmp / "resumed.log", "w+", encoding="utf-8") as log:
    proc = subprocess.Popen([sys.executable, "-m", "meshdistill", *_args(resumed, teacher)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
      yield {"two": two, "one": one, "out2": out2, "env": env, "teacher": teacher,
             "resumed": (proc, log, resumed)}
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_two_processes_match_one_process(runs):
  two, one, out2 = runs["two"], runs["one"], runs["out2"]
  assert "devices: 8 x cpu (cpu) in 2 processes" in out2
  # Every process read the same loss at every step: the guard's decisions cannot differ.
  seen = [_progress_losses(out2, f"[p{i}] ") for i in range(2)]
  assert sorted(seen[0]) == list(range(1, STEPS + 1)) and seen[0] == seen[1]
  # Same per-step losses and final parameters as one process on 8 devices.
  l2, l1 = _train_losses(two), _train_losses(one)
  assert sorted(l2) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([l2[s] for s in sorted(l2)], [l1[s] for s in sorted(l2)], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), _load_state(two, STEPS),
               _load_state(one, STEPS))
  assert os.path.isfile(os.path.join(two, "summary.json"))  # written once, by process 0


def test_one_process_checkpoint_resumes_on_two_and_a_killed_process_stops_the_other(runs, tmp_path):
  """1 -> 2 processes: the 1-process run's step-2 checkpoint resumes as a longer 2-process job whose first
  loss (step 3: the restored parameters on the restored data position, before any new update) is the
  1-process run's; then process 1 is killed and process 0 must stop on its own, leaving loadable checkpoints.
  The 2-process job runs the student over the batch (``mesh.student_split=batch``; the checkpoint was written
  with the student split over ``tensor``): the restore re-lays the student out, and the loss must not move."""
  run = str(tmp_path / "killed")
  shutil.copytree(os.path.join(runs["one"], "checkpoints", "2"), os.path.join(run, "checkpoints", "2"))
  port = distributed.free_port()
  cmd = [sys.executable, "-m", "meshdistill", *_args(run, runs["teacher"], "--set", "train.steps=500",
                                                     "--set", "mesh.student_split=batch")]
  logs = [open(tmp_path / f"p{i}.log", "w+", encoding="utf-8") for i in range(2)]  # noqa: SIM115
  procs = [subprocess.Popen(cmd, env=distributed.local_env(i, 2, port, base=runs["env"]), stdout=logs[i],
                            stderr=subprocess.STDOUT) for i in range(2)]
  ckpt = os.path.join(run, "checkpoints")
  try:
    t0 = time.monotonic()
    while not any(n.isdigit() and int(n) > 2 for n in os.listdir(ckpt)):
      assert all(p.poll() is None for p in procs), "a process ended before its first checkpoint"
      assert time.monotonic() - t0 < TIMEOUT_S, "no checkpoint written"
      time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code = procs[0].wait(timeout=60)
    waited = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  logs[0].seek(0)
  out = logs[0].read()
  assert "resumed from step 2" in out, out[-3000:]
  np.testing.assert_allclose(_train_losses(run)[3], _train_losses(runs["one"])[3], rtol=1e-5)
  assert code != 0 and waited < 60, out[-3000:]
  # Process 0 stops with advice of its own, or is aborted by the runtime with the reason: JAX's coordination
  # service ("another task died") or gloo, whose threads abort the process (past Python's reach) when a peer
  # vanishes mid-collective; `meshdistill launch` then names the signal and says to rerun.
  gloo_abort = code == -signal.SIGABRT and "throwing an instance of 'gloo::" in out
  assert "rerun the same command" in out or "another task died" in out or gloo_abort, out[-3000:]
  steps = [int(n) for n in os.listdir(ckpt) if n.isdigit()]
  assert max(steps) < 500, "the run ended before the kill: nothing was tested"
  assert int(_load_state(run, max(steps))["step"]) == max(steps)


def test_two_process_checkpoint_resumes_on_one_process(runs):
  proc, log, resumed = runs["resumed"]
  proc.wait(timeout=TIMEOUT_S)
  log.seek(0)
  out = log.read()
  assert proc.returncode == 0 and "resumed from step 2" in out, out[-3000:]
  lr, l2 = _train_losses(resumed), _train_losses(runs["two"])
  assert sorted(lr) == [3, 4]
  np.testing.assert_allclose([lr[3], lr[4]], [l2[3], l2[4]], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), _load_state(resumed, STEPS),
               _load_state(runs["two"], STEPS))


def test_two_process_teacher_cache_equals_one_process_cache(teacher, tmp_path):
  """``cache-teacher`` as 2 processes (each writing its own shards) against 1 process, on the tiny data.

  On 8x1 (no collective in the teacher) the shards are bit-identical: same content hash, same manifest. On
  2x4 the teacher's tensor all-reduces run through gloo with 2 processes but in-process with one, which sums
  in another order: the float32 log-probabilities then agree to float32 rounding, not bit for bit."""
  env = _env(tmp_path)
  layouts = {"8x1": ((8, 1), "float16"), "2x4": ((2, 4), "float32")}

  def cmd(name, processes):
    (data, tensor), precision = layouts[name]
    sets = {"pretrain.teacher": teacher, "data.max_chars": 8000, "run.run_dir": str(tmp_path / "run"),
            "mesh.data": data, "mesh.tensor": tensor}
    args = ["cache-teacher", "--config", "tiny", "--out", str(tmp_path / f"{name}-{processes}"), "--k", "8",
            "--rows-per-shard", "48", "--precision", precision]
    args += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    launch = ["launch", "--processes", str(processes), "--", "meshdistill"] if processes > 1 else []
    return [sys.executable, "-m", "meshdistill", *launch, *args]

  # All four jobs at once: their start-up and compile waits overlap.
  jobs = {(name, n): subprocess.Popen(cmd(name, n), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True) for name in layouts for n in (1, 2)}
  outs = {key: p.communicate(timeout=TIMEOUT_S)[0] for key, p in jobs.items()}
  for key, p in jobs.items():
    assert p.returncode == 0, outs[key][-3000:]
  assert "(2 writers)" in outs[("8x1", 2)] and "[p1] teacher cache" in outs[("8x1", 2)]
  caches = {key: TeacherCache(str(tmp_path / f"{key[0]}-{key[1]}"), verify=True) for key in jobs}
  one, two = caches[("8x1", 1)].manifest, caches[("8x1", 2)].manifest
  assert len(one["shards"]) == 5 and one["rows"] == 237  # 3 shards written by process 0, 2 by process 1
  assert two["content_sha256"] == one["content_sha256"] and two == one
  assert sorted(os.listdir(tmp_path / "8x1-2")) == sorted(os.listdir(tmp_path / "8x1-1"))  # no progress files left
  one, two = caches[("2x4", 1)], caches[("2x4", 2)]
  rows = np.arange(one.manifest["rows"])
  got, want = two.rows(rows), one.rows(rows)
  assert sorted(got) == sorted(want) and len(want) >= 3
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
  assert {k: v for k, v in two.manifest.items() if k not in ("shards", "content_sha256")} == {
      k: v for k, v in one.manifest.items() if k not in ("shards", "content_sha256")}


@pytest.mark.parametrize(
    "owners, expect",
    [
        ([[0, 0, 0, 0], [1, 1, 1, 1]], [(0, 2), (1, 2)]),  # 2 processes x 4 devices on 2x4: a half each
        ([[0, 0], [0, 0], [1, 1], [1, 1]], [(0, 2), (1, 2)]),  # 4x2: two mesh rows each
        ([[0, 1, 2, 3], [4, 5, 6, 7]], [(0, 2)] * 4 + [(1, 2)] * 4),  # one device each, tensor across processes
        ([[0, 0, 1, 1]], [(0, 1), (0, 1)]),  # 1x4 over 2 processes: both read the whole batch
        ([[0, 0], [1, 1], [0, 0], [1, 1]], [None, None]),  # scattered rows
        ([[0, 0], [0, 1]], [None, None]),  # overlapping, different rows
    ],
)
def test_batch_part_is_the_rows_a_process_holds(owners, expect):
  assert [distributed.batch_part(owners, p) for p in range(len(expect))] == expect


def test_resolve_reads_flags_then_environment_and_names_what_is_missing():
  env = {"MESHDISTILL_COORDINATOR": "10.0.0.1:8476", "MESHDISTILL_NUM_PROCESSES": "4", "MESHDISTILL_PROCESS_ID": "3"}
  assert distributed.resolve(environ=env) == distributed.Settings("10.0.0.1:8476", 4, 3)
  assert distributed.resolve("h:1", 2, 0, environ=env) == distributed.Settings("h:1", 2, 0)
  assert not distributed.resolve(environ={}).multi
  assert distributed.resolve(environ={"SLURM_NTASKS": "8"}).coordinator == distributed.AUTO
  assert not distributed.resolve(environ={"SLURM_NTASKS": "1"}).multi
  with pytest.raises(distributed.DistributedError, match="needs --process-id"):
    distributed.resolve("h:1", 2, environ={})
  with pytest.raises(distributed.DistributedError, match="without a coordinator"):
    distributed.resolve(num_processes=2, environ={})
  with pytest.raises(distributed.DistributedError, match="smaller than num_processes"):
    distributed.resolve("h:1", 2, 2, environ={})
  with pytest.raises(distributed.DistributedError, match="HOST:PORT"):
    distributed.resolve("h", 2, 0, environ={})


def test_launch_prefixes_output_and_stops_the_others_when_one_fails():
  code = (
      "import os, sys, time\n"
      "i = int(os.environ['MESHDISTILL_PROCESS_ID'])\n"
      "print('process', i, 'of', os.environ['MESHDISTILL_NUM_PROCESSES'], flush=True)\n"
      "time.sleep(0.5 if i == 1 else 120)\n"
      "sys.exit(7 if i == 1 else 0)\n"
  )
  out = io.StringIO()
  t0 = time.monotonic()
  assert distributed.launch(2, [sys.executable, "-c", code], out=out, grace_s=5) == 7
  assert time.monotonic() - t0 < 60  # process 0 (sleeping 120 s) was stopped
  text = out.getvalue()
  assert "[p0] process 0 of 2" in text and "[p1] process 1 of 2" in text
  assert "process 1 exited with code 7" in text and "rerun" not in text  # a process that exits gives its own advice
  # A process a native library aborts (gloo does so from its own thread when a peer vanishes mid-collective)
  # prints no advice: the launcher names the signal and says how to go on.
  out = io.StringIO()
  aborts = "import os, time\nif os.environ['MESHDISTILL_PROCESS_ID'] == '1': os.abort()\ntime.sleep(120)\n"
  assert distributed.launch(2, [sys.executable, "-c", aborts], out=out, grace_s=5) == 128 + signal.SIGABRT
  text = out.getvalue()
  assert "process 1 was stopped by SIGABRT" in text and "rerun the same command to resume" in text, text
  assert distributed.launch(2, [sys.executable, "-c", "print('ok')"], out=io.StringIO()) == 0
