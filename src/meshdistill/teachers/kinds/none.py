"""``teacher.source: none``: no teacher; the student trains on the data alone, with a strategy that declares
``needs_teacher = False`` (e.g. ``distill.kind: hard_label_ce``, the baseline a distilled student is compared with)."""

from __future__ import annotations

from typing import ClassVar

from meshdistill.core.typed_yaml import ConfigError
from meshdistill.teachers.kinds._base import NOTHING, Prepared, TeacherSource, register
from meshdistill.train.teacher import TeacherKind


@register
class NoTeacher(TeacherSource):
  """no teacher: train on the data alone (distill.kind=hard_label_ce)"""

  name: ClassVar[str] = "none"
  gives: ClassVar[TeacherKind] = NOTHING

  def check(self):
    super().check()
    if self.cfg.models.student_init.from_teacher:
      raise ConfigError("student.init.from_teacher copies the teacher's weights, but teacher.source=none has no "
                        "teacher; remove student.init (or choose a teacher source)")

  def prepare(self, data, mesh, teacher_mesh, services):
    del mesh, teacher_mesh
    services.report("teacher: none (the student trains on the data alone)")
    return Prepared(data, None, None)
