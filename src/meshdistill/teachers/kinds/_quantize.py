"""``teacher.quantize``: a setting of every source that runs the teacher's weights (its projections stored int8 /
int4 / nf4 for inference, `meshdistill.models.quantize`); its one rule lives here."""

from __future__ import annotations

from meshdistill.core.typed_yaml import ConfigError
from meshdistill.models.quantize import QUANTIZE, quantize_model


def check_quantize(values: dict) -> None:
  q = values.get("quantize")
  if q is not None and q not in QUANTIZE:
    raise ConfigError(f"teacher.quantize={q!r}; choose one of {list(QUANTIZE)} or null (float teacher weights)")


def quantized_teacher(cfg, teacher, mesh):
  """``teacher`` with its projections stored as ``teacher.quantize`` says (unchanged when it is null).

  Applied after the student is built, so ``student.init.from_teacher`` copies the float weights."""
  q = cfg.models.teacher_quantize
  if q is None or teacher is None or not hasattr(teacher, "iter_modules"):  # no weights here (a top-k teacher)
    return teacher

  return quantize_model(teacher, q, mesh=mesh)
