"""On-policy distillation on a task with checkable answers: held-out exact-match accuracy vs steps.

The task is multi-digit arithmetic (`meshdistill.data.tasks`, every number least significant digit first) on
the byte tokenizer. A teacher is trained here on the task's train split (next-token CE) until its held-out
greedy accuracy is high; a smaller student is warm-started with ``--warm-steps`` of SFT on the data (per
seed), then every arm trains ``--steps`` more steps from that same state (fresh Adam, the same learning
rate, batch size and data order, so equal steps means equal prompts and about equal student tokens):

* ``SFT (data)``          next-token CE on the data's answers;
* ``SFT (teacher)``       sequence-level KD: CE on the teacher's greedy answers to the same prompts;
* ``off-policy KD``       forward KL to the teacher on the data's answers (temperature 1);
* ``GKD lambda 0.5/1.0``  the divergence (``--gkd-divergence``) on the student's own samples with that
                          probability, else on the data's answers;
* ``sampled-token``       REINFORCE on the student's own samples, advantage ``log p_t - log p_s`` per token
                          (`meshdistill.strategies.SampledTokenKD`, discount 0).

Held-out greedy exact-match accuracy is measured every ``--eval-every`` steps on ``--eval-prompts`` held-out
problems; ``--seeds`` repeats the warm start and every arm (student init, data order, sampling keys).

  nice -n 10 python benchmarks/onpolicy_task.py --seeds 0,1,2   # writes results/on_policy_task.{md,json,png}
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshdistill as md  # noqa: E402
from meshdistill.data import ByteTokenizer  # noqa: E402
from meshdistill.data.prompts import PromptData  # noqa: E402
from meshdistill.data.tasks import parse_task  # noqa: E402
from meshdistill.train.loop.task_eval import task_accuracy  # noqa: E402
from meshdistill.strategies import HardLabelCE, LogitKD, SampledTokenKD  # noqa: E402
from meshdistill.train.hardlabel import HardLabelTrainer  # noqa: E402
from meshdistill.train.onpolicy import OnPolicyConfig, OnPolicyDistiller  # noqa: E402
from meshdistill.train.optimizers import default_optimizer  # noqa: E402


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--task", default="add6")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--train-problems", type=int, default=20000)
  p.add_argument("--eval-prompts", type=int, default=256)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--teacher", default="64,2", help="d_model,n_layers of the teacher")
  p.add_argument("--student", default="32,1", help="d_model,n_layers of the student")
  p.add_argument("--teacher-steps", type=int, default=1500)
  p.add_argument("--teacher-lr", type=float, default=3e-3)
  p.add_argument("--warm-steps", type=int, default=300)
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--gkd-divergence", default="reverse_kl")
  p.add_argument("--arms", default=None, help="comma-separated arm keys (default: all)")
  p.add_argument("--out", default=os.path.join(HERE, "results", "on_policy_task.md"))
  p.add_argument("--render", nargs="+", default=None, metavar="JSON",
                 help="train nothing: write --out from these raw results (runs of the same task, seeds and warm start, "
                      "e.g. one with other --arms / --gkd-divergence), their arms side by side")
  return p.parse_args(argv)


def _model_cfg(spec: str, vocab: int, seq: int) -> md.ModelConfig:
  d, layers = (int(x) for x in spec.split(","))
  return md.ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=4, n_kv_heads=4, mlp_hidden=4 * d,
                        max_len=seq)


def arms(gkd_divergence: str, new_tokens: int, eos: int, pad: int) -> dict:
  """key -> (label, strategy, OnPolicyConfig): every arm an `OnPolicyDistiller` on the same batches."""
  def on(lmbda, **kw):
    return OnPolicyConfig(lmbda=lmbda, max_new_tokens=new_tokens, temperature=1.0, eos_id=eos, pad_id=pad, **kw)

  kd = LogitKD(temperature=1.0, alpha=1.0)
  gkd = LogitKD(temperature=1.0, alpha=1.0, divergence=gkd_divergence)
  return {
      "sft": ("SFT (data)", HardLabelCE(), on(0.0)),
      "seqkd": ("SFT (teacher outputs, seq-KD)", HardLabelCE(), OnPolicyConfig(
          lmbda=1.0, seq_kd=True, max_new_tokens=new_tokens, temperature=0.0, eos_id=eos, pad_id=pad)),
      "offpolicy": ("off-policy KD (forward KL)", kd, on(0.0)),
      "gkd05": (f"GKD lambda 0.5 ({gkd_divergence})", gkd, on(0.5)),
      "gkd10": (f"GKD lambda 1.0 ({gkd_divergence})", gkd, on(1.0)),
      "sampled": ("sampled-token on-policy", SampledTokenKD(), on(1.0)),
  }


def merge(raws: list[dict]) -> dict:
  """One result of several runs from the same warm start (same task, seeds, teacher and warm-start settings)."""
  out = json.loads(json.dumps(raws[0]))
  same = ("task", "seeds", "batch", "teacher", "student", "teacher_steps", "warm_steps", "steps", "lr", "eval_every")
  for raw in raws[1:]:
    differ = [k for k in same if raw["args"][k] != out["args"][k]]
    if differ or raw["warm_acc"] != out["warm_acc"]:
      raise ValueError(f"results differ in {differ or 'the warm start'}: not from the same warm start")
    out["command"] += "`; `" + raw["command"]
    out["total_seconds"] += raw["total_seconds"]
    for k, label in raw["labels"].items():
      key = k if k not in out["labels"] else f"{k}:{raw['args']['gkd_divergence']}"
      out["labels"][key] = label
      for field in ("curves", "tokens", "seconds"):
        out[field][key] = raw[field][k]
  return out


def main(argv=None):
  a = _args(argv)
  if a.render:
    raws = []
    for path in a.render:
      with open(path) as f:
        raws.append(json.load(f))
    raw = merge(raws)
    base = os.path.splitext(a.out)[0]
    with open(base + ".json", "w") as f:
      json.dump(raw, f, indent=1)
    render(raw, a.out, base + ".png")
    print(f"wrote {a.out}")
    return
  task, tok = parse_task(a.task), ByteTokenizer()
  seq = task.prompt_len + task.answer_width  # prompt + answer + EOS = seq + 1 tokens a row
  held = task.rows("held_out", a.eval_prompts, seed=0)
  prompts = [r["prompt"] for r in held]
  t_cfg, s_cfg = _model_cfg(a.teacher, tok.vocab_size, seq), _model_cfg(a.student, tok.vocab_size, seq)
  seeds = [int(s) for s in a.seeds.split(",")]
  t0 = time.time()

  def data_for(seed):
    return PromptData(task.rows("train", a.train_problems, seed=0), tok, seq_len=seq, batch_size=a.batch, seed=seed,
                      val_rows=held)

  def acc(graphdef, params):
    return task_accuracy((graphdef, params), task, prompts, tok)["greedy"]

  # the teacher
  teacher = md.init_model(t_cfg, seed=100)
  tt = HardLabelTrainer(teacher, optimizer=default_optimizer(a.teacher_lr))
  state, it = tt.init_state(), data_for(100).train_iterator()
  for _ in range(a.teacher_steps):
    state, _ = tt.step(state, next(it))
  teacher = tt.student(state)
  teacher_acc = acc(*nnx.split(teacher))
  print(f"teacher {a.teacher}: held-out greedy {teacher_acc:.3f} after {a.teacher_steps} steps "
        f"({time.time() - t0:.0f}s)", flush=True)

  table = arms(a.gkd_divergence, task.answer_width + 1, tok.eos_id, tok.pad_id)
  keys = list(table) if a.arms is None else a.arms.split(",")
  distillers = {}
  curves = {k: [] for k in keys}  # per seed: [(step, acc)], plus tokens
  tokens = {k: [] for k in keys}
  warm_acc, seconds = [], {k: 0.0 for k in keys}
  warm = HardLabelTrainer(md.init_model(s_cfg, seed=0), optimizer=default_optimizer(a.lr))
  for seed in seeds:
    data = data_for(seed)
    state, it = warm.init_state(md.init_model(s_cfg, seed=seed)), data.train_iterator()
    for _ in range(a.warm_steps):
      state, _ = warm.step(state, next(it))
    warm_params = jax.device_get(state.params["student"])
    position = it.get_state()
    warm_acc.append(acc(warm.student_def, warm_params))
    print(f"seed {seed}: warm start ({a.warm_steps} SFT steps) held-out greedy {warm_acc[-1]:.3f}", flush=True)
    for k in keys:
      label, strategy, on_policy = table[k]
      if k not in distillers:
        distillers[k] = OnPolicyDistiller(md.init_model(s_cfg, seed=0), teacher, strategy=strategy, on_policy=on_policy,
                                          optimizer=default_optimizer(a.lr), seed=seed)
      d = copy.copy(distillers[k])  # the same compiled step and sampler; this seed's sampling keys
      d.seed = seed
      start = time.time()
      state = d.init_state(nnx.merge(warm.student_def, warm_params))
      it = data.train_iterator(dict(position))
      curve, n_tok = [(0, warm_acc[-1])], 0.0
      for step in range(1, a.steps + 1):
        state, m = d.step(state, next(it))
        n_tok += float(m["tokens"])
        if step % a.eval_every == 0 or step == a.steps:
          curve.append((step, acc(d.student_def, jax.device_get(state.params["student"]))))
      seconds[k] += time.time() - start
      curves[k].append(curve)
      tokens[k].append(n_tok)
      print(f"  {label:38s} " + " ".join(f"{s}:{v:.3f}" for s, v in curve) + f"  ({time.time() - start:.0f}s)",
            flush=True)

  raw = {"command": "python benchmarks/onpolicy_task.py " + " ".join(argv if argv is not None else sys.argv[1:]),
         "args": vars(a), "teacher_acc": teacher_acc, "warm_acc": warm_acc, "seeds": seeds,
         "labels": {k: table[k][0] for k in keys}, "curves": curves, "tokens": tokens, "seconds": seconds,
         "total_seconds": time.time() - t0, "machine": f"{os.cpu_count()} CPU cores, jax {jax.__version__}"}
  base = os.path.splitext(a.out)[0]
  with open(base + ".json", "w") as f:
    json.dump(raw, f, indent=1)
  render(raw, a.out, base + ".png")
  print(f"wrote {a.out} ({time.time() - t0:.0f}s)")


def _stats(curves):
  steps = [s for s, _ in curves[0]]
  vals = np.array([[v for _, v in c] for c in curves])  # [seeds, evals]
  return steps, vals.mean(0), vals.std(0), vals.min(0), vals.max(0)


def render(raw: dict, out: str, png: str) -> None:
  """The Markdown report (and the plot) from the raw results."""
  a = raw["args"]
  lines = [
      "# On-policy distillation on a task with checkable answers",
      "",
      f"Command: `{raw['command']}` ({raw['machine']}; {raw['total_seconds'] / 60:.1f} min in all).",
      "",
      f"Task `{a['task']}` (every number least significant digit first, byte tokenizer), {a['train_problems']} "
      f"train problems, {a['eval_prompts']} held-out problems (disjoint by construction). Teacher d,L="
      f"{a['teacher']} trained {a['teacher_steps']} steps: held-out greedy accuracy **{raw['teacher_acc']:.3f}**. "
      f"Student d,L={a['student']}, warm start {a['warm_steps']} SFT steps per seed: "
      f"{np.mean(raw['warm_acc']):.3f} (seeds {raw['seeds']}: {', '.join(f'{x:.3f}' for x in raw['warm_acc'])}). "
      f"Each arm: {a['steps']} steps of {a['batch']} prompts from that state, learning rate {a['lr']}, fresh Adam.",
      "",
      "Held-out greedy exact-match accuracy, mean +- sd over seeds [min, max]:",
      "",
  ]
  keys = list(raw["labels"])
  steps = _stats(raw["curves"][keys[0]])[0]
  lines.append("| arm | " + " | ".join(f"step {s}" for s in steps) + " | student tokens | seconds |")
  lines.append("|---|" + "---|" * (len(steps) + 2))
  for k in keys:
    _, mean, sd, lo, hi = _stats(raw["curves"][k])
    cells = [f"{m:.3f} +- {s:.3f} [{x:.3f}, {y:.3f}]" for m, s, x, y in zip(mean, sd, lo, hi)]
    lines.append(f"| {raw['labels'][k]} | " + " | ".join(cells) + f" | {np.mean(raw['tokens'][k]):.0f} | "
                 f"{raw['seconds'][k]:.0f} |")
  lines += ["", f"![accuracy vs steps]({os.path.basename(png)})", ""]
  with open(out, "w") as f:
    f.write("\n".join(lines))
  try:
    import matplotlib
  except ImportError:
    return
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  seeds = raw["seeds"]  # one panel per seed: the warm starts differ too much for a mean to show the arms apart
  fig, axes = plt.subplots(1, len(seeds), figsize=(4.2 * len(seeds), 4.2), sharey=True, squeeze=False)
  for i, (ax, seed) in enumerate(zip(axes[0], seeds)):
    for k in keys:
      curve = raw["curves"][k][i]
      style = "--" if "forward_kl" in raw["labels"][k] and k.startswith("gkd") else "-"
      ax.plot([c[0] for c in curve], [c[1] for c in curve], style, marker=".", label=raw["labels"][k])
    ax.set_title(f"{a['task']}, seed {seed} (warm start {raw['warm_acc'][i]:.3f})")
    ax.set_xlabel("steps after the warm start")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("held-out greedy exact match")
  axes[0][-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(png, dpi=110)


if __name__ == "__main__":
  main()
