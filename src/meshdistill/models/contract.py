"""The model contract: what the train step, the strategies, generation, export and the planner ask of a model.

Three protocols, each the exact surface its callers use (`typing.Protocol`, runtime-checkable, so
``isinstance(model, LanguageModel)`` checks that the members exist; `check_model` also names what is missing):

`ModelSpec` (``model.cfg``)
  the sizes the step, the teacher cache and the planner read: ``vocab_size`` (the real vocabulary: logits
  and ``head_weight()`` never carry padding), ``max_len``, ``d_model``, ``n_layers``, ``n_heads``,
  ``n_kv_heads``, ``hd``, ``tie_embeddings``, and ``check_tensor_split(tensor)`` (raises naming the size a
  ``tensor``-way split cannot divide). `meshdistill.models.ModelConfig` and the tunix adapter's
  ``TunixConfig`` are both one.

`LanguageModel` (teachers and students: `meshdistill.train.step`, the strategies, the teacher cache)
  ``cfg`` (a `ModelSpec`); ``model(tokens_BxT, capture=(...), logits=True) -> ModelOutput`` with
  ``logits`` float32 ``[B, T, V]`` (``None`` with ``logits=False``) and, on request, ``hidden`` (L+1) x
  ``[B, T, D]``, ``attn`` L x ``[B, H, T, T]`` and ``final`` ``[B, T, D]`` (a model that cannot give an
  entry raises a ValueError naming it); with ``segment_ids`` / ``positions`` ``[B, T]`` (rows packed from several
  documents, ``data.packing: documents``) attention stays within a document and RoPE restarts at each;
  ``head_weight() -> [D, V]``, the LM head that maps ``final`` to the logits (chunked losses never build
  ``[B, T, V]``).

`DecodingModel` (generation, `meshdistill.models.generate`; on-policy distillation)
  a `LanguageModel` with a cached decode step that is the model's own forward pass, not a second copy:
  ``empty_cache(batch, slots, sharding=None) -> kv`` and ``decode_step(tokens_BxT, kv, valid_BxS, index,
  positions_BxT, last_only=False, kernel=False) -> (logits float32 [B, T or 1, V], kv)``.

The built-in `meshdistill.models.decoder.Decoder` is a `DecodingModel`; the tunix adapter
(`meshdistill.models.tunix_adapter.TunixLM`) is a `LanguageModel` (no cached decoding). Export to
Hugging Face (`meshdistill.models.hf.export_hf`) needs the built-in decoder's parameters, and the family
(`meshdistill.models.families`) that names them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from meshdistill.models.decoder import ModelOutput


@runtime_checkable
class ModelSpec(Protocol):
  """The sizes of a model (``model.cfg``) its callers read."""

  vocab_size: int
  max_len: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  tie_embeddings: bool

  @property
  def hd(self) -> int:
    """Head dimension."""
    ...

  def check_tensor_split(self, tensor: int) -> None:
    """Raises a ValueError naming a size a ``tensor``-way split cannot divide."""
    ...


@runtime_checkable
class LanguageModel(Protocol):
  """A teacher or student: a forward pass with captures, and its LM head."""

  cfg: ModelSpec

  def __call__(self, tokens_BxT: jax.Array, *, capture: tuple[str, ...] = (), logits: bool = True,
               segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> ModelOutput:
    """Logits ``[B, T, V]`` (float32) and the captured entries (``"hidden"``, ``"attn"``, ``"final"``); packed
    documents' ``segment_ids`` / ``positions`` ``[B, T]`` keep each document's tokens to themselves."""
    ...

  def head_weight(self) -> jax.Array:
    """The LM head as ``[D, V]`` (no vocabulary padding)."""
    ...


@runtime_checkable
class DecodingModel(LanguageModel, Protocol):
  """A `LanguageModel` that decodes against a key/value cache (generation, on-policy distillation)."""

  def empty_cache(self, batch: int, slots: int, sharding: Any = None) -> Any:
    """Zero key/value caches of ``slots`` positions for ``batch`` rows."""
    ...

  def decode_step(self, tokens_BxT: jax.Array, kv: Any, valid_BxS: jax.Array, index: Any, positions_BxT: jax.Array,
                  *, last_only: bool = False, kernel: bool = False) -> tuple[jax.Array, Any]:
    """``(logits float32 [B, T or 1, V], new kv)`` of ``tokens_BxT`` written into cache slots ``index ..``, attending
    to the first ``valid_BxS.shape[1]`` slots (the cache may be longer); ``kernel``: the caches are placed per device
    (whole on one, or rows over ``data`` and key/value heads over ``tensor`` of the mesh in context; a model may
    then write and attend in one kernel per device)."""
    ...


_MEMBERS = {
    ModelSpec: ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "n_kv_heads", "tie_embeddings", "hd",
                "check_tensor_split"),
    LanguageModel: ("cfg", "__call__", "head_weight"),
    DecodingModel: ("cfg", "__call__", "head_weight", "empty_cache", "decode_step"),
}


def missing_members(obj: Any, protocol: type = LanguageModel) -> list[str]:
  """The members of ``protocol`` that ``obj`` lacks (its ``cfg`` checked against `ModelSpec` as ``cfg.<name>``)."""
  if protocol not in _MEMBERS:
    raise ValueError(f"protocol={protocol!r}; choose one of {[p.__name__ for p in _MEMBERS]}")
  missing = [m for m in _MEMBERS[protocol] if not hasattr(obj, m)]
  if protocol is not ModelSpec and hasattr(obj, "cfg"):
    missing += [f"cfg.{m}" for m in missing_members(obj.cfg, ModelSpec)]
  return missing


def check_model(obj: Any, protocol: type = LanguageModel, who: str = "model") -> None:
  """Raises a TypeError naming ``who``, its type and the members of ``protocol`` it lacks."""
  missing = missing_members(obj, protocol)
  if missing:
    raise TypeError(
        f"{who} of type {type(obj).__name__} is not a {protocol.__name__}: it lacks {missing} "
        "(see meshdistill.models.contract; the built-in Decoder has all of them)"
    )


__all__ = ["DecodingModel", "LanguageModel", "ModelSpec", "check_model", "missing_members"]
