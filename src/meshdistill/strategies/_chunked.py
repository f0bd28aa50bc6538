"""Logit distillation without ``[B, T, V]`` logits: chunked over tokens, parallel over the vocabulary."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Union

import jax
import jax.numpy as jnp

from meshdistill import losses
from meshdistill.losses._chunked import chunked_token_sums
from meshdistill.models import ModelOutput
from meshdistill.strategies._logit import Scalar, value_at

Divergence = Callable[..., jax.Array]

# setting -> (low, high, low inclusive, high inclusive, example)
_RANGES = {
    "temperature": (0.0, float("inf"), False, False, "2.0"),
    "alpha": (0.0, 1.0, True, True, "0.5"),
    "beta": (0.0, 1.0, True, True, "0.5"),
    "skew": (0.0, 1.0, True, False, "0.1"),
}


def divergence_registry() -> dict[str, Divergence]:
  """Per-token divergences by name: ``losses.DIVERGENCES`` when the package has one, else forward KL."""
  registry = getattr(losses, "DIVERGENCES", None)
  return dict(registry) if registry else {"forward_kl": losses.forward_kl}


def resolve_divergence(divergence: Union[str, Divergence]) -> Divergence:
  """A divergence function ``f(student_CxV, teacher_CxV, mask_C, temperature, **hyper) -> [C]``.

  ``divergence`` is a name of `divergence_registry` or such a function.
  """
  if callable(divergence):
    return divergence
  registry = divergence_registry()
  if divergence not in registry:
    raise ValueError(
        f"ChunkedLogitKD.divergence={divergence!r} is unknown; choose one of {sorted(registry)} or pass a function "
        "f(student_CxV, teacher_CxV, mask_C, temperature) -> [C]"
    )
  return registry[divergence]


def _hyperparameters(divergence: Union[str, Divergence]) -> tuple[str, ...]:
  if callable(divergence):
    return ()
  return tuple(getattr(losses, "HYPERPARAMETERS", {}).get(divergence, ()))


def _as_scalar(name: str, value: Any) -> Scalar:
  """Checks a constant against its range; turns a schedule spec dict into a schedule function."""
  low, high, low_in, high_in, example = _RANGES[name]
  if callable(value):
    return value  # a schedule function cannot be checked without running it
  if isinstance(value, dict):
    from meshdistill import schedules  # pylint: disable=g-import-not-at-top

    lo, hi = schedules.value_range(value, f"ChunkedLogitKD.{name}")
    fn = schedules.from_spec(value, f"ChunkedLogitKD.{name}")
  else:
    try:
      lo = hi = float(value)
    except (TypeError, ValueError):
      raise ValueError(
          f"ChunkedLogitKD.{name}={value!r} must be a number, a schedule function or a schedule spec dict"
      ) from None
    fn = value
  if not ((lo >= low if low_in else lo > low) and (hi <= high if high_in else hi < high)):
    brackets = ("[" if low_in else "(", "]" if high_in else ")")
    interval = f"> {low}" if high == float("inf") else f"in {brackets[0]}{low}, {high}{brackets[1]}"
    raise ValueError(f"ChunkedLogitKD.{name}={value!r} must be {interval} (e.g. {example})")
  return fn


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedLogitKD:
  """`LogitKD` computed from final hidden states and LM-head weights, ``chunk_size`` tokens at a time.

  ``loss = alpha * tau^2 * D(teacher_tau, student_tau) + (1 - alpha) * CE(student, targets)``,
  with `LogitKD`'s metrics (token sums over unmasked tokens): ``kl`` (forward KL at tau),
  ``ce``, ``teacher_ce``, ``corr``, ``agree``, and the optimised term under the divergence's
  name when it is not the forward KL.

  The models run without their LM heads (``needs_logits = False``); the step hands over the
  heads (``needs_head = True``) and calls `per_batch` on all local rows at once. Their tokens
  are flattened and cut into chunks of ``chunk_size`` (`meshdistill.losses.chunked_token_sums`):
  per device at most ``chunk_size x V / tensor`` logits of each model exist at a time, the
  vocabulary is never gathered, and the backward pass recomputes nothing.

  Args:
    temperature: tau > 0.
    alpha: weight of the distillation term, in [0, 1].
    divergence: a name of `meshdistill.losses.DIVERGENCES` (default ``"forward_kl"``), or any
      per-token function ``f(student_CxV, teacher_CxV, mask_C, temperature) -> [C]`` that reduces
      over V with sums and maxima only (its metric is then named after the function).
    beta: ``jsd`` only, in [0, 1]; skew: ``skew_kl`` / ``skew_reverse_kl`` only, in [0, 1).
    chunk_size: tokens per chunk over this device's rows (``b * T`` tokens); ``0`` forms the full
      logits at once (the naive loss, same numbers). Memory per device scales with
      ``chunk_size * V / tensor`` instead of ``b * T * V / tensor``.

  ``temperature``, ``alpha``, ``beta``, ``skew`` are numbers, schedules (functions of the step)
  or schedule spec dicts (`meshdistill.schedules.from_spec`). No top-k variant: that needs a
  vocabulary-wide top-k per token (use `LogitKD(top_k=...)`).
  """

  temperature: Scalar = 2.0
  alpha: Scalar = 0.5
  divergence: Union[str, Divergence] = "forward_kl"
  beta: Scalar = 0.5
  skew: Scalar = 0.1
  chunk_size: int = 1024
  capture: tuple[str, ...] = ("final",)
  needs_logits: ClassVar[bool] = False
  needs_head: ClassVar[bool] = True

  def __post_init__(self):
    for name in _RANGES:
      object.__setattr__(self, name, _as_scalar(name, getattr(self, name)))
    if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 0:
      raise ValueError(
          f"ChunkedLogitKD.chunk_size={self.chunk_size!r} must be a non-negative integer: tokens per chunk "
          "(e.g. 1024), or 0 for the unchunked loss"
      )
    if "final" not in self.capture:
      raise ValueError(f"ChunkedLogitKD.capture={self.capture!r} must include 'final' (the LM-head input)")
    resolve_divergence(self.divergence)
    if self.divergence == "jsd" and not callable(self.beta) and float(self.beta) in (0.0, 1.0):
      other = "forward_kl" if float(self.beta) == 0.0 else "reverse_kl"
      raise ValueError(
          f"ChunkedLogitKD.beta={self.beta!r} makes divergence='jsd' identically 0; for that limit use "
          f"divergence={other!r}, or choose 0 < beta < 1"
      )

  @property
  def term_name(self) -> str:
    """Metric name of the optimised divergence (``kl`` for the forward KL)."""
    fn = resolve_divergence(self.divergence)
    if fn is losses.forward_kl:
      return "kl"
    return self.divergence if isinstance(self.divergence, str) else getattr(fn, "__name__", "divergence")

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    del student_cfg, teacher_cfg, key
    return {}

  def scalars(self, step) -> dict[str, jax.Array]:
    """Temperature, alpha and the divergence's hyper-parameters at ``step``."""
    out = {"temperature": value_at(self.temperature, step), "alpha": value_at(self.alpha, step)}
    for name in _hyperparameters(self.divergence):
      out[name] = value_at(getattr(self, name), step)
    return out

  def token_terms(self, params, student_CxV, teacher_CxV, targets_C, mask_C) -> dict[str, jax.Array]:
    """Per-token loss and metrics of one chunk; ``params = scalars(step)``."""
    tau, alpha = params["temperature"], params["alpha"]
    hyper = {k: v for k, v in params.items() if k not in ("temperature", "alpha")}
    out = {
        "kl": losses.forward_kl(student_CxV, teacher_CxV, mask_C, tau),
        "ce": losses.cross_entropy(student_CxV, targets_C, mask_C),
        "teacher_ce": losses.cross_entropy(teacher_CxV, targets_C, mask_C),
        "corr": losses.pearson(student_CxV, teacher_CxV, mask_C),
        "agree": losses.top1_agreement(student_CxV, teacher_CxV, mask_C),
    }
    name = self.term_name
    if name != "kl":
      out[name] = resolve_divergence(self.divergence)(student_CxV, teacher_CxV, mask_C, tau, **hyper)
    out["loss"] = alpha * tau**2 * out[name] + (1.0 - alpha) * out["ce"]
    return out

  def per_batch(
      self, params, student: ModelOutput, teacher: ModelOutput, heads, targets_BxT, mask_BxT, step
  ) -> dict[str, jax.Array]:
    """Token sums over this device's rows.

    ``student.final``: [b, T, D], ``teacher.final``: [b, T, E]; ``heads = (student_DxV,
    teacher_ExV)`` with V split over ``tensor``; ``targets_BxT``, ``mask_BxT``: [b, T].
    """
    del params
    student_head_DxV, teacher_head_ExV = heads
    s_final, t_final = student.final, teacher.final
    return chunked_token_sums(
        self.token_terms,
        self.scalars(step),
        s_final.reshape(-1, s_final.shape[-1]),
        student_head_DxV,
        t_final.reshape(-1, t_final.shape[-1]),
        teacher_head_ExV,
        targets_BxT.reshape(-1),
        jnp.asarray(mask_BxT, jnp.float32).reshape(-1),
        chunk_size=self.chunk_size,
    )
