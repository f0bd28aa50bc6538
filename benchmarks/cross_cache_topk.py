"""A cross-tokenizer teacher cache at k below the teacher's vocabulary: what the spread tail costs each loss.

The cached top-k of a teacher of another tokenizer reaches the losses as log-probabilities over its whole
vocabulary (`meshdistill.losses.topk_logprobs`: the kept ids and the actual next token exact, the rest of the tail
spread evenly over the other ids). At k = the vocabulary that is the live teacher; below it, this measures the
difference on the rows of ``configs/cross_tokenizer.yaml`` (a BPE teacher of 512 ids pretrained on its own tokens,
a byte student), with the teacher pretrained ``pretrain.steps`` (the config's 150; cached in ``--teacher-cache``):

* ``byte KL``: the mean KL(live || top-k) of the teacher's next-byte distributions (`byte_kl`'s projection, up to
  ``max_depth`` 16 bytes inside a teacher token) over the counted student positions: the error of the target
  itself, whatever the student;
* the relative change of each distillation term (``byte_kl``, ``span_kl``'s hybrid, ``uld`` with ``top_k: 8``) for
  an untrained student, against the live teacher's, over the same rows.

Run: ``python benchmarks/cross_cache_topk.py [--rows 64 --teacher-cache DIR]``; writes
``benchmarks/results/cross_cache_topk.md``.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import meshdistill as md
from bench import harness

md.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from meshdistill import jobs, losses  # noqa: E402
from meshdistill.config import load_config  # noqa: E402
from meshdistill.data import StudentRows  # noqa: E402
from meshdistill.data.alignment import byte_tables_of, matched_vocabulary  # noqa: E402
from meshdistill.models import ModelOutput  # noqa: E402
from meshdistill.strategies import ByteKL, SpanKL, ULD  # noqa: E402
from meshdistill.teachers import cache as tc  # noqa: E402

ROOT = pathlib.Path(__file__).parent
RESULT = ROOT / "results" / "cross_cache_topk.md"
ALIGN = ("teacher_targets", "teacher_span", "student_span", "teacher_last", "student_last", "span_bytes")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", type=int, default=64)
  p.add_argument("--ks", default="1,4,16,64,128")
  p.add_argument("--teacher-cache", default=None, help="pretrain.cache_dir (a teacher pretrained there is reused)")
  args = p.parse_args()
  root = tempfile.mkdtemp(prefix="cross-cache-topk-")
  sets = [f"run.run_dir={root}/run", "mesh.backend=single", "mesh.data=1", "mesh.tensor=1"]
  if args.teacher_cache:
    sets.append(f"pretrain.cache_dir={args.teacher_cache}")
  cfg = load_config(str(ROOT.parent / "configs" / "cross_tokenizer.yaml"), sets)
  t0 = time.perf_counter()
  data = jobs.load_data(cfg)
  teacher, _ = jobs.obtain_teacher(cfg, data.teacher_side(), None)
  W = teacher.cfg.vocab_size
  rows = tc.teacher_rows_of(data, cfg.data.teacher_seq_len)
  part = rows.rows(np.arange(min(args.rows, len(rows))))
  student_rows = StudentRows(data.teacher_tokenizer, data.tokenizer, cfg.data.seq_len)
  batch = student_rows.batch(part)
  student = md.init_model(cfg.student, seed=1)
  s_logits = jax.jit(lambda x: student(x).logits)(batch["inputs"])
  live = jax.jit(lambda x: teacher(x).logits)(batch["teacher_inputs"])
  tables = byte_tables_of(data.teacher_tokenizer, data.tokenizer, max_depth=16)
  strategies = {
      "byte_kl": ByteKL(max_depth=16).with_tables(tables),
      "span_kl": SpanKL(top_k=8).with_matched(*matched_vocabulary(data.teacher_tokenizer, data.tokenizer)),
      "uld": ULD(top_k=8),
  }

  arrays = {k: jnp.asarray(batch[k]) for k in (*ALIGN, "targets", "mask")}

  @jax.jit
  def terms(t_logits, batch, s_logits):  # arrays as arguments: constants would be folded at compile time
    aligned = losses.Aligned(t_logits, *(batch[k] for k in ALIGN))
    out = {}
    for name, s in strategies.items():
      per = jax.vmap(lambda o, a, y, m, s=s: s.terms(o, a, y, m, 1.0))(ModelOutput(logits=s_logits), aligned,
                                                                       batch["targets"], batch["mask"])
      out[name] = jnp.sum(per["term"])
    # the teacher's next-byte distributions at the counted student positions (byte_kl's own projection)
    def one(t, tt, y, span, nbytes):
      starts, sizes = losses.byte_offsets(y, tables.student_lengths)
      logq, ok = losses.next_byte_logprobs(t, tt, starts, tables)
      return logq, ok & (span >= 0) & (nbytes[jnp.maximum(span, 0)] > 0) & (sizes > 0)
    out["bytes"] = jax.vmap(one)(t_logits, batch["teacher_targets"], batch["targets"], batch["student_span"],
                                 batch["span_bytes"])
    return out

  ref = terms(live, arrays, s_logits)
  live_q, counted = ref.pop("bytes")
  lines = []
  for k in [int(x) for x in args.ks.split(",")] + [W]:
    topk, own = tc.TeacherTopK(teacher, k=k).with_targets(batch["teacher_inputs"], batch["teacher_targets"])
    dense = jax.vmap(lambda i, lp, tail, y, o: losses.topk_logprobs(i, lp, tail, W, y, o))(
        topk.indices, topk.logprobs, topk.tail, jnp.asarray(batch["teacher_targets"]), own)
    got = terms(dense, arrays, s_logits)
    q, _ = got.pop("bytes")
    kl = jnp.sum(jnp.where(jnp.exp(live_q) > 0, jnp.exp(live_q) * (live_q - q), 0.0), -1)
    mean_kl = float(jnp.sum(jnp.where(counted, kl, 0.0)) / jnp.maximum(jnp.sum(counted), 1))
    mass = float(jnp.mean(jnp.sum(jnp.exp(topk.logprobs), -1)))
    rel = {n: float(got[n] / ref[n] - 1) for n in strategies}
    lines.append(f"| {k} | {mass:.3f} | {mean_kl:.2e} | " + " | ".join(f"{100 * rel[n]:+.2f}%" for n in strategies)
                 + " |")
  seconds = time.perf_counter() - t0
  text = "\n".join([
      "# A cross-tokenizer cache below the teacher's vocabulary: the cost of the spread tail",
      "",
      f"`python benchmarks/cross_cache_topk.py --rows {args.rows}"
      + (f" --teacher-cache {args.teacher_cache}`" if args.teacher_cache else "`")
      + f" ({harness.machine()}, {seconds:.0f} s with the teacher as found).",
      "",
      f"`configs/cross_tokenizer.yaml`: a BPE teacher of {W} ids (pretrained {cfg.pretrain.steps} steps on its own "
      f"tokens), rows of {cfg.data.teacher_seq_len} teacher tokens, a byte student of {cfg.data.seq_len}; "
      f"{len(part['inputs'])} rows, {int(np.sum(counted))} counted student positions. `kept mass`: the mean "
      "teacher probability in the top k; `byte KL`: mean KL(live || top-k) of the teacher's next-byte distributions "
      "over the counted positions; the last three columns: each distillation term against the live teacher's, for "
      f"an untrained student. k = {W} is the whole vocabulary (the live teacher).",
      "",
      "| k | kept mass | byte KL | byte_kl | span_kl | uld |",
      "|---|---|---|---|---|---|",
      *lines,
      "",
  ])
  RESULT.write_text(text)
  print(text)


if __name__ == "__main__":
  main()
