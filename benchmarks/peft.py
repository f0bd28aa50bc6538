"""Full fine-tuning vs LoRA vs QLoRA students on the main job: per-device memory and step time.

The main job's models, batch and 2x4 mesh (`meshdistill.config.Config` defaults; teacher and
student freshly initialised: memory and time do not depend on the weights) are distilled with
the whole student trained, with LoRA adapters (``--rank``, all seven projections) on a float32
base, and with adapters on an int8 / int4 base (QLoRA). For each:

* per-device bytes of the train state (parameters + optimizer state, the shards on device 0),
  and of the optimizer state alone;
* XLA's memory analysis of the compiled step (arguments, temporaries, total; per device);
* the median step time over ``--steps`` steps after a compiled warm-up step.

Run: ``python benchmarks/peft.py [--rank 8 --steps 10]``; writes ``benchmarks/results/peft.md``.
"""

from __future__ import annotations

import argparse
import pathlib
import platform

from bench.harness import median_call

import meshdistill as md

md.simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshdistill.config import Config  # noqa: E402
from meshdistill.train.memory import step_memory  # noqa: E402
from meshdistill.models.lora import LoraConfig, adapter_count, apply_lora  # noqa: E402
from meshdistill.train.loop.trainer import make_optimizer  # noqa: E402

RESULT = pathlib.Path(__file__).parent / "results" / "peft.md"


def bytes_on_first_device(tree) -> int:
  device = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f}"


def measure(cfg: Config, mesh, teacher, lora: LoraConfig | None, steps: int, batch) -> dict:
  student = md.init_model(cfg.student, seed=1, mesh=mesh)
  if lora is not None:
    student = apply_lora(student, lora, seed=2, mesh=mesh)
  d = md.Distiller(student, teacher, optimizer=make_optimizer(cfg.train, cfg.student.n_layers), mesh=mesh)
  state = d.init_state()
  mem = step_memory(d, state, batch)
  out = {
      "state": bytes_on_first_device(state),
      "opt": bytes_on_first_device(state.opt_state),
      "trained": adapter_count(student) if lora is not None else md.param_count(student),
      "temp": mem.temp_bytes,
      "args": mem.argument_bytes,
      "total": mem.total_bytes,
  }
  m = None

  def one_step():
    nonlocal state, m
    state, m = d.step(state, batch)
    return state, m

  out["step_s"] = median_call(one_step, steps)  # one call to compile, then the median of ``steps`` calls
  out["loss"] = float(m["loss"])
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--steps", type=int, default=10)
  args = p.parse_args()
  cfg = Config()
  mesh = md.make_mesh(data=cfg.mesh.data, tensor=cfg.mesh.tensor)
  teacher = md.init_model(cfg.teacher, seed=0, mesh=mesh)
  B, T = cfg.train.batch_size, cfg.data.seq_len
  rng = np.random.default_rng(0)
  x = rng.integers(0, cfg.student.vocab_size, (B, T + 1))
  batch = {"inputs": x[:, :-1].astype(np.int32), "targets": x[:, 1:].astype(np.int32), "mask": np.ones((B, T), np.float32)}
  variants = [
      ("full fine-tuning", None),
      (f"LoRA r={args.rank}", LoraConfig(rank=args.rank)),
      (f"QLoRA r={args.rank}, int8 base", LoraConfig(rank=args.rank, quantize="int8")),
      (f"QLoRA r={args.rank}, int4 base", LoraConfig(rank=args.rank, quantize="int4")),
  ]
  rows = []
  for name, lora in variants:
    r = measure(cfg, mesh, teacher, lora, args.steps, batch)
    print(name, r, flush=True)
    rows.append((name, r))
  s = cfg.student
  lines = [
      "# Full fine-tuning vs LoRA vs QLoRA students (main job)",
      "",
      f"`python benchmarks/peft.py --rank {args.rank} --steps {args.steps}` on {platform.machine()} "
      f"({jax.default_backend()}, 8 simulated devices, 2x4 mesh); student d_model={s.d_model}, "
      f"n_layers={s.n_layers}, mlp_hidden={s.mlp_hidden}, vocab {s.vocab_size}; teacher d_model={cfg.teacher.d_model}; "
      f"batch {B} x {T}. Adapters on q, k, v, o, gate, up, down. Memory is per device (device 0's shards; "
      "XLA's memory analysis of the compiled step, which includes the teacher's weights and the batch).",
      "",
      "| student | trained params | train state MiB | optimizer state MiB | step args MiB | step temp MiB "
      "| step total MiB | step time s (median) |",
      "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name, r in rows:
    lines.append(
        f"| {name} | {r['trained']:,} | {_mib(r['state'])} | {_mib(r['opt'])} | {_mib(r['args'])} | "
        f"{_mib(r['temp'])} | {_mib(r['total'])} | {r['step_s']:.3f} |"
    )
  lines += [
      "",
      "CPU step times on a shared 2-core machine are noisy and say nothing about accelerator speed; the "
      "memory columns are deterministic.",
      "",
  ]
  RESULT.parent.mkdir(parents=True, exist_ok=True)
  kept = RESULT.read_text().partition("\n## Quality")[2] if RESULT.exists() else ""
  RESULT.write_text("\n".join(lines) + ("\n## Quality" + kept if kept else ""))  # quality notes: written by hand
  print("\n".join(lines))


if __name__ == "__main__":
  main()
