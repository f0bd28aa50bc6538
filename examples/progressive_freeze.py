"""Progressive layer freezing on a 2x4 mesh of simulated CPU devices.

Three stages (bottom 80% of blocks frozen at lr 1e-4, bottom 50% at 5e-5, nothing frozen
at 1e-5), a few steps each, ONE compiled step for all of them. For each stage it prints
which parts of the student actually moved (parameters compared bit for bit before and
after the stage) and the learning rate the optimizer used.

    python examples/progressive_freeze.py
"""

import meshdistill as md

md.simulate_cpu_devices(8)  # first thing: before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from meshdistill.train.freezing import describe_stages, freeze_status, progressive_freeze, Stage  # noqa: E402
from meshdistill.train.loop.safeguards import safeguarded, skipped_updates  # noqa: E402

STEPS_PER_STAGE = 3
N_LAYERS = 5


def batches(n, batch=8, seq=16, vocab=64, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(n):
    x = rng.integers(0, vocab, (batch, seq + 1))
    mask = np.ones((batch, seq), np.float32)
    yield {"inputs": x[:, :-1].astype(np.int32), "targets": x[:, 1:].astype(np.int32), "mask": mask}


def moved_parts(before, after) -> list[str]:
  """Names of the student parts (block i, embed, final_norm, head) with any bit changed."""
  moved = set()
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after)):
    if not np.array_equal(np.asarray(a), np.asarray(b)):
      keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
      moved.add(f"block {keys[1]}" if keys[0] == "blocks" else keys[0])
  return sorted(moved)


def main():
  mesh = md.make_mesh(data=2, tensor=4)
  teacher_cfg = md.ModelConfig(
      vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_len=16
  )
  student_cfg = teacher_cfg.replace(n_layers=N_LAYERS, d_model=16, mlp_hidden=32)
  teacher = md.init_model(teacher_cfg, seed=0, mesh=mesh)
  student = md.init_model(student_cfg, seed=1, mesh=mesh)

  stages = [
      Stage(start_step=0, freeze=0.8, lr=1e-4),
      Stage(start_step=STEPS_PER_STAGE, freeze=0.5, lr=5e-5),
      Stage(start_step=2 * STEPS_PER_STAGE, freeze=0.0, lr=1e-5),
  ]
  print("\n".join(describe_stages(stages, N_LAYERS)))
  tx = safeguarded(progressive_freeze(stages, N_LAYERS, optax.adamw(1.0, weight_decay=0.1)), clip=None)
  d = md.Distiller(student, teacher, optimizer=tx, mesh=mesh)
  state = d.init_state()

  data = batches(len(stages) * STEPS_PER_STAGE)
  for k in range(len(stages)):
    before = jax.device_get(state.params["student"])
    lrs = set()
    for _ in range(STEPS_PER_STAGE):
      state, metrics = d.step(state, next(data))
      lrs.add(freeze_status(state.opt_state)["lr"])
    after = jax.device_get(state.params["student"])
    lr_text = ", ".join(f"{lr:.3g}" for lr in sorted(lrs))
    print(f"stage {k + 1}: lr used {lr_text}, loss {float(metrics['loss']):.4f}, moved: {moved_parts(before, after)}")
  print(f"compiled steps: {d.compiled_step(state)._cache_size()}, skipped updates: {skipped_updates(state.opt_state)}")


if __name__ == "__main__":
  main()
