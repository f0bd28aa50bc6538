"""Logit distillation: a divergence at temperature tau mixed with hard-label CE.

`LogitRecipe` holds what `LogitKD` and `ChunkedLogitKD` share: the settings, their checks,
the per-token loss and metrics, and the divergence fallback. The two differ only in where the
logits come from (the models' heads, or chunks formed from the final hidden states).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Union

import jax
import jax.numpy as jnp

from meshdistill import losses
from meshdistill.models import ModelOutput
from meshdistill.losses.schedules import Scalar, check_integer, check_scalar, value_at, value_range
from meshdistill.strategies._base import SequenceStrategy, Strategy, register

Divergence = Callable[..., jax.Array]

# setting -> keyword arguments of `check_scalar` (allowed interval, an example that works)
# temperature >= 0.01: below it the float32 softmax of logits / tau is already one-hot for logit gaps of 1 or more
# (exp(-1 / 0.01) = exp(-100) is below float32's smallest normal, exp(-87.3)), so a lower tau changes no target,
# only the size of the 1 / tau factors of the loss and its gradient, which overflow float32 (NaN) from about 1e-9.
RANGES = {
    "temperature": {"low": 0.01, "example": "2.0; below 0.01 softmax(logits / temperature) is one-hot in float32 for "
                                            "logit gaps of 1 or more, and its 1 / temperature factors overflow to NaN "
                                            "from about 1e-9"},
    "alpha": {"low": 0.0, "high": 1.0, "example": "0.5"},
    "beta": {"low": 0.0, "high": 1.0, "example": "0.5"},
    "skew": {"low": 0.0, "high": 1.0, "high_open": True, "example": "0.1"},
}


def logit_token_metrics(student_TxV, teacher_TxV, targets_T, mask_T) -> dict[str, jax.Array]:
  """Per-token monitoring metrics shared by the logit strategies (``[T]``, 0 where masked)."""
  return {
      "ce": losses.cross_entropy(student_TxV, targets_T, mask_T),
      "teacher_ce": losses.cross_entropy(teacher_TxV, targets_T, mask_T),
      "corr": losses.pearson(student_TxV, teacher_TxV, mask_T),
      "agree": losses.top1_agreement(student_TxV, teacher_TxV, mask_T),
  }


def logit_metrics(student: ModelOutput, teacher: ModelOutput, targets_T, mask_T) -> dict[str, jax.Array]:
  """Token sums of `logit_token_metrics` for one sequence."""
  per_token = logit_token_metrics(student.logits, teacher.logits, targets_T, mask_T)
  return {k: jnp.sum(v) for k, v in per_token.items()}


def resolve_divergence(owner: str, divergence: Union[str, Divergence]) -> Divergence:
  """The per-token function ``f(student_TxV, teacher_TxV, mask_T, temperature, **hyper) -> [T]``.

  ``divergence`` is a name of `meshdistill.losses.DIVERGENCES` or such a function.
  """
  if callable(divergence):
    return divergence
  if divergence not in losses.DIVERGENCES:
    raise ValueError(
        f"{owner}.divergence={divergence!r} is unknown; choose one of {sorted(losses.DIVERGENCES)} or pass a "
        "function f(student_TxV, teacher_TxV, mask_T, temperature) -> [T]"
    )
  return losses.DIVERGENCES[divergence]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitRecipe(Strategy):
  """``loss = alpha * tau^2 * D(teacher_tau, student_tau) + (1 - alpha) * CE(student, targets)``.

  Args:
    temperature: tau >= 0.01 (see `RANGES`), softens both distributions (the ``tau^2`` factor keeps the
      gradient scale independent of tau).
    alpha: weight of the distillation term, in [0, 1].
    divergence: ``D``, a name in `meshdistill.losses.DIVERGENCES`: ``forward_kl``
      (default), ``reverse_kl``, ``jsd``, ``skew_kl``, ``skew_reverse_kl``, ``tvd``, ``mse``;
      or any per-token function ``f(student_TxV, teacher_TxV, mask_T, temperature) -> [T]``
      that reduces over V with sums and maxima only (its metric is named after it).
    beta: ``jsd`` only: the generalised JSD's interpolation in [0, 1] (TRL's convention,
      near 0 ~ forward KL, near 1 ~ reverse KL; see `meshdistill.losses.jsd`).
    skew: ``skew_kl`` / ``skew_reverse_kl`` only: mixture weight in [0, 1) (DistiLLM: 0.1).

  ``temperature``, ``alpha``, ``beta`` and ``skew`` are each a number, a schedule (a
  function of the step, see `meshdistill.losses.schedules`) or a schedule spec dict such as
  ``{"kind": "linear", "start": 3.0, "end": 1.0, "steps": 1000}``, checked by
  `meshdistill.losses.schedules.check_scalar`; schedules are evaluated on the traced step inside
  the compiled step (no recompilation).

  Metrics (token means): ``loss``, ``kl`` (forward KL at tau over the full vocabulary,
  always reported for comparability), ``ce``, ``teacher_ce``, ``corr``, ``agree``, and,
  when the optimised term is not the full forward KL, the term itself under `term_name`.
  """

  temperature: Scalar = 2.0
  alpha: Scalar = 0.5
  divergence: Union[str, Divergence] = "forward_kl"
  beta: Scalar = 0.5
  skew: Scalar = 0.1

  def __post_init__(self):
    owner = type(self).__name__
    resolve_divergence(owner, self.divergence)
    checked = {name: check_scalar(f"{owner}.{name}", getattr(self, name), **kw) for name, kw in RANGES.items()}
    if self.divergence == "jsd" and not callable(self.beta):
      lo, hi = value_range(self.beta)
      if lo == hi and lo in (0.0, 1.0):
        other = "forward_kl" if lo == 0.0 else "reverse_kl"
        raise ValueError(
            f"{owner}.beta={self.beta!r} makes divergence='jsd' identically 0 (its mixture collapses onto one "
            f"side); for the limit it tends to use divergence={other!r}, or choose 0 < beta < 1"
        )
    for name, value in checked.items():  # a YAML-style spec dict becomes a schedule function
      object.__setattr__(self, name, value)

  @property
  def term_name(self) -> str:
    """Metric name of the optimised term (``kl`` for the full forward KL)."""
    fn = resolve_divergence(type(self).__name__, self.divergence)
    if fn is losses.forward_kl:
      return "kl"
    return self.divergence if isinstance(self.divergence, str) else getattr(fn, "__name__", "divergence")

  def hyperparameters(self) -> tuple[str, ...]:
    """The divergence's own settings (``beta``, ``skew``) it is called with."""
    return () if callable(self.divergence) else losses.HYPERPARAMETERS.get(self.divergence, ())

  def scalars(self, step) -> dict[str, jax.Array]:
    """Temperature, alpha and the divergence's hyper-parameters at ``step``."""
    names = ("temperature", "alpha", *self.hyperparameters())
    return {name: value_at(getattr(self, name), step) for name in names}

  def divergence_term(self, student_TxV, teacher_TxV, mask_T, tau, hyper) -> jax.Array:
    """The optimised per-token term ``[T]``."""
    return resolve_divergence(type(self).__name__, self.divergence)(student_TxV, teacher_TxV, mask_T, tau, **hyper)

  def token_terms(self, params, student_TxV, teacher_TxV, targets_T, mask_T) -> dict[str, jax.Array]:
    """Per-token loss and metrics (``[T]``, 0 where masked); ``params = scalars(step)``.

    The full forward KL (the default) takes the fused form `meshdistill.losses.forward_kl_terms` (the same
    values in one pass over V; its metrics carry no gradient); other divergences are formed term by term."""
    tau, alpha = params["temperature"], params["alpha"]
    if self.term_name == "kl":  # the default recipe: one pass over V, few collectives (`losses.forward_kl_terms`)
      return losses.forward_kl_terms(student_TxV, teacher_TxV, targets_T, mask_T, tau, alpha)
    hyper = {k: v for k, v in params.items() if k not in ("temperature", "alpha")}
    out = {"kl": losses.forward_kl(student_TxV, teacher_TxV, mask_T, tau)}
    out.update(logit_token_metrics(student_TxV, teacher_TxV, targets_T, mask_T))
    name = self.term_name
    if name != "kl":
      out[name] = self.divergence_term(student_TxV, teacher_TxV, mask_T, tau, hyper)
    out["loss"] = alpha * tau**2 * out[name] + (1.0 - alpha) * out["ce"]
    return out

  def fallback(self) -> LogitRecipe:
    """The same recipe on the logit MSE (steadier than a KL when a run blows up)."""
    return dataclasses.replace(self, divergence="mse")


@register("logit_kd")
@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitKD(LogitRecipe, SequenceStrategy):
  """Logit distillation mixed with hard labels, on the models' logits (see `LogitRecipe`).

  Args (besides `LogitRecipe`'s):
    top_k: None for the full vocabulary, or k: compare on the teacher's top-k tokens plus
      one tail bin (`meshdistill.losses.topk_divergence`; a named divergence of
      distributions only, not ``mse``); the term's metric is ``topk_<divergence>``.
    capture: extra model outputs (none needed).
  """

  top_k: int | None = None
  capture: tuple[str, ...] = ()
  accepts_topk: ClassVar[bool] = True  # with top_k set, the teacher's top-k per token is all it reads
  chunked_form: ClassVar[str | None] = "chunked_logit_kd"  # `ChunkedLogitKD`, the same recipe (distill.chunk_size)

  def __post_init__(self):
    super().__post_init__()
    check_integer("LogitKD.top_k", self.top_k, 1, allow_none=True, meaning=" (None: the full vocabulary)")
    if self.top_k is not None and self.divergence not in losses.DISTRIBUTION_DIVERGENCES:
      raise ValueError(
          f"LogitKD.top_k={self.top_k} needs a divergence of distributions, but divergence={self.divergence!r} "
          f"compares logits; choose one of {sorted(losses.DISTRIBUTION_DIVERGENCES)} or top_k=None"
      )

  @property
  def term_name(self) -> str:
    return super().term_name if self.top_k is None else f"topk_{self.divergence}"

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    del key
    if self.top_k is not None:
      vocab = min(student_cfg.vocab_size, teacher_cfg.vocab_size)
      if self.top_k > vocab:
        raise ValueError(f"LogitKD.top_k={self.top_k} exceeds the vocabulary size {vocab}; use top_k <= {vocab}")
    return {}

  def divergence_term(self, student_TxV, teacher_TxV, mask_T, tau, hyper) -> jax.Array:
    if self.top_k is None:
      return super().divergence_term(student_TxV, teacher_TxV, mask_T, tau, hyper)
    indices_TxK, logprobs_TxK = losses.teacher_topk(teacher_TxV, self.top_k, tau)
    tail_T = losses.topk_tail(teacher_TxV, indices_TxK, tau)
    return losses.topk_divergence(
        student_TxV, indices_TxK, logprobs_TxK, mask_T, tau, self.divergence, tail_T, **hyper
    )

  def fallback(self) -> LogitKD:
    return dataclasses.replace(self, divergence="mse", top_k=None)

  def per_sequence(self, params, student: ModelOutput, teacher: ModelOutput, targets_T, mask_T, step):
    del params
    if isinstance(teacher, losses.TopK):
      per_token = self.topk_token_terms(self.scalars(step), student.logits, teacher, targets_T, mask_T)
    else:
      per_token = self.token_terms(self.scalars(step), student.logits, teacher.logits, targets_T, mask_T)
    return {k: jnp.sum(v) for k, v in per_token.items()}

  def topk_token_terms(self, params, student_TxV, teacher: losses.TopK, targets_T, mask_T) -> dict[str, jax.Array]:
    """`token_terms` against a teacher given only by its top-k (`meshdistill.losses.TopK`, e.g. an offline
    cache): the same loss as a live teacher with the same ``top_k``; of the metrics only ``ce`` and
    ``agree`` (the teacher's top-1 is its first id) can be formed without the teacher's logits."""
    tau, alpha = params["temperature"], params["alpha"]
    hyper = {k: v for k, v in params.items() if k not in ("temperature", "alpha")}
    ids_TxK, logprobs_TxK, tail_T = losses.narrow_topk(teacher, self.top_k)
    term_T = losses.topk_divergence(student_TxV, ids_TxK, logprobs_TxK, mask_T, tau, self.divergence, tail_T, **hyper)
    at_top_T = jnp.take_along_axis(student_TxV, ids_TxK[:, :1], axis=-1)[:, 0]
    agree_T = (at_top_T >= jnp.max(student_TxV, axis=-1)).astype(jnp.float32)
    out = {self.term_name: term_T, "ce": losses.cross_entropy(student_TxV, targets_T, mask_T)}
    out["agree"] = agree_T * mask_T
    out["loss"] = alpha * tau**2 * term_T + (1.0 - alpha) * out["ce"]
    return out
