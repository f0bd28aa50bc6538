"""Teacher sources: one `TeacherSource` per way of getting a run's teacher, chosen by ``teacher.source``.

=============  ===========================================================  =========  ==========================
source         what it is                                                   gives      settings (``teacher.*``)
=============  ===========================================================  =========  ==========================
``pretrained`` ``pretrain.teacher``, or cached / pretrained for the settings  a model    ``quantize``
``hf``         a Hugging Face model directory                               a model    ``hf``, ``quantize``
``cache``      an offline top-k cache (``meshdistill cache-teacher``)        top-k      ``cache``, ``hf``
``submesh``    a live teacher on devices of its own, one batch ahead        top-k      ``devices``, ``hf``, ``quantize``
``remote``     a teacher served over HTTP (``meshdistill serve-teacher``)    top-k      ``url``, ``k``, ``timeout``, ...
``none``       no teacher (a strategy with ``needs_teacher = False``)        nothing
=============  ===========================================================  =========  ==========================

A config without ``teacher.source`` chooses by the key it sets (``cache``, ``devices``, ``hf``; none: pretrained),
so configs written before the setting load as they did. The contract and registry are in `_base`; each source is
one module of this package, which imports them all (a module added here is a source: `register`).
"""

import importlib
import pkgutil

from meshdistill.teachers.kinds._base import (
  MODEL,
  NOTHING,
  TEACHER_KEYS,
  TOPK,
  ModelSource,
  NoTeacherModel,
  Prepared,
  Services,
  Source,
  TeacherSource,
  get,
  infer,
  names,
  option,
  register,
  resolve,
  teacher_keys,
  temperature_refusal,
  topk_refusal,
)

__all__ = [
  "MODEL",
  "NOTHING",
  "TEACHER_KEYS",
  "TOPK",
  "ModelSource",
  "NoTeacherModel",
  "Prepared",
  "Services",
  "Source",
  "TeacherSource",
  "for_config",
  "get",
  "infer",
  "names",
  "option",
  "register",
  "resolve",
  "teacher_keys",
  "temperature_refusal",
  "topk_refusal",
]

for _module in pkgutil.iter_modules(__path__):
  if not _module.name.startswith("_"):
    importlib.import_module(f"{__name__}.{_module.name}")


def for_config(cfg) -> TeacherSource:
  """The source ``cfg`` chose (``teacher.source``, or inferred from its keys), for that run."""
  return get(cfg.models.teacher_kind)(cfg)
