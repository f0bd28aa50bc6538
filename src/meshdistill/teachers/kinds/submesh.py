"""``teacher.source: submesh``: a live teacher on devices of its own (``teacher.devices: {data, tensor}``, other mesh
axes by name: ``{data: 1, expert: 2, tensor: 2}``) beside the
student's mesh, one batch ahead (`meshdistill.teachers.mesh`); the student receives its top-k per token. The teacher
it runs is ``teacher.hf`` when set, else the pretrained one (`Pretrained`), optionally ``teacher.quantize``d; its
identity is that teacher's."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from meshdistill.core.typed_yaml import ConfigError
from meshdistill.strategies import Strategy
from meshdistill.parallel.backends import layout_class
from meshdistill.parallel.mesh import DATA, TENSOR, mesh_shape, shape_label
from meshdistill.teachers.kinds._base import TOPK, Prepared, TeacherSource, register, topk_refusal
from meshdistill.train.teacher import TeacherKind
from meshdistill.teachers.kinds.hf import check_hf_path
from meshdistill.teachers.kinds._quantize import check_quantize
from meshdistill.teachers.mesh import TeacherMeshData, TeacherOnMesh, split_meshes
from meshdistill.teachers.kinds._quantize import quantized_teacher
from meshdistill.core.vocab import resolve_shared_vocab


@register
class SubMesh(TeacherSource):
  """a live teacher on its own devices, e.g. teacher.devices: {data: 1, tensor: 4}"""

  name: ClassVar[str] = "submesh"
  gives: ClassVar[TeacherKind] = TOPK
  settings: ClassVar[tuple[str, ...]] = ("devices", "hf", "quantize")
  required: ClassVar[tuple[str, ...]] = ("devices",)

  @classmethod
  def check_settings(cls, values):
    d = values.get("devices")
    try:
      if not isinstance(d, dict) or not {DATA, TENSOR} <= set(d):
        raise ValueError("")
      mesh_shape(d, "teacher.devices")
    except ValueError as e:
      raise ConfigError(f"teacher.devices={d!r} must be the teacher's own mesh {{data: D, tensor: T}} (positive "
                        "integers; other mesh axes by name, e.g. {data: 1, expert: 2, tensor: 2}), e.g. "
                        "{data: 1, tensor: 4}; the student's mesh (mesh.data x mesh.tensor) takes other devices"
                        + (f" ({e})" if str(e) else "")) from None
    check_hf_path(values)
    check_quantize(values)

  def accepts(self, strategy: type[Strategy], distill: Any) -> str | None:
    return topk_refusal(self.name, strategy, distill, "teacher.devices sends the student the teacher's top-k only")

  def check(self):
    super().check()  # the strategy first: the sub-mesh teacher sends the student its top-k only
    if not layout_class(self.cfg.mesh.backend).spans_processes:  # a mesh split over devices of its own
      raise ConfigError(f"teacher.devices needs mesh.backend=shard_map (got {self.cfg.mesh.backend!r})")

  def extra_devices(self):
    return math.prod(self.cfg.models.teacher_devices.values())

  def _student_shape(self):
    m = self.cfg.mesh
    return mesh_shape({DATA: m.data, **(m.axes or {}), TENSOR: m.tensor})

  def meshes(self, build_mesh):
    try:
      return split_meshes(self.cfg.models.teacher_devices, self._student_shape())
    except ValueError as e:
      raise ConfigError(str(e)) from None

  def prepare(self, data, mesh, teacher_mesh, services):
    cfg, d = self.cfg, self.cfg.models.teacher_devices
    teacher, identity = self.runs().model(data, teacher_mesh, services)
    teacher = quantized_teacher(cfg, teacher, teacher_mesh)  # teacher.quantize
    vocab = resolve_shared_vocab(teacher.cfg.vocab_size, cfg.student.vocab_size) or teacher.cfg.vocab_size
    tau = float(cfg.distill.value("temperature"))  # constant: checked by `check`
    on_mesh = TeacherOnMesh(teacher, k=cfg.distill.value("top_k"), temperature=tau, vocab=vocab,
                            teacher_mesh=teacher_mesh, student_mesh=mesh)
    services.report(f"teacher: on its own {shape_label(mesh_shape(d))} mesh, student on "
                    f"{shape_label(self._student_shape())}")
    return Prepared(TeacherMeshData(data, on_mesh), on_mesh.spec(), identity)

  def saved_tokenizer(self, identity):
    return self.runs().saved_tokenizer(identity)

  def saved_model(self, identity, mesh, tokenizer):
    """The teacher it ran, read on ``mesh`` (the student's devices: after training they are free)."""
    return self.runs().saved_model(identity, mesh, tokenizer)
