"""Distil a local Hugging Face checkpoint into a smaller model of the same family, and export it.

    python examples/hf_distill.py [TEACHER_DIR] [OUT_DIR]

Defaults: the tiny Qwen3 test checkpoint (tests/fixtures/hf_qwen3) as teacher, the student
written to /tmp/meshdistill_hf_student. Runs on a 2x4 mesh of simulated CPU devices: the
teacher is read from disk straight onto the mesh (each device reads its quarter of every
tensor-split weight), the student is a fresh half-depth, half-width model of the same family
and tokenizer, distilled for a few steps and written back as a Hugging Face checkpoint that
transformers, vLLM or meshdistill itself load.
"""

import pathlib
import sys

import meshdistill as md

md.simulate_cpu_devices(8)  # first thing: before JAX starts

import numpy as np  # noqa: E402

from meshdistill.models.hf import export_hf, load_hf  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(teacher_dir: str, out_dir: str, steps: int = 8) -> None:
  mesh = md.make_mesh(data=2, tensor=4)
  teacher = load_hf(teacher_dir, mesh)
  t = teacher.cfg
  student_cfg = t.replace(n_layers=max(1, t.n_layers // 2), d_model=t.d_model // 2, mlp_hidden=t.mlp_hidden // 2)
  student = md.init_model(student_cfg, seed=1, mesh=mesh)
  print(f"teacher {md.param_count(teacher):,} params ({t.n_layers} layers, d={t.d_model}) from {teacher_dir}")
  print(f"student {md.param_count(student):,} params ({student_cfg.n_layers} layers, d={student_cfg.d_model})")

  d = md.Distiller(student, teacher, strategy=md.LogitKD(), mesh=mesh, optimizer=md.default_optimizer(3e-3))
  state = d.init_state()
  rng = np.random.default_rng(0)
  for step in range(steps):
    x = rng.integers(0, t.vocab_size, (8, 17)).astype(np.int32)  # stand-in for a tokenized corpus
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:], "mask": np.ones((8, 16), np.float32)}
    state, metrics = d.step(state, batch)
    print(f"step {step}: loss {float(metrics['loss']):.4f}  kl {float(metrics['kl']):.4f}")

  out = export_hf(d.student(state), out_dir, tokenizer=teacher_dir, overwrite=True)  # replaces an earlier export
  files = sorted(p.name for p in out.iterdir())
  again = load_hf(out, mesh)
  print(f"exported {files} to {out}; reloaded {md.param_count(again):,} params")


if __name__ == "__main__":
  args = sys.argv[1:]
  main(args[0] if args else str(ROOT / "tests" / "fixtures" / "hf_qwen3"),
       args[1] if len(args) > 1 else "/tmp/meshdistill_hf_student")
