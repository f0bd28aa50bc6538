"""``teacher.source: hf``: a Hugging Face model directory (``teacher.hf``: ``config.json`` + ``*.safetensors``),
loaded sharded on the mesh; its identity is that directory. Its shape and tokenizer are read when the config loads
(`meshdistill.teachers.sources.resolve`)."""

from __future__ import annotations

from typing import ClassVar

from flax import nnx

from meshdistill.core.typed_yaml import ConfigError
from meshdistill.teachers.kinds._base import ModelSource, register
from meshdistill.teachers.kinds._quantize import check_quantize
from meshdistill.models import abstract_params
from meshdistill.models.hf import load_hf
from meshdistill.parallel.mesh import platform_of
from meshdistill.models.stacking import to_scanned, to_unrolled


def check_hf_path(values: dict) -> None:
  """``teacher.hf``: a non-empty path (what it holds is checked when the config resolves the teacher's shape)."""
  path = values.get("hf")
  if path is not None and (not isinstance(path, str) or not path):
    raise ConfigError(f"teacher.hf={path!r} must be the path of a local Hugging Face model directory or a Hub id "
                      "org/name[@revision]")


def load_teacher_hf(cfg, mesh):
  """The teacher of ``teacher.hf`` on ``mesh`` (each device reading only its slices)."""
  want = cfg.teacher.frozen(platform_of(mesh))  # param_dtype auto: stored in its compute dtype, read so from disk
  model = load_hf(cfg.models.teacher_hf, mesh, dtype=want.dtype, param_dtype=want.param_dtype,
                  max_len=want.max_len, scan_layers=want.scan_layers)
  return with_config(model, want, mesh)


def with_config(model, want, mesh=None):
  """``model`` with its `ModelConfig` set to ``want`` (equal up to the compute-only ``remat`` / ``attention`` and
  the weights' layout ``scan_layers``, converted here; the padding and key/value replication the mesh asked for at
  load time (`ModelConfig.for_tensor`) are kept)."""
  want = want.with_scan_on(mesh)  # `scan_layers: auto` decided for ``mesh``
  model = to_scanned(model) if want.scan_layers else to_unrolled(model)
  want = want.replace(vocab_multiple=model.cfg.vocab_multiple, replicate_kv=model.cfg.replicate_kv)
  if model.cfg.replace(remat=want.remat, attention=want.attention) != want:
    raise ValueError(f"loaded model config {model.cfg} differs from the configured {want}")
  if model.cfg == want:
    return model

  graphdef, _, _ = abstract_params(want)
  return nnx.merge(graphdef, nnx.state(model))


@register
class HuggingFace(ModelSource):
  """a Hugging Face model directory, e.g. teacher.hf: path/to/Qwen3-8B"""

  name: ClassVar[str] = "hf"
  settings: ClassVar[tuple[str, ...]] = ("hf", "quantize")
  required: ClassVar[tuple[str, ...]] = ("hf",)

  @classmethod
  def check_settings(cls, values):
    check_hf_path(values)
    check_quantize(values)

  def model(self, data, mesh, services):
    path = self.cfg.models.teacher_hf
    services.report(f"teacher: {path} (Hugging Face)")
    return load_teacher_hf(self.cfg, mesh), path

  def saved_model(self, identity, mesh, tokenizer):
    """``teacher.hf``, read again (its tokenizer is the data's)."""
    del identity, tokenizer
    return self.cfg.models.teacher_hf, load_teacher_hf(self.cfg, mesh)
