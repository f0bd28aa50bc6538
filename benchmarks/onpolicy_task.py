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
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
if HERE not in sys.path:  # imported rather than run (the tests): the benchmarks' package `bench`
  sys.path.append(HERE)

import jax  # noqa: E402
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

RESULTS = os.path.join(HERE, "results")


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--task", default="add5")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--train-problems", type=int, default=20000)
  p.add_argument("--eval-prompts", type=int, default=256)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--teacher", default="64,2", help="d_model,n_layers of the teacher")
  p.add_argument("--student", default="32,1", help="d_model,n_layers of the student")
  p.add_argument("--teacher-steps", type=int, default=1000)
  p.add_argument("--teacher-lr", type=float, default=3e-3)
  p.add_argument("--warm-lr", type=float, default=3e-3)
  p.add_argument("--warm-band", default="0.3,0.6", help="held-out accuracy a warm start stops in (the first check at "
                                                           "or above the lower end)")
  p.add_argument("--warm-check", type=int, default=5, help="SFT steps between the warm start's accuracy checks")
  p.add_argument("--warm-max", type=int, default=1500, help="SFT steps at most for a warm start")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="learning rates swept on the first seed, per arm")
  p.add_argument("--eval-every", type=int, default=25)
  p.add_argument("--arms", default="offpolicy,gkd,gkd_rkl,sampled")
  p.add_argument("--state-dir", default=None, help="where the teacher and warm starts are saved (default: "
                                                   "/tmp/meshdistill_onpolicy_task/<task>)")
  p.add_argument("--out", default=None, help="raw results (.json; default results/on_policy_task_<task>.json)")
  p.add_argument("--gradient-check", action="store_true",
                 help="train nothing: at the saved warm starts, the cosine between the sampled-token gradient and the "
                      "reverse-KL GKD gradient on the same samples (and each against itself on other samples); added "
                      "to --out")
  p.add_argument("--render", nargs="+", default=None, metavar="JSON",
                 help="train nothing: write results/on_policy_task.{md,png} from these raw results (one per task)")
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


def run(a, argv) -> dict:
  task, tok = parse_task(a.task), ByteTokenizer()
  seq = task.prompt_len + task.answer_width  # prompt + answer + EOS = seq + 1 tokens a row
  held = task.rows("held_out", a.eval_prompts, seed=0)
  prompts = [r["prompt"] for r in held]
  t_cfg, s_cfg = _model_cfg(a.teacher, tok.vocab_size, seq), _model_cfg(a.student, tok.vocab_size, seq)
  seeds = [int(s) for s in a.seeds.split(",")]
  lrs = [float(x) for x in a.lrs.split(",")]
  lo, hi = (float(x) for x in a.warm_band.split(","))
  state_dir = a.state_dir or os.path.join("/tmp/meshdistill_onpolicy_task", a.task)
  os.makedirs(state_dir, exist_ok=True)
  t0 = time.time()

  def data_for(seed):
    return PromptData(task.rows("train", a.train_problems, seed=0), tok, seq_len=seq, batch_size=a.batch, seed=seed,
                      val_rows=held)

  def acc(graphdef, params):
    return task_accuracy((graphdef, params), task, prompts, tok)["greedy"]

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
  teacher_path = os.path.join(state_dir, f"teacher_{a.teacher}_{a.teacher_steps}.pkl")
  teacher = md.init_model(t_cfg, seed=100)
  t_def = nnx.split(teacher)[0]
  if os.path.exists(teacher_path):
    saved = _load(teacher_path)
    teacher = nnx.merge(t_def, saved["params"])
    teacher_acc = saved["acc"]
  else:
    tt = HardLabelTrainer(teacher, optimizer=default_optimizer(a.teacher_lr))
    state, it = tt.init_state(), data_for(100).train_iterator()
    for _ in range(a.teacher_steps):
      state, _ = tt.step(state, next(it))
    teacher = tt.student(state)
    teacher_acc = acc(*nnx.split(teacher))
    _save(teacher_path, {"params": jax.device_get(nnx.split(teacher)[1]), "acc": teacher_acc})
  print(f"{a.task}: teacher {a.teacher}: held-out greedy {teacher_acc:.3f} ({time.time() - t0:.0f}s)", flush=True)

  # per seed: the warm start, saved once
  warm_def = nnx.split(md.init_model(s_cfg, seed=0))[0]
  warm = {}
  for seed in seeds:
    path = os.path.join(state_dir, f"warm_{a.student}_seed{seed}_{a.warm_band}_{a.warm_lr}_{a.warm_check}.pkl")
    if not os.path.exists(path):
      trainer = HardLabelTrainer(md.init_model(s_cfg, seed=seed), optimizer=default_optimizer(a.warm_lr))
      data = data_for(seed)
      state, it, steps, w_acc = trainer.init_state(), data.train_iterator(), 0, 0.0
      while steps < a.warm_max:
        for _ in range(a.warm_check):
          state, _ = trainer.step(state, next(it))
        steps += a.warm_check
        w_acc = acc(trainer.student_def, jax.device_get(state.params["student"]))
        if w_acc >= lo:
          break
      _save(path, {"params": jax.device_get(state.params["student"]), "position": it.get_state(), "acc": w_acc,
                   "steps": steps})
    warm[seed] = _load(path)
    warm[seed]["off_path"] = off_path(warm_def, warm[seed]["params"], seed)
    note = "" if lo <= warm[seed]["acc"] <= hi else f" (outside the band {a.warm_band})"
    print(f"  seed {seed}: warm start {warm[seed]['steps']} SFT steps, held-out greedy {warm[seed]['acc']:.3f}{note} "
          f"; {warm[seed]['off_path']:.3f} of its sampled tokens follow its first wrong one -> {path}", flush=True)

  if a.gradient_check:
    return {"gradient_check": gradient_check(s_cfg, teacher, warm_def, warm, data_for, table_of=arms(
        task.answer_width + 1, tok.eos_id, tok.pad_id))}

  n_s, n_t = matmul_params(md.init_model(s_cfg, seed=0)), matmul_params(teacher)
  train_flops = (6 * n_s + 2 * n_t) * a.batch * seq
  sample_flops = 2 * n_s * a.batch * (task.prompt_len + task.answer_width + 1)  # prompt pass + one step per new token

  table = arms(task.answer_width + 1, tok.eos_id, tok.pad_id)
  keys = a.arms.split(",")
  results = {k: {"sweep": {}, "curves": [], "flops": [], "seconds": 0.0, "lr": None, "off_path": []} for k in keys}
  curve_off_path = []

  def run_arm(k, lr, seed, d):
    label, _, _ = table[k]
    d.seed = seed
    start = time.time()
    state = d.init_state(nnx.merge(warm_def, warm[seed]["params"]))
    it = data_for(seed).train_iterator(dict(warm[seed]["position"]))
    curve, flops, spent = [(0, warm[seed]["acc"])], [0.0], 0.0
    for step in range(1, a.steps + 1):
      state, m = d.step(state, next(it))
      spent += train_flops + (sample_flops if float(m["on_policy"]) else 0.0)
      if step % a.eval_every == 0 or step == a.steps:
        curve.append((step, acc(d.student_def, jax.device_get(state.params["student"]))))
        flops.append(spent)
    seconds = time.time() - start
    curve_off_path.append(off_path(d.student_def, jax.device_get(state.params["student"]), seed))
    print(f"  {label:40s} lr {lr:g} seed {seed}: " + " ".join(f"{s}:{v:.3f}" for s, v in curve)
          + f"  off-path {curve_off_path[-1]:.3f} ({seconds:.0f}s)", flush=True)
    return curve, flops, seconds, curve_off_path[-1]

  def distiller(k, lr):
    _, strategy, on_policy = table[k]
    return OnPolicyDistiller(md.init_model(s_cfg, seed=0), teacher, strategy=strategy, on_policy=on_policy,
                             optimizer=default_optimizer(lr), seed=seeds[0])

  first = seeds[0]
  for k in keys:  # the sweep on the first seed
    best = None
    for lr in lrs:
      curve, flops, seconds, off = run_arm(k, lr, first, distiller(k, lr))
      score = float(np.mean([v for _, v in curve[1:]]))
      results[k]["sweep"][str(lr)] = {"curve": curve, "flops": flops, "seconds": seconds, "score": score,
                                      "off_path": off}
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
    d = distiller(k, lr)
    for seed in seeds[1:]:
      curve, flops, seconds, off = run_arm(k, lr, seed, d)
      results[k]["curves"].append(curve)
      results[k]["flops"].append(flops)
      results[k]["seconds"] += seconds
      results[k]["off_path"].append(off)

  return {"command": "python benchmarks/onpolicy_task.py " + " ".join(argv if argv is not None else sys.argv[1:]),
          "args": vars(a), "teacher_acc": teacher_acc, "seeds": seeds,
          "warm": {str(s): {k: warm[s][k] for k in ("acc", "steps", "off_path")} for s in seeds},
          "labels": {k: table[k][0] for k in keys}, "results": results,
          "params": {"student_matmul": n_s, "teacher_matmul": n_t},
          "flops_per_step": {"train": train_flops, "sample": sample_flops},
          "total_seconds": time.time() - t0, "machine": f"{os.cpu_count()} CPU cores, jax {jax.__version__}"}


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
    print(f"  seed {seed}: cosine sampled-token vs reverse-KL gradient on the same samples "
          f"{out[str(seed)]['st_vs_rkl']:.3f}; across two sample sets: sampled-token {out[str(seed)]['st_vs_st']:.3f}, "
          f"reverse KL {out[str(seed)]['rkl_vs_rkl']:.3f}", flush=True)
  return out


def main(argv=None):
  a = _args(argv)
  if a.render:
    raws = []
    for path in a.render:
      with open(path) as f:
        raws.append(json.load(f))
    out = os.path.join(RESULTS, "on_policy_task.md")
    render(raws, out, os.path.join(RESULTS, "on_policy_task.png"), paths=a.render)
    print(f"wrote {out}")
    return
  raw = run(a, argv)
  out = a.out or os.path.join(RESULTS, f"on_policy_task_{a.task}.json")
  if a.gradient_check:  # added to the results of the same task and warm starts
    with open(out) as f:
      full = json.load(f)
    full["gradient_check"] = raw["gradient_check"]
    full["gradient_check_command"] = "python benchmarks/onpolicy_task.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    with open(out, "w") as f:
      json.dump(full, f, indent=1)
    print(f"added the gradient check to {out}")
    return
  with open(out, "w") as f:
    json.dump(raw, f, indent=1)
  for line in summary_lines(raw):
    print(line)
  print(f"wrote {out} ({raw['total_seconds'] / 60:.1f} min)")


if __name__ == "__main__":
  main()
