"""Typed run configuration: YAML files and ``--set key=value`` overrides -> nested dataclasses.

A run is described by `Config`, whose sections are frozen, keyword-only dataclasses::

  mesh        data x tensor layout, step backend, simulated CPU devices
  teacher     `ModelConfig` of the teacher, and ``source`` with that source's settings (``hf: PATH``, ``cache: PATH``,
              ``devices: {data, tensor}``, ``quantize``; see `meshdistill.teachers.kinds`); with ``hf`` its
              ``max_len`` is config.json's ``max_position_embeddings`` unless the config names one
  teachers    several named teacher sources and how they combine (route / mix; `meshdistill.teachers.multi`)
  student     `ModelConfig` of the student, ``hf: PATH``, or ``init: {from_teacher: true, layers: [...]}`` (``max_len``
              from config.json too, the teacher's with ``teacher.hf``, unless named)
  data        `meshdistill.data.DataConfig` (corpus, tokenizer, seq_len, ...)
  distill     the strategy (a registered name) and its recipe (temperature / alpha: numbers or schedule specs)
  preference  how a ``distill.kind: preference`` run gets its (chosen, rejected) pairs
  train       steps, batch size, optimizer, evaluation and logging cadence
  pretrain    how the teacher is obtained: a checkpoint, or pretrained from scratch and cached
  safeguards  divergence guard, automatic remat by memory, static loss scaling
  checkpoint  where / how often train states are saved, and how many are kept
  run         the run directory

The dataclass defaults ARE the main job (``meshdistill distill`` with no arguments) and the
one source of its settings: the packaged ``configs/default.yaml`` is generated from them
(`meshdistill.config.files`), and a test keeps the file equal to them. A YAML file only needs
the keys it changes: `load_config` overlays the file, then the overrides, on the defaults. Everything is checked before any work starts: an unknown key or a bad
value raises `ConfigError` naming the dotted key and what is allowed.

This module holds `Config` (and the checks across its sections), `load_config` and `dump_config`; the
section dataclasses live in `meshdistill.config.sections` and are importable from here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import yaml

from meshdistill import strategies
from meshdistill.parallel.distributed.platforms import cpu_only
from meshdistill.config import files as config_files
from meshdistill.core.typed_yaml import ConfigError, from_dict, to_plain
from meshdistill.config.files import config_path  # noqa: F401  (part of this module's API)
from meshdistill.config.sections import (
  CheckpointSettings,
  DistillSettings,
  GuardSettings,
  MeshSettings,
  OnPolicySettings,
  PreferenceSettings,
  PretrainSettings,
  RematSettings,
  RunSettings,
  SafeguardSettings,
  TrainSettings,
)
from meshdistill.data import DataConfig
from meshdistill.train.freezing import check_stages
from meshdistill.core.fsutil import write_text_atomic
from meshdistill.models import ModelConfig
from meshdistill.teachers.multi import TeachersSettings, check_teachers
from meshdistill.teachers.sources import ModelSources, nest_sources, resolve, split_sources

# The package's names: `meshdistill.config.__all__` (the one list).


def _default_teacher() -> ModelConfig:
  return ModelConfig(
    vocab_size=264, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=512, max_len=128, tie_embeddings=False
  )


def _default_student() -> ModelConfig:
  return ModelConfig(
    vocab_size=264, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=256, max_len=128, tie_embeddings=False
  )


def _default_distill() -> DistillSettings:
  """The main job's recipe, stated in full: `LogitKD` on the forward KL at temperature 1.0, alpha 1.0 (LogitKD's
  own defaults, which a config naming ``distill.kind`` starts from, are temperature 2.0 and alpha 0.5)."""
  return DistillSettings(kind="logit_kd", temperature=1.0, alpha=1.0, divergence="forward_kl")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """A whole run. Defaults are the main job; see the module docstring for the sections."""

  mesh: MeshSettings = dataclasses.field(default_factory=MeshSettings)
  teacher: ModelConfig = dataclasses.field(default_factory=_default_teacher)
  student: ModelConfig = dataclasses.field(default_factory=_default_student)
  data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(seq_len=128, max_chars=3_000_000))
  distill: DistillSettings = dataclasses.field(default_factory=_default_distill)
  preference: PreferenceSettings = dataclasses.field(default_factory=PreferenceSettings)
  train: TrainSettings = dataclasses.field(default_factory=TrainSettings)
  pretrain: PretrainSettings = dataclasses.field(default_factory=PretrainSettings)
  safeguards: SafeguardSettings = dataclasses.field(default_factory=SafeguardSettings)
  checkpoint: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
  run: RunSettings = dataclasses.field(default_factory=RunSettings)
  models: ModelSources = dataclasses.field(default_factory=ModelSources)  # teacher.hf / student.hf / student.init
  teachers: TeachersSettings = dataclasses.field(default_factory=TeachersSettings)

  def __post_init__(self):
    from_hf = self.models.max_len_from_hf  # before `resolve` empties it: the bounds read from a config.json
    for section, value in resolve(self).items():  # shapes (and tokenizer) derived from teacher.hf / student.*
      object.__setattr__(self, section, value)
    # the mesh the checks below hold against: an auto mesh as it resolves without an accelerator (known before JAX
    # starts); on accelerators it is checked once the job has decided it (`MeshSettings.resolved`, `prepare_devices`)
    mesh = self.mesh if not self.mesh.auto else self.mesh.resolved(None) if cpu_only() else None
    for who in ("teacher", "student"):
      m = getattr(self, who)
      if m.max_len < self.data.seq_len:
        origin = " (config.json's max_position_embeddings)" if who in from_hf else ""
        raise ConfigError(
          f"{who}.max_len={m.max_len}{origin} is shorter than data.seq_len={self.data.seq_len}; "
          f"set {who}.max_len >= {self.data.seq_len} or lower data.seq_len"
        )
      if m.attention == "splash" and self.data.seq_len % 128:
        raise ConfigError(
          f"{who}.attention=splash needs data.seq_len a multiple of 128 (the kernel's block width), got "
          f"{self.data.seq_len}; set data.seq_len={max(128, self.data.seq_len // 128 * 128)} or {who}.attention=xla"
        )
      try:
        if mesh is not None:
          m.check_tensor_split(mesh.tensor)
      except ValueError as e:
        raise ConfigError(f"{who}: {e} (mesh.tensor={mesh.tensor})") from None
    if self.student.param_dtype not in ("float32", "auto"):
      raise ConfigError(
        f"student.param_dtype={self.student.param_dtype!r}: the student trains with float32 weights (optimizer "
        "updates on bfloat16 / float16 weights are not supported); set student.param_dtype=float32 and use "
        "student.dtype=bfloat16 for bfloat16 compute (teacher.param_dtype may be bfloat16: the teacher is frozen)"
      )
    self._check_tokenizers()
    check_teachers(self)
    n_new = self.distill.on_policy.max_new_tokens
    if self.distill.on_policy.active and n_new > self.data.seq_len:
      raise ConfigError(
        f"distill.on_policy.max_new_tokens={n_new} leaves no prompt in rows of data.seq_len={self.data.seq_len} "
        f"tokens; use max_new_tokens <= {self.data.seq_len} (prompts are the first seq_len + 1 - max_new_tokens tokens)"
      )
    for section, model in (("train", self.student), ("pretrain", self.teacher)):
      stages = getattr(self, section).stages()
      if stages is not None:
        try:
          check_stages(stages, model.n_layers)
        except ValueError as e:
          raise ConfigError(f"{section}.freeze: {e}".replace("Stage(", "stage(")) from None
    if self.models.student_lora.enabled and self.student.scan_layers is True:
      raise ConfigError("student.lora needs per-layer blocks (qwix adapts blocks/<i>/... by path): set "
                        "student.scan_layers=false or auto for a LoRA student (the teacher may stay scanned)")
    if self.models.student_lora.enabled and self.student.scan_layers == "auto":  # per layer on every platform
      object.__setattr__(self, "student", self.student.replace(scan_layers=False))
    if mesh is None:
      return
    if strategies.get(self.distill.kind).needs_pairs and self.train.batch_size % (2 * mesh.data):
      raise ConfigError(
        f"train.batch_size={self.train.batch_size} with distill.kind=preference: rows come in (chosen, rejected) pairs "
        f"that share a data shard, so use a multiple of 2 * mesh.data = {2 * mesh.data}"
      )
    for section in ("train", "pretrain"):
      b = getattr(self, section).batch_size
      if b % mesh.data:
        ok = [d for d in range(1, b + 1) if b % d == 0]
        raise ConfigError(
          f"{section}.batch_size={b} is not divisible by mesh.data={mesh.data}; use a multiple of "
          f"{mesh.data} or mesh.data in {ok}"
        )

  def _check_tokenizers(self) -> None:
    """One tokenizer: equal vocabularies. A teacher of its own (``data.teacher_tokenizer``): a strategy that aligns
    the two tokenizations (``cross_tokenizer``: uld, span_kl, byte_kl); the others are refused, naming those that
    work."""
    cross = sorted(n for n in strategies.names() if strategies.get(n).cross_tokenizer)
    aligns = strategies.get(self.distill.kind).cross_tokenizer
    if self.data.teacher_tokenizer is None:
      if aligns:
        raise ConfigError(f"distill.kind={self.distill.kind} distils a teacher of another tokenizer: set "
                          "data.teacher_tokenizer (byte, bpe or a tokenizer.json path)")
      if self.teacher.vocab_size != self.student.vocab_size and not self.models.student_hf:  # hf: padding checked
        raise ConfigError(
          f"teacher.vocab_size={self.teacher.vocab_size} != student.vocab_size={self.student.vocab_size}; "
          "distillation compares distributions token by token: set both to the tokenizer's vocabulary size, or give "
          f"the teacher its own tokenizer (data.teacher_tokenizer) and distil with distill.kind in {cross}"
        )
      return
    if not aligns:
      raise ConfigError(
        f"data.teacher_tokenizer={self.data.teacher_tokenizer!r} gives the teacher its own tokens, but "
        f"distill.kind={self.distill.kind} compares the models token by token over one vocabulary (logit and "
        "attention-map transfer need the same tokens on both sides), so it is refused; choose distill.kind in "
        f"{cross}, or drop data.teacher_tokenizer"
      )
    teacher_len = self.data.teacher_seq_len or self.data.seq_len
    if self.teacher.max_len < teacher_len:
      raise ConfigError(f"teacher.max_len={self.teacher.max_len} is shorter than the teacher's rows "
                        f"(data.teacher_seq_len={teacher_len}); raise teacher.max_len or lower data.teacher_seq_len")

  def to_dict(self) -> dict:
    """Plain nested dict (YAML/JSON-serializable) of every setting."""
    return nest_sources(to_plain(self), self.models)

  def replace(self, **sections) -> Config:
    return dataclasses.replace(self, **sections)

  @property
  def checkpoint_dir(self) -> str:
    return self.checkpoint.dir or os.path.join(self.run.run_dir, "checkpoints")


# --------------------------------------------------------------------------- loading
def load_config(name_or_path: str | None = None, overrides: Sequence[str] = ()) -> Config:
  """The `Config` of a YAML file (or packaged config name) with ``key.path=value`` overrides.

  The file and the overrides are overlaid on the defaults (the main job). Override values are
  parsed as YAML (``train.steps=200``, ``distill.alpha=0.7``, ``mesh.simulate_cpu_devices=false``,
  ``distill.temperature={kind: linear, start: 3, end: 1, steps: 500}``).

  Raises:
    ConfigError: an unknown key or a bad value, named by its dotted path.
    FileNotFoundError: the config file does not exist.
  """
  return from_dict(Config, split_sources(config_files.read(name_or_path, overrides)))



def run_config(run_dir: str) -> Config:
  """The `Config` a run was started with (its ``config.yaml``), pointed at ``run_dir``."""
  path = os.path.join(run_dir, "config.yaml")
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"RUN_DIR={run_dir!r} holds no config.yaml; give the run directory of a `meshdistill distill` run"
    )
  return load_config(path, [f"run.run_dir={run_dir}"])

def dump_config(cfg: Config, path: str) -> None:
  """Writes ``cfg`` as YAML (loadable with `load_config`)."""
  write_text_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))  # never a half-written config.yaml
