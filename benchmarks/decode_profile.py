"""Where a decoded token's time goes: a profiler trace of one cached-sampling call, split by role.

Run on a TPU (from the checkout's root, ``PYTHONPATH=src:benchmarks``)::

    python benchmarks/decode_profile.py --pair qwen3 --batch 64 --out decode_profile.json

The sampler and model are those of `tpu_step.py`'s sampling rows (the pair's student with random float32 weights
computing in bfloat16, prompt 128 + 256 new tokens, temperature 1): one call compiles, one more is timed, a third is
traced. Each device op of the trace is put in one role by its HLO instruction (`bench.op_kinds.describe`: output
shape and the JAX operation it came from):

* ``attention``: the two products of a decoded token against the key/value cache (scores, weighted values), or
  the decoding kernel (`meshdistill.models._decode_attention`: its slot write included);
* ``cache writes``: the new token's keys and values written into their slot (``dynamic_update_slice`` of a cache);
* ``cache moves``: whole caches (or pieces of them) copied between HBM and on-chip memory by the compiler's
  memory-space assignment (``copy-*`` / ``slice-*`` of cache-shaped arrays);
* ``weights``: every other matrix product (projections, MLP, LM head) and the copies of weights;
* ``prefill``: the prompt's forward pass (everything outside the decoding loops);
* ``other``: the rest inside the loops (norms, RoPE, sampling, masks).

Printed: per role the milliseconds of the call and microseconds per decoded token (the loops' time over the new
tokens), beside the call's wall time. The JSON holds the same with the slowest instructions (``--top``, 40 by
default; each with its milliseconds in the call, description and role).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time

ROLES = ("attention", "cache writes", "cache moves", "weights", "prefill", "other")


def role_of(name: str, what: str, cache_dims: tuple[int, int]) -> str:
  """The role of instruction ``name`` described as ``what`` (``"shape op_name"``); ``cache_dims``: (kv heads, head
  dim) of a layer's cache, whatever its rows and slots (a piece of a cache is a block of its rows)."""
  G, K = cache_dims
  # a cache [B, S, G, K] (or [B, G, S, K]), or the compiler's piece of one (a block of its rows)
  cache = re.search(rf"\[\d+,\d+,{G},{K}\]|\[\d+,{G},\d+,{K}\]", what) is not None
  if name.startswith(("copy-", "slice-")):  # asynchronous copies carry no operation name
    return "cache moves" if cache else "weights"
  if "/while/" not in what:
    return "prefill"
  if "BNTS" in what:  # `jax.nn.dot_product_attention`'s einsums (vmap(BTNH,BSNH->BNTS), vmap(BNTS,BSNH->BTNH))
    return "attention"
  if "decode_attention" in what or "decode_attention" in name:  # the kernel: slot write and attention in one
    return "attention"
  if "dynamic_update_slice" in what and cache:
    return "cache writes"
  if "dot_general" in what:
    return "weights"
  return "other"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--pair", default="qwen3")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=256)
  parser.add_argument("--out", default=None, help="write the result as JSON here")
  parser.add_argument("--top", type=int, default=40, help="instructions listed in the JSON, slowest first")
  args = parser.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import meshdistill as md
  from bench.chip_pairs import Setting, model_configs
  from bench.chip_step import device_ops
  from bench.op_kinds import describe
  from meshdistill.models import generate as gen

  _, scfg = model_configs(args.pair, Setting(attn="auto", remat="none", scan="both"))  # the model's default
  scfg = scfg.replace(max_len=args.prompt + args.new)
  model = md.init_model(scfg, seed=1)
  B, N = args.batch, args.new
  prompts = np.random.default_rng(B).integers(0, scfg.vocab_size, (B, args.prompt)).astype(np.int32)
  mask = np.ones((B, args.prompt), bool)
  cfg = gen.SamplingConfig(max_new_tokens=N, temperature=1.0)
  call = lambda seed: jax.block_until_ready(gen.generate(model, prompts, mask, jax.random.key(seed), cfg))  # noqa: E731
  call(0)
  t0 = time.perf_counter()
  call(1)
  wall = time.perf_counter() - t0
  ops, _ = device_ops(lambda: call(2))
  graphdef, params = nnx.split(model)
  program = gen.decoding_program(params, scfg, B, args.prompt + N - 1)  # the one `generate` ran: its names
  hlo = program.lower(params, jnp.asarray(prompts), jnp.asarray(mask), jax.random.key(0), graphdef=graphdef,
                          cfg=cfg, return_logits=False, mesh=None).compile().as_text()
  per_op = collections.Counter()
  loops_ms = 0.0
  for name, ms in ops:
    if name.startswith("while"):
      loops_ms += ms
    elif not name.startswith("jit_"):
      per_op[name] += ms
  what = describe(hlo, list(per_op))
  dims = (scfg.n_kv_heads, scfg.hd)
  roles = collections.Counter()
  for name, ms in per_op.items():
    roles[role_of(name, what.get(name, ""), dims)] += ms
  tokens = N - 1  # tokens decoded inside the loops (the first comes from the prompt's pass)
  out = {
      "pair": args.pair, "batch": B, "prompt": args.prompt, "new": N, "wall_s": wall, "loops_ms": loops_ms,
      "us_per_token": {r: 1e3 * roles[r] / tokens for r in ROLES if r != "prefill"},
      "ms": {r: roles[r] for r in ROLES}, "loop_us_per_token": 1e3 * loops_ms / tokens,
      "top": [(n, round(ms, 3), what.get(n, "")[:120], role_of(n, what.get(n, ""), dims))
              for n, ms in per_op.most_common(args.top)],
      "device": jax.devices()[0].device_kind, "jax": jax.__version__,
  }
  print(f"{args.pair} batch {B}, {args.prompt} + {N} tokens: call {wall * 1e3:.1f} ms, loops {loops_ms:.1f} ms "
        f"({out['loop_us_per_token']:.0f} us per decoded token)")
  for r in ROLES:
    per = "" if r == "prefill" else f"  {out['us_per_token'][r]:8.1f} us/token"
    print(f"  {r:14s} {roles[r]:9.2f} ms{per}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()
