"""A tour of the distillation strategies on a 2x4 mesh of simulated CPU devices.

Each strategy distils a tiny random teacher (4 layers, d=64, 8 heads) into a tiny
student (2 layers, d=32, 4 heads) for a few steps on synthetic token sequences, through
the same sharded train step (batch split over ``data``, weights over ``tensor``), and a
table of first/last loss and per-term values is printed.

    python examples/strategies_tour.py [--steps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import meshdistill as md

# For models this small compiling dominates; skipping the CPU backend's LLVM
# optimisation roughly halves the tour's time without changing any number.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
md.simulate_cpu_devices(8)  # before JAX starts a backend

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from meshdistill import losses  # noqa: E402
from meshdistill.strategies import (  # noqa: E402
    AttentionTransfer,
    Composite,
    FeaturePooling,
    FeatureProjection,
    HardLabelCE,
    LogitKD,
)

VOCAB, SEQ, BATCH = 64, 32, 8
TEACHER = md.ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=4, n_heads=8, n_kv_heads=4, mlp_hidden=128, max_len=SEQ)
STUDENT = md.ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_len=SEQ)
HIDDEN_METRICS = ("loss", "grad_norm", "tokens", "teacher_ce", "corr", "agree")


def synthetic_batch(seed: int) -> dict[str, np.ndarray]:
  """Arithmetic sequences ``(a + b t) mod V`` with random a, b; the last quarter of half the rows is padding."""
  rng = np.random.default_rng(seed)
  a = rng.integers(0, VOCAB, (BATCH, 1))
  b = rng.integers(1, 5, (BATCH, 1))
  tokens = (a + b * np.arange(SEQ + 1)[None, :]) % VOCAB
  mask = np.ones((BATCH, SEQ), np.float32)
  mask[: BATCH // 2, 3 * SEQ // 4 :] = 0.0
  return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32), "mask": mask}


def strategies() -> dict[str, object]:
  """The methods to run: default logit KD, other divergences if available, and the rest."""
  out: dict[str, object] = {"logit_kd": LogitKD()}
  divergences = getattr(losses, "DIVERGENCES", None) or {}
  if "divergence" in {f.name for f in dataclasses.fields(LogitKD)}:
    for name in ("reverse_kl", "jsd"):
      if name in divergences:
        out[f"logit_kd[{name}]"] = LogitKD(divergence=name)
  out["attention_transfer"] = AttentionTransfer()
  out["feature_pooling"] = FeaturePooling()
  out["feature_projection"] = FeatureProjection()
  out["composite"] = Composite(
      terms={"kd": LogitKD(), "attn": AttentionTransfer(), "proj": FeatureProjection(), "ce": HardLabelCE()},
      # the attention weight decays linearly to 0 over 10 steps (a schedule of the step)
      weights={"kd": 1.0, "attn": lambda step: 0.5 * jnp.maximum(0.0, 1.0 - step / 10), "proj": 0.5, "ce": 0.1},
  )
  return out


def term_values(metrics: dict) -> str:
  per_term = {k: v for k, v in metrics.items() if k.endswith("/loss")}
  if not per_term:
    per_term = {k: v for k, v in metrics.items() if k not in HIDDEN_METRICS}
  return "  ".join(f"{k}={float(v):.4f}" for k, v in sorted(per_term.items())) or "-"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()

  mesh = md.make_mesh(data=2, tensor=4)
  teacher = md.init_model(TEACHER, seed=0, mesh=mesh)
  student = md.init_model(STUDENT, seed=1, mesh=mesh)
  batches = [synthetic_batch(i) for i in range(args.steps)]

  rows = []
  for name, strategy in strategies().items():
    start = time.perf_counter()
    d = md.Distiller(student, teacher, strategy=strategy, optimizer=md.default_optimizer(3e-3), mesh=mesh)
    state = d.init_state()
    loss_curve = []
    for batch in batches:
      state, metrics = d.step(state, batch)
      loss_curve.append(float(metrics["loss"]))
    rows.append((name, loss_curve[0], loss_curve[-1], term_values(metrics), time.perf_counter() - start))

  print(f"mesh {dict(mesh.shape)}, {args.steps} steps, batch {BATCH} x seq {SEQ}, vocab {VOCAB}")
  print(f"{'method':<22} {'first loss':>10} {'last loss':>10} {'time s':>7}  per-term values (last step)")
  for name, first, last, terms, seconds in rows:
    print(f"{name:<22} {first:>10.4f} {last:>10.4f} {seconds:>7.1f}  {terms}")


if __name__ == "__main__":
  main()
