"""The teacher and student sources as config keys: `ModelSources` and `StudentInit` (the typed form, field
``models`` of `meshdistill.config.Config`), `split_sources` (the raw sections' keys moved into ``models``)
and `nest_sources` (put back when a config is written)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from meshdistill.core.typed_yaml import ConfigError, unknown_key
from meshdistill.models.compress.qat import QuantizeAware
from meshdistill.models.lora import LoraConfig
from meshdistill.teachers.kinds._base import TEACHER_KEYS, teacher_keys
from meshdistill.teachers.kinds._base import resolve as resolve_teacher
from meshdistill.teachers.sources._hub import local_or_id

FREE_KEYS = ("max_len", "dtype", "param_dtype", "remat", "scan_layers", "attention")  # settable beside a derived shape


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudentInit:
  """``student.init``: ``from_teacher: true`` copies the teacher's embeddings, LM head, final norm and
  the blocks ``layers`` (teacher block indices, in the student's order) into the student; ``pruned: DIR`` starts
  from the student ``meshdistill prune --out DIR`` cut from the teacher (its shape from ``DIR/student``)."""

  from_teacher: bool = False
  layers: tuple[int, ...] | None = None
  pruned: str | None = None

  def __post_init__(self):
    if self.pruned is not None:
      if not isinstance(self.pruned, str) or not self.pruned:
        raise ConfigError(f"student.init.pruned={self.pruned!r} must be the --out directory of `meshdistill prune` "
                          "(or a Hugging Face Hub id org/name[@revision] of one)")
      if self.from_teacher:
        raise ConfigError("student.init.pruned and student.init.from_teacher exclude each other: start the student "
                          "from a pruned teacher or from a subset of its blocks, not both")
      object.__setattr__(self, "pruned", local_or_id(self.pruned))  # a Hub id: resolved with the shapes
    if self.layers is not None and not self.from_teacher:
      raise ConfigError(
          f"student.init.layers={list(self.layers)} is set but student.init.from_teacher is false; "
          "set student.init.from_teacher=true (or remove student.init.layers)"
      )
    if self.from_teacher:
      if not self.layers:
        raise ConfigError(
            "student.init.from_teacher=true needs student.init.layers, the teacher blocks to copy, e.g. [0, 2]"
        )
      if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.layers):
        raise ConfigError(f"student.init.layers={list(self.layers)} must be teacher block indices (integers >= 0)")
      if len(set(self.layers)) != len(self.layers):
        raise ConfigError(f"student.init.layers={list(self.layers)} names a block twice; list each block once")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSources:
  """``teacher.source`` and its settings (``teacher.hf``, ``teacher.cache``, ``teacher.devices``,
  ``teacher.quantize``), ``student.hf``, ``student.init`` and ``student.lora`` of a config (paths made absolute).

  The teacher's keys are checked by the source they belong to (`meshdistill.teachers.kinds`): ``teacher_source``
  as given (None: chosen by the keys set, `teacher_kind`)."""

  teacher_source: str | None = None  # the teacher.source given (None: inferred from the keys below)
  teacher_hf: str | None = None
  student_hf: str | None = None
  student_init: StudentInit = dataclasses.field(default_factory=StudentInit)
  teacher_cache: str | None = None  # an offline top-k cache (`meshdistill.teachers.cache`): no teacher weights loaded
  teacher_devices: dict | None = None  # the teacher's own mesh {data, tensor, other axes} (`teachers.mesh`)
  student_lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # rank 0: no adapters
  teacher_quantize: str | None = None  # the teacher's projections stored int8 / int4 / nf4 (`models.quantize`)
  student_quantize_aware: QuantizeAware = dataclasses.field(default_factory=QuantizeAware)  # weights null: off
  teacher_options: dict = dataclasses.field(default_factory=dict)  # other settings of the chosen source, by key
  hub: dict = dataclasses.field(default_factory=dict)  # {setting: "org/name@commit"}: Hub ids resolved to the paths
  # the sections ("teacher", "student") whose shape is read from a config.json and whose max_len the config did not
  # name: their bound becomes config.json's max_position_embeddings (`split_sources` sets it, `resolve` empties it)
  max_len_from_hf: tuple[str, ...] = ()

  def __post_init__(self):
    resolve_teacher(self.teacher_values())  # the chosen source checks its own settings
    if self.teacher_cache is not None:
      object.__setattr__(self, "teacher_cache", os.path.abspath(os.path.expanduser(self.teacher_cache)))
    if self.student_hf is not None and (not isinstance(self.student_hf, str) or not self.student_hf):
      raise ConfigError(f"student.hf={self.student_hf!r} must be the path of a local Hugging Face model directory "
                        "or a Hub id org/name[@revision]")
    for who in ("teacher", "student"):  # teacher.hf: checked by its source (above); a Hub id: resolved with the shapes
      if getattr(self, f"{who}_hf") is not None:
        object.__setattr__(self, f"{who}_hf", local_or_id(getattr(self, f"{who}_hf")))
    if self.student_hf and (self.student_init.from_teacher or self.student_init.pruned):
      raise ConfigError(
          "student.hf and student.init exclude each other: start the student from a pretrained "
          "checkpoint (student.hf) or from the teacher's blocks (student.init), not both"
      )
    if self.student_quantize_aware.enabled and self.student_lora.enabled:
      raise ConfigError("student.quantize_aware and student.lora exclude each other: LoRA trains adapters on a "
                        "frozen base (quantize the base with student.lora.quantize), quantization-aware training "
                        "trains the whole student through fake quantization; choose one")
    if self.student_hf and not self.teacher_hf:
      raise ConfigError(
          "student.hf needs teacher.hf: a Hugging Face student is distilled from a Hugging Face teacher with the "
          "same tokenizer; set teacher.hf, or describe the student by its shape"
      )

  def teacher_values(self) -> dict[str, Any]:
    """The ``teacher.<key>``s of the source settings that are set (``source`` included when given)."""
    values = {**{k: getattr(self, f"teacher_{k}") for k in TEACHER_KEYS}, **self.teacher_options}
    return {k: v for k, v in values.items() if v is not None and v != {}}

  @property
  def teacher_kind(self) -> str:
    """The teacher source this config chose: ``teacher.source``, or the one its keys name."""
    return resolve_teacher(self.teacher_values()).name

  @property
  def any(self) -> bool:
    return bool(self.teacher_hf or self.student_hf or self.student_init.from_teacher or self.student_init.pruned)


def _student_subsection(key: str, value, cls, example: str) -> dict:
  """``student.<key>`` checked against the dataclass ``cls`` (errors name ``student.<key>.*``), as a plain dict."""
  if value is not None and not isinstance(value, dict):
    raise ConfigError(f"student.{key}={value!r} must be a mapping, e.g. {example}")
  allowed = [f.name for f in dataclasses.fields(cls)]
  for k in value or {}:
    if k not in allowed:
      raise unknown_key(f"student.{key}.", k, allowed)
  try:
    cls(**(value or {}))
  except (TypeError, ValueError) as e:
    raise ConfigError(str(e)) from None
  return dict(value or {})


def split_sources(raw: dict) -> dict:
  """Moves ``teacher.hf``, ``student.hf`` and ``student.init`` of a raw config into ``raw["models"]``.

  Raises `ConfigError` when a section with a derived shape also sets a shape key (other than
  `FREE_KEYS`): the shape is read from the checkpoint or the teacher, not typed twice. A section whose shape comes
  from a ``config.json`` (``teacher.hf``, ``student.hf``, ``student.init.from_teacher`` with ``teacher.hf``) and
  that names no ``max_len`` is listed in ``max_len_from_hf``: its bound is ``max_position_embeddings``, not the
  section's default (only the raw mapping tells a named ``max_len`` from the default).
  """
  raw = dict(raw)
  models: dict[str, Any] = {}
  student = raw.get("student")
  for key, cls, example in (("lora", LoraConfig, "{rank: 8, alpha: 16}"),  # not sources of the shape: how the
                            ("quantize_aware", QuantizeAware, "{weights: int4, group_size: 32}")):  # student trains
    if isinstance(student, dict) and key in student:
      student = dict(student)
      models[f"student_{key}"] = _student_subsection(key, student.pop(key), cls, example)
      raw["student"] = student
  for who, keys in (("teacher", teacher_keys()), ("student", ("hf", "init"))):
    section = raw.get(who)
    if not isinstance(section, dict) or not any(k in section for k in keys):
      continue
    section = dict(section)
    for k in keys:
      if k in section:
        value = section.pop(k)
        if who == "student":
          models[f"student_{k}"] = _checked(f"student.{k}", value)
        elif k in TEACHER_KEYS:
          models[f"teacher_{k}"] = value
        else:  # a setting of a source without a field of its own
          models.setdefault("teacher_options", {})[k] = value
    if who == "teacher":  # checked as written, by the source they belong to
      resolve_teacher({**{k: models[f"teacher_{k}"] for k in TEACHER_KEYS if f"teacher_{k}" in models},
                       **models.get("teacher_options", {})})
    init = models.get("student_init") if who == "student" else None
    init = init if isinstance(init, dict) else {}
    derived = models.get(f"{who}_hf") is not None or bool(init.get("from_teacher") or init.get("pruned"))
    typed = sorted(k for k in section if k not in FREE_KEYS)
    if derived and typed:
      how = f"{who}.hf" if models.get(f"{who}_hf") is not None else (
          "student.init.pruned" if init.get("pruned") else "student.init.from_teacher")
      origin = {"hf": "config.json", "pruned": "the pruned student"}.get(how.rsplit(".", 1)[-1], "the teacher")
      raise ConfigError(
          f"{who}.{typed[0]} is set, but with {how} the {who}'s shape is derived ({origin}); "
          f"remove {[f'{who}.{k}' for k in typed]} (beside it only {[f'{who}.{k}' for k in FREE_KEYS]} may be set)"
      )
    from_hf = models.get(f"{who}_hf") is not None or (init.get("from_teacher") and models.get("teacher_hf"))
    if from_hf and "max_len" not in section:
      models["max_len_from_hf"] = (*models.get("max_len_from_hf", ()), who)
    raw[who] = section
  if "models" in raw:
    raise ConfigError(
        "unknown section 'models'; give the teacher and student sources as teacher.hf, student.hf and student.init"
    )
  if models:
    raw["models"] = models
  return raw


def _checked(key: str, value: Any) -> Any:
  """Type checks of the raw source keys, named as the user wrote them (not as ``models.*``)."""
  if key.endswith(".hf"):
    if value is not None and (not isinstance(value, str) or not value):
      raise ConfigError(f"{key}={value!r} must be the path of a local Hugging Face model directory or a Hub id "
                        "org/name[@revision]")
    return value
  if value is None:
    return value
  allowed = [f.name for f in dataclasses.fields(StudentInit)]
  if not isinstance(value, dict):
    raise ConfigError(f"{key}={value!r} must be a mapping, e.g. {{from_teacher: true, layers: [0, 2]}} or "
                      "{pruned: DIR}")
  for k in value:
    if k not in allowed:
      raise unknown_key(f"{key}.", k, allowed)
  if not isinstance(value.get("from_teacher", False), bool):
    raise ConfigError(f"{key}.from_teacher={value['from_teacher']!r} must be true or false")
  layers = value.get("layers")
  if layers is not None and (
      not isinstance(layers, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
  ):
    raise ConfigError(f"{key}.layers={layers!r} must be a list of teacher block indices, e.g. [0, 2]")
  return value


def nest_sources(plain: dict, sources: ModelSources) -> dict:
  """The inverse of `split_sources` on a plain (``to_dict``) config: derived sections keep only their
  source keys and `FREE_KEYS`."""
  plain = dict(plain)
  plain.pop("models", None)
  lora = sources.student_lora
  hub = sources.hub  # a Hub id is written as given, pinned to the commit it resolved to
  if sources.teacher_hf:
    plain["teacher"] = {"hf": hub.get("teacher.hf", sources.teacher_hf), **{k: plain["teacher"][k] for k in FREE_KEYS}}
  if sources.student_hf:
    plain["student"] = {"hf": hub.get("student.hf", sources.student_hf), **{k: plain["student"][k] for k in FREE_KEYS}}
  elif sources.student_init.from_teacher:
    init = {"from_teacher": True, "layers": list(sources.student_init.layers)}
    plain["student"] = {"init": init, **{k: plain["student"][k] for k in FREE_KEYS}}
  elif sources.student_init.pruned:
    pruned = hub.get("student.init.pruned", sources.student_init.pruned)
    plain["student"] = {"init": {"pruned": pruned}, **{k: plain["student"][k] for k in FREE_KEYS}}
  if sources.teacher_source:
    plain["teacher"] = {**plain["teacher"], "source": sources.teacher_source}
  if sources.teacher_cache:
    plain["teacher"] = {**plain["teacher"], "cache": sources.teacher_cache}
  if sources.teacher_devices:
    plain["teacher"] = {**plain["teacher"], "devices": dict(sources.teacher_devices)}
  if sources.teacher_quantize:
    plain["teacher"] = {**plain["teacher"], "quantize": sources.teacher_quantize}
  if sources.teacher_options:
    plain["teacher"] = {**plain["teacher"], **sources.teacher_options}
  if lora.enabled:
    plain["student"] = {**plain["student"], "lora": {**dataclasses.asdict(lora), "targets": list(lora.targets)}}
  if sources.student_quantize_aware.enabled:
    plain["student"] = {**plain["student"], "quantize_aware": dataclasses.asdict(sources.student_quantize_aware)}
  return plain
