"""Building models directly onto a mesh, each device materialising only its shards."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from meshdistill.mesh import TENSOR, param_shardings
from meshdistill.models.decoder import Decoder, ModelConfig


def _create(cfg: ModelConfig, seed: int) -> Decoder:
  with nnx.use_eager_sharding(False):
    return Decoder(cfg, rngs=nnx.Rngs(seed))


def abstract_params(cfg: ModelConfig, mesh: Mesh | None = None):
  """(graphdef, abstract state, shardings or None) of a decoder, without allocating it."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: _create(cfg, 0)))
  shardings = None if mesh is None else param_shardings(nnx.get_partition_spec(state), mesh)
  return graphdef, state, shardings


def init_model(cfg: ModelConfig, seed: int = 0, mesh: Mesh | None = None) -> Decoder:
  """Initialises a decoder from ``seed``.

  With ``mesh`` the parameters are created already split over ``tensor`` (and
  replicated over ``data``): the initialiser is jitted with the target shardings, so
  no device ever holds a full copy of a split weight. Values equal the unsharded
  initialisation for the same seed (JAX's partitionable threefry).
  """
  if mesh is None:
    return _create(cfg, seed)
  cfg.check_tensor_split(mesh.shape[TENSOR])
  graphdef, _, shardings = abstract_params(cfg, mesh)
  state = jax.jit(lambda: nnx.state(_create(cfg, seed)), out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def shard_model(model: Decoder, mesh: Mesh) -> Decoder:
  """Returns a copy of ``model`` with its parameters placed on ``mesh`` per their partitioning."""
  model.cfg.check_tensor_split(mesh.shape[TENSOR])
  graphdef, state = nnx.split(model)
  shardings = param_shardings(nnx.get_partition_spec(state), mesh)
  return nnx.merge(graphdef, jax.device_put(state, shardings))
