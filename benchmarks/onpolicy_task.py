"""On-policy distillation on tasks with checkable answers: held-out accuracy vs steps and vs compute, fair arms.

Tasks (`meshdistill.data.tasks`, byte tokenizer): ``add5`` (5-digit addition, every number least significant digit
first) and ``chain12`` (running sums of 12 digits: every answer digit is the previous one plus a prompt digit, so one
wrong early digit ruins the rest). Per task a teacher is trained (next-token CE) and saved; per seed a smaller
student is trained by SFT on the data until its held-out greedy accuracy first reaches ``--warm-band`` (e.g. 30-60%):
that state (parameters and data position) is SAVED ONCE and LOADED by every arm, so every arm of a seed starts from
the same student, at the same point of the same data order, with fresh Adam.

Arms (each an `OnPolicyDistiller` on the same batches of ``--batch`` prompts):

* ``offpolicy``  off-policy KD: forward KL to the teacher on the data's answers (lambda 0);
* ``gkd``        GKD with its published defaults: generalized JSD beta 0.5 (TRL's convention and default), lambda 0.5
                 (TRL's default), student samples at temperature 1 (the GKD paper's);
* ``gkd_rkl``    GKD lambda 1 with reverse KL (every batch the student's own samples, the full-distribution form);
* ``sampled``    the sampled-token form (`meshdistill.strategies.SampledTokenKD`, discount 0: each token's advantage
                 its own ``log p_teacher - log p_student``, the teacher's exact log-probability over its whole
                 vocabulary, samples from the current parameters: no importance weights, no reference penalty).

Learning rate: every arm's is chosen from ``--lrs`` on the first seed (the one with the best mean accuracy over the
curve's evaluations after step 0); the other seeds run at that rate. Compute: FLOPs per step counted from the models'
matmul parameters (``2 N`` per token forward, ``6 N`` forward and backward; attention's ``T x T`` terms left out,
rows of at most 18 tokens): student forward + backward and teacher forward on every row position of the step, plus,
for a generated batch, the student's prompt pass and one decode step per new token for every row.

  nice -n 10 python benchmarks/onpolicy_task.py --task add5                  # results/on_policy_task_add5.json
  nice -n 10 python benchmarks/onpolicy_task.py --task chain12 --student 16,1 --teacher-steps 1500
  python benchmarks/onpolicy_task.py --render benchmarks/results/on_policy_task_add5.json \\
      benchmarks/results/on_policy_task_chain12.json   # writes results/on_policy_task.{md,png}

The chip's run (larger models in a few minutes): ``--arm-lrs cpu`` (each arm at the rate the CPU run's sweep chose)
or ``--arm-lrs arm=lr,...`` runs the arms in LOCKSTEP -- step k of every arm and seed before step k + 1, so every arm
has the same steps, batches and samples whenever the run stops -- and ``--budget`` (seconds for the arms) /
``--deadline`` (seconds for the whole command, compiles, teacher and warm starts included) stop them cleanly, the
results saying the steps reached. ``--require-backend tpu`` refuses (exit 2) anywhere JAX's backend is not the TPU, so
CPU numbers are never written as the chip's. ``--render`` puts such runs in the section "On the chip, larger student",
their ranking beside the CPU run's of the same task:

  python benchmarks/onpolicy_task.py --require-backend tpu --task add5 --teacher 512,4 --student 256,4 --batch 256 \\
      --teacher-lr 1e-3 --teacher-steps 1500 --teacher-target 0.98 --teacher-check 100 --warm-lr 1e-3 \\
      --warm-check 5 --warm-max 600 --arm-lrs offpolicy=3e-4,gkd=3e-4,gkd_rkl=3e-4,sampled=3e-4 --arm-warmup 10 \\
      --steps 200 --eval-every 25 --budget 150 --deadline 235 --out 'benchmarks/results/on_policy_task_chip_{task}.json'
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import sys
import time


def _required_backend(argv: list[str]) -> str | None:
  """``--require-backend``'s value in ``argv`` (the last one given; read before JAX starts), None without one."""
  found = None
  for i, x in enumerate(argv):
    if x == "--require-backend" and i + 1 < len(argv):
      found = argv[i + 1]
    elif x.startswith("--require-backend="):
      found = x.split("=", 1)[1]
  return found


if _required_backend(sys.argv) in (None, "cpu"):  # a run that requires an accelerator leaves the platform to JAX
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshdistill as md  # noqa: E402
from meshdistill.data import ByteTokenizer  # noqa: E402
from meshdistill.data.prompts import PromptData  # noqa: E402
from meshdistill.data.tasks import parse_task  # noqa: E402
from meshdistill.strategies import HardLabelCE, LogitKD, SampledTokenKD  # noqa: E402
from meshdistill.train.hardlabel import HardLabelTrainer  # noqa: E402
from meshdistill.train.loop.task_eval import complete, task_accuracy  # noqa: E402
from meshdistill.train.onpolicy import OnPolicyConfig, OnPolicyDistiller  # noqa: E402
from meshdistill.train.optimizers import default_optimizer  # noqa: E402

from bench.render_onpolicy_task import render, summary_lines  # noqa: E402
from bench.results import libtpu_version  # noqa: E402

RESULTS = os.path.join(HERE, "results")
REPO = os.path.dirname(HERE)
DEFAULT_BATCH = 64
_LOG = []  # --log: the file progress lines are also appended to
_now = time.time  # the clock --budget is read on (a test hands in its own)


def say(line: str) -> None:
  """A progress line: printed, and appended to ``--log`` when given."""
  print(line, flush=True)
  for path in _LOG:
    with open(path, "a") as f:
      f.write(line + "\n")


def refuse(message: str):
  """Stop the command before it runs anything: ``message`` on stderr, exit status 2."""
  print(f"onpolicy_task.py: {message}", file=sys.stderr, flush=True)
  raise SystemExit(2)


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--task", default="add5", help="a task, or several separated by commas (then --out holds {task})")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--train-problems", type=int, default=20000)
  p.add_argument("--eval-prompts", type=int, default=256)
  p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="prompts (rows) a step, every model")
  p.add_argument("--teacher", default="64,2", help="d_model,n_layers of the teacher")
  p.add_argument("--student", default="32,1", help="d_model,n_layers of the student")
  p.add_argument("--teacher-steps", type=int, default=1000, help="the teacher's training steps (at most, with "
                                                                  "--teacher-target)")
  p.add_argument("--teacher-target", type=float, default=None,
                 help="stop the teacher's training at the first check (every --teacher-check steps) at or above this "
                      "held-out greedy accuracy (default: train exactly --teacher-steps steps)")
  p.add_argument("--teacher-check", type=int, default=100, help="teacher steps between checks of its accuracy (with "
                                                                "--teacher-target) or of the clock (with --deadline)")
  p.add_argument("--teacher-lr", type=float, default=3e-3)
  p.add_argument("--warm-lr", type=float, default=3e-3)
  p.add_argument("--warm-band", default="0.3,0.6", help="held-out accuracy a warm start stops in (the first check at "
                                                           "or above the lower end)")
  p.add_argument("--warm-check", type=int, default=5, help="SFT steps between the warm start's accuracy checks")
  p.add_argument("--warm-max", type=int, default=1500, help="SFT steps at most for a warm start")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="learning rates swept on the first seed, per arm")
  p.add_argument("--arm-lrs", default="sweep",
                 help="sweep: each arm's rate the best of --lrs on the first seed (one arm after the other); cpu: each "
                      "arm's rate chosen by the CPU run's sweep (--cpu-results); or arm=lr,... for every arm. Other "
                      "than sweep the arms run in lockstep: step k of every arm and seed before step k + 1")
  p.add_argument("--arm-warmup", type=int, default=0,
                 help="steps over which each arm's learning rate rises linearly to its value (step k of the first N at "
                      "k/N of it); 0 (default, the CPU runs): the full rate from the first step. Fresh Adam's first "
                      "step moves every weight by about the learning rate, whatever its gradient's size")
  p.add_argument("--cpu-results", default=None, help="the CPU run whose chosen rates --arm-lrs cpu takes (default "
                                                     "results/on_policy_task_{task}.json)")
  p.add_argument("--budget", type=float, default=None,
                 help="wall-clock seconds for each task's arms (in lockstep): they stop after the step at which it is "
                      "spent, every arm at the same step, and the results say the steps reached")
  p.add_argument("--deadline", type=float, default=None,
                 help="wall-clock seconds for the whole command, compiles, teachers and warm starts included, shared "
                      "evenly over the tasks left; in a task's share the teacher stops training at 30%%, the warm "
                      "starts at 55%%, the arms in time for their final evaluation (needs lockstep arms)")
  p.add_argument("--require-backend", default=None, metavar="BACKEND",
                 help="refuse to run (exit 2) unless JAX's default backend is BACKEND (tpu: numbers from anything "
                      "else are never written as the chip's)")
  p.add_argument("--log", default=None, help="also append the progress lines to this file")
  p.add_argument("--eval-every", type=int, default=25)
  p.add_argument("--arms", default="offpolicy,gkd,gkd_rkl,sampled")
  p.add_argument("--state-dir", default=None, help="where the teacher and warm starts are saved ({task}: the task's "
                                                   "name; default /tmp/meshdistill_onpolicy_task/{task})")
  p.add_argument("--out", default=None, help="raw results (.json; default results/on_policy_task_{task}.json; {task} "
                                             "is each task's name)")
  p.add_argument("--gradient-check", action="store_true",
                 help="train nothing: at the saved warm starts, the cosine between the sampled-token gradient and the "
                      "reverse-KL GKD gradient on the same samples (and each against itself on other samples); added "
                      "to --out")
  p.add_argument("--render", nargs="+", default=None, metavar="JSON",
                 help="train nothing: write results/on_policy_task.{md,png} from these raw results (one per task; "
                      "those of lockstep runs make the section 'On the chip, larger student')")
  p.add_argument("--render-dir", default=RESULTS, help="where --render writes (default benchmarks/results)")
  return p.parse_args(argv)


def _model_cfg(spec: str, vocab: int, seq: int) -> md.ModelConfig:
  d, layers = (int(x) for x in spec.split(","))
  return md.ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=4, n_kv_heads=4, mlp_hidden=4 * d,
                        max_len=seq)


def arms(new_tokens: int, eos: int, pad: int) -> dict:
  """key -> (label, strategy, OnPolicyConfig)."""
  def on(lmbda):
    return OnPolicyConfig(lmbda=lmbda, max_new_tokens=new_tokens, temperature=1.0, eos_id=eos, pad_id=pad)

  return {
      "offpolicy": ("off-policy KD (forward KL, lambda 0)", LogitKD(temperature=1.0, alpha=1.0), on(0.0)),
      "gkd": ("GKD (JSD beta 0.5, lambda 0.5)", LogitKD(temperature=1.0, alpha=1.0, divergence="jsd", beta=0.5),
              on(0.5)),
      "gkd_rkl": ("GKD (reverse KL, lambda 1)", LogitKD(temperature=1.0, alpha=1.0, divergence="reverse_kl"), on(1.0)),
      "sampled": ("sampled-token (discount 0, lambda 1)", SampledTokenKD(), on(1.0)),
      "sft": ("SFT on the data", HardLabelCE(), on(0.0)),
  }


def warmed_up(lr: float, steps: int):
  """``lr`` (a constant rate, ``steps`` 0) or the schedule rising linearly to it: optimizer step ``c`` (0-based) at
  ``lr * min(1, (c + 1) / steps)``, so the first step is ``lr / steps`` and step ``steps`` the full rate."""
  if steps < 0:
    refuse(f"--arm-warmup {steps}: give 0 (no warm-up) or a number of steps")
  if steps == 0:
    return lr
  return lambda count: lr * jnp.minimum(1.0, (count + 1) / steps)


def matmul_params(model) -> int:
  """Parameters that are matmul weights (2-D: projections, and the tied embedding as the LM head)."""
  return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if x.ndim == 2))


def _save(path, obj):
  with open(path + ".tmp", "wb") as f:
    pickle.dump(obj, f)
  os.replace(path + ".tmp", path)


def _load(path):
  with open(path, "rb") as f:
    return pickle.load(f)


def _suffix(a) -> str:
  """What a saved teacher's or warm start's file name adds for settings other than the CPU run's (its files keep
  their names)."""
  return ("" if a.batch == DEFAULT_BATCH else f"_b{a.batch}") + (
      "" if a.teacher_target is None else f"_to{a.teacher_target}_{a.teacher_check}")


def chosen_lrs(a, task_name: str, keys: list[str]) -> dict:
  """``--arm-lrs`` other than sweep: ``{"mode", "source", "lrs": {arm: rate}}``."""
  if a.arm_lrs == "cpu":
    path = (a.cpu_results or os.path.join(RESULTS, "on_policy_task_{task}.json")).replace("{task}", task_name)
    if not os.path.exists(path):
      refuse(f"--arm-lrs cpu reads the CPU run's chosen rates from {path}, which does not exist; give --cpu-results "
             "or the rates themselves (--arm-lrs offpolicy=3e-3,gkd=3e-3,...)")
    with open(path) as f:
      cpu = json.load(f)["results"]
    missing = [k for k in keys if k not in cpu]
    if missing:
      refuse(f"--arm-lrs cpu: {path} has no rate for {','.join(missing)} (it holds {','.join(cpu)})")
    return {"mode": "cpu", "source": _shown(path), "lrs": {k: float(cpu[k]["lr"]) for k in keys}}
  try:
    given = {k: float(v) for k, v in (x.split("=") for x in a.arm_lrs.split(","))}
  except ValueError:
    refuse(f"--arm-lrs {a.arm_lrs}: expected sweep, cpu or arm=lr,... (e.g. offpolicy=3e-3,gkd=3e-3)")
  if sorted(given) != sorted(keys):
    refuse(f"--arm-lrs {a.arm_lrs} names {','.join(sorted(given))}; give one rate for each arm of --arms: "
           f"{','.join(keys)}")
  return {"mode": "fixed", "source": None, "lrs": given}


def _shown(path: str) -> str:
  """``path`` relative to the repository when inside it (as the report shows it)."""
  full = os.path.abspath(path)
  return os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else path


def run(a, argv, task_name: str | None = None, share_end: float = math.inf) -> dict:
  """One task's benchmark (``task_name``, default ``--task``); ``share_end``: the wall-clock time (``time.time()``)
  by which this task's part of ``--deadline`` ends (its phases' limits are shares of the time until then)."""
  a = argparse.Namespace(**dict(vars(a), task=task_name or a.task))
  task, tok = parse_task(a.task), ByteTokenizer()
  seq = task.prompt_len + task.answer_width  # prompt + answer + EOS = seq + 1 tokens a row
  held = task.rows("held_out", a.eval_prompts, seed=0)
  prompts = [r["prompt"] for r in held]
  t_cfg, s_cfg = _model_cfg(a.teacher, tok.vocab_size, seq), _model_cfg(a.student, tok.vocab_size, seq)
  seeds = [int(s) for s in a.seeds.split(",")]
  lrs = [float(x) for x in a.lrs.split(",")]
  lo, hi = (float(x) for x in a.warm_band.split(","))
  state_dir = (a.state_dir or "/tmp/meshdistill_onpolicy_task/{task}").replace("{task}", a.task)
  os.makedirs(state_dir, exist_ok=True)
  t0 = time.time()
  span = share_end - t0  # inf without a deadline
  timing = {"eval": 0.0}  # seconds of the latest accuracy evaluation

  def data_for(seed):
    return PromptData(task.rows("train", a.train_problems, seed=0), tok, seq_len=seq, batch_size=a.batch, seed=seed,
                      val_rows=held)

  def acc(graphdef, params):
    start = time.time()
    out = task_accuracy((graphdef, params), task, prompts, tok)["greedy"]
    timing["eval"] = time.time() - start
    return out

  answers = [r["completion"] for r in held]

  def off_path(graphdef, params, seed):
    """The share of a student's sampled completion tokens (temperature 1, the held-out prompts) that come after its
    first wrong token: tokens an on-policy batch trains on whose prefix no exact-match answer can follow."""
    n_new = task.answer_width + 1
    texts = complete((graphdef, params), prompts, tok, max_new_tokens=n_new, temperature=1.0, seed=seed)
    after = total = 0
    for text, answer in zip(texts, answers):
      gen = text + "\0" if len(text) < n_new else text  # "\0": the EOS it stopped at
      want = answer + "\0"
      first = next((i for i, (x, y) in enumerate(zip(gen, want)) if x != y), min(len(gen), len(want)))
      total += len(gen)
      after += max(0, len(gen) - first - 1)
    return after / total

  # the teacher: trained once, saved, loaded by every later run
  teacher_path = os.path.join(state_dir, f"teacher_{a.teacher}_{a.teacher_steps}{_suffix(a)}.pkl")
  teacher = md.init_model(t_cfg, seed=100)
  t_def = nnx.split(teacher)[0]
  if os.path.exists(teacher_path):
    saved = _load(teacher_path)
    teacher = nnx.merge(t_def, saved["params"])
    teacher_acc = saved["acc"]
    t_steps, t_stopped = saved.get("steps", a.teacher_steps), saved.get("stopped_by", "steps")
  else:
    tt = HardLabelTrainer(teacher, optimizer=default_optimizer(a.teacher_lr))
    state, it = tt.init_state(), data_for(100).train_iterator()
    # in chunks only where something is checked between them: the CPU run trains its teacher in one stretch
    chunk = a.teacher_steps if a.teacher_target is None and math.isinf(span) else a.teacher_check
    t_steps, t_stopped, teacher_acc = 0, "steps", None
    while t_steps < a.teacher_steps:
      for _ in range(min(chunk, a.teacher_steps - t_steps)):
        state, m = tt.step(state, next(it))
      t_steps, teacher_acc = min(t_steps + chunk, a.teacher_steps), None
      if a.teacher_target is not None:
        teacher_acc = acc(*nnx.split(tt.student(state)))
        if teacher_acc >= a.teacher_target:
          t_stopped = "target"
          break
      jax.block_until_ready(m)
      if t_steps < a.teacher_steps and time.time() > t0 + 0.3 * span:
        t_stopped = "time"
        break
    teacher = tt.student(state)
    if teacher_acc is None:
      teacher_acc = acc(*nnx.split(teacher))
    if t_stopped != "time":  # a teacher cut short by the clock is not the one these settings name
      _save(teacher_path, {"params": jax.device_get(nnx.split(teacher)[1]), "acc": teacher_acc, "steps": t_steps,
                           "stopped_by": t_stopped})
  t_teacher = time.time()
  say(f"{a.task}: teacher {a.teacher}: {t_steps} steps ({t_stopped}), held-out greedy {teacher_acc:.3f} "
      f"({t_teacher - t0:.0f}s)")

  # per seed: the warm start, saved once
  warm_def = nnx.split(md.init_model(s_cfg, seed=0))[0]
  warm = {}
  sft = None  # one trainer for every seed's warm start: its step and fresh state compile once
  for i, seed in enumerate(seeds):
    path = os.path.join(state_dir, f"warm_{a.student}_seed{seed}_{a.warm_band}_{a.warm_lr}_{a.warm_check}"
                                   f"{_suffix(a)}.pkl")
    seed_end = time.time() + (t0 + 0.55 * span - time.time()) / (len(seeds) - i)  # the warm starts' time, shared out
    if not os.path.exists(path):
      sft = sft or HardLabelTrainer(md.init_model(s_cfg, seed=0), optimizer=default_optimizer(a.warm_lr))
      data = data_for(seed)
      state, it, steps, w_acc, by_clock = sft.init_state(md.init_model(s_cfg, seed=seed)), data.train_iterator(), 0, \
          0.0, False
      while steps < a.warm_max:
        for _ in range(a.warm_check):
          state, _ = sft.step(state, next(it))
        steps += a.warm_check
        w_acc = acc(sft.student_def, jax.device_get(state.params["student"]))
        if w_acc >= lo:
          break
        if time.time() > seed_end:
          by_clock = True
          break
      got = {"params": jax.device_get(state.params["student"]), "position": it.get_state(), "acc": w_acc,
             "steps": steps}
      if not by_clock:  # one cut short by the clock is not the one these settings name
        _save(path, got)
      warm[seed] = dict(got, stopped_by="time" if by_clock else "band")
    else:
      warm[seed] = _load(path)
    warm[seed]["off_path"] = off_path(warm_def, warm[seed]["params"], seed)
    note = "" if lo <= warm[seed]["acc"] <= hi else f" (outside the band {a.warm_band})"
    say(f"  seed {seed}: warm start {warm[seed]['steps']} SFT steps, held-out greedy {warm[seed]['acc']:.3f}{note} "
        f"; {warm[seed]['off_path']:.3f} of its sampled tokens follow its first wrong one -> {path}")
  t_warm = time.time()

  if a.gradient_check:
    return {"gradient_check": gradient_check(s_cfg, teacher, warm_def, warm, data_for, table_of=arms(
        task.answer_width + 1, tok.eos_id, tok.pad_id))}

  n_s, n_t = matmul_params(md.init_model(s_cfg, seed=0)), matmul_params(teacher)
  train_flops = (6 * n_s + 2 * n_t) * a.batch * seq
  sample_flops = 2 * n_s * a.batch * (task.prompt_len + task.answer_width + 1)  # prompt pass + one step per new token

  table = arms(task.answer_width + 1, tok.eos_id, tok.pad_id)
  keys = a.arms.split(",")
  common = {"command": "python benchmarks/onpolicy_task.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "args": vars(a), "teacher_acc": teacher_acc, "seeds": seeds,
            "labels": {k: table[k][0] for k in keys}, "params": {"student_matmul": n_s, "teacher_matmul": n_t},
            "flops_per_step": {"train": train_flops, "sample": sample_flops}, **machine()}

  distillers = {}  # (arm, lr) -> its distiller: the seeds of an arm at a rate share its compiled step

  def distiller(k, lr):
    if (k, lr) not in distillers:
      _, strategy, on_policy = table[k]
      optimizer = default_optimizer(warmed_up(lr, a.arm_warmup))
      distillers[k, lr] = OnPolicyDistiller(md.init_model(s_cfg, seed=0), teacher, strategy=strategy,
                                            on_policy=on_policy, optimizer=optimizer, seed=seeds[0])
    return distillers[k, lr]

  if a.arm_lrs != "sweep":
    choice = chosen_lrs(a, a.task, keys)
    # the arms stop in time for their final evaluation: an accuracy and an off-path share per arm and seed
    reserve = 2 * timing["eval"] * len(keys) * len(seeds) + 1.0
    budget_end = math.inf if a.budget is None else _now() + a.budget
    stop_at = min(budget_end, share_end - reserve)
    results, lock, seconds = lockstep({k: distiller(k, choice["lrs"][k]) for k in keys}, seeds, warm, warm_def,
                                      data_for, a, stop_at, acc, off_path, train_flops, sample_flops)
    lock.update(stopped_by=lock["stopped_by"] if lock["stopped_by"] == "steps" else (
        "budget" if budget_end <= share_end - reserve else "deadline"), budget_s=a.budget, deadline_s=a.deadline)
    for k in keys:
      results[k]["lr"] = choice["lrs"][k]
      say(f"  {table[k][0]:40s} lr {choice['lrs'][k]:g}: final "
          + ", ".join(f"{c[-1][1]:.3f}" for c in results[k]["curves"]))
    return {**common, "warm": {str(s): {k: warm[s][k] for k in ("acc", "steps", "off_path")} for s in seeds},
            "results": results, "lockstep": lock, "lr_choice": choice,
            "teacher": {"steps": t_steps, "stopped_by": t_stopped},
            "phase_seconds": {"teacher": t_teacher - t0, "warm": t_warm - t_teacher, **seconds},
            "total_seconds": time.time() - t0}
  results = {k: {"sweep": {}, "curves": [], "flops": [], "seconds": 0.0, "lr": None, "off_path": [], "losses": []}
             for k in keys}
  curve_off_path = []

  def run_arm(k, lr, seed, d):
    label, _, _ = table[k]
    d.seed = seed
    start = time.time()
    state = d.init_state(nnx.merge(warm_def, warm[seed]["params"]))
    it = data_for(seed).train_iterator(dict(warm[seed]["position"]))
    curve, flops, spent, losses = [(0, warm[seed]["acc"])], [0.0], 0.0, []
    for step in range(1, a.steps + 1):
      state, m = d.step(state, next(it))
      spent += train_flops + (sample_flops if float(m["on_policy"]) else 0.0)
      losses.append(float(m["loss"]))
      if step % a.eval_every == 0 or step == a.steps:
        curve.append((step, acc(d.student_def, jax.device_get(state.params["student"]))))
        flops.append(spent)
    seconds = time.time() - start
    curve_off_path.append(off_path(d.student_def, jax.device_get(state.params["student"]), seed))
    say(f"  {label:40s} lr {lr:g} seed {seed}: " + " ".join(f"{s}:{v:.3f}" for s, v in curve)
        + f"  off-path {curve_off_path[-1]:.3f} ({seconds:.0f}s)")
    return curve, flops, seconds, curve_off_path[-1], losses

  first = seeds[0]
  for k in keys:  # the sweep on the first seed
    best = None
    for lr in lrs:
      curve, flops, seconds, off, losses = run_arm(k, lr, first, distiller(k, lr))
      score = float(np.mean([v for _, v in curve[1:]]))
      results[k]["sweep"][str(lr)] = {"curve": curve, "flops": flops, "seconds": seconds, "score": score,
                                      "off_path": off, "losses": losses}
      if best is None or score > best[0]:
        best = (score, lr)
    results[k]["lr"] = best[1]
  for k in keys:  # the other seeds at each arm's best rate
    lr = results[k]["lr"]
    chosen = results[k]["sweep"][str(lr)]
    results[k]["curves"].append(chosen["curve"])
    results[k]["flops"].append(chosen["flops"])
    results[k]["seconds"] += chosen["seconds"]
    results[k]["off_path"].append(chosen["off_path"])
    results[k]["losses"].append(chosen["losses"])
    d = distiller(k, lr)
    for seed in seeds[1:]:
      curve, flops, seconds, off, losses = run_arm(k, lr, seed, d)
      results[k]["curves"].append(curve)
      results[k]["flops"].append(flops)
      results[k]["seconds"] += seconds
      results[k]["off_path"].append(off)
      results[k]["losses"].append(losses)

  return {**common, "warm": {str(s): {k: warm[s][k] for k in ("acc", "steps", "off_path")} for s in seeds},
          "results": results, "total_seconds": time.time() - t0}


def machine() -> dict:
  """Where the numbers were measured: JAX's backend, its first device's kind, jax's version (and libtpu's on a
  TPU)."""
  backend, kind = jax.default_backend(), jax.devices()[0].device_kind
  where = f"{os.cpu_count()} CPU cores" if backend == "cpu" else f"{jax.device_count()} x {kind}"
  out = {"machine": f"{where}, jax {jax.__version__}", "backend": backend, "device_kind": kind, "jax": jax.__version__}
  if backend == "tpu":
    out["libtpu"] = libtpu_version()
    out["machine"] += f", libtpu {out['libtpu']}"
  return out


def lockstep(distillers, seeds, warm, warm_def, data_for, a, stop_at, acc, off_path, train_flops, sample_flops):
  """Every arm (``distillers``: arm -> its `OnPolicyDistiller`) on every seed from the seed's saved warm start, in
  lockstep: step k of every (arm, seed) before step k + 1, until ``--steps`` or until ``stop_at`` (``time.time()``)
  has passed at the end of a step: every arm then has the same steps, batches and samples. Evaluated every
  ``--eval-every`` steps and at the last step. ``(results per arm, the lockstep record, phase seconds)``."""
  runs = []
  for k, d in distillers.items():
    for seed in seeds:
      runs.append({"arm": k, "seed": seed, "d": d, "state": d.init_state(nnx.merge(warm_def, warm[seed]["params"])),
                   "it": data_for(seed).train_iterator(dict(warm[seed]["position"])),
                   "curve": [(0, warm[seed]["acc"])], "flops": [0.0], "spent": 0.0, "seconds": 0.0, "losses": []})
  start, step, stopped = time.time(), 0, "steps"
  while step < a.steps:
    if _now() >= stop_at:
      stopped = "clock"
      break
    step += 1
    for r in runs:
      t = time.time()
      r["d"].seed = r["seed"]  # the sampling keys of this seed (the distiller is shared by an arm's seeds)
      r["state"], m = r["d"].step(r["state"], next(r["it"]))
      r["spent"] += train_flops + (sample_flops if float(m["on_policy"]) else 0.0)
      r["losses"].append(float(m["loss"]))
      if step % a.eval_every == 0:
        r["curve"].append((step, acc(r["d"].student_def, jax.device_get(r["state"].params["student"]))))
        r["flops"].append(r["spent"])
      r["seconds"] += time.time() - t
    if step % a.eval_every == 0:
      say(f"  step {step}: " + ", ".join(f"{r['arm']}/{r['seed']} {r['curve'][-1][1]:.3f}" for r in runs)
          + f" ({time.time() - start:.0f}s)")
  arms_done = time.time()
  results = {k: {"sweep": {}, "curves": [], "flops": [], "seconds": 0.0, "lr": None, "off_path": [], "losses": []}
             for k in distillers}
  for r in runs:
    params = jax.device_get(r["state"].params["student"])
    if r["curve"][-1][0] != step:
      r["curve"].append((step, acc(r["d"].student_def, params)))
      r["flops"].append(r["spent"])
    res = results[r["arm"]]
    res["curves"].append(r["curve"])
    res["flops"].append(r["flops"])
    res["seconds"] += r["seconds"]
    res["off_path"].append(off_path(r["d"].student_def, params, r["seed"]))
    res["losses"].append(r["losses"])
  say(f"  lockstep: {step} steps of at most {a.steps} ({stopped}), {arms_done - start:.0f}s")
  lock = {"steps_reached": step, "max_steps": a.steps, "stopped_by": stopped, "runs": len(runs)}
  return results, lock, {"arms": arms_done - start, "final_eval": time.time() - arms_done}


def gradient_check(s_cfg, teacher, warm_def, warm, data_for, table_of, batches: int = 4) -> dict:
  """Per seed, at its warm start: over ``batches`` batches of the student's samples, the cosine between the gradient
  of the sampled-token loss and the gradient of reverse-KL GKD on the SAME samples (the latter is the exact
  expectation over each position's next token of the former: `tests/test_onpolicy_identities.py`), and, as the
  sampling noise of each, the cosine between two gradients of the same loss on two sample sets of the same prompts."""
  import optax  # pylint: disable=g-import-not-at-top

  from meshdistill.train.distiller import Distiller  # pylint: disable=g-import-not-at-top

  def grad_of(d, params, batch):  # plain SGD at rate 1: the parameter change is minus the gradient
    state = d.init_state(nnx.merge(warm_def, params))
    new, _ = Distiller.step(d, state, batch)
    before = jax.tree.leaves(params)
    after = jax.tree.leaves(jax.device_get(new.params["student"]))
    return np.concatenate([(np.asarray(b) - np.asarray(x)).ravel() for b, x in zip(before, after)])

  def cos(x, y):
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))

  out = {}
  for seed, w in warm.items():
    ds = {}
    for k in ("sampled", "gkd_rkl"):
      _, strategy, on_policy = table_of[k]
      ds[k] = OnPolicyDistiller(md.init_model(s_cfg, seed=0), teacher, strategy=strategy, on_policy=on_policy,
                                optimizer=optax.sgd(1.0), seed=seed)
    it = data_for(seed).train_iterator(dict(w["position"]))
    rows = {"st_vs_rkl": [], "st_vs_st": [], "rkl_vs_rkl": []}
    for b in range(batches):
      prompts = ds["sampled"].as_prompt_batch(next(it))
      state = ds["sampled"].init_state(nnx.merge(warm_def, w["params"]))
      one, two = (ds["sampled"].sample_batch(state, prompts, step) for step in (b, 1000 + b))
      st1, st2 = grad_of(ds["sampled"], w["params"], one), grad_of(ds["sampled"], w["params"], two)
      rkl1, rkl2 = grad_of(ds["gkd_rkl"], w["params"], one), grad_of(ds["gkd_rkl"], w["params"], two)
      rows["st_vs_rkl"] += [cos(st1, rkl1), cos(st2, rkl2)]
      rows["st_vs_st"].append(cos(st1, st2))
      rows["rkl_vs_rkl"].append(cos(rkl1, rkl2))
    out[str(seed)] = {k: float(np.mean(v)) for k, v in rows.items()}
    say(f"  seed {seed}: cosine sampled-token vs reverse-KL gradient on the same samples "
        f"{out[str(seed)]['st_vs_rkl']:.3f}; across two sample sets: sampled-token {out[str(seed)]['st_vs_st']:.3f}, "
        f"reverse KL {out[str(seed)]['rkl_vs_rkl']:.3f}")
  return out


def main(argv=None):
  a = _args(argv)
  _LOG[:] = [a.log] if a.log else []
  if a.render:
    raws = []
    for path in a.render:
      with open(path) as f:
        raws.append(json.load(f))
    out = os.path.join(a.render_dir, "on_policy_task.md")
    render(raws, out, os.path.join(a.render_dir, "on_policy_task.png"), paths=[_shown(p) for p in a.render])
    print(f"wrote {out}")
    return
  if a.require_backend and jax.default_backend() != a.require_backend:
    refuse(f"--require-backend {a.require_backend}: JAX's default backend is {jax.default_backend()} "
           f"({jax.devices()[0].device_kind}); nothing was run. On the chip's machine leave JAX_PLATFORMS unset "
           f"(or set it to {a.require_backend}).")
  tasks = a.task.split(",")
  if len(tasks) > 1 and "{task}" not in (a.out or "{task}"):
    refuse(f"--task {a.task} runs {len(tasks)} tasks: --out {a.out} must hold {{task}} (one file per task)")
  if len(tasks) > 1 and "{task}" not in (a.state_dir or "{task}"):
    refuse(f"--task {a.task} runs {len(tasks)} tasks: --state-dir {a.state_dir} must hold {{task}} (each task's "
           "teacher and warm starts apart)")
  if a.arm_lrs == "sweep" and (a.budget is not None or a.deadline is not None):
    refuse("--budget and --deadline stop arms that run in lockstep at one rate each: add --arm-lrs cpu (the CPU "
           "sweep's choices) or --arm-lrs offpolicy=3e-3,gkd=3e-3,... (a sweep does not fit a budget)")
  if a.arm_lrs != "sweep":
    for name in tasks:  # checked before anything trains
      chosen_lrs(a, name, a.arms.split(","))
  start = time.time()
  for i, name in enumerate(tasks):
    share_end = math.inf if a.deadline is None else time.time() + (start + a.deadline - time.time()) / (len(tasks) - i)
    raw = run(a, argv, name, share_end)
    out = (a.out or os.path.join(RESULTS, "on_policy_task_{task}.json")).replace("{task}", name)
    if a.gradient_check:  # added to the results of the same task and warm starts
      with open(out) as f:
        full = json.load(f)
      full["gradient_check"] = raw["gradient_check"]
      full["gradient_check_command"] = "python benchmarks/onpolicy_task.py " + " ".join(
          argv if argv is not None else sys.argv[1:])
      with open(out, "w") as f:
        json.dump(full, f, indent=1)
      say(f"added the gradient check to {out}")
      continue
    if "lockstep" in raw:
      raw["out"] = _shown(out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump(raw, f, indent=1)
    for line in summary_lines(raw):
      say(line)
    say(f"wrote {out} ({raw['total_seconds'] / 60:.1f} min)")


if __name__ == "__main__":
  main()
