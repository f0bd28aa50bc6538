"""The strategy contract: what the train step asks of a strategy, its defaults, and the registry by name.

Two kinds of strategy, told apart by ``needs_head``:

* per-sequence (`SequenceStrategy`, ``needs_head = False``): the step vmaps
  ``per_sequence(params, student, teacher, targets_T, mask_T, step)`` over the local rows;
  ``student`` / ``teacher`` are one sequence's `ModelOutput` (logits ``[T, V]``, hidden
  states ``(L+1) x [T, D]``, attention maps ``L x [H, T, T]``);
* per-batch (`BatchStrategy`, ``needs_head = True``): the step calls
  ``per_batch(params, student, teacher, heads, targets_BxT, mask_BxT, step)`` once on all
  local rows with the LM heads ``heads = (student_DxV, teacher_ExV)`` (V split over
  ``tensor``); with ``needs_logits = False`` the models skip their own heads and the
  strategy forms logits itself (e.g. chunked over tokens, `ChunkedLogitKD`). A model with a final logit
  soft-cap (``ModelConfig.final_softcap``, Gemma 2) adds ``softcaps=(student, teacher)`` (each a float or
  None): logits formed from a head must go through `meshdistill.models._variants.softcap` with it, on each vocabulary
  shard before any reduction; a strategy that declares ``reads_tied_heads`` also gets ``tied_heads=(student,
  teacher)``: True where that head is the model's ``[V, D]`` embedding table transposed (``cfg.tie_embeddings``), a
  layout hint (`meshdistill.losses.chunked_token_sums` then reads the table as stored, not a transposed copy);
  one that declares ``drops_metrics`` gets ``metrics=False`` in the metrics-light step (which reads ``"loss"`` only):
  it may then leave out the other sums and the work that forms them (work XLA would not drop by itself, e.g. a
  kernel's);

Both return a dict of token SUMS over their rows: ``"loss"`` is required, every other entry
is reported as a metric; the step sums over the global batch and divides by the global count
of unmasked tokens. Every strategy also has

* ``capture``: the extra model outputs it needs (a subset of ``("hidden", "attn", "final")``);
* ``init_params(student_cfg, teacher_cfg, key)``: extra trainable parameters (``{}`` when
  none), replicated and trained with the student; also where a strategy checks its settings
  against the model sizes (raising ``ValueError``);
* ``fallback()``: the strategy that replaces it after a divergence (`DivergenceGuard`), or
  None for the guard's generic logit-MSE fallback;
* its capabilities, read by the step, the `Distiller`, the config, the jobs and the teacher sources
  (`meshdistill.teachers.kinds`): ``needs_teacher`` (False: trains on the data alone, e.g. `HardLabelCE`),
  ``accepts_topk`` (True: trains from a teacher given by its top-k per token -- an offline cache, a teacher on other
  devices -- with the ``top_k`` and ``temperature`` it then reads; `check_topk_teacher` checks one such teacher),
  ``cross_tokenizer``
  (True: distils a teacher of another tokenizer, on the teacher's own tokens; `with_tokenizers` hands it what it needs
  of the two tokenizers), ``needs_pairs`` (True: its batches are (chosen, rejected) row pairs), ``chunked_form`` (the
  registered name of its token-chunked form, which a config's ``distill.chunk_size`` chooses), ``count`` (None: the
  loss is a mean over unmasked tokens; else ``count(mask_BxT)``, how many of what it averages over the local rows
  hold, e.g. pairs of rows).

Nothing outside this package probes a strategy for an attribute: every capability is declared here, with its
default, and read directly.

Subclassing `SequenceStrategy` / `BatchStrategy` gives every attribute its default, so the
step reads them directly. `register` makes a strategy available by name to configs
(``distill.kind``) and to `get`; `from_settings` builds one from a config section.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax

from meshdistill.models import ModelOutput

CAPTURES = ("hidden", "attn", "final")


class Strategy(abc.ABC):
  """Defaults of the contract; subclass `SequenceStrategy` or `BatchStrategy` instead of this."""

  capture: tuple[str, ...] = ()  # a dataclass field or a property in subclasses
  needs_logits: ClassVar[bool] = True
  needs_head: ClassVar[bool] = False
  needs_teacher: ClassVar[bool] = True  # False: trains on the data alone (no teacher source needed)
  accepts_topk: ClassVar[bool] = False  # True: trains from a teacher's top-k per token (reads top_k, temperature)
  cross_tokenizer: ClassVar[bool] = False  # True: the teacher runs on its own tokens (`meshdistill.losses.Aligned`)
  needs_pairs: ClassVar[bool] = False  # True: batches of (chosen, rejected) row pairs sharing a data shard
  # the registered name of the same loss computed in token chunks from final hidden states and LM heads, which a
  # config's distill.chunk_size chooses (None: no such form)
  chunked_form: ClassVar[str | None] = None
  reads_tied_heads: ClassVar[bool] = False  # True: per_batch takes tied_heads=(student, teacher) (see the docstring)
  drops_metrics: ClassVar[bool] = False  # True: per_batch takes metrics=False in a metrics-light step (docstring)
  count: ClassVar[Any] = None  # None: a mean over unmasked tokens; else count(mask_BxT) -> what the loss averages over

  def init_params(self, student_cfg, teacher_cfg, key) -> Any:
    """Extra trainable parameters: none by default."""
    del student_cfg, teacher_cfg, key
    return {}

  def fallback(self) -> Strategy | None:
    """The strategy to switch to after a divergence; None: the guard's generic fallback."""
    return None

  def check_topk_teacher(self, teacher) -> None:
    """Raises unless this strategy (one that ``accepts_topk``) trains from ``teacher``'s top-k alone: a
    `meshdistill.train.teacher.TopKTeacher` (its ``k``, ``temperature`` and ``source``). By default it reads a
    top-k of at most ``teacher.k`` tokens (``top_k``) at the teacher's temperature (a constant ``temperature``)."""
    name = label(self)
    top_k, tau = self.top_k, self.temperature  # type: ignore[attr-defined]  # the settings of one that accepts_topk
    if top_k is None or top_k > teacher.k:
      raise ValueError(
          f"{teacher.source} holds the teacher's top-{teacher.k}, but {name}.top_k={top_k}; set "
          f"distill.top_k to an integer in [1, {teacher.k}] (the full-vocabulary loss needs a live teacher)"
      )
    if callable(tau) or float(tau) != float(teacher.temperature):
      raise ValueError(
          f"{teacher.source} holds log-probabilities at temperature {teacher.temperature}, but {name}.temperature="
          f"{tau!r}; set distill.temperature={teacher.temperature} (a constant), or write a cache at "
          "the temperature you want"
      )

  def with_tokenizers(self, tokenizers) -> Strategy:
    """This strategy given what it needs of the two tokenizers of a teacher of another tokenizer: ``tokenizers``
    (`meshdistill.data.alignment.TokenizerPair`) gives the matched vocabulary (``matched()``) and the next-byte tables
    (``byte_tables(max_depth=...)``) on demand. By default it needs nothing: itself."""
    del tokenizers
    return self

  def replace(self, **changes) -> Strategy:
    """This strategy with the settings ``changes`` (a dataclass strategy: `dataclasses.replace`)."""
    return dataclasses.replace(self, **changes)  # type: ignore[type-var]  # subclasses are dataclasses

  @classmethod
  def settings(cls) -> tuple[str, ...]:
    """The settings this strategy takes by name (a config's ``distill.<name>`` / ``distill.options``): its
    constructor's fields. Their defaults are the dataclass defaults: the API's and the config's."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.init) if dataclasses.is_dataclass(cls) else ()

  @classmethod
  def from_settings(cls, settings: Mapping[str, Any]) -> Strategy:
    """This strategy from named settings; a None value means the strategy's own default.

    Raises:
      ValueError: a setting (not None) this strategy does not have, naming it and the settings it has.
    """
    unknown = [k for k, v in settings.items() if v is not None and k not in cls.settings()]
    if unknown:
      named = ", ".join(f"{cls.__name__}.{k}={settings[k]!r}" for k in unknown)
      raise ValueError(
          f"{named} {'is not a setting' if len(unknown) == 1 else 'are not settings'} of {cls.__name__} "
          f"(strategy {name_of(cls)!r}); its settings: {sorted(cls.settings())}"
      )
    return cls(**{k: v for k, v in settings.items() if v is not None})


class SequenceStrategy(Strategy):
  """A strategy the step vmaps over sequences: implement `per_sequence`."""

  @abc.abstractmethod
  def per_sequence(self, params, student: ModelOutput, teacher: ModelOutput, targets_T, mask_T, step):
    """The loss terms of one sequence (the step vmaps this over the local rows): ``{"loss": ..., ...}``."""


class BatchStrategy(Strategy):
  """A strategy called once on all local rows with the LM heads: implement `per_batch`."""

  needs_logits: ClassVar[bool] = False
  needs_head: ClassVar[bool] = True

  @abc.abstractmethod
  def per_batch(
      self, params, student: ModelOutput, teacher: ModelOutput, heads, targets_BxT, mask_BxT, step,
      softcaps=(None, None),
  ) -> dict[str, jax.Array]:
    """The loss terms of all local rows at once, with the LM ``heads``: ``{"loss": ..., ...}``."""


def label(strategy: Strategy) -> str:
  """How messages name ``strategy``: its own ``label`` when it has one, else its class name."""
  return getattr(strategy, "label", None) or type(strategy).__name__


# The contract is written once, above: `Strategy` declares every attribute the step, the Distiller, the jobs and
# the teacher sources read, with its default. `CONTRACT` is that list (what `check` asks of a strategy that does
# not derive from `Strategy`); `PerSequence` / `PerBatch` are the two kinds' names as the contract's types.
CONTRACT = tuple(n for n in vars(Strategy) if not n.startswith("_") and n not in ("replace", "settings", "from_settings"))
PerSequence = SequenceStrategy
PerBatch = BatchStrategy


# --------------------------------------------------------------------------- registry
_REGISTRY: dict[str, type] = {}


def register(name: str):
  """Class decorator: makes the strategy available as ``name`` (configs' ``distill.kind``, `get`)."""

  def add(cls: type) -> type:
    if name in _REGISTRY and _REGISTRY[name] is not cls:
      raise ValueError(f"strategy name {name!r} is taken by {_REGISTRY[name].__name__}; choose another for {cls}")
    _REGISTRY[name] = cls
    return cls

  return add


def names() -> list[str]:
  """The registered strategy names."""
  return sorted(_REGISTRY)


def name_of(cls: type) -> str | None:
  """The name ``cls`` is registered under (None if it is not)."""
  return next((name for name, c in _REGISTRY.items() if c is cls), None)


def get(name: str) -> type[Strategy]:
  """The strategy class registered as ``name``."""
  if name not in _REGISTRY:
    raise ValueError(f"strategy {name!r} is not registered; choose one of {names()}")
  return _REGISTRY[name]


def from_settings(name: str, settings: Mapping[str, Any]) -> Strategy:
  """The strategy registered as ``name``, built from a config section (see `Strategy.from_settings`)."""
  return get(name).from_settings(settings)


def check(strategy: Any, where: str = "strategy") -> str:  # Any: it checks what may not be a `Strategy`
  """The kind of ``strategy`` (``"per_sequence"`` or ``"per_batch"``), checked against the contract.

  Raises:
    ValueError: naming what ``strategy`` lacks and how to get the defaults.
  """
  missing = [a for a in CONTRACT if not hasattr(strategy, a)]
  kind = "per_batch" if getattr(strategy, "needs_head", False) else "per_sequence"
  if not callable(getattr(strategy, kind, None)):
    missing.append(kind)
  if missing:
    raise ValueError(
        f"{where}={type(strategy).__name__} is not a strategy: it lacks {missing}; subclass "
        "meshdistill.strategies.SequenceStrategy (or BatchStrategy), which supplies the defaults"
    )
  bad = [c for c in strategy.capture if c not in CAPTURES]
  if bad:
    raise ValueError(f"{where}.capture={tuple(strategy.capture)!r} names {bad}; choose from {CAPTURES}")
  return kind
