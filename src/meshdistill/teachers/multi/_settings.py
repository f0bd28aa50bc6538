"""The ``teachers:`` section: several named teacher sources and how they combine (`TeachersSettings`), one member's
settings (`Member`), its own run config (`member_config`) and the checks across sections (`check_teachers`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from meshdistill.core.typed_yaml import ConfigError
from meshdistill.strategies import get as strategy_class
from meshdistill.teachers.kinds._base import MODEL, NOTHING, TEACHER_KEYS, get, names, topk_refusal
from meshdistill.teachers.sources._settings import ModelSources

COMBINES = ("route", "mix")
ROUTE_FIELDS = ("domain",)  # the per-row fields of the data a route can read (`meshdistill.data._domains`)
MEMBER_KEYS = ("name", "source", "temperature", "weight", "takes", "dir")  # beside the source's own settings
# Sources that cannot be one of several yet, and why.
_REFUSED = {"submesh": "runs on devices of its own beside the student's mesh; give it as teacher.devices alone"}
# Top-k sources that answer for any rows (so for the rows the student generates, on-policy), and why the others
# cannot.
_SCORES_NEW_ROWS = ("remote",)  # asked for each batch's rows in its step's turn (`RemoteTeacherData.fetch`)
_NO_NEW_ROWS = {"cache": "a cache holds the top-k of the corpus rows it was written over, and generated rows are new"}
_EXAMPLE = ("e.g. teachers: {combine: route, route_by: domain, sources: [{name: code, source: cache, cache: PATH, "
            "takes: [python]}, {name: prose, source: hf, hf: PATH, takes: [prose]}]}")


@dataclasses.dataclass(frozen=True)
class Member:
  """One of several teachers: ``name``, its ``source`` (a ``teacher.source``) with that source's ``settings``
  (``teacher.<key>``s), ``temperature`` (its log-probabilities' temperature; None: ``distill.temperature``),
  ``weight`` (its share of a mix), ``takes`` (the route values its rows have) and ``dir`` (a pretrained teacher's
  directory: ``pretrain.teacher`` for it)."""

  name: str
  source: str
  settings: dict
  temperature: float | None = None
  weight: float = 1.0
  takes: tuple[str, ...] = ()
  dir: str | None = None


def _member(i: int, raw: Any, combine: str) -> Member:
  where = f"teachers.sources[{i}]"
  if not isinstance(raw, dict):
    raise ConfigError(f"{where}={raw!r} must be a mapping with name and source, {_EXAMPLE}")
  name, kind = raw.get("name"), raw.get("source")
  if not isinstance(name, str) or not name or "/" in name:
    raise ConfigError(f"{where}.name={name!r} must be a non-empty name without '/' (metrics are kl/<name>)")
  if kind not in names():
    raise ConfigError(f"{where}.source={kind!r} is not a teacher source; choose one of {names()}")
  if kind in _REFUSED or get(kind).gives == NOTHING:
    raise ConfigError(f"{where}.source={kind} cannot be one of several teachers: "
                      f"{_REFUSED.get(kind, 'it gives no teacher')}")
  settings = {k: v for k, v in raw.items() if k not in MEMBER_KEYS and v is not None}
  try:
    get(kind).check_keys(settings)
  except ConfigError as e:
    said = str(e).replace("teacher.", f"{where}.")
    raise ConfigError(said if where in said else f"{where} ({name}): {said}") from None
  tau, weight, takes = raw.get("temperature"), raw.get("weight", 1.0), raw.get("takes")
  if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.01 <= tau < math.inf):
    raise ConfigError(f"{where}.temperature={tau!r} must be a number >= 0.01, finite ({name}'s log-probabilities), "
                      "or null (distill.temperature)")
  if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
    raise ConfigError(f"{where}.weight={weight!r} must be a positive number, finite ({name}'s share of a mix), "
                      "e.g. 1.0")
  if combine == "route":
    if not isinstance(takes, (list, tuple)) or not takes or not all(isinstance(t, str) and t for t in takes):
      raise ConfigError(f"{where}.takes={takes!r} must list the route values whose rows go to {name} (with "
                        "route_by: domain, names of data.corpora), e.g. [python]")
  elif takes is not None:
    raise ConfigError(f"{where}.takes is for teachers.combine: route; with combine: {combine} every teacher sees "
                      "every row (remove takes, or choose combine: route)")
  directory = raw.get("dir")
  if directory is not None and (kind != "pretrained" or not isinstance(directory, str) or not directory):
    raise ConfigError(f"{where}.dir={directory!r} is the directory of a pretrained teacher (source: pretrained) only")
  return Member(name, kind, settings, None if tau is None else float(tau), float(weight), tuple(takes or ()),
                directory)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeachersSettings:
  """``teachers``: several teachers in one run (`meshdistill.teachers.multi`); ``sources`` empty: one teacher, the
  ``teacher`` section's.

  ``combine``: ``route`` (each row to the teacher that ``takes`` its ``route_by`` value: ``domain``, the corpus of
  ``data.corpora`` the row came from) or ``mix`` (every token's target the ``weight``-ed mixture of the teachers'
  top-k). ``sources``: a list of mappings, each ``name``, ``source`` (a ``teacher.source``) and that source's
  settings, ``temperature``, ``weight``, ``takes`` (route) and, for ``source: pretrained``, ``dir``."""

  combine: str = "route"
  route_by: str = "domain"
  sources: tuple[dict, ...] = ()

  def __post_init__(self):
    if self.combine not in COMBINES:
      raise ConfigError(f"teachers.combine={self.combine!r}; choose one of {list(COMBINES)}")
    if self.route_by not in ROUTE_FIELDS:
      raise ConfigError(f"teachers.route_by={self.route_by!r} is not a field every row carries; choose one of "
                        f"{list(ROUTE_FIELDS)} (domain: the corpus of data.corpora a row came from)")
    members = self.members()
    if len(members) == 1:
      raise ConfigError("teachers.sources names one teacher; for one, use the teacher section (teacher.source ...), "
                        "for several list two or more")
    seen: dict[str, str] = {}
    for m in members:
      if m.name in seen:
        raise ConfigError(f"teachers.sources: two teachers are named {m.name!r}; give each its own name")
      seen[m.name] = m.name
    if self.combine == "mix":
      _check_shares(members)
    owner: dict[str, str] = {}
    for m in members:
      for value in m.takes:
        if value in owner:
          raise ConfigError(f"teachers.sources: {self.route_by} {value!r} is taken by {owner[value]} and "
                            f"{m.name}; a row goes to one teacher (combine: mix blends them)")
        owner[value] = m.name

  @property
  def active(self) -> bool:
    return bool(self.sources)

  def members(self) -> tuple[Member, ...]:
    return tuple(_member(i, raw, self.combine) for i, raw in enumerate(self.sources))


_F32_MAX, _F32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38  # numpy.finfo(float32): max, smallest normal


def _check_shares(members: tuple[Member, ...]) -> None:
  """Raises unless the weights of a mix, normalised in float32 as the step does (`meshdistill.losses.mix_topk`), give
  each teacher a share float32 holds: weights whose sum passes float32's largest number (``1e38`` twice) would make
  every share NaN, and a share below its smallest normal number would give its teacher nothing."""
  weights = [m.weight for m in members]
  total = math.fsum(weights)
  for i, m in enumerate(members):
    share = m.weight / total
    if total > _F32_MAX or share < _F32_TINY:
      raise ConfigError(
        f"teachers.sources[{i}].weight={m.weight!r} ({m.name}): the weights {weights} sum to {total:.4g} and give it "
        f"the share {share:.4g}, outside float32 (the step's precision: sums up to {_F32_MAX:.4g}, shares from "
        f"{_F32_TINY:.4g}); give weights of comparable size, e.g. 1.0 each (only their ratios matter)")


def check_teachers(cfg) -> None:
  """The checks of ``teachers`` across sections: not with ``teacher.<source key>``s; a route over the corpora that
  names every corpus and no other; a strategy that trains from a top-k (``distill.top_k``) at one temperature."""
  t = cfg.teachers
  if not t.active:
    return
  given = sorted(cfg.models.teacher_values())
  if given:
    raise ConfigError(f"teachers and teacher.{given[0]} are both set; several teachers are listed in "
                      f"teachers.sources (each with its source's settings): remove teacher.{given[0]}, or teachers")
  members = t.members()
  if t.combine == "route":
    corpora = list(cfg.data.corpora or ())
    if not corpora:
      raise ConfigError("teachers.combine=route with route_by: domain needs data.corpora (named corpora, each row "
                        "from one), e.g. {python: stdlib, prose: /usr/share/common-licenses}")
    taken = {v: m.name for m in members for v in m.takes}
    unknown = sorted(set(taken) - set(corpora))
    if unknown:
      raise ConfigError(f"teachers.sources: {taken[unknown[0]]} takes domain {unknown[0]!r}, which is not a corpus "
                        f"of data.corpora ({corpora})")
    free = [c for c in corpora if c not in taken]
    if free:
      raise ConfigError(f"data.corpora {free} go to no teacher: add them to a teacher's takes (teachers.sources"
                        "[i].takes), or remove them from data.corpora")
  reason = topk_refusal("teachers", strategy_class(cfg.distill.kind), cfg.distill,
                        "several teachers are combined into one top-k target per token")
  if reason:
    raise ConfigError(reason.replace("choose a teacher.source that runs the teacher on the student's mesh",
                                     "use one teacher"))
  on_policy = cfg.distill.on_policy
  if on_policy.active or on_policy.prompts_file:
    _check_on_policy(t, on_policy)


def _check_on_policy(t: TeachersSettings, on_policy) -> None:
  """Several teachers on the on-policy path: every one runs a model or is served (generated rows are new: no cache
  holds them), the student samples, and a route has the corpus of every row."""
  for i, m in enumerate(t.members()):
    if get(m.source).gives != MODEL and m.source not in _SCORES_NEW_ROWS:
      why = _NO_NEW_ROWS.get(m.source, "it gives the top-k of the data's rows only")
      raise ConfigError(f"teachers.sources[{i}] ({m.name}, source: {m.source}) cannot score the rows the student "
                        f"generates (distill.on_policy): {why}; give it as a model teacher (source: pretrained or "
                        "hf) or a served one (remote), or set distill.on_policy.lambda=0")
  if on_policy.seq_kd:
    raise ConfigError("distill.on_policy.seq_kd=true lets the teacher sample, but teachers lists several: set "
                      "seq_kd=false (the student samples and every teacher scores its rows), or use one teacher")
  if on_policy.prompts_file and t.combine == "route":
    raise ConfigError(f"distill.on_policy.prompts_file={on_policy.prompts_file} gives prompt pairs without a corpus, "
                      "so teachers.combine=route has no domain to route them by: use combine: mix, or train on the "
                      "rows of data.corpora (no prompts_file)")


def member_config(cfg, member: Member):
  """The run config ``cfg`` as one teacher, ``member``, would have it: its source and settings in the teacher
  section (its shape derived as for one teacher), ``pretrain.teacher`` its ``dir``, ``teachers`` empty."""
  values = member.settings
  fields = {f"teacher_{k}": values[k] for k in TEACHER_KEYS if k != "source" and k in values}
  options = {k: v for k, v in values.items() if k not in TEACHER_KEYS}
  if values.get("hf") and cfg.data.tokenizer in ("byte", "bpe"):
    raise ConfigError(f"teachers: {member.name} is a Hugging Face teacher (hf: {values['hf']}); set data.tokenizer "
                      "to the teachers' tokenizer.json (one tokenizer for every teacher and the student)")
  models = ModelSources(teacher_source=member.source, teacher_options=options, **fields)
  pretrain = cfg.pretrain if member.dir is None else dataclasses.replace(cfg.pretrain, teacher=member.dir)
  try:
    return dataclasses.replace(cfg, models=models, pretrain=pretrain, teachers=TeachersSettings())
  except ConfigError as e:
    raise ConfigError(f"teachers: {member.name}: {e}") from None


def one_teacher(cfg, name: str | None, what: str = "cache-teacher"):
  """The run config ``cfg`` as the one teacher ``what`` (a job that runs one teacher model) works on: ``cfg`` itself
  without ``teachers``, else the member ``name`` (`member_config`) at its own temperature (``distill.temperature``
  the member's ``temperature`` when set). Raises `ConfigError` naming ``--teacher`` and the choices."""
  if not cfg.teachers.active:
    if name is not None:
      raise ConfigError(f"--teacher {name} picks one of teachers.sources, but this config lists no teachers; remove "
                        "--teacher (the teacher section's teacher is the one)")
    return cfg
  members = cfg.teachers.members()
  runs_model = [m.name for m in members if get(m.source).gives == MODEL]
  if name is None:
    raise ConfigError(f"{what}: this config lists several teachers ({[m.name for m in members]}); pick one with "
                      f"--teacher NAME (one that runs a model: {runs_model})")
  member = next((m for m in members if m.name == name), None)
  if member is None:
    raise ConfigError(f"--teacher {name} is not in teachers.sources; choose one of {[m.name for m in members]}")
  if member.name not in runs_model:
    raise ConfigError(f"--teacher {name} is source: {member.source}, which runs no teacher model here for {what}; "
                      f"choose one that does: {runs_model}")
  sub = member_config(cfg, member)
  if member.temperature is not None:
    sub = dataclasses.replace(sub, distill=dataclasses.replace(sub.distill, temperature=member.temperature))
  return sub
