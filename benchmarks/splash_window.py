"""The splash kernel with a sliding window and a soft-cap, compiled for a TPU on this CPU machine:
benchmarks/results/families.md (its "splash on TPU" table).

Off TPU the tests run the kernel in interpret mode (tests/test_family_blocks.py compares its local mask and cap with
the explicit scores); this compiles the real Mosaic kernels (forward, dq, dkv) with libtpu for one ``v5e`` chip,
the way the decoder calls them (`meshdistill.models._attention.splash_attention` under a mesh of TPU devices), for
Gemma's local layers (window, ``query_pre_attn_scalar`` scale, Gemma 2's cap 50), a Mistral-style window, and the
causal kernel for comparison. Prints one Markdown row per case. Needs libtpu (``pip install -e '.[tpu]'``).

  python benchmarks/splash_window.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from bench import harness  # noqa: E402
from meshdistill.models._attention import splash_attention  # noqa: E402

B, T, H, G, K = 1, 1024, 8, 4, 128
CASES = [
    ("Gemma local layer: window 256, scale 256^-0.5, cap 50", {"window": 256, "scale": 256**-0.5, "cap": 50.0}),
    ("Mistral-style window 512", {"window": 512}),
    ("causal (no window)", {}),
]


def main() -> int:
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
  mesh = Mesh(np.array(devices[:1]).reshape(1, 1), ("data", "tensor"))
  sharding = NamedSharding(mesh, P())
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in ((B, H, T, K), (B, G, T, K), (B, G, T, K))]
  print(f"| case (B={B}, T={T}, H={H}, G={G}, K={K}, bfloat16, values and gradients) | TPU kernels | compile s |")
  print("|---|---|---|")
  out = []
  for name, opts in CASES:
    def loss(q, k, v, opts=opts):
      return jnp.sum(splash_attention(q, k, v, **opts).astype(jnp.float32))

    def compile_it(loss=loss):
      with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()

    seconds, _ = harness.timed(lambda: out.append(compile_it()))  # noqa: B023
    kernels = out.pop().as_text().count('custom_call_target="tpu_custom_call"')
    print(f"| {name} | {kernels} | {seconds:.1f} |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
