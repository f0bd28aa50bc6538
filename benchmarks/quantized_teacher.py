"""The main job's teacher quantized (``teacher.quantize``) against the float teacher, on validation rows.

Loads the main job's cached teacher (`meshdistill.jobs.obtain_teacher`: pretrained on first use) on
the 2x4 mesh, quantizes its block projections to int8 / int4 / nf4 (`meshdistill.models.quantize`)
and compares, over ``--batches`` validation batches (masked tokens excluded):

* the logit error: max |quantized - float| over all logits, relative to max |float logit|, and the
  mean absolute error;
* KL(float || quantized) of the next-token distributions (nats per token) and top-1 agreement;
* each teacher's validation cross-entropy;
* per-device bytes of the teacher's weights (device 0's shards; 4-bit values take a byte on CPU).

Run: ``python benchmarks/quantized_teacher.py [--batches 8]``; rewrites the section
``## Quantized teacher`` of ``benchmarks/results/peft.md`` (the rest is kept).
"""

from __future__ import annotations

import argparse
import os
import platform

import meshdistill as md

md.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from meshdistill import jobs  # noqa: E402
from meshdistill.config import load_config  # noqa: E402
from meshdistill.models.quantize import QUANTIZE, quantize_model  # noqa: E402

from bench.results import replace_section  # noqa: E402

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "peft.md")
SECTION = "\n## Quantized teacher"


def _device0_bytes(model) -> int:
  device = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(nnx.state(model)) for s in x.addressable_shards
             if s.device == device)


def _logits_fn(model):
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x).logits)
  return lambda x: fn(state, x)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batches", type=int, default=8)
  args = ap.parse_args()
  cfg = load_config(None)
  mesh = jobs.build_mesh(cfg)
  data = jobs.load_data(cfg, mesh=mesh)
  teacher, path = jobs.obtain_teacher(cfg, data, mesh)
  models = {"float32": teacher, **{q: quantize_model(teacher, q, mesh=mesh) for q in QUANTIZE}}
  fns = {k: _logits_fn(m) for k, m in models.items()}
  stats = {k: {"max_err": 0.0, "abs_err": 0.0, "kl": 0.0, "agree": 0.0, "ce": 0.0} for k in models}
  max_logit, tokens = 0.0, 0.0
  for batch in data.val_batches(max_batches=args.batches):
    x = jnp.asarray(batch["inputs"])
    mask = np.asarray(batch["mask"], np.float64)
    targets = np.asarray(batch["targets"])
    ref = np.asarray(fns["float32"](x), np.float64)
    ref_logp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    max_logit = max(max_logit, float(np.abs(ref).max()))
    tokens += mask.sum()
    for k, fn in fns.items():
      got = np.asarray(fn(x), np.float64)
      logp = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
      s = stats[k]
      err = np.abs(got - ref)
      s["max_err"] = max(s["max_err"], float((err.max(-1) * (mask > 0)).max()))
      s["abs_err"] += float((err.mean(-1) * mask).sum())
      s["kl"] += float(((np.exp(ref_logp) * (ref_logp - logp)).sum(-1) * mask).sum())
      s["agree"] += float(((got.argmax(-1) == ref.argmax(-1)) * mask).sum())
      s["ce"] += float((-np.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask).sum())
  lines = [
      SECTION.strip(),
      "",
      f"`python benchmarks/quantized_teacher.py --batches {args.batches}`: the main job's teacher ({path}, "
      f"d_model={cfg.teacher.d_model}, {cfg.teacher.n_layers} layers) with its block projections quantized "
      "(`teacher.quantize`, per output channel; embeddings, norms and LM head stay float32), against the "
      f"float32 teacher on {int(tokens):,} validation tokens; 2x4 mesh ({platform.machine()}, "
      f"{jax.default_backend()}). Max |logit| of the float teacher: {max_logit:.2f}. Weight bytes: device 0's "
      "shards (int4 / nf4 take one byte per value on CPU; a TPU packs two per byte).",
      "",
      "| teacher | weights KiB / device | max logit error (relative) | mean abs logit error | KL(float‖quantized) "
      "| top-1 agreement | validation CE |",
      "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for k, s in stats.items():
    lines.append(
        f"| {k} | {_device0_bytes(models[k]) / 1024:.1f} | {s['max_err']:.4f} ({s['max_err'] / max_logit:.2%}) "
        f"| {s['abs_err'] / tokens:.5f} | {s['kl'] / tokens:.6f} | {s['agree'] / tokens:.2%} | {s['ce'] / tokens:.4f} |"
    )
  lines.append("")
  section = "\n".join(lines)
  print(section)
  replace_section(RESULT, SECTION, section)


if __name__ == "__main__":
  main()
