"""The router's loss terms and expert-utilisation metrics of a mixture-of-experts student (`meshdistill.models.moe`).

From the routing the student's forward pass reports (`meshdistill.models.decoder.ModelOutput.router`, one
`Routing` per expert layer), over the unmasked tokens of the GLOBAL batch and all expert layers ("rows":
``L * tokens``):

* ``moe_aux``, the load-balancing loss of Switch / Mixtral as transformers computes it
  (``load_balancing_loss_func``: softmax of the router logits, each row's ``top_k`` experts):
  ``E * sum_e f_e * P_e`` with ``f_e`` the number of top-k assignments to expert ``e`` per row and ``P_e`` the mean
  router probability of ``e``. 1.0 when routing is uniform (``top_k`` times that when every expert gets a row's
  whole top-k).
* ``moe_z``, the router z-loss (ST-MoE): the mean over rows of ``logsumexp(logits)**2``.

The step adds ``MoeConfig.aux_loss_weight * moe_aux + MoeConfig.z_loss_weight * moe_z`` to the loss and reports both.
``f`` is a count (no gradient) and ``P`` a token sum, so the loss needs the global counts before it can be formed:
`router_terms` sums the counts over the mesh axes (without gradient) and returns this device's share of each term,
which the step sums over ``data`` like every token sum; every layout gives the one-device numbers.

Utilisation metrics (global): ``moe_load_max`` / ``moe_load_min``, the assignments of the busiest / idlest expert
(summed over layers) over an even share (1.0: balanced), and ``moe_dropped``, the fraction of assignments the
capacity dropped (0 when dropless).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from meshdistill.models.moe import MoeConfig, route
from meshdistill.parallel.collectives import psum_bundled


def router_sums(router: tuple, mask_BxT: jax.Array, moe: MoeConfig) -> dict[str, jax.Array]:
  """Token sums over the unmasked rows of every expert layer: ``counts`` [E] top-k assignments per expert,
  ``probs`` [E] router probabilities (softmax), ``z`` squared log-sum-exps, ``dropped`` assignments, ``rows``."""
  mask_BxTx1 = mask_BxT.astype(jnp.float32)[..., None]
  E = moe.n_experts
  counts_E = probs_E = jnp.zeros((E,), jnp.float32)
  z = dropped = jnp.zeros((), jnp.float32)
  for r in router:
    logits_BxTxE = r.logits_BxTxE.astype(jnp.float32)
    _, experts_BxTxk = route(logits_BxTxE, moe)
    chosen_BxTxE = jnp.sum(jax.nn.one_hot(experts_BxTxk, E, dtype=jnp.float32), axis=-2)
    counts_E = counts_E + jnp.sum(chosen_BxTxE * mask_BxTx1, axis=(0, 1))
    probs_E = probs_E + jnp.sum(jax.nn.softmax(logits_BxTxE, axis=-1) * mask_BxTx1, axis=(0, 1))
    z = z + jnp.sum(jax.nn.logsumexp(logits_BxTxE, axis=-1) ** 2 * mask_BxTx1[..., 0])
    dropped = dropped + jnp.sum(r.dropped_BxT * mask_BxTx1[..., 0])
  rows = len(router) * jnp.sum(mask_BxTx1)
  return {"counts": jax.lax.stop_gradient(counts_E), "probs": probs_E, "z": z, "dropped": dropped, "rows": rows}


def router_terms(router: tuple, mask_BxT: jax.Array, moe: MoeConfig, axes: Any) -> tuple[dict, dict]:
  """``(terms, metrics)``: ``terms`` = {moe_aux, moe_z}, this device's shares of the global terms (their sum over
  ``axes`` is the global value; gradients flow through the router probabilities and logits), and ``metrics``, the
  global utilisation (see the module doc). ``axes``: the mesh axes the rows are split over (``None``: none)."""
  s = router_sums(router, mask_BxT, moe)
  counts_E, rows, dropped = psum_bundled(jax.lax.stop_gradient((s["counts"], s["rows"], s["dropped"])), axes)
  rows = jnp.maximum(rows, 1.0)
  E, k = moe.n_experts, moe.top_k
  terms = {"moe_aux": E * jnp.sum(counts_E / rows * s["probs"] / rows), "moe_z": s["z"] / rows}
  even = k * rows / E  # each expert's assignments under perfectly even routing
  metrics = {"moe_load_max": jnp.max(counts_E) / even, "moe_load_min": jnp.min(counts_E) / even,
             "moe_dropped": dropped / (k * rows)}
  return terms, metrics


def weighted(terms: dict, moe: MoeConfig) -> jax.Array:
  """The terms' contribution to the loss: ``aux_loss_weight * moe_aux + z_loss_weight * moe_z``."""
  return moe.aux_loss_weight * terms["moe_aux"] + moe.z_loss_weight * terms["moe_z"]
