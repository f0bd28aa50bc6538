"""The teacher-source contract and its registry: what a source gives the step, its settings, how it is prepared.

A run's teacher comes from exactly one source, chosen by ``teacher.source`` (or, for configs that name none, by the
one source key they set: `infer`). A source is a `TeacherSource` subclass registered by name (`register`):

* ``gives``: what reaches the step, a `meshdistill.train.teacher.TeacherKind` -- `MODEL` (a teacher model the step
  runs on every batch), `TOPK` (the teacher's top-k log-probabilities per token, delivered with the batch under
  `meshdistill.core.batch.TOPK_KEYS`; no teacher weights on the student's devices) or `NOTHING` (``TeacherKind.NONE``:
  no teacher, the strategy must not need one);
* ``settings``: the ``teacher.<key>`` keys it takes beside the teacher's shape (``required``: those it cannot do
  without); `check_settings` is the one home of their rules. A key of another source is an error naming it, the
  chosen source and that source's settings (`check_keys`);
* ``accepts``: which strategies it trains -- read from the strategies' declared capabilities (``needs_teacher``,
  ``accepts_topk``, ``top_k``, ``temperature``), checked from the config before any data or weights are read
  (`check`);
* ``meshes``: where it runs -- the student's mesh, or a mesh of its own beside it (``teacher.devices``);
* ``saved_model``: the teacher model of a finished run, for the jobs after training (evaluate, generate): read only,
  never pretrained; a source without one (`NOTHING`, a top-k cache) refuses with `NoTeacherModel`, saying so;
* ``prepare``: what it does before training -- obtain (load, pretrain) and place a model, open a cache, start a
  teacher on its sub-mesh -- returning a `Prepared`: the data (a source that gives `TOPK` wraps it), the teacher
  (a model, a `meshdistill.teachers.cache.TopKTeacher`, or None) and its identity (the ``teacher_dir`` a run's
  checkpoints record: a directory, a cache path, a Hugging Face directory). A source that runs a model obtains it on
  the data of the teacher's own tokens when the teacher has its own tokenizer (`ModelSource.teacher_data`).

`Source` is what the distill job asks of a run's teacher (`check`, `meshes`, `prepare`): every `TeacherSource`, and
the several teachers of ``teachers:`` combined (`meshdistill.teachers.multi.Teachers`), implement it, so the job
composes a run from one source and its data without asking which kind it has.

The jobs lend a source what it cannot own without importing them (`Services`: pretraining a teacher is a job).
"""

from __future__ import annotations

import abc
import dataclasses
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

from meshdistill.core.typed_yaml import ConfigError
from meshdistill.models import ModelConfig
from meshdistill.strategies import Strategy
from meshdistill.strategies import get as strategy_class
from meshdistill.strategies import names as strategy_names
from meshdistill.train.teacher import TeacherKind

# The run's `meshdistill.config.Config`. Named, not imported: the config package sits above the teacher sources (it
# checks its sections with them), so a source reads the config it is handed and never imports the package.
Config = Any

# The teacher kinds: the one set (`TeacherKind`) the step's decision uses too; ``NOTHING`` is ``TeacherKind.NONE``.
MODEL, TOPK, NOTHING = TeacherKind.MODEL, TeacherKind.TOPK, TeacherKind.NONE
# The teacher.<key>s the config keeps in fields of their own (`meshdistill.teachers.sources.ModelSources`); a
# source's other settings are kept by name in ``ModelSources.teacher_options``.
TEACHER_KEYS = ("source", "hf", "cache", "devices", "quantize")


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What a source hands the job: the data (with the teacher's top-k in every training batch when it gives
  `TOPK`), the teacher (a model, a `TopKTeacher`, or None) and its identity (recorded in checkpoints).

  ``cache``: on the on-policy path (``distill.on_policy``), an offline cache over the data's rows
  (`meshdistill.teachers.cache.TeacherCache`) that serves the batches of the data's completions, the teacher (then a
  model) running live on the generated ones only (`meshdistill.train.onpolicy.OnPolicyDistiller`); the data then
  yields each batch's ``row_ids``. None otherwise.

  ``topk_of``: several teachers on the on-policy path, what gives a generated batch their target
  (`meshdistill.teachers.multi.MultiTeacherData.score`, the `OnPolicyDistiller`'s ``topk_of``); the data is then the
  plain corpus (a generated batch replaces its rows, so nothing is run ahead on rows that would not be trained on).
  ``teachers``: several teachers, their `meshdistill.teachers.multi.MultiTeacherData`, each one evaluated at the end
  (`meshdistill.teachers.multi.evaluate_teachers`). Both None for one teacher."""

  data: Any
  teacher: Any
  identity: str | None
  cache: Any = None
  topk_of: Callable[[dict], dict] | None = None
  teachers: Any = None


@runtime_checkable
class Source(Protocol):
  """What the distill job asks of a run's teacher: a `TeacherSource`, or several combined
  (`meshdistill.teachers.multi.Teachers`)."""

  def check(self) -> None:
    """Refuses, from the config alone, what this teacher cannot train; before any data, meshes or weights."""

  def meshes(self, build_mesh: Callable[[Config], Any]) -> tuple[Any, Any]:
    """``(teacher_mesh, student_mesh)``: the teacher's own mesh (None: it shares the student's) and the student's."""

  def prepare(self, data: Any, mesh: Any, teacher_mesh: Any, services: Services) -> Prepared:
    """The data, the teacher and its identity, ready for the `Distiller` on ``mesh``."""


class NoTeacherModel(ConfigError):
  """The run's teacher source has no teacher model (`TeacherSource.saved_model`): nothing to evaluate or generate
  with."""


@dataclasses.dataclass(frozen=True)
class Services:
  """What the jobs lend a source: ``pretrain(cfg, data=, mesh=, out=)`` trains a teacher from scratch into ``out``
  (`meshdistill.jobs.pretrain`); ``report(line)`` says where the teacher came from."""

  pretrain: Callable[..., Any]
  report: Callable[[str], None]


class TeacherSource(abc.ABC):
  """One way to get a run's teacher; subclass it, set the class attributes, decorate with `register`.

  Instances hold the run's `Config`; `prepare` may be called once per job.
  """

  name: ClassVar[str] = ""
  gives: ClassVar[TeacherKind] = MODEL
  settings: ClassVar[tuple[str, ...]] = ()  # the teacher.<key>s this source takes (besides "source")
  required: ClassVar[tuple[str, ...]] = ()  # of those, the ones it needs

  def __init__(self, cfg: Config):
    self.cfg = cfg

  # ------------------------------------------------------------------ settings (config time)
  @classmethod
  def check_keys(cls, values: dict[str, Any], chosen_by: str | None = None) -> None:
    """Raises `ConfigError` for a ``teacher.<key>`` of another source, or a required one left out.

    ``chosen_by``: the key that chose this source in a config without ``teacher.source`` (`infer`); the message
    then says the two keys exclude each other, as it did before the setting."""
    other = sorted(k for k in values if k not in cls.settings)
    if other:
      pair = f"teacher.{other[0]} and teacher.{chosen_by} exclude each other: " if chosen_by else ""
      raise ConfigError(
          f"{pair}teacher.{other[0]} is not a setting of teacher.source={cls.name}; its settings: "
          f"{[f'teacher.{k}' for k in cls.settings]} (teacher.{other[0]} belongs to teacher.source="
          f"{_owner(other[0])}); remove it, or choose that source"
      )
    missing = [k for k in cls.required if values.get(k) is None]
    if missing:
      what = (cls.__doc__ or cls.name).strip().splitlines()[0]
      raise ConfigError(f"teacher.source={cls.name} needs teacher.{missing[0]} ({what})")
    cls.check_settings(values)

  @classmethod
  def check_settings(cls, values: dict[str, Any]) -> None:
    """This source's rules on its settings' values (``values``: the ``teacher.<key>``s given, not None)."""
    del values

  # ------------------------------------------------------------------ the run (before any data or weights)
  def check(self) -> None:
    """Refuses, from the config alone, a strategy this source cannot train (`accepts`) and settings it cannot
    serve; called before data, meshes or weights are touched."""
    reason = self.accepts(strategy_class(self.cfg.distill.kind), self.cfg.distill)
    if reason:
      raise ConfigError(reason)
    on_policy = self.cfg.distill.on_policy
    if self.gives is TOPK and (on_policy.active or on_policy.prompts_file):
      raise ConfigError(f"distill.on_policy trains on prompts and sampled completions, but teacher.source={self.name} "
                        "feeds the teacher's top-k of the corpus rows; remove one of them")

  def accepts(self, strategy: type[Strategy], distill: Any) -> str | None:
    """None when ``strategy`` (a strategy class, its settings in ``distill``) trains from this source, else why not.

    By default: a source that gives a teacher serves every strategy that needs one; one that gives `NOTHING`,
    only strategies with ``needs_teacher = False``."""
    del distill
    if self.gives == NOTHING and strategy.needs_teacher:
      return (f"teacher.source={self.name} gives no teacher, but distill.kind={self.cfg.distill.kind} needs one; "
              f"choose a teacher source ({[n for n in names() if get(n).gives != NOTHING]}) or a strategy that needs "
              "no teacher (distill.kind=hard_label_ce)")
    return None

  def meshes(self, build_mesh: Callable[[Config], Any]) -> tuple[Any, Any]:
    """``(teacher_mesh, student_mesh)``: the teacher's own mesh (None: it shares the student's) and the student's."""
    return None, build_mesh(self.cfg)

  def extra_devices(self) -> int:
    """Devices this source takes beside the student's mesh (simulated CPU devices are counted with them)."""
    return 0

  @abc.abstractmethod
  def prepare(self, data: Any, mesh: Any, teacher_mesh: Any, services: Services) -> Prepared:
    """The data, the teacher and its identity, ready for the `Distiller` on ``mesh``."""

  def runs(self) -> ModelSource:
    """The source of the teacher model behind this one, for the jobs that run the model itself (``cache-teacher``,
    ``serve-teacher``, a teacher of its own tokenizer in ``distill``): a `ModelSource` is itself; a source whose
    teacher is the top-k of a model (a cache, a sub-mesh or a served teacher) names that model by its settings:
    ``teacher.hf`` when set, else the pretrained teacher. A source of `NOTHING` has none (`NoTeacherModel`)."""
    if self.gives == NOTHING:
      raise NoTeacherModel(f"teacher.source={self.name} gives no teacher: there is no teacher model to run; set "
                           "teacher.hf (a Hugging Face teacher) or teacher.source=pretrained")
    return typing.cast(ModelSource, get("hf" if self.cfg.models.teacher_hf else "pretrained")(self.cfg))

  # ------------------------------------------------------------------ after training (evaluate, generate)
  def saved_tokenizer(self, identity: str | None) -> Any:
    """The tokenizer kept with the teacher a run recorded as ``identity``, or None: the run's data settings name it."""
    del identity
    return None

  def saved_model(self, identity: str | None, mesh: Any, tokenizer: Any) -> tuple[str | None, Any]:
    """``(identity, teacher model on mesh)``: the teacher of a run whose checkpoints recorded ``identity`` (their
    ``teacher_dir``; None before any), read only -- nothing is pretrained or written. By default there is none: a
    `NoTeacherModel` error saying what the source gives instead."""
    del identity, mesh, tokenizer
    gives = "gives no teacher" if self.gives == NOTHING else "gives the teacher's top-k only (no teacher weights)"
    raise NoTeacherModel(
        f"teacher.source={self.name} {gives}: this run has no teacher model to evaluate or generate with; use its "
        "student (--model student), or a source that loads a teacher (teacher.hf, or pretrain.teacher=DIR)")


class ModelSource(TeacherSource):
  """A source that runs a teacher model: `model` obtains it on a mesh; `prepare` places it on the student's (a
  teacher of its own tokenizer obtained on the data of its own tokens, `teacher_data`)."""

  gives: ClassVar[TeacherKind] = MODEL

  def runs(self) -> ModelSource:
    return self

  def check(self) -> None:
    super().check()
    if self.cfg.data.teacher_tokenizer is not None and self.cfg.distill.on_policy.active:
      raise ConfigError("data.teacher_tokenizer (a teacher of its own tokenizer) runs the teacher live in the step on "
                        "its own tokens, or reads a cross-tokenizer teacher.cache; teacher.devices and "
                        "distill.on_policy do not take it yet")

  @abc.abstractmethod
  def model(self, data: Any, mesh: Any, services: Services) -> tuple[Any, str]:
    """``(teacher model on mesh, its identity)``."""

  def teacher_data(self, data: Any) -> Any:
    """The data the teacher model is obtained (pretrained) on: ``data``, or for a teacher of its own tokenizer
    (``data.teacher_tokenizer``) the same documents through that tokenizer alone
    (`meshdistill.data.DataBundle.teacher_side`)."""
    return data if self.cfg.data.teacher_tokenizer is None else data.teacher_side()

  def prepare(self, data, mesh, teacher_mesh, services):
    del teacher_mesh
    teacher, identity = self.model(self.teacher_data(data), mesh, services)
    return Prepared(data, teacher, identity)


def topk_refusal(name: str, strategy: type[Strategy], distill: Any, what: str) -> str | None:
  """Why a source that gives `TOPK` cannot train ``strategy`` (its config settings ``distill``), or None.

  Read from its declared capabilities: ``accepts_topk`` and, for those that do, a ``top_k`` set; and the one rule of
  every teacher whose top-k is taken for this run: at one temperature, so ``distill.temperature`` is a constant (not a
  schedule). ``what`` names the source as the message starts (e.g. ``"teacher.devices sends the student the
  teacher's top-k only"``)."""
  top_k = distill.value("top_k") if "top_k" in strategy.settings() else None
  if strategy.accepts_topk and top_k is not None:
    return temperature_refusal(distill, what)
  needs = f"distill.kind={distill.kind}" + (" without distill.top_k" if strategy.accepts_topk else "")
  takes = [n for n in strategy_names() if strategy_class(n).accepts_topk]
  return (f"{what} (not its logits, hidden states or attention maps), but {needs} needs more: set distill.kind to one "
          f"of {takes} with distill.top_k (e.g. 32), or choose a teacher.source that runs the teacher on the "
          f"student's mesh (teacher.source={name} gives top-k per token)")


def temperature_refusal(distill: Any, what: str) -> str | None:
  """Why ``distill.temperature`` (the section's, or the strategy's default) cannot be the one temperature a teacher's
  top-k is taken at, or None: the one rule of every teacher whose top-k is taken for a run (a sub-mesh, served or
  combined teacher, a cache being written, a teacher served). ``what`` starts the message."""
  tau = distill.value("temperature")
  if callable(tau) or isinstance(tau, dict):
    return f"{what}, taken at one temperature: distill.temperature={tau!r} must be a constant (a number, e.g. 1.0)"
  return None


# --------------------------------------------------------------------------- registry
_REGISTRY: dict[str, type[TeacherSource]] = {}


def register(cls: type[TeacherSource]) -> type[TeacherSource]:
  """Class decorator: makes the source available as ``teacher.source: <cls.name>``."""
  if not cls.name:
    raise ValueError(f"{cls.__name__} has no name; set the class attribute name = '<teacher.source value>'")
  shape = sorted(set(cls.settings) & {f.name for f in dataclasses.fields(ModelConfig)})
  if shape:
    raise ValueError(f"{cls.__name__}.settings names {shape}, keys of the teacher's shape (ModelConfig); "
                     "give the source's settings other names")
  if not isinstance(cls.gives, TeacherKind):
    raise ValueError(f"{cls.__name__}.gives={cls.gives!r} is not a TeacherKind; choose one of "
                     f"{[f'TeacherKind.{k.name}' for k in TeacherKind]} (meshdistill.train.teacher)")
  if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
    raise ValueError(f"teacher source {cls.name!r} is taken by {_REGISTRY[cls.name].__name__}; choose another")
  _REGISTRY[cls.name] = cls
  return cls


def names() -> list[str]:
  """The registered source names."""
  return sorted(_REGISTRY)


def teacher_keys() -> tuple[str, ...]:
  """Every ``teacher.<key>`` that belongs to a source (``source`` and each registered source's settings): the config
  moves them out of the teacher's shape section."""
  extra = sorted({k for cls in _REGISTRY.values() for k in cls.settings} - set(TEACHER_KEYS))
  return (*TEACHER_KEYS, *extra)


def get(name: str) -> type[TeacherSource]:
  """The source class registered as ``name``."""
  if name not in _REGISTRY:
    raise ConfigError(f"teacher.source={name!r} is not a teacher source; choose one of {names()}")
  return _REGISTRY[name]


# Which source an older config (no teacher.source) chose by the one source key it set, in this order.
_INFERRED = (("cache", "cache"), ("devices", "submesh"), ("hf", "hf"))


def infer(values: dict[str, Any]) -> str:
  """The source a config without ``teacher.source`` names by its keys (``values``: the ``teacher.<key>``s set):
  ``cache`` -> cache, ``devices`` -> submesh, ``hf`` -> hf, none of them -> pretrained. Two of ``cache`` /
  ``devices`` are ambiguous: an error naming both."""
  given = [k for k, _ in _INFERRED[:2] if values.get(k) is not None]
  if len(given) > 1:
    raise ConfigError(f"teacher.{given[0]} and teacher.{given[1]} exclude each other (a cached teacher runs nowhere); "
                      f"remove one of them, or choose with teacher.source (one of {names()})")
  return next((kind for key, kind in _INFERRED if values.get(key) is not None), "pretrained")


def resolve(values: dict[str, Any]) -> type[TeacherSource]:
  """The source class of ``values`` (the ``teacher.<key>``s set, ``source`` among them or inferred), its settings
  checked (`TeacherSource.check_keys`)."""
  values = {k: v for k, v in values.items() if v is not None}
  kind = values.pop("source", None)
  if kind is not None and not isinstance(kind, str):
    raise ConfigError(f"teacher.source={kind!r} must be one of {names()}")
  if kind is not None:
    cls = get(kind)
    cls.check_keys(values)
  else:
    cls = get(infer(values))
    cls.check_keys(values, next((key for key, name in _INFERRED if name == cls.name), None))
  return cls


def option(cfg: Config, key: str, default: Any = None) -> Any:
  """The chosen source's setting ``teacher.<key>`` (one without a field of its own: ``teacher_options``)."""
  return cfg.models.teacher_options.get(key, default)


def _owner(key: str) -> str:
  owners = [n for n in names() if key in _REGISTRY[n].settings]
  return " or ".join(owners) or "none"
