"""Quantization-aware students (``student.quantize_aware``): the student trains through fake quantization, via qwix.

`quantize_aware(model, QuantizeAware(weights="int4", group_size=32))` returns the decoder with qwix's quantized
training (``qwix.QtProvider``) on its block projections (attention q / k / v / o, MLP gate / up / down): in the
forward pass each projection's weight (and, with ``activations: int8``, its input) is quantized and dequantized
(symmetric absmax scales per output channel, or per ``group_size`` inputs of each output channel), in the backward
pass the gradient goes straight through to the float weights. The parameters, the optimizer state and the
checkpoints are those of the float model; the embedding, the norms and the LM head stay float. The teacher is
untouched (its own precision, or ``teacher.quantize``).

`post_training(model, settings)` quantizes a float student with the SAME rule after training (qwix's
``PtqProvider``: weights stored as integer ``qvalue`` plus ``scale``), which is both how the trained student is served
and the baseline a quantization-aware student is measured against (PTQ). `dequantized` writes the weights a
quantized student computes with back into a float decoder: the form `export_hf` writes (a checkpoint any
transformers version loads, whose weights are exactly representable in the quantized grid).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from meshdistill.models._build import _create
from meshdistill.models.quantize import apply_rules, projection_pattern

log = logging.getLogger(__name__)

WEIGHTS = {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}
ACTIVATIONS = {"none": None, "int8": jnp.int8}
SETTING = "student.quantize_aware"


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeAware:
  """``student.quantize_aware``: the quantization the student trains through (``weights: null``: off).

  Args:
    weights: ``int8``, ``int4`` or ``fp8`` (float8 e4m3) weights of the block projections.
    activations: ``none`` or ``int8`` (dynamic, per token) inputs of those projections.
    group_size: scales per ``group_size`` input features of each output channel (it must divide every
      projection's input size: ``d_model``, ``n_heads * head_dim``, ``mlp_hidden``); null: one scale per output
      channel.
  """

  weights: str | None = None
  activations: str = "none"
  group_size: int | None = None

  def __post_init__(self):
    if self.weights is not None and self.weights not in WEIGHTS:
      raise ValueError(f"{SETTING}.weights={self.weights!r}; choose one of {list(WEIGHTS)} (or null: off)")
    if self.activations not in ACTIVATIONS:
      raise ValueError(f"{SETTING}.activations={self.activations!r}; choose one of {list(ACTIVATIONS)}")
    g = self.group_size
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
      raise ValueError(f"{SETTING}.group_size={g!r} must be a positive integer (input features per scale), or null "
                       "for one scale per output channel")
    if self.weights is None and (self.activations != "none" or g is not None):
      raise ValueError(f"{SETTING}: activations / group_size are set but weights is null; set {SETTING}.weights "
                       f"to one of {list(WEIGHTS)}")

  @property
  def enabled(self) -> bool:
    return self.weights is not None

  def check(self, cfg) -> None:
    """Raises a ValueError naming ``group_size`` when it does not divide a projection's input size."""
    if self.group_size is None:
      return
    sizes = {"d_model": cfg.d_model, "n_heads * head_dim": cfg.n_heads * cfg.hd, "mlp_hidden": cfg.mlp_hidden}
    bad = {k: v for k, v in sizes.items() if v % self.group_size}
    if bad:
      raise ValueError(f"{SETTING}.group_size={self.group_size} does not divide {bad} (the input sizes of the "
                       "student's projections); choose a common divisor, or null for per-channel scales")

  def rule(self, provider: str):
    import qwix  # pylint: disable=g-import-not-at-top

    rule = qwix.QtRule if provider == "qt" else qwix.QuantizationRule
    return rule(module_path=projection_pattern(), weight_qtype=WEIGHTS[self.weights],
                act_qtype=ACTIVATIONS[self.activations], tile_size=self.group_size)

  def describe(self) -> str:
    acts = "" if self.activations == "none" else f", {self.activations} activations"
    return f"{self.weights} weights" + (f" in groups of {self.group_size}" if self.group_size else "") + acts


def _sample_input():
  return jnp.zeros((1, 1), jnp.int32)


def quantize_aware(model, settings: QuantizeAware):
  """``model`` training through ``settings``' fake quantization (qwix quantized training: straight-through
  gradients); ``model`` itself is unchanged and shares its weights with the result. Wrap a model already built for
  its mesh (``init_model(cfg, mesh=...)``, ``load_hf(path, mesh)``): re-partitioning a wrapped model for another
  ``tensor`` size rebuilds it without the wrapper."""
  import qwix  # pylint: disable=g-import-not-at-top

  if not settings.enabled:
    return model
  settings.check(model.cfg)
  if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
    raise ValueError(f"{SETTING} with student.lora: adapters train on a frozen base; choose one of the two")
  log.info("student: quantization-aware training with %s", settings.describe())
  return apply_rules(model, qwix.QtProvider([settings.rule("qt")]), _sample_input(), SETTING)


def abstract_quantize_aware(cfg, settings: QuantizeAware):
  """(graphdef, abstract state) of a `Decoder` of ``cfg`` training through ``settings``, without allocating it (the
  planner's student: the float parameters, the fake-quantizing program)."""
  return nnx.split(nnx.eval_shape(lambda: quantize_aware(_create(cfg, 0), settings)))


def post_training(model, settings: QuantizeAware):
  """A copy of the float ``model`` with its block projections quantized by ``settings``' rule after training
  (qwix ``PtqProvider``: integer or float8 ``qvalue`` and ``scale`` per output channel or group)."""
  import qwix  # pylint: disable=g-import-not-at-top

  settings.check(model.cfg)
  return apply_rules(model, qwix.PtqProvider([settings.rule("ptq")]), _sample_input(), SETTING)


def quantized_weights(quantized) -> dict:
  """``{kernel path: qwix QArray}`` of a post-training-quantized decoder (`post_training`): each quantized
  projection's integer (or float8) ``qvalue`` and float ``scale``, in the model's layout (``[in, out]`` and
  ``[in / group_size or 1, out]``; a scanned decoder's with a leading layer axis)."""
  import qwix  # pylint: disable=g-import-not-at-top

  found = {}
  for path, module in nnx.iter_graph(quantized):
    kernel = getattr(module, "kernel", None) if isinstance(module, nnx.Module) else None
    value = getattr(kernel, "array", None)
    value = value.get_value() if isinstance(value, nnx.Variable) else value
    if isinstance(value, qwix.QArray):  # a quantized projection's weight (qwix's WithAux around a QArray)
      found[(*path, "kernel")] = value
  return found


def dequantized(model, settings: QuantizeAware):
  """A float decoder of ``model``'s config whose projection weights are the quantized-then-dequantized weights of
  ``settings`` (what the quantized student computes with, up to activation quantization)."""
  import qwix  # pylint: disable=g-import-not-at-top

  settings.check(model.cfg)
  dequant = {k: qwix.dequantize(v) for k, v in quantized_weights(post_training(model, settings)).items()}
  graphdef, state = nnx.split(model)
  leaves = [(k, v.replace(dequant[k].astype(v.get_value().dtype)) if k in dequant else v)
            for k, v in nnx.to_flat_state(state)]
  if not dequant:
    raise AssertionError(f"{SETTING}: no projection was quantized (qwix rule {projection_pattern()!r})")
  return nnx.merge(graphdef, nnx.from_flat_state(leaves))
