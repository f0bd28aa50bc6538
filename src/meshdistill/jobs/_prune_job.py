"""``meshdistill prune``: the run's teacher scored on the run's own training batches and cut to a smaller student
(`meshdistill.models.compress`), written where ``student.init: {pruned: OUT}`` of a distillation config reads it.

``OUT`` receives, atomically (a temporary sibling renamed into place) and with an owner marker:

* ``student/`` -- the pruned student in the project's model-directory format (`save_teacher`: orbax parameters,
  ``teacher.json`` with its `ModelConfig` and checksums, the run's tokenizer), its ``info`` naming the teacher;
* ``hf/`` -- the same student as a Hugging Face checkpoint of the teacher's family (`export_hf`), with the
  teacher's tokenizer files when the teacher is ``teacher.hf``;
* ``scores.npz`` -- every importance score (`meshdistill.models.compress.Importance`);
* ``report.json`` -- the targets, both models' sizes and parameter counts, the aggregation, the calibration size,
  the units kept and the units removed.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from typing import IO

from flax import nnx

from meshdistill.models.compress import PruneTargets, prune as prune_model
from meshdistill.config import Config, ConfigError
from meshdistill.jobs._setup import build_mesh, load_data, resolve_mesh, stream_reporter
from meshdistill.jobs._teacher import obtain_teacher
from meshdistill.models import families
from meshdistill.models.hf import export_hf, read_hf_config
from meshdistill.parallel import distributed
from meshdistill.parallel.backends import make_layout
from meshdistill.teachers.checkpoint import save_teacher
from meshdistill.core.fsutil import atomic_output_dir
from meshdistill.core.ownership import OutputKind, check_owned, write_marker

log = logging.getLogger("meshdistill.jobs")

PRUNE_ENTRIES = ("student", "hf", "scores.npz", "report.json")
PRUNE_KIND = OutputKind("pruned", "pruned student directory (--out)", lambda n: n in PRUNE_ENTRIES)
STUDENT_DIR = "student"  # the pruned student in the model-directory format, inside OUT


def check_prune_target(out: str, overwrite: bool) -> None:
  """Raises unless ``out`` may receive a pruned student (a non-empty one only with ``overwrite``, and only when an
  earlier ``meshdistill prune`` wrote it)."""
  check_owned(out, PRUNE_KIND, overwrite=overwrite, flag="--overwrite")


def _family(cfg: Config) -> str | None:
  """The teacher's family name when it is a Hugging Face checkpoint (the student is exported as the same family)."""
  if not cfg.models.teacher_hf:
    return None
  return families.family_for(read_hf_config(cfg.models.teacher_hf)).name


def prune(cfg: Config, out: str, targets: PruneTargets, *, batches: int = 8, overwrite: bool = False,
          stream: IO[str] | None = None) -> dict:
  """Scores the run's teacher on ``batches`` training batches of the run's data on the run's mesh and writes the
  student cut to ``targets`` into ``out`` (see the module docstring). Returns the report (``out`` added)."""
  if distributed.process_count() > 1:
    raise ConfigError("meshdistill prune runs as one process (the student is cut on the host); run it without "
                      "--coordinator / --num-processes")
  if not targets.any:
    raise ConfigError("meshdistill prune: no target given; set at least one of --mlp, --heads, --embed, --layers")
  if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
    raise ConfigError(f"--batches={batches!r} must be a positive integer (calibration batches of train.batch_size)")
  cfg = resolve_mesh(cfg)
  teacher_cfg = cfg.teacher.replace(vocab_multiple=1, replicate_kv=False)
  try:
    student_cfg = targets.student_config(teacher_cfg)
    student_cfg.check_tensor_split(cfg.mesh.tensor)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  out = os.path.abspath(out)
  check_prune_target(out, overwrite)
  say = stream_reporter(stream)
  mesh = build_mesh(cfg)
  data = load_data(cfg, mesh=mesh)
  teacher, identity = obtain_teacher(cfg, data, mesh, stream=stream, report=say)
  layout = make_layout(cfg.mesh.backend, mesh, fsdp=cfg.mesh.fsdp)
  if layout.fsdp:  # the teacher split as the run splits it (over data too)
    graphdef, state = nnx.split(layout.fit_model(teacher))
    teacher = nnx.merge(graphdef, layout.place_params(state))
  it = data.train_iterator()
  try:
    calibration = list(itertools.islice(it, batches))
  finally:
    it.close()
  say(f"prune: scoring the teacher on {len(calibration)} batches of {data.global_batch_size} rows "
      f"(depth by {targets.depth})")
  try:
    result = prune_model(teacher, calibration, targets, mesh=mesh if layout.mesh is not None else None)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  report = {**result.report, "teacher_source": str(identity), "mesh": cfg.to_dict()["mesh"]}
  _write(out, result, report, data, cfg)
  say(f"prune: {report['teacher']['params']:,} -> {report['student']['params']:,} parameters "
      f"({100 * report['fraction_kept']:.1f}%) -> {out}")
  return {**report, "out": out}


def _write(out: str, result, report: dict, data, cfg: Config) -> None:
  tokenizer = cfg.models.teacher_hf or (None if cfg.data.tokenizer == "byte" else data.tokenizer)
  with atomic_output_dir(out) as tmp:
    save_teacher(os.path.join(tmp, STUDENT_DIR), result.student, data.tokenizer,
                 info={"pruned": {k: report[k] for k in ("targets", "teacher", "student", "kept")}})
    export_hf(result.student, os.path.join(tmp, "hf"), tokenizer=tokenizer, family=_family(cfg))
    result.importance.save(os.path.join(tmp, "scores.npz"))
    with open(os.path.join(tmp, "report.json"), "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
    write_marker(tmp, PRUNE_KIND)
