"""Building models directly onto a mesh, each device materialising only its shards."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshdistill.parallel.mesh import param_shardings
from meshdistill.parallel.rules import split_ways
from meshdistill.models.decoder import Decoder, ModelConfig


def _create(cfg: ModelConfig, seed: int | jax.Array) -> Decoder:
  """A decoder drawn from ``seed`` (an int, or the key ``jax.random.key(seed)``: the same weights)."""
  with nnx.use_eager_sharding(False):
    return Decoder(cfg, rngs=nnx.Rngs(seed))


def abstract_params(cfg: ModelConfig, mesh: Mesh | None = None):
  """(graphdef, abstract state, shardings or None) of a decoder, without allocating it."""
  cfg = cfg.with_scan_on(mesh) if mesh is not None else cfg  # `scan_layers: auto` decided for ``mesh``
  graphdef, state = nnx.split(nnx.eval_shape(lambda: _create(cfg, 0)))
  shardings = None if mesh is None else param_shardings(nnx.get_partition_spec(state), mesh)
  return graphdef, state, shardings


def _value(v):
  return v.get_value() if hasattr(v, "get_value") else v


def _reshape_state(state: nnx.State, target: nnx.State, fn) -> nnx.State:
  """``target``'s variables (metadata, partitioning) holding ``fn(value, target_shape)`` of ``state``'s."""
  source = dict(nnx.to_flat_state(state))
  return nnx.from_flat_state(
      [(k, t.replace(fn(_value(source[k]), tuple(_value(t).shape)))) for k, t in nnx.to_flat_state(target)]
  )


def pad_state(state: nnx.State, target: nnx.State) -> nnx.State:
  """``state`` zero-padded at the end of each axis to the shapes of ``target`` (vocabulary padding rows) and cast to
  its dtypes (``param_dtype``)."""
  dtypes = {k: _value(t).dtype for k, t in nnx.to_flat_state(target)}
  cast = lambda x, dtype: x if dtype in (None, x.dtype) else x.astype(dtype)  # noqa: E731 (abstract: as is)
  state = nnx.from_flat_state([(k, v.replace(cast(_value(v), dtypes.get(k)))) for k, v in nnx.to_flat_state(state)])
  return _reshape_state(
      state, target, lambda x, shape: jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)]) if x.shape != shape else x
  )


def init_model(cfg: ModelConfig, seed: int = 0, mesh: Mesh | None = None) -> Decoder:
  """Initialises a decoder from ``seed``.

  With ``mesh`` the parameters are created already split over ``tensor`` (and
  replicated over ``data``): the initialiser is jitted with the target shardings, so
  no device ever holds a full copy of a split weight. Values equal the unsharded
  initialisation for the same seed (JAX's partitionable threefry); a vocabulary that
  ``tensor`` does not divide gets zero padding rows (`ModelConfig.for_tensor`), the real
  rows still equal the unsharded initialisation. Weights stored in another ``param_dtype`` than
  float32 are the float32 initialisation rounded to it (the same seed, the same model).
  """
  if mesh is not None:
    cfg = cfg.with_scan_on(mesh)  # `scan_layers: auto` decided for ``mesh``
  if mesh is None and cfg.param_dtype == "float32":
    return _create(cfg, seed)
  graphdef, initialise = _initializer(cfg, mesh)
  return nnx.merge(graphdef, initialise(jax.random.key(seed)))


@functools.lru_cache(maxsize=16)
def _initializer(cfg: ModelConfig, mesh: Mesh | None):
  """(graphdef, jitted ``key -> state``) of `init_model` for ``cfg`` on ``mesh``: traced and compiled once per
  config and mesh, then reused for every seed (a new model on the same mesh costs one run of it, not a compile)."""
  fitted = cfg if mesh is None else cfg.for_tensor(split_ways(mesh, "vocab"))
  graphdef, target, shardings = abstract_params(fitted, mesh)
  real = cfg.replace(vocab_multiple=1, replicate_kv=False, param_dtype="float32")
  placement = {} if mesh is None else {"out_shardings": shardings}
  return graphdef, jax.jit(lambda key: pad_state(nnx.state(_create(real, key)), target), **placement)


def frozen_model(model: Decoder, platform: str | None = None) -> Decoder:
  """``model`` with its weights stored as a frozen model's (`ModelConfig.frozen` on ``platform``): a teacher of
  ``param_dtype="auto"`` computing in bfloat16 gets bfloat16 weights (each float32 weight rounded, as
  `init_model` rounds). In place: the module's variables take the rounded arrays, so the float32 ones are freed
  (a caller holding the teacher does not keep a second copy on the device). Any other model (a quantized or adapted
  one too) is returned as it is."""
  if not isinstance(model, Decoder):
    return model
  cfg = model.cfg.frozen(platform)
  if cfg.weight_dtype == model.cfg.weight_dtype:  # stored as it would be already (auto on a CPU: float32)
    return model
  _, target, _ = abstract_params(cfg)
  state = nnx.state(model)
  if {k for k, _ in nnx.to_flat_state(state)} != {k for k, _ in nnx.to_flat_state(target)}:
    return model  # quantized or adapted weights (qwix, LoRA): stored as their wrapper chose
  nnx.update(model, pad_state(state, target))
  model.cfg = cfg
  return model


def fit_model(model: Decoder, tensor: int) -> Decoder:
  """``model`` itself when its config suits a ``tensor``-way split, else a copy padded / re-partitioned for it."""
  if not isinstance(model, Decoder):  # e.g. a tunix adapter: no padding, only the check
    model.cfg.check_tensor_split(tensor)
    return model
  fitted = model.cfg.for_tensor(tensor)
  if fitted == model.cfg:
    return model
  graphdef, target, _ = abstract_params(fitted)
  state = nnx.state(model)
  extra = {k for k, _ in nnx.to_flat_state(state)} - {k for k, _ in nnx.to_flat_state(target)}
  if extra:  # e.g. LoRA adapters applied before the model met the mesh
    raise ValueError(
        f"a model with extra variables ({'.'.join(map(str, sorted(extra)[0]))}, ...) needs re-partitioning for mesh "
        f"tensor={tensor} (vocab_multiple={fitted.vocab_multiple}, replicate_kv={fitted.replicate_kv}); build it on "
        "the mesh first (init_model(cfg, mesh=...) / load_hf(path, mesh)), then wrap it"
    )
  return nnx.merge(graphdef, pad_state(state, target))


def shard_model(model: Decoder, mesh: Mesh) -> Decoder:
  """Returns a copy of ``model`` with its parameters placed on ``mesh`` per their partitioning.

  A vocabulary that ``tensor`` does not divide is padded first (`ModelConfig.for_tensor`).
  """
  model = fit_model(model, split_ways(mesh, "vocab"))
  graphdef, state = nnx.split(model)
  shardings = param_shardings(nnx.get_partition_spec(state), mesh)
  return nnx.merge(graphdef, jax.device_put(state, shardings))
