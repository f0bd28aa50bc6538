"""The decoder's outputs for fixed weights and tokens, pinned: logits, hidden states, attention probabilities, MoE
routing and cached generation of every block kind (dense with q/k norms and biases, Gemma's post-norms, soft-caps
and sliding / global layers, mixture-of-experts with and without dense layers and a capacity; unrolled and
scanned, remat too), against ``tests/fixtures/forward_reference.npz``.

The fixture holds these outputs as the decoder computed them before its layers returned `BlockOutput` (the tuple
forms, commit 8aa3d65), so a change to how the blocks hand their results on that changes a number fails here. It is
written by this module run as a script, ``python tests/test_forward_reference.py`` (one CPU device; the weights come
from ``init_model(cfg, seed=0)``, whose random streams do not depend on the machine).

Tolerance: on the machine that wrote the fixture the outputs are equal bit for bit. XLA:CPU orders its float32 sums
by the CPU's vector width, so another CPU may round each sum of ``W`` terms differently, by at most
`helpers.summation_atol` of ``W`` terms; a model's output goes through ``L`` blocks and the head, each adding such
sums (``W`` = the widest contraction: ``max(d_model, mlp_hidden, heads x head_dim, vocabulary)``), so the bound
taken is `summation_atol` of ``(L + 1) * W`` terms at the array's largest value.
"""

import pathlib
import sys

import jax
import numpy as np
import pytest

import meshdistill as md
from meshdistill.models.generate import SamplingConfig, generate
from meshdistill.models.moe import MoeConfig

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "forward_reference.npz"

BASE = md.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_len=16)
GEMMA = BASE.replace(
    n_layers=5, sliding_window=3, layer_types=("sliding_attention", "full_attention") * 2 + ("sliding_attention",),
    rope_theta=1e6, rope_local_theta=1e4, qk_norm=True, post_norms=True, norm_offset=True, geglu=True,
    embed_scale=True, query_scale=0.3, attn_softcap=5.0, final_softcap=10.0)
MOE = MoeConfig(n_experts=4, top_k=2, expert_hidden=16)
CONFIGS = {
    "dense": BASE.replace(qk_norm=True, qkv_bias=True, attention="explicit"),
    "dense_scanned_remat": BASE.replace(qk_norm=True, qkv_bias=True, scan_layers=True, remat="full"),
    "gemma": GEMMA.replace(attention="explicit"),
    "gemma_scanned": GEMMA.replace(attention="explicit", scan_layers=True),
    "moe_mixed_capacity": BASE.replace(n_layers=3, qk_norm=True, attention="explicit",
                                       moe=MoeConfig(n_experts=4, top_k=2, expert_hidden=16, dense_layers=(1,),
                                                     capacity_factor=1.0)),
    "moe_scanned": BASE.replace(moe=MOE, scan_layers=True),
}
GENERATED = ("dense", "gemma_scanned", "moe_mixed_capacity")  # cached decoding: unrolled, scanned, experts
# The left-padded row of the expert-capacity case: its padding takes no expert's places (the prompt's pass tells
# the experts which tokens are padding); its generated logits were pinned again when that began, and once before
# when the prompt's pass began attending to the prompt's slots only (pad tokens then took capacity, and their
# queries, which see no key, average the slots attended to). The unpadded row's stayed equal to the bit both times.


def forward_outputs(name: str) -> dict[str, np.ndarray]:
  """Every output the fixture pins for ``CONFIGS[name]``, by key ``name/what``."""
  cfg = CONFIGS[name]
  model = md.init_model(cfg, seed=0)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
  capture = ("hidden",) + (("attn",) if cfg.attention == "explicit" else ()) + (("router",) if cfg.moe else ())
  out = model(jax.numpy.asarray(tokens), capture=capture)
  got = {"logits": out.logits}
  got |= {f"hidden{i}": h for i, h in enumerate(out.hidden)}
  got |= {f"attn{i}": a for i, a in enumerate(out.attn)}
  got |= {f"router{i}": r.logits_BxTxE for i, r in enumerate(out.router)}
  got |= {f"dropped{i}": r.dropped_BxT for i, r in enumerate(out.router)}
  if name in GENERATED:
    prompts = np.array([[0, 0, 5, 6], [7, 8, 9, 10]], np.int32)
    gen = generate(model, prompts, prompts != 0, None, SamplingConfig(max_new_tokens=4, temperature=0),
                   return_logits=True)
    got |= {"generated": gen.logits_BxNxV}
  return {f"{name}/{k}": np.asarray(v) for k, v in got.items()}


def _widest(cfg) -> int:
  return max(cfg.d_model, cfg.mlp_hidden, cfg.n_heads * cfg.hd, cfg.vocab_size)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_decoders_outputs_equal_the_pinned_ones(name):
  from helpers import summation_atol

  with np.load(FIXTURE) as stored:
    want = {k: stored[k] for k in stored.files if k.startswith(f"{name}/")}
  got = forward_outputs(name)
  assert sorted(got) == sorted(want)  # the same captures: one entry per layer, a routing per expert layer only
  cfg = CONFIGS[name]
  for key, value in want.items():
    atol = summation_atol((cfg.n_layers + 1) * _widest(cfg), value)
    np.testing.assert_allclose(got[key], value, rtol=0, atol=atol, err_msg=f"{key} (atol {atol:.3g})")


if __name__ == "__main__":
  arrays = {k: v for name in CONFIGS for k, v in forward_outputs(name).items()}
  np.savez_compressed(sys.argv[1] if len(sys.argv) > 1 else FIXTURE, **arrays)
  print(f"wrote {len(arrays)} arrays, {sum(v.nbytes for v in arrays.values())} bytes")
