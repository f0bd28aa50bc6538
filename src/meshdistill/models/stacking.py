"""Stacked (``ModelConfig.scan_layers``) <-> per-layer decoder weights.

A scanned decoder holds each block weight once, stacked ``[L, ...]`` at ``blocks/<name>``; an unrolled
one holds ``L`` weights at ``blocks/<i>/<name>``. The pair `stack_layers` / `unstack_layers` converts
states (parameters, or any tree of variables laid out like them); `to_scanned` / `to_unrolled` convert
a model, keeping its placement on a mesh. Hugging Face import/export, layer-subset initialisation and
checkpoints of the other layout go through these, so everything keyed by block index keeps working.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from meshdistill.parallel.mesh import param_shardings
from meshdistill.models._build import _value, abstract_params
from meshdistill.models.decoder import Decoder, ModelConfig

__all__ = ["is_stacked", "stack_layers", "to_scanned", "to_unrolled", "unstack_layers"]


def is_stacked(state: nnx.State) -> bool:
  """Whether ``state`` (a decoder's) holds stacked blocks (``blocks/<name>``, no layer index)."""
  return any(k[0] == "blocks" and not isinstance(k[1], int) for k, _ in nnx.to_flat_state(state) if len(k) > 1)


def _convert(state: nnx.State, target: nnx.State, value) -> nnx.State:
  source = dict(nnx.to_flat_state(state))
  extra = sorted(set(source) - {k for k, _ in nnx.to_flat_state(target)})
  extra = [k for k in extra if k[0] != "blocks"]  # the blocks' other-layout keys are the ones converted
  if extra:
    raise ValueError(
        f"cannot convert between stacked and per-layer blocks: {'/'.join(map(str, extra[0]))} is not a decoder "
        "weight (e.g. LoRA adapters); convert the plain model first, then wrap it"
    )
  return nnx.from_flat_state([(k, t.replace(value(source, k))) for k, t in nnx.to_flat_state(target)])


def stack_layers(state: nnx.State, cfg: ModelConfig) -> nnx.State:
  """Per-layer ``blocks/<i>/<name>`` weights -> stacked ``blocks/<name>`` ``[L, ...]`` (the layout of a decoder
  built with ``cfg.replace(scan_layers=True)``; partitioning ``(None, *per-layer)``)."""
  target = abstract_params(cfg.replace(scan_layers=True))[1]

  def value(source, k):
    if k[0] != "blocks":
      return _value(source[k])
    return jnp.stack([_value(source[("blocks", i, *k[1:])]) for i in range(cfg.n_layers)])

  return _convert(state, target, value)


def unstack_layers(state: nnx.State, cfg: ModelConfig) -> nnx.State:
  """Stacked ``blocks/<name>`` ``[L, ...]`` weights -> per-layer ``blocks/<i>/<name>`` (the inverse of
  `stack_layers`)."""
  target = abstract_params(cfg.replace(scan_layers=False))[1]

  def value(source, k):
    return _value(source[("blocks", *k[2:])])[k[1]] if k[0] == "blocks" else _value(source[k])

  return _convert(state, target, value)


def _mesh(state: nnx.State):
  for x in jax.tree.leaves(state):
    if isinstance(getattr(x, "sharding", None), NamedSharding):
      return x.sharding.mesh
  return None


def _relayout(model: Decoder, scan: bool, convert) -> Decoder:
  if not isinstance(model, Decoder):
    raise TypeError(f"scan_layers conversion needs a meshdistill Decoder, got {type(model).__name__}")
  if model.cfg.scan_layers == scan:
    return model
  cfg = model.cfg.replace(scan_layers=scan)
  graphdef, target, _ = abstract_params(cfg)
  state = nnx.state(model)
  mesh = _mesh(state)
  if mesh is None:
    return nnx.merge(graphdef, convert(state, model.cfg))
  shardings = param_shardings(nnx.get_partition_spec(target), mesh)
  return nnx.merge(graphdef, jax.jit(lambda s: convert(s, model.cfg), out_shardings=shardings)(state))


def to_scanned(model: Decoder) -> Decoder:
  """``model`` with stacked blocks (``scan_layers=True``), same values; on a mesh the stacked weights keep the
  per-layer split over ``tensor``. ``model`` itself when it is already scanned."""
  return _relayout(model, True, stack_layers)


def to_unrolled(model: Decoder) -> Decoder:
  """``model`` with per-layer blocks (``scan_layers=False``), same values. ``model`` itself when already unrolled."""
  return _relayout(model, False, unstack_layers)
