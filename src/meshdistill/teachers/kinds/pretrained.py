"""``teacher.source: pretrained`` (the main job's default): the teacher directory ``pretrain.teacher`` names, else
the one cached for these settings (`teacher_dir`, keyed by `teacher_key`), else one pretrained now on hard labels and
cached. Its identity is that directory."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, ClassVar

from meshdistill.parallel.distributed import agree_on
from meshdistill.data import load_tokenizer
from meshdistill.teachers.checkpoint import TeacherDamagedError, load_teacher, read_teacher_meta
from meshdistill.teachers.kinds._base import ModelSource, register
from meshdistill.teachers.kinds._quantize import check_quantize

log = logging.getLogger("meshdistill.jobs")  # the records keep the name they always had


def default_cache_dir() -> str:
  """``$MESHDISTILL_CACHE`` or ``$XDG_CACHE_HOME/meshdistill`` (default ``~/.cache/meshdistill``) + ``/teachers``."""
  root = os.environ.get("MESHDISTILL_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshdistill"
  )
  return os.path.join(root, "teachers")


def teacher_key(cfg, tokenizer: Any) -> str:
  """A digest of everything that determines a pretrained teacher (sizes, tokenizer, data, recipe, mesh-free)."""
  p = cfg.pretrain
  recipe = {
    k: getattr(p, k)
    for k in ("steps", "batch_size", "lr", "warmup", "final_lr_fraction", "weight_decay", "clip", "seed")
  }
  if p.freeze:  # a freezing schedule changes the teacher; absent, the key stays what it was before the setting counted
    recipe["freeze"] = p.freeze
  if p.mu_dtype != "float32":  # likewise: the default keeps the key it had
    recipe["mu_dtype"] = p.mu_dtype
  d = cfg.data
  data = {
    k: getattr(d, k)
    for k in ("source", "text_key", "val_fraction", "max_chars", "max_docs", "seq_len", "seed", "num_epochs")
  }
  if getattr(d, "corpora", None) is not None:  # named corpora: absent, the key stays what it was before the setting
    data["corpora"] = d.corpora
  # the teacher is pretrained and cached in float32 whatever teacher.param_dtype (the stored dtype, cast on load)
  model = {k: v for k, v in dataclasses.asdict(cfg.teacher).items() if k != "param_dtype"}
  model["dtype"] = cfg.teacher.compute_dtype.name  # dtype auto: the dtype it resolves to (the key it always had)
  blob = json.dumps(
    {"model": model, "tokenizer": tokenizer.fingerprint, "data": data, "recipe": recipe},
    sort_keys=True,
    default=str,
  )
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def teacher_dir(cfg, tokenizer: Any) -> str:
  """Where the cached teacher of ``cfg`` lives (``pretrain.cache_dir`` / ``default_cache_dir()``)."""
  root = os.path.expanduser(cfg.pretrain.cache_dir) if cfg.pretrain.cache_dir else default_cache_dir()
  return os.path.join(root, f"teacher-{teacher_key(cfg, tokenizer)}")


@register
class Pretrained(ModelSource):
  """a teacher of this project's own format: pretrain.teacher, or cached / pretrained for these settings"""

  name: ClassVar[str] = "pretrained"
  settings: ClassVar[tuple[str, ...]] = ("quantize",)

  @classmethod
  def check_settings(cls, values):
    check_quantize(values)

  def model(self, data, mesh, services):
    cfg, report = self.cfg, services.report
    if cfg.pretrain.teacher:
      path = os.path.expanduser(cfg.pretrain.teacher)
      report(f"teacher: {path}")
      return load_teacher(path, cfg.teacher, mesh, data.tokenizer), path

    path = teacher_dir(cfg, data.tokenizer)
    # Every process of a job takes process 0's answer: pretraining is a collective.
    if agree_on(int(os.path.isfile(os.path.join(path, "teacher.json"))), "whether the teacher is cached"):
      report(f"teacher: cached {path}")
      try:
        return load_teacher(path, cfg.teacher, mesh, data.tokenizer), path
      except Exception as e:  # noqa: BLE001 -- any unreadable cache entry is rebuilt, the reason reported
        # The cache key covers the architecture and the tokenizer: a cached teacher that does not load is damaged.
        why = str(e) if isinstance(e, TeacherDamagedError) else f"{type(e).__name__}: {str(e)[:300]}"
        log.warning("cached teacher %s cannot be used (%s); rebuilding it", path, why)
        report(f"teacher: the cached teacher is damaged ({why}); pretraining it again ({cfg.pretrain.steps} steps)")
    else:
      report(f"teacher: none cached for these settings; pretraining one ({cfg.pretrain.steps} steps) -> {path}")
    services.pretrain(cfg, data=data, mesh=mesh, out=path)  # the cache is ours to replace
    return load_teacher(path, cfg.teacher, mesh, data.tokenizer), path

  def _saved_dir(self, identity):
    tdir = identity or self.cfg.pretrain.teacher
    if not tdir:
      raise FileNotFoundError(f"{self.cfg.run.run_dir} names no teacher: set pretrain.teacher=DIR or distil first")
    return os.path.expanduser(tdir)

  def saved_tokenizer(self, identity):
    """The tokenizer saved in the teacher's directory."""
    return load_tokenizer(os.path.join(self._saved_dir(identity), "tokenizer"))

  def saved_model(self, identity, mesh, tokenizer):
    """The teacher directory the run recorded (else ``pretrain.teacher``), read only."""
    tdir = self._saved_dir(identity)
    read_teacher_meta(tdir)
    return tdir, load_teacher(tdir, self.cfg.teacher, mesh, tokenizer)
