"""The teacher as top-k: `TopKTeacher` (a teacher known by its top-k only) and `TeacherTopK` (a placed teacher
compiled to return its `TopK` for a batch of rows, the program `write_cache` and `meshdistill.teacher_mesh` run)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshdistill import losses
from meshdistill.fsdp import data_specs
from meshdistill.mesh import DATA, host_to_global, param_shardings


# --------------------------------------------------------------------------- the teacher as top-k
@dataclasses.dataclass(frozen=True, kw_only=True)
class TopKTeacher:
  """A teacher known only by its top-k (no weights): what a `Distiller` needs to train from it.

  Attributes:
    cfg: the teacher's `ModelConfig` (vocabulary and length; its weights are not loaded).
    k: tokens kept per position.
    temperature: the temperature its log-probabilities were taken at.
    vocab: the token range ``[0, vocab)`` the top-k was taken over.
    source: where it comes from (a cache directory, a sub-mesh), for messages.
  """

  cfg: Any
  k: int
  temperature: float
  vocab: int
  source: str = "top-k teacher"

  def check_strategy(self, strategy: Any) -> None:
    """Raises a clear error unless ``strategy`` can train from this teacher's top-k alone."""
    from meshdistill.strategies import LogitKD  # pylint: disable=g-import-not-at-top

    if type(strategy) is not LogitKD:  # pylint: disable=unidiomatic-typecheck
      raise ValueError(
          f"{self.source} gives the teacher's top-{self.k} tokens only, but strategy {type(strategy).__name__} needs "
          "a live teacher (its logits, hidden states, attention maps or LM head); use distill.kind=logit_kd with "
          f"distill.top_k <= {self.k}, or a live teacher (remove teacher.cache)"
      )
    if strategy.top_k is None or strategy.top_k > self.k:
      raise ValueError(
          f"{self.source} holds the teacher's top-{self.k}, but LogitKD.top_k={strategy.top_k}; set distill.top_k to "
          f"an integer in [1, {self.k}] (the full-vocabulary loss needs a live teacher)"
      )
    if callable(strategy.temperature) or float(strategy.temperature) != float(self.temperature):
      raise ValueError(
          f"{self.source} holds log-probabilities at temperature {self.temperature}, but LogitKD.temperature="
          f"{strategy.temperature!r}; set distill.temperature={self.temperature} (a constant), or write a cache at "
          "the temperature you want"
      )


def _topk_rows(teacher_params, inputs_BxT, *, teacher_def, k, temperature, vocab):
  """Per-device: the teacher's `TopK` for rows ``inputs_BxT`` (as a live `LogitKD(top_k=k)` computes it)."""
  teacher = nnx.merge(teacher_def, teacher_params)
  logits_BxTxV = jax.lax.stop_gradient(teacher(inputs_BxT).logits)[..., :vocab]

  def one(logits_TxV):
    ids_TxK, logprobs_TxK = losses.teacher_topk(logits_TxV, k, temperature)
    return losses.TopK(ids_TxK, logprobs_TxK, losses.topk_tail(logits_TxV, ids_TxK, temperature))

  return jax.vmap(one)(logits_BxTxV)


class TeacherTopK:
  """A teacher placed on ``mesh`` (or one device) and compiled to return its `TopK` for a batch of rows.

  The program is the one a live top-k step runs for its teacher: `jax.shard_map` manual over ``data``,
  the vocabulary split over ``tensor`` (vocabulary-parallel top-k selection). Calls dispatch
  asynchronously; the result stays on ``mesh``, rows split over ``data``.
  """

  def __init__(self, teacher, *, k: int, temperature: float = 1.0, vocab: int | None = None,
               mesh: Mesh | None = None):
    vocab = teacher.cfg.vocab_size if vocab is None else vocab
    if not 1 <= k <= vocab:
      raise ValueError(f"k={k} must be in [1, {vocab}] (the teacher's vocabulary range)")
    self.cfg, self.k, self.temperature, self.vocab, self.mesh = teacher.cfg, k, float(temperature), vocab, mesh
    graphdef, params = nnx.split(teacher)
    if mesh is None:
      self.params = jax.device_put(params, jax.devices()[0])
    else:
      teacher.cfg.check_tensor_split(mesh.shape["tensor"])
      self.params = jax.device_put(params, param_shardings(nnx.get_partition_spec(params), mesh))
    fn = functools.partial(_topk_rows, teacher_def=graphdef, k=k, temperature=self.temperature, vocab=vocab)
    if mesh is None:
      self._fn = jax.jit(fn)
    else:
      self._fn = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(data_specs(self.params), P(DATA)), out_specs=P(DATA),
                                       axis_names={DATA}, check_vma=False))

  def __call__(self, inputs_BxT) -> losses.TopK:
    """The teacher's top-k of host or device rows ``[B, T]`` (B a multiple of the mesh's ``data``)."""
    if self.mesh is None:
      inputs_BxT = jax.device_put(inputs_BxT, jax.devices()[0])
    elif not isinstance(inputs_BxT, jax.Array) or inputs_BxT.sharding.mesh != self.mesh:
      inputs_BxT = host_to_global(np.asarray(inputs_BxT), self.mesh)
    return self._fn(self.params, inputs_BxT)

  def spec(self, source: str) -> TopKTeacher:
    return TopKTeacher(cfg=self.cfg, k=self.k, temperature=self.temperature, vocab=self.vocab, source=source)
