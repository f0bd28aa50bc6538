"""Quantized frozen decoders (a teacher for inference): projections stored int8 / int4 / nf4, via qwix.

`quantize_model(model, "int8", mesh=mesh)` returns a copy of a `Decoder` whose block projections
(attention q / k / v / o, MLP gate / up / down) hold qwix ``QArray`` weights -- an integer ``qvalue``
``[in, out]`` and a float ``scale`` ``[1, out]`` per output channel -- dequantised inside each matmul.
The embedding, the norms and the LM head stay float. It is the machinery of the QLoRA base
(`meshdistill.models.lora`, ``student.lora.quantize``) without adapters.

The quantized weights keep their base weight's split over ``tensor`` (``qvalue`` as the kernel; a
``scale`` of a row-split weight, size 1 on the split dimension, is replicated). A quantized model is
for inference only: as a teacher it is an input of the step run under ``stop_gradient``, never
differentiated and never in the optimizer (`meshdistill.train.step`).

Storage: int8 one byte per weight; int4 / nf4 (nf4 is qwix's 16-level NormalFloat, stored ``uint4``)
are packed two per byte where the backend packs 4-bit types (TPU) and take one byte per value on CPU,
where JAX keeps 4-bit arrays unpacked. 4-bit storage adds no shape limit of its own on CPU (odd sizes
work); a split over ``tensor`` needs the sizes the float model needs. Checkpoints store nf4's
``uint4`` widened to ``uint8`` (tensorstore has no ``uint4``; `meshdistill.storage.checkpoint`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshdistill.models._build import _create
from meshdistill.parallel.rules import fitted_shardings  # noqa: F401 -- also read here (placed, lora)

log = logging.getLogger(__name__)

QUANTIZE = ("int8", "int4", "nf4")
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # the decoder's block projections (attn/*, mlp/*)


def projection_pattern(targets=PROJECTIONS) -> str:
  """The qwix ``module_path`` regex of the decoder's block projections named ``targets``: ``blocks/0/attn/q`` in an
  unrolled decoder, ``blocks/attn/q`` in a scanned one (``scan_layers``: one stacked block, no layer index)."""
  return r"blocks/(?:\d+/)?(attn|mlp)/(" + "|".join(map(re.escape, targets)) + ")"


def apply_rules(model, provider, tokens, setting: str):
  """``qwix.quantize_model(model, provider, tokens)``, refused (ValueError naming ``setting``) when the provider's rules
  matched no projection: a quantization that would silently leave the model float."""
  import qwix  # pylint: disable=g-import-not-at-top

  quantized = qwix.quantize_model(model, provider, tokens)
  if provider.get_unused_rules():
    raise ValueError(f"{setting}: no projection of the model matched qwix rule {projection_pattern()!r}; nothing "
                     "would be quantized")
  return quantized


def qtype(name: str | None, setting: str = "quantize"):
  """The qwix weight type of a ``quantize`` setting (``None``: float)."""
  if name is not None and name not in QUANTIZE:
    raise ValueError(f"{setting}={name!r}; choose one of {list(QUANTIZE)} or null (float weights)")
  return {None: None, "int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}[name]


def init_tokens(cfg) -> jax.Array:
  """The tokens qwix runs a decoder of ``cfg`` on once to find and convert its projections: one token, or 128 for
  ``attention='splash'`` (the kernel's shortest sequence)."""
  return jnp.zeros((1, 128 if getattr(cfg, "attention", None) == "splash" else 1), jnp.int32)


def is_quantized(model_or_state: Any) -> bool:
  """Whether a decoder (or its state) holds quantized (``qvalue`` / ``scale``) weights."""
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
  return any("qvalue" in map(str, k) for k, _ in nnx.to_flat_state(state))


def placed(model, mesh: Mesh):
  """``model`` with every weight put on ``mesh`` per its partition metadata (`fitted_shardings`)."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.device_put(state, fitted_shardings(state, mesh)))


def quantize_model(model, quantize: str, *, mesh: Mesh | None = None, setting: str = "teacher.quantize"):
  """A copy of ``model`` whose block projections are stored quantized (``quantize``: `QUANTIZE`).

  ``model`` is unchanged. With ``mesh`` every weight, quantized storage included, is placed per its
  ``tensor`` split (the scales of row-split weights replicated). ``setting`` names the option in errors.
  """
  import qwix  # pylint: disable=g-import-not-at-top

  weight_qtype = qtype(quantize, setting)
  if weight_qtype is None:
    raise ValueError(f"{setting} is null: nothing to quantize; choose one of {list(QUANTIZE)}")
  if is_quantized(model):
    raise ValueError(f"{setting}: the model is already quantized")
  if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):  # adapters (`meshdistill.models.lora`)
    raise ValueError(f"{setting}: the model holds LoRA adapters; quantize its base with student.lora.quantize "
                     "(`apply_lora`), or merge the adapters first (`merge_lora`)")
  provider = qwix.PtqProvider([qwix.QuantizationRule(module_path=projection_pattern(), weight_qtype=weight_qtype)])
  quantized = apply_rules(model, provider, init_tokens(model.cfg), setting)
  if mesh is not None:  # quantized storage is computed eagerly; pin every leaf to its split
    quantized = placed(quantized, mesh)
  log.info("quantized %s projections to %s: %.1f MiB of weights (was %.1f MiB)", type(model).__name__, quantize,
           weight_bytes(quantized) / 2**20, weight_bytes(model) / 2**20)
  return quantized


def weight_bytes(model_or_state: Any) -> int:
  """Bytes of a model's parameters by dtype item size (4-bit types counted as half a byte per value)."""
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
  total = 0.0
  for x in jax.tree.leaves(state):
    bits = jnp.dtype(x.dtype).itemsize * 8 if jnp.dtype(x.dtype) not in (jnp.int4, jnp.uint4) else 4
    total += x.size * bits / 8
  return int(total)


def abstract_quantized(cfg, quantize: str):
  """(graphdef, abstract state) of a `Decoder` of ``cfg`` with ``quantize`` projections, without allocating it."""
  return nnx.split(nnx.eval_shape(lambda: quantize_model(_create(cfg, 0), quantize)))
