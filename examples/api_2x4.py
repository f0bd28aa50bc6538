"""Distil a 4-layer teacher into a 2-layer student on a 2x4 mesh, then check layout parity.

Runs on a laptop CPU: 8 devices are simulated when no accelerator is present.

    python examples/api_2x4.py

Prints the loss of 20 steps on the 2x4 mesh, then replays the same steps on
shard_map 8x1, the pmap shim and a single device, and ends with the largest relative
difference of the per-step losses between all of them.
"""

import meshdistill as md

md.simulate_cpu_devices(8)  # before anything starts JAX

import time  # noqa: E402

import numpy as np  # noqa: E402

STEPS = 20
TEACHER = md.ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=256, max_len=64)
STUDENT = TEACHER.replace(n_layers=2, d_model=32, mlp_hidden=128)


def batches(n, batch=16, seq=32, seed=0):
  """Toy corpus: noisy counting sequences, so a teacher forward has structure to copy."""
  rng = np.random.default_rng(seed)
  for _ in range(n):
    start = rng.integers(0, 256, (batch, 1))
    x = (start + np.arange(seq + 1)[None, :] * rng.integers(1, 4, (batch, 1))) % 256
    noise = rng.random(x.shape) < 0.1
    x = np.where(noise, rng.integers(0, 256, x.shape), x)
    mask = np.ones((batch, seq), np.float32)
    mask[: batch // 4, seq - 8 :] = 0.0  # some padded rows
    yield {"inputs": x[:, :-1].astype(np.int32), "targets": x[:, 1:].astype(np.int32), "mask": mask}


def run(shape, backend, verbose=False):
  mesh = md.make_mesh(*shape) if shape else None
  place = mesh if backend == "shard_map" else None
  teacher = md.init_model(TEACHER, seed=0, mesh=place)
  student = md.init_model(STUDENT, seed=1, mesh=place)
  distiller = md.Distiller(student, teacher, mesh=mesh, backend=backend, strategy=md.LogitKD(temperature=2.0, alpha=0.5))
  state = distiller.init_state()
  losses, t0 = [], time.perf_counter()
  for i, batch in enumerate(batches(STEPS)):
    state, metrics = distiller.step(state, batch)
    losses.append(float(metrics["loss"]))
    if verbose:
      print(
          f"step {i + 1:2d}  loss {losses[-1]:.4f}  kl {float(metrics['kl']):.4f}  ce {float(metrics['ce']):.4f}  "
          f"corr {float(metrics['corr']):.3f}  agree {float(metrics['agree']):.3f}"
      )
  return np.array(losses), time.perf_counter() - t0


if __name__ == "__main__":
  print(f"teacher {md.param_count(md.init_model(TEACHER))} params, student {md.param_count(md.init_model(STUDENT))} params")
  print("shard_map 2x4 (data=2, tensor=4):")
  ref, secs = run((2, 4), "shard_map", verbose=True)
  print(f"  {secs:.1f}s")
  others = {"shard_map 8x1": ((8, 1), "shard_map"), "pmap 8": ((8, 1), "pmap"), "single device": (None, "single")}
  worst = 0.0
  for name, (shape, backend) in others.items():
    losses, secs = run(shape, backend)
    diff = float(np.max(np.abs(losses - ref) / np.abs(ref)))
    worst = max(worst, diff)
    print(f"{name:14s} final loss {losses[-1]:.6f}  max-rel-diff vs 2x4 {diff:.2e}  ({secs:.1f}s)")
  print(f"backend-parity max-rel-diff: {worst:.3e}")
  if worst > 1e-5:
    raise SystemExit("layouts disagree by more than 1e-5")
