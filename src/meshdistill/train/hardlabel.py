"""Training one model on hard labels (next-token cross-entropy), with no teacher.

Used to pretrain a teacher from scratch and to train the "scratch student" baseline of the
quality benchmark. It is the `Distiller` with no teacher: the same step
(`meshdistill.train.step.per_device_step` skips the teacher forward pass when there is none -- no
wasted third of the compute), the same layouts, the same token mean over unmasked tokens of the
GLOBAL batch. States are interchangeable with a distiller's (``params = {"student": ...,
"strategy": {}}``), so checkpoints, evaluation and the trainer loop serve both.
"""

from __future__ import annotations

import dataclasses

import optax
from jax.sharding import Mesh

from meshdistill.train.distiller import Distiller
from meshdistill.models import Decoder
from meshdistill.strategies import HardLabelCE


@dataclasses.dataclass(frozen=True, kw_only=True)
class NextTokenCE(HardLabelCE):
  """`HardLabelCE` that also reports its loss as ``ce`` (the pretraining metrics: ``loss`` = ``ce``)."""

  def per_sequence(self, params, student, teacher, targets_T, mask_T, step):
    out = super().per_sequence(params, student, teacher, targets_T, mask_T, step)
    return {**out, "ce": out["loss"]}


def HardLabelTrainer(  # pylint: disable=invalid-name -- a class name kept for the API
    model: Decoder,
    *,
    optimizer: optax.GradientTransformation | None = None,
    mesh: Mesh | None = None,
    backend: str | None = None,
    fsdp: bool = False,
    micro_batch: int | str | None = None,
) -> Distiller:
  """A `Distiller` training ``model`` alone on next-token cross-entropy (``teacher_def`` / ``teacher_params``
  / ``teacher_cfg`` are None; a divergence guard over it restores but has no fallback loss). ``micro_batch``: the
  `Distiller`'s (gradient accumulation)."""
  return Distiller(model, None, strategy=NextTokenCE(), optimizer=optimizer, mesh=mesh, backend=backend, fsdp=fsdp,
                   micro_batch=micro_batch)
