"""The ``mesh`` section of a run's `meshdistill.config.Config`: `MeshSettings` (the layout, its backend, simulated
CPU devices) and how ``auto`` sizes become the devices present (`MeshSettings.resolved`)."""

from __future__ import annotations

import dataclasses
import math

from meshdistill.core.typed_yaml import ConfigError, positive_int
from meshdistill.parallel.backends import BACKENDS, layout_class
from meshdistill.parallel.fsdp import unsupported as fsdp_unsupported
from meshdistill.parallel.layout import check_student_split
from meshdistill.parallel.mesh import check_axes

CPU_MESH = (2, 4)  # `mesh` auto without an accelerator: data x tensor, the reference layout on 8 simulated devices


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSettings:
  """``data`` x ``tensor`` devices; ``simulate_cpu_devices``: ``auto`` exposes data*tensor CPU
  devices when running on CPU (it does not affect GPU/TPU), ``true`` forces the CPU platform with
  simulated devices, ``false`` uses the devices as they are. ``fsdp``: weights of both models and the
  student's optimizer moments split over ``data`` too (`meshdistill.parallel.fsdp`; ``backend: shard_map`` only).
  ``student_split``: ``tensor`` (the student split over ``tensor`` like the teacher) or ``batch`` (the student
  replicated, run on the batch rows split over ``data`` x ``tensor``:
  `meshdistill.parallel.backends.ShardMapLayout`). ``axes``: more mesh axes and their sizes, between ``data`` and
  ``tensor`` (e.g. ``{expert: 2}``; `meshdistill.parallel.mesh.EXTRA_AXES`): the devices are the product of all
  sizes; ``expert`` splits the experts of mixture-of-experts models (expert parallelism, an all-to-all of the routed
  tokens: `meshdistill.models.moe`), what no rule splits over an axis (`meshdistill.parallel.rules`) holds replicas.

  ``data`` / ``tensor``: ``auto`` (the default) uses the devices present, decided when the job starts
  (`resolved`): without an accelerator the reference layout 2 x 4 on 8 simulated CPU devices; on accelerators all of
  them, ``data`` the largest divisor of their count that divides the batch and ``tensor`` the rest (one chip: 1 x 1);
  a size given is kept and the other fills the devices."""

  data: int | str = "auto"
  tensor: int | str = "auto"
  axes: dict | None = None
  backend: str = "shard_map"
  simulate_cpu_devices: bool | str = "auto"
  fsdp: bool = False
  student_split: str = "tensor"

  def __post_init__(self):
    for name in ("data", "tensor"):
      if getattr(self, name) != "auto":
        positive_int(f"mesh.{name}", getattr(self, name))
    try:
      check_axes(self.axes or {})
    except ValueError as e:
      raise ConfigError(str(e)) from None
    if self.backend not in BACKENDS:
      raise ConfigError(f"mesh.backend={self.backend!r}; choose one of {list(BACKENDS)}")
    if not (self.simulate_cpu_devices == "auto" or isinstance(self.simulate_cpu_devices, bool)):
      raise ConfigError(f"mesh.simulate_cpu_devices={self.simulate_cpu_devices!r}; choose one of ['auto', true, false]")
    if not isinstance(self.fsdp, bool):
      raise ConfigError(f"mesh.fsdp={self.fsdp!r}; choose true or false")
    if self.fsdp and not layout_class(self.backend).supports_fsdp:
      raise ConfigError(fsdp_unsupported(self.backend))
    try:
      check_student_split(self.student_split, self.fsdp)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    if not self.auto:
      problem = layout_class(self.backend).check_settings(self.data, self.tensor, self.axes)
      if problem is not None:
        raise ConfigError(problem)

  @property
  def auto(self) -> bool:
    """Whether ``data`` or ``tensor`` is still ``auto`` (`resolved` makes them sizes)."""
    return "auto" in (self.data, self.tensor)

  @property
  def devices(self) -> int:
    """The devices the mesh takes (``auto`` sizes as on a machine without an accelerator: `resolved`)."""
    m = self.resolved(None) if self.auto else self
    return int(m.data) * int(m.tensor) * math.prod((self.axes or {}).values())  # resolved: both sizes

  def resolved(self, accelerators: int | None, batch: int = 1) -> "MeshSettings":
    """These settings with ``auto`` sizes decided: ``accelerators`` None (the CPU platform) takes the reference
    layout ``CPU_MESH`` (data 2 x tensor 4; the pmap layout, which needs tensor 1: 8 x 1; ``single``: 1 x 1);
    otherwise the ``accelerators`` present (divided by the other axes' sizes): a size given is kept and the other
    fills them, both ``auto`` take ``data`` = the largest divisor of their count that divides ``batch``."""
    if not self.auto:
      return self
    layout = layout_class(self.backend)
    given = {k: getattr(self, k) for k in ("data", "tensor") if getattr(self, k) != "auto"}
    others = math.prod((self.axes or {}).values())
    if layout.one_device:
      data, tensor = 1, 1
    elif accelerators is None:
      data, tensor = CPU_MESH
      if layout.check_settings(data, tensor, self.axes) is not None:  # pmap: no tensor axis
        data, tensor = data * tensor, 1
      data, tensor = given.get("data", data), given.get("tensor", tensor)
    else:
      n = max(accelerators // others, 1)
      if "tensor" in given:
        data, tensor = given.get("data", max(n // given["tensor"], 1)), given["tensor"]
      elif "data" in given:
        data, tensor = given["data"], max(n // given["data"], 1)
      else:
        data = math.gcd(n, batch)
        tensor = n // data
        if layout.check_settings(data, tensor, self.axes) is not None:  # pmap: data over every device
          data, tensor = n, 1
    return dataclasses.replace(self, data=data, tensor=tensor)
