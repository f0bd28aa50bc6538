"""LoRA and QLoRA students: low-rank adapters on a frozen (optionally quantized) `Decoder`, via qwix.

`apply_lora(model, LoraConfig(rank=8))` returns the same decoder with, on every targeted projection
``W [in, out]``, two adapter weights ``kernel_lora_a [in, r]`` and ``kernel_lora_b [r, out]`` (flax
``nnx.LoRAParam``), so the projection computes ``x @ W + (x @ A @ B) * alpha / rank``. ``B`` starts at
zero: at initialisation the adapted model computes exactly what the base model computes.

Adapters follow their base weight's split over ``tensor``: for a column-split weight (q / k / v, MLP
gate / up: ``W`` split over ``out``) ``B`` is split over ``out`` and ``A`` is replicated; for a
row-split weight (attention out, MLP down: ``W`` split over ``in``) ``A`` is split over ``in`` and
``B`` replicated. The low-rank product therefore needs no collective beyond the one the base matmul
already has.

With ``quantize`` (``"int8"``, ``"int4"`` or ``"nf4"``) the targeted base weights are stored quantized
(per output channel, qwix ``QArray``: integer ``qvalue`` plus float ``scale``) and dequantised inside
the step; the adapters stay float32 (QLoRA).

Training only the adapters is the `Distiller`'s ``trainable`` filter (`TRAINABLE`, picked
automatically for a student that holds adapters): the step differentiates and the optimizer keeps
state for the adapters only; the base weights are inputs of the step and never move.
`merge_lora` folds the adapters into the (dequantised) base weights, giving a plain `Decoder` for
`meshdistill.models.export_hf`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshdistill.models._build import _create, abstract_params
from meshdistill.models.decoder import Decoder, ModelConfig
from meshdistill.models.quantize import QUANTIZE, fitted_shardings, init_tokens, placed, projection_pattern, qtype

log = logging.getLogger(__name__)

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the decoder's projections (attn/*, mlp/*)
TRAINABLE = nnx.LoRAParam  # the nnx filter of the parameters a LoRA student trains


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """``student.lora``: adapters of rank ``rank`` (0: no adapters, the whole student trains).

  Args:
    rank: adapter rank r (> 0 turns LoRA on); at most the smaller side of every targeted weight.
    alpha: scale numerator: the adapters add ``(x @ A @ B) * alpha / rank``; ``None``: ``2 * rank``.
    targets: projection names, from `TARGETS` (``q k v o`` of attention, ``gate up down`` of the MLP).
    dropout: adapter input dropout; only 0 is supported (the step carries no dropout key).
    quantize: ``None`` (float base) or one of `QUANTIZE`: the frozen base weights of the targeted
      projections stored quantized (QLoRA).
  """

  rank: int = 0
  alpha: float | None = None
  targets: tuple[str, ...] = TARGETS
  dropout: float = 0.0
  quantize: str | None = None

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
      raise ValueError(f"student.lora.rank={self.rank!r} must be an integer >= 1 (0 turns LoRA off), e.g. 8")
    if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                                   or not self.alpha > 0):
      raise ValueError(f"student.lora.alpha={self.alpha!r} must be a number > 0 (e.g. 16), or null for 2 * rank")
    targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
    object.__setattr__(self, "targets", targets)
    if not targets or any(not isinstance(t, str) for t in targets):
      raise ValueError(f"student.lora.targets={list(targets)!r} must be a non-empty list of names from {TARGETS}")
    bad = [t for t in targets if t not in TARGETS]
    if bad:
      raise ValueError(
          f"student.lora.targets names {bad}, which match no module of the decoder; choose from {list(TARGETS)} "
          "(attention q/k/v/o, MLP gate/up/down)"
      )
    if self.dropout != 0:
      raise ValueError(
          f"student.lora.dropout={self.dropout!r}: only 0 is supported (the train step carries no dropout key)"
      )
    if self.quantize is not None and self.quantize not in QUANTIZE:
      raise ValueError(f"student.lora.quantize={self.quantize!r}; choose one of {list(QUANTIZE)} or null")

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale_alpha(self) -> float:
    return float(2 * self.rank if self.alpha is None else self.alpha)


def _module_path(path) -> str:
  return "/".join(str(p) for p in path)


def _targeted(model: Decoder, lora: LoraConfig) -> dict[str, nnx.Linear]:
  """The decoder's linear layers ``lora`` adapts, by path (``blocks/0/attn/q``)."""
  pattern = re.compile(projection_pattern(lora.targets))
  found = {_module_path(p): m for p, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)}
  return {p: m for p, m in found.items() if pattern.fullmatch(p)}


def check_lora(model: Decoder, lora: LoraConfig) -> None:
  """Raises ValueError for targets matching no module, or a rank larger than a targeted weight allows."""
  moe = getattr(getattr(model, "cfg", None), "moe", None)
  mlp = [t for t in lora.targets if t in ("gate", "up", "down")]
  if moe is not None and mlp:
    raise ValueError(
        f"student.lora.targets={list(lora.targets)} names the MLP projections {mlp}, but this student's MLPs are "
        "mixtures of experts whose weights are stacked [experts, in, out] and take no adapters; target the attention "
        "projections only (targets: [q, k, v, o]; the router and experts then stay frozen) or train the whole student "
        "(lora.rank: 0)"
    )
  chosen = _targeted(model, lora)
  for t in lora.targets:
    if not any(p.endswith("/" + t) for p in chosen):
      have = sorted({p.rsplit("/", 1)[1] for p, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear) for p in
                     [_module_path(p)] if p.startswith("blocks/")})
      raise ValueError(f"student.lora.targets: {t!r} matches no module of the student; its projections: {have}")
  for path, m in chosen.items():
    small = min(m.in_features, m.out_features)
    if lora.rank > small:
      raise ValueError(
          f"student.lora.rank={lora.rank} is larger than the layer {path} ([{m.in_features}, {m.out_features}]) "
          f"allows; choose a rank <= {small} (the smaller side of every targeted weight)"
      )


def _qtype(name: str | None):
  return qtype(name, "student.lora.quantize")


def apply_lora(model: Decoder, lora: LoraConfig, *, seed: int = 0, mesh: Mesh | None = None) -> Decoder:
  """A copy of ``model`` with adapters (and, with ``lora.quantize``, a quantized base); ``model`` is unchanged.

  ``A`` is drawn from ``seed`` (He-uniform), ``B`` is zero. With ``mesh`` every weight, adapters and
  quantized storage included, is placed per its ``tensor`` split.
  """
  import qwix  # pylint: disable=g-import-not-at-top

  if not lora.enabled:
    raise ValueError("apply_lora: student.lora.rank is 0 (LoRA off); set a rank >= 1")
  if is_lora(model):
    raise ValueError("apply_lora: the model already holds adapters")
  if getattr(model.cfg, "scan_layers", False):
    raise ValueError(
        "student.lora needs per-layer blocks: qwix adapts the linear layers it finds by path (blocks/<i>/attn/q), "
        "which stacked blocks do not have; set student.scan_layers=false for a LoRA student (the teacher may stay "
        "scanned)"
    )
  check_lora(model, lora)
  provider = qwix.LoraProvider(
      module_path=projection_pattern(lora.targets),
      rank=lora.rank,
      alpha=lora.scale_alpha,
      weight_qtype=_qtype(lora.quantize),
  )
  adapted = qwix.apply_lora_to_model(model, provider, init_tokens(model.cfg), rngs=nnx.Rngs(params=seed))
  adapted.lora = lora  # a static attribute: part of the graph definition, read by `merge_lora`
  if mesh is not None:  # quantized storage is computed eagerly; pin every leaf to its split
    adapted = placed(adapted, mesh)
  n = sum(x.size for x in jax.tree.leaves(nnx.state(adapted, TRAINABLE)))
  log.info("LoRA: rank %d, alpha %g, targets %s, quantize %s: %d adapter parameters",
           lora.rank, lora.scale_alpha, list(lora.targets), lora.quantize, n)
  return adapted


def is_lora(model_or_state: Any) -> bool:
  """Whether a decoder (or its state) holds LoRA adapters."""
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
  return bool(jax.tree.leaves(nnx.filter_state(state, TRAINABLE)))


def adapter_count(model: Decoder) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, TRAINABLE)))


def _value(x):
  return x[...] if isinstance(x, nnx.Variable) else x


def merge_lora(model: Decoder, adapters: bool = True) -> Decoder:
  """A plain `Decoder` whose targeted kernels are ``dequantize(W) + A @ B * alpha / rank``; same placement.

  ``adapters=False``: the frozen base alone (``dequantize(W)``), what a PEFT adapter directory applies to."""
  import qwix  # pylint: disable=g-import-not-at-top
  from qwix._src.providers import ptq  # pylint: disable=g-import-not-at-top

  cfg: ModelConfig = model.cfg
  graphdef, abstract, _ = abstract_params(cfg)
  merged = {}
  for path, m in nnx.iter_modules(model):
    if not hasattr(m, "kernel_lora_a"):
      continue
    kernel = m.kernel
    if isinstance(kernel, ptq.WithAux):
      base = qwix.dequantize(jax.tree.map(_value, kernel.array, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    else:
      base = _value(kernel)
    a, b = _value(m.kernel_lora_a), _value(m.kernel_lora_b)
    lora: LoraConfig = model.lora
    delta = (a @ b) * (lora.scale_alpha / lora.rank) if adapters else 0.0
    merged[tuple(path) + ("kernel",)] = (base.astype(jnp.float32) + delta).astype(jnp.float32)

  plain = nnx.to_flat_state(abstract)
  state = nnx.state(model)
  flat = dict(nnx.to_flat_state(state))
  values = []
  for key, var in plain:
    if key in merged:
      values.append((key, var.replace(merged[key])))
    else:
      values.append((key, var.replace(_value(flat[key]))))
  return nnx.merge(graphdef, nnx.from_flat_state(values))


def abstract_lora(cfg: ModelConfig, lora: LoraConfig, mesh: Mesh | None = None):
  """(graphdef, abstract state, shardings or None) of a LoRA student, without allocating it."""
  model = nnx.eval_shape(lambda: apply_lora(_create(cfg, 0), lora))
  graphdef, state = nnx.split(model)
  return graphdef, state, (None if mesh is None else fitted_shardings(state, mesh))
