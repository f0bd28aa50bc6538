"""What the mixture-of-experts families share: `ExpertFamily`, a `Family` whose blocks route tokens to experts
(`meshdistill.models.moe`), with the expert weight names of its checkpoints.

Hugging Face checkpoints (transformers 5 writes them so too) store each expert's projections as separate
``[out, in]`` tensors, ``model.layers.<i>.<moe>.experts.<e>.<proj>.weight``; the decoder stacks them ``[E, in,
out]``. `Family.weight_name` names such a stacked parameter with the placeholder ``{e}`` in place of the expert
index (``model.layers.0.mlp.experts.{e}.gate_proj.weight``); `meshdistill.models.hf` reads and writes the ``E``
tensors it stands for, each device only the experts and the window of its shard.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from meshdistill.models._config import ModelConfig
from meshdistill.models.families._base import Family, param_path, weight_name
from meshdistill.models.moe import MoeConfig

EXPERT = "{e}"  # the expert-index placeholder in a stacked expert weight's Hugging Face name


class ExpertFamily(Family, abc.ABC):
  """A family with mixture-of-experts blocks. Subclasses name ``moe_module`` (the block's MLP module in the
  checkpoint: ``mlp`` or ``block_sparse_moe``) and ``projections`` (the decoder's ``gate`` / ``up`` / ``down`` ->
  the checkpoint's expert projection names), and map the config in `moe_from_hf` / `moe_fields`."""

  experts = True
  moe_module: ClassVar[str] = "mlp"
  projections: ClassVar[dict[str, str]] = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

  @abc.abstractmethod
  def moe_from_hf(self, hf: dict[str, Any], n_layers: int) -> MoeConfig:
    """The `MoeConfig` of a checkpoint's ``config.json`` (``n_layers`` blocks)."""

  @abc.abstractmethod
  def moe_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields of ``cfg.moe``."""

  def check_hf(self, hf: dict[str, Any], where: str) -> None:
    super().check_hf(hf, where)
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
      raise ValueError(f"{where}: sliding_window={hf['sliding_window']} is not supported; the decoder attends over "
                       "the whole sequence (expected null)")

  def from_hf(self, hf: dict[str, Any], *, max_len: int | None = None, dtype: str = "float32",
              where: str = "config.json") -> ModelConfig:
    cfg = super().from_hf(hf, max_len=max_len, dtype=dtype, where=where)
    try:
      moe = self.moe_from_hf(hf, cfg.n_layers)
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"{where}: the mixture-of-experts fields of model_type={self.model_type!r} cannot be read "
                       f"({e})") from None
    return cfg.replace(moe=moe)

  def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    return {**self.moe_fields(cfg), "router_aux_loss_coef": cfg.moe.aux_loss_weight, "output_router_logits": False}

  def _expert_names(self) -> dict[tuple[str, ...], tuple[str, bool]]:
    """Block parameter path -> (name inside ``model.layers.<i>.``, transposed?) of the expert weights."""
    names = {("mlp", "router"): (f"{self.moe_module}.gate.weight", True)}
    for ours, theirs in self.projections.items():
      names[("mlp", ours)] = (f"{self.moe_module}.experts.{EXPERT}.{theirs}.weight", True)
    return names

  def weight_name(self, path: tuple) -> tuple[str, bool]:
    p = tuple(str(x) for x in path)
    if len(p) > 2 and p[0] == "blocks" and p[2:] in self._expert_names():
      name, transposed = self._expert_names()[p[2:]]
      return f"model.layers.{p[1]}.{name}", transposed
    return weight_name(path)

  def param_path(self, name: str) -> tuple[tuple, bool]:
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
      for path, (hf, transposed) in self._expert_names().items():
        if parts[3] == hf:
          return ("blocks", int(parts[2]), *path), transposed
    found = param_path(name)
    if found is None:
      raise ValueError(f"Hugging Face tensor {name!r} has no counterpart in the decoder of family {self.name!r}")
    return found
