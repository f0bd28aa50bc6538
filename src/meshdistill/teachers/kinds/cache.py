"""``teacher.source: cache``: an offline top-k cache (``teacher.cache``, written by ``meshdistill cache-teacher``):
no teacher weights are loaded; every training batch carries the teacher's top-k. The cache is checked against the
run's data, tokenizer, teacher config and student vocabulary; its identity is its directory. With ``distill.on_policy``
the cache serves the batches of the data's completions and the teacher that wrote it runs live on the generated
ones (`Cached._on_policy`). With
``data.teacher_tokenizer`` the cache must be a cross-tokenizer one of that teacher tokenizer: its rows are
re-tokenized for the student and aligned on the fly (`meshdistill.teachers.cache.CachedCrossData`). With ``teacher.hf``
the teacher's shape and tokenizer are those of the Hugging Face teacher that wrote it (its weights are not read)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from flax import nnx

from meshdistill.core.typed_yaml import ConfigError
from meshdistill.models import ModelConfig
from meshdistill.parallel.mesh import platform_of
from meshdistill.teachers import cache as tc
from meshdistill.teachers.kinds._base import TOPK, Prepared, TeacherSource, register
from meshdistill.train.teacher import TeacherKind
from meshdistill.teachers.kinds.hf import HuggingFace, check_hf_path
from meshdistill.teachers.kinds.pretrained import Pretrained

# How the teacher computes or is placed, not what: remat, stacked blocks, and the vocabulary padding and key/value
# replication `ModelConfig.for_tensor` adds for the writer's mesh (the manifest holds the fitted config).
_PLACEMENT = ("remat", "scan_layers", "vocab_multiple", "replicate_kv")


def _dtypes_as_run(fields: dict, platform: str) -> dict:
  """A teacher's config fields as they compare between a cache and a run: without `_PLACEMENT`, and ``dtype`` /
  ``param_dtype`` of ``auto`` as they resolve on ``platform`` for a frozen teacher (`ModelConfig.frozen`), so a
  cache written under float32 settings is this config's on a CPU."""
  out = {k: v for k, v in fields.items() if k not in _PLACEMENT}
  run = ModelConfig(dtype=out.get("dtype", "float32"), param_dtype=out["param_dtype"]).for_platform(platform)
  out["dtype"], out["param_dtype"] = run.dtype, run.frozen(platform).param_dtype
  return out


@register
class Cached(TeacherSource):
  """an offline top-k cache, e.g. teacher.cache: path/to/cache (meshdistill cache-teacher --out)"""

  name: ClassVar[str] = "cache"
  gives: ClassVar[TeacherKind] = TOPK
  # teacher.hf: the Hugging Face teacher that wrote the cache, for its shape and tokenizer (no weights are read)
  settings: ClassVar[tuple[str, ...]] = ("cache", "hf")
  required: ClassVar[tuple[str, ...]] = ("cache",)

  @classmethod
  def check_settings(cls, values):
    check_hf_path(values)
    path = values.get("cache")
    if not isinstance(path, str) or not path:
      raise ConfigError(f"teacher.cache={path!r} must be the path of a teacher cache (written by "
                        "`meshdistill cache-teacher`)")

  def check(self):
    # The strategy is checked against the cache's own k and temperature when the `Distiller` is built.
    if self.cfg.models.student_init.from_teacher:
      raise ConfigError("student.init.from_teacher copies the teacher's weights, but teacher.cache loads none; "
                        "remove student.init (or teacher.cache)")
    on_policy = self.cfg.distill.on_policy
    if on_policy.prompts_file:
      raise ConfigError(f"distill.on_policy.prompts_file={on_policy.prompts_file} trains on prompt pairs, but "
                        f"teacher.cache={self.cfg.models.teacher_cache} holds the teacher's top-k of the corpus rows; "
                        "remove one of them (on-policy distillation from a cache reads the corpus rows)")
    if on_policy.active and self.cfg.data.teacher_tokenizer:
      raise ConfigError(f"distill.on_policy with a cross-tokenizer teacher.cache (data.teacher_tokenizer="
                        f"{self.cfg.data.teacher_tokenizer}) is not supported: the generated rows need the teacher on "
                        "its own tokens; set distill.on_policy.lambda=0, or use a cache of the student's tokenizer")

  def prepare(self, data, mesh, teacher_mesh, services):
    del teacher_mesh
    cfg = self.cfg
    cache = tc.TeacherCache(cfg.models.teacher_cache)
    platform = platform_of(mesh)
    teacher_cfg = _dtypes_as_run(dataclasses.asdict(cfg.teacher), platform)
    # a cache written before param_dtype was a setting: float32 weights
    saved_cfg = _dtypes_as_run({"param_dtype": "float32", **cache.manifest["teacher"]["config"]}, platform)
    if saved_cfg != teacher_cfg:
      diff = sorted(k for k in set(saved_cfg) | set(teacher_cfg) if saved_cfg.get(k) != teacher_cfg.get(k))
      raise ConfigError(
        f"teacher.cache={cache.path} was made by another teacher (teacher.{diff[0]}: cache "
        f"{saved_cfg.get(diff[0])!r}, this config {teacher_cfg.get(diff[0])!r}); use the config that wrote the cache"
      )
    what = f"({cache.manifest['precision']}, {cache.bytes_per_token():.1f} bytes/token); no teacher weights loaded"
    if data.teacher_tokenizer is not None:  # a student of another tokenizer: aligned on the fly
      setting = cfg.data.teacher_tokenizer
      tc.check_cross(cache, data.teacher_tokenizer, setting)
      rows = tc.teacher_rows_of(data, cache.seq_len)
      got = tc.open_cross(data, cache, setting, tc.teacher_rows_identity(rows, data.teacher_tokenizer))
      services.report(f"teacher: top-{cache.k} cross-tokenizer cache {cache.path} of teacher tokenizer {setting!r}, "
                      f"{cache.num_rows} rows of {cache.seq_len} teacher tokens re-tokenized for the student {what}")
      return Prepared(got, cache.spec(), cache.path)
    tc.check_not_cross(cache)
    cache.check(data=tc.data_identity(data.train, data.tokenizer), vocab=cfg.student.vocab_size)
    if cfg.distill.on_policy.active:
      return self._on_policy(cache, data, mesh, services)
    services.report(f"teacher: top-{cache.k} cache {cache.path} {what}")
    return Prepared(tc.CachedTeacherData(data, cache), cache.spec(), cache.path)

  def _on_policy(self, cache, data, mesh, services):
    """``distill.on_policy`` with a cache: the cache serves the batches of the data's completions (read by their
    ``row_ids``), and the teacher that wrote it -- ``teacher.hf``, else the pretrained one (``pretrain.teacher``, or
    cached for these settings), as ``meshdistill cache-teacher`` found it -- runs live on the generated batches only.
    Its weights must be the cache's (the manifest's hash): the two shares then train against one teacher."""
    source = HuggingFace(self.cfg) if self.cfg.models.teacher_hf else Pretrained(self.cfg)
    teacher, where = source.model(data, mesh, services)
    saved = cache.manifest["teacher"]
    placed = {k: v for k, v in dataclasses.asdict(teacher.cfg).items() if k in _PLACEMENT}
    if all(saved["config"].get(k) == v for k, v in placed.items()):  # the same vocabulary padding: comparable hashes
      got = tc.weights_hash(nnx.state(teacher))
      if saved.get("weights_sha256") not in (None, got):
        raise ConfigError(
          f"teacher.cache={cache.path} was written by another teacher than the one distill.on_policy would run live on "
          f"the generated rows ({where}: its weights differ from the cache's); give the teacher that wrote the cache "
          "(pretrain.teacher=DIR or teacher.hf=DIR), or rewrite the cache with this teacher "
          "(meshdistill cache-teacher)")
    services.report(f"teacher: top-{cache.k} cache {cache.path} for the batches of the data's completions; the "
                    f"teacher {where} live on the generated ones")
    return Prepared(tc.RowIdData(data, cache), teacher, cache.path, cache=cache)

  def saved_model(self, identity, mesh, tokenizer):
    """With ``teacher.hf`` (the teacher that wrote the cache) that model, read on ``mesh``; else none (the cache
    holds its top-k only)."""
    if self.cfg.models.teacher_hf:
      return HuggingFace(self.cfg).saved_model(identity, mesh, tokenizer)
    return super().saved_model(identity, mesh, tokenizer)
