"""The pairs and settings `tpu_step.py` and `long_context.py` measure on a TPU chip, shared with the scripts that plan
them (`plan_chip.py`, `long_context.py`): the teacher / student presets of each pair, a `Setting` (batch, sequence,
remat, loss chunk, micro-batch, attention kernel, splash blocks, AdamW's first moment), the model configs of both, and
the planner of a pair at a setting (`pair_planner`: one chip of a v5e as the chip's own plan)."""

from __future__ import annotations

import dataclasses

# name -> (teacher preset, student preset, student layers)
PAIRS = {
    "qwen3": ("qwen3-1.7b", "qwen3-0.6b", 14),
    "llama": ("llama3.2-1b", "llama3.2-1b", 8),
    "gemma3": ("gemma-3-1b", "gemma-3-1b", 13),
    "tiny": ("tiny", "tiny", 1),  # a smoke test of tpu_step.py on any machine
}
SCAN = ("both", "teacher", "student", "none")  # `Setting.scan`: which models scan their layers
TINY = dict(vocab_size=512, d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=128, mlp_hidden=512,
            max_len=4096, qk_norm=True)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One configuration of a pair: batch, sequence, remat policy, loss chunk, micro-batch, attention kernel.
  ``remat``, ``chunk`` and ``mb`` take ``auto``: the `Distiller` decides them before the step is measured
  (`meshdistill.train.tuning`)."""

  b: int = 8
  t: int = 2048
  remat: str = "full"
  chunk: int | str = 1024  # tokens per chunk of the loss, or "auto" (the Distiller's `chunk_size="auto"`)
  mb: str = "whole"  # rows per forward and backward pass (`train.micro_batch`): "whole", a number, or "auto"
  attn: str = "splash"
  blocks: str = "default"  # splash blocks: "default" (512 everywhere) or e.g. "q512-kv1024-c512-fused"
  mu: str = "float32"  # AdamW's first moment (`train.mu_dtype`): float32 or bfloat16
  metrics: str = "full"  # the step measured: "full" (`Distiller.step`) or "light" (its `metrics_light` step)
  scan: str = "both"  # the models whose layers are scanned (`ModelConfig.scan_layers`): both, teacher, student, none
  dtypes: str = "bf16"  # "bf16": both compute in bfloat16, the teacher stored so (named); "auto": the defaults
  # `ChunkedLogitKD.loss_kernel`: xla (XLA's two passes: what a row that names none measured), pallas (the one-read
  # kernel) or auto (the package's default: the kernel on a TPU)
  loss: str = "xla"
  only: str = ""  # the systems of `tpu_step.py --systems` that measure this setting, joined by "+" ("": every one)

  @classmethod
  def parse(cls, text: str) -> "Setting":
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    kw = {}
    for part in filter(None, text.split(",")):
      k, _, v = part.partition("=")
      if k not in fields:
        raise SystemExit(f"--config {text!r}: unknown key {k!r}; keys: {sorted(fields)}")
      kw[k] = int(v) if fields[k] in ("int", int) or (k == "chunk" and v != "auto") else v
    if not (kw.get("mb", "whole") in ("whole", "auto") or str(kw["mb"]).isdigit()):
      raise SystemExit(f"--config {text!r}: mb={kw['mb']!r}; choose whole, auto or a number of rows")
    if kw.get("metrics", "full") not in ("full", "light"):
      raise SystemExit(f"--config {text!r}: metrics={kw['metrics']!r}; choose full or light")
    if kw.get("loss", "xla") not in ("xla", "pallas", "auto"):
      raise SystemExit(f"--config {text!r}: loss={kw['loss']!r}; choose xla, pallas or auto")
    if "only" in kw and not all(kw["only"].split("+")):
      raise SystemExit(f"--config {text!r}: only={kw['only']!r}; name systems joined by '+', e.g. only=tunix+plain")
    if kw.get("scan", "both") not in SCAN:
      raise SystemExit(f"--config {text!r}: scan={kw['scan']!r}; choose one of {', '.join(SCAN)}")
    return cls(**kw)

  def measured_by(self, system: str) -> bool:
    """Whether ``system`` measures this setting (``only`` names it, or names nothing)."""
    return not self.only or system in self.only.split("+")

  def label(self) -> str:
    # the rows measured before a setting existed keep their label; ``only`` says who measures, not what
    mu = "" if self.mu == "float32" else f",mu={self.mu}"
    light = "" if self.metrics == "full" else f",metrics={self.metrics}"
    scan = "" if self.scan == "both" else f",scan={self.scan}"
    dtypes = "" if self.dtypes == "bf16" else f",dtypes={self.dtypes}"
    mb = "" if self.mb == "whole" else f",mb={self.mb}"
    loss = "" if self.loss == "xla" else f",loss={self.loss}"
    return (f"b={self.b},t={self.t},remat={self.remat},chunk={self.chunk},attn={self.attn},blocks={self.blocks}"
            f"{mu}{light}{scan}{dtypes}{mb}{loss}")

  @property
  def chunk_size(self) -> int:
    """The loss chunk as a number: ``auto``'s outcome where nothing is measured (1024) until the Distiller decides."""
    return 1024 if self.chunk == "auto" else int(self.chunk)

  @property
  def micro_batch(self) -> int | str | None:
    """The `Distiller`'s ``micro_batch``: None (the whole batch), ``"auto"`` or rows."""
    return None if self.mb == "whole" else "auto" if self.mb == "auto" else int(self.mb)

  def optimizer(self):
    """The student's optimizer: ``md.default_optimizer(1e-4)``, AdamW's first moment in ``mu``."""
    import meshdistill as md

    return md.default_optimizer(1e-4, mu_dtype=None if self.mu == "float32" else self.mu)


def model_configs(pair: str, s: Setting):
  """The teacher and student configs of ``pair`` at setting ``s``. A sequence longer than a preset's ``max_len``
  (Qwen3's 40,960) raises that bound to ``s.t`` in both: ``max_len`` only bounds the sequence (positions are rotated
  as they come, nothing is sized by it), so the step's shapes and memory are those of the model with its context
  extended (as rope scaling extends Qwen3's to 131,072 tokens)."""
  from meshdistill.models import ModelConfig
  from meshdistill.planner import resolve_model

  tname, sname, layers = PAIRS[pair]
  if pair == "tiny":
    tname = sname = ModelConfig(**TINY)
  named = s.dtypes != "auto"  # "auto": the models' defaults (`ModelConfig.dtype` / `param_dtype` auto)
  teacher, _ = resolve_model(tname, who="teacher", dtype="bfloat16" if named else None,
                             param_dtype="bfloat16" if named else None,
                             scan_layers=s.scan in ("both", "teacher"), attention=s.attn, remat="none")
  student, _ = resolve_model(sname, who="student", dtype="bfloat16" if named else None,
                             param_dtype="float32" if named else None,
                             scan_layers=s.scan in ("both", "student"), attention=s.attn, remat=s.remat)
  student = student.with_layers(range(layers))
  if s.t > min(teacher.max_len, student.max_len):
    teacher, student = (m.replace(max_len=max(m.max_len, s.t)) for m in (teacher, student))
  return teacher, student


def plan_overrides(s: Setting) -> list[str]:
  """The distillation settings a plan of ``s`` takes: those `tpu_step` measures (``ChunkedLogitKD`` at temperature 2,
  alpha 0.5) and AdamW's first moment."""
  return ["distill.temperature=2.0", "distill.alpha=0.5", f"train.mu_dtype={s.mu}"]


def pair_planner(pair: str, s: Setting, topology: str, one_chip: bool = False):
  """The `meshdistill.planner.Planner` of ``pair`` at ``s`` for ``topology`` (the models of `model_configs`, the
  settings of `plan_overrides`). ``one_chip``: for one chip of its family instead (``v5e:2x2`` -> ``v5e:1x1``): the
  program one chip runs, whose calibrated time is the chip source's, as ``md.plan(..., devices="local")`` plans it
  on one v5e chip."""
  from meshdistill.planner import make_planner

  if one_chip:
    family, shape = topology.split(":")
    topology = f"{family}:{'x'.join('1' for _ in shape.split('x'))}"
  tcfg, scfg = model_configs(pair, s)
  return make_planner(tcfg, scfg, topology=topology, seq=s.t, remat=s.remat, overrides=plan_overrides(s))
