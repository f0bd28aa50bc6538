"""Building a run's student from its sources (`build_student`: loaded, copied from the teacher by
`student_from_teacher`, or fresh) and its adapters (`with_lora`). The teacher's loaders live with their sources
(`meshdistill.teachers.kinds`: `load_teacher_hf`, `quantized_teacher`, re-exported here)."""

from __future__ import annotations

import os

from flax import nnx

from meshdistill.models import abstract_params, init_model
from meshdistill.models.compress.qat import quantize_aware
from meshdistill.models.hf import load_hf
from meshdistill.models.lora import LoraConfig, apply_lora
from meshdistill.models.stacking import to_scanned
from meshdistill.teachers.kinds._quantize import quantized_teacher  # noqa: F401 -- re-exported
from meshdistill.teachers.checkpoint import load_teacher, read_teacher_meta
from meshdistill.teachers.kinds.hf import load_teacher_hf, with_config
from meshdistill.teachers.sources._settings import ModelSources


def build_student(cfg, teacher, mesh):
  """The run's student on ``mesh``: loaded (``student.hf``), copied from ``teacher`` (``student.init``), the
  pruned student of ``student.init.pruned``, or initialised from ``train.seed``."""
  src: ModelSources = cfg.models
  if src.student_hf:
    model = load_hf(src.student_hf, mesh, dtype=cfg.student.dtype, param_dtype=cfg.student.param_dtype,
                    max_len=cfg.student.max_len, scan_layers=cfg.student.scan_layers)
    model = with_config(model, cfg.student, mesh)
  elif src.student_init.from_teacher:
    model = student_from_teacher(teacher, src.student_init.layers, cfg.student, mesh)
  elif src.student_init.pruned:
    model = pruned_student(src.student_init.pruned, cfg.student, mesh)
  else:
    model = init_model(cfg.student, seed=cfg.train.seed, mesh=mesh)
  return quantize_aware(with_lora(model, src.student_lora, seed=cfg.train.seed, mesh=mesh), src.student_quantize_aware)


def pruned_student(path: str, student_cfg, mesh=None):
  """The student ``meshdistill prune --out path`` wrote (``path/student``, the model-directory format) on ``mesh``,
  with the configured ``max_len`` (a bound on the sequence length: no weight depends on it)."""
  directory = os.path.join(path, "student")
  saved = read_teacher_meta(directory)["model"]["max_len"]
  model = load_teacher(directory, student_cfg.replace(max_len=saved), mesh)
  if saved == student_cfg.max_len:
    return model
  graphdef, _, _ = abstract_params(model.cfg.replace(max_len=student_cfg.max_len))
  return nnx.merge(graphdef, nnx.state(model))


def with_lora(model, lora: LoraConfig, *, seed: int, mesh):
  """``model`` with the adapters of ``student.lora`` (unchanged when its rank is 0)."""
  if not lora.enabled:
    return model

  return apply_lora(model, lora, seed=seed + 1, mesh=mesh)


def student_from_teacher(teacher, layers, student_cfg, mesh=None):
  """A student whose embeddings, LM head, final norm and blocks are copies of ``teacher``'s.

  Student block ``i`` is teacher block ``layers[i]``. ``student_cfg`` must be the teacher's
  configuration with ``n_layers=len(layers)`` (``max_len``, ``dtype``, ``param_dtype``, ``remat``, ``scan_layers``,
  ``attention`` may differ; the copies are cast to the student's ``param_dtype``).
  The copies are new buffers on ``mesh`` with the student's shardings (never aliases of the
  teacher's weights, which the train step must not update).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  scan = student_cfg.with_scan_on(mesh).scan_layers
  t = teacher.cfg.replace(scan_layers=False)
  student_cfg = student_cfg.replace(scan_layers=False)  # built per layer, stacked at the end when asked for
  # the copies keep the teacher's layout for the mesh (vocabulary padding, key/value replication)
  student_cfg = student_cfg.replace(vocab_multiple=t.vocab_multiple, replicate_kv=t.replicate_kv)
  if len(layers) != student_cfg.n_layers or any(not 0 <= i < t.n_layers for i in layers):
    raise ValueError(f"layers={list(layers)} must be {student_cfg.n_layers} block indices in [0, {t.n_layers})")
  if t.with_layers(layers).replace(max_len=student_cfg.max_len, dtype=student_cfg.dtype, remat=student_cfg.remat,
                                   attention=student_cfg.attention, param_dtype=student_cfg.param_dtype) != student_cfg:
    raise ValueError("student_from_teacher: student_cfg must be the teacher's config with n_layers=len(layers) "
                     "(ModelConfig.with_layers(layers))")
  graphdef, abstract, shardings = abstract_params(student_cfg, mesh)
  teacher_flat = dict(nnx.to_flat_state(nnx.state(teacher)))
  leaves = []
  for key, var in nnx.to_flat_state(abstract):
    if key[0] != "blocks":
      value = teacher_flat[key].get_value()
    elif teacher.cfg.scan_layers:  # the teacher's stacked weight, its layer layers[i]
      value = teacher_flat[(key[0], *key[2:])].get_value()[layers[key[1]]]
    else:
      value = teacher_flat[(key[0], layers[key[1]], *key[2:])].get_value()
    leaves.append((key, var.replace(value.astype(var.get_value().dtype))))
  state = nnx.from_flat_state(leaves)
  if mesh is None:
    state = jax.jit(lambda s: jax.tree.map(jnp.copy, s))(state)
  else:
    state = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=shardings)(state)
  student = nnx.merge(graphdef, state)
  return to_scanned(student) if scan else student
