"""The pairs and settings `tpu_step.py` measures on a TPU chip, shared with the scripts that plan them
(`plan_chip.py`): the teacher / student presets of each pair and a `Setting` (batch, sequence, remat, loss chunk,
attention kernel, splash blocks, AdamW's first moment), the model configs of both, and `use_splash_blocks` (the
context a setting's splash blocks are traced in)."""

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
  """One configuration of a pair: batch, sequence, remat policy, loss chunk, attention kernel."""

  b: int = 8
  t: int = 2048
  remat: str = "full"
  chunk: int = 1024
  attn: str = "splash"
  blocks: str = "default"  # splash blocks: "default" (512 everywhere) or e.g. "q512-kv1024-c512-fused"
  mu: str = "float32"  # AdamW's first moment (`train.mu_dtype`): float32 or bfloat16
  metrics: str = "full"  # the step measured: "full" (`Distiller.step`) or "light" (its `metrics_light` step)
  scan: str = "both"  # the models whose layers are scanned (`ModelConfig.scan_layers`): both, teacher, student, none
  dtypes: str = "bf16"  # "bf16": both compute in bfloat16, the teacher stored so (named); "auto": the defaults

  @classmethod
  def parse(cls, text: str) -> "Setting":
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    kw = {}
    for part in filter(None, text.split(",")):
      k, _, v = part.partition("=")
      if k not in fields:
        raise SystemExit(f"--config {text!r}: unknown key {k!r}; keys: {sorted(fields)}")
      kw[k] = int(v) if fields[k] in ("int", int) else v
    if kw.get("metrics", "full") not in ("full", "light"):
      raise SystemExit(f"--config {text!r}: metrics={kw['metrics']!r}; choose full or light")
    if kw.get("scan", "both") not in SCAN:
      raise SystemExit(f"--config {text!r}: scan={kw['scan']!r}; choose one of {', '.join(SCAN)}")
    return cls(**kw)

  def label(self) -> str:
    # the rows measured before a setting existed keep their label
    mu = "" if self.mu == "float32" else f",mu={self.mu}"
    light = "" if self.metrics == "full" else f",metrics={self.metrics}"
    scan = "" if self.scan == "both" else f",scan={self.scan}"
    dtypes = "" if self.dtypes == "bf16" else f",dtypes={self.dtypes}"
    return (f"b={self.b},t={self.t},remat={self.remat},chunk={self.chunk},attn={self.attn},blocks={self.blocks}"
            f"{mu}{light}{scan}{dtypes}")

  def optimizer(self):
    """The student's optimizer: ``md.default_optimizer(1e-4)``, AdamW's first moment in ``mu``."""
    import meshdistill as md

    return md.default_optimizer(1e-4, mu_dtype=None if self.mu == "float32" else self.mu)


def model_configs(pair: str, s: Setting):
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
  return teacher, student


def use_splash_blocks(spec: str):
  """A context in which the splash kernel's blocks are ``spec`` for every program traced inside it
  (`meshdistill.models.splash_blocks`): ``default`` (the package's own), or ``q<N>-kv<N>-c<N>[-fused]``: query /
  key-value / key-value compute blocks of every pass, and the fused backward kernel (dq computed in the dkv pass)."""
  import contextlib
  import math

  from meshdistill.models import splash_blocks

  if spec == "default":
    return contextlib.nullcontext()
  parts = dict((p[0] if p[0] != "k" else "kv", p.lstrip("qkvc")) for p in spec.split("-") if p != "fused")
  q, kv, c = int(parts["q"]), int(parts["kv"]), int(parts.get("c", parts["kv"]))
  fused = spec.endswith("fused")

  def sizes(T, **_):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    bq, bkv, bc = math.gcd(T, q), math.gcd(T, kv), math.gcd(T, c)
    return splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bc, block_q_dkv=bq, block_kv_dkv=bkv,
                             block_kv_dkv_compute=bc, block_q_dq=None if fused else bq,
                             block_kv_dq=None if fused else bkv, use_fused_bwd_kernel=fused)

  return splash_blocks(sizes)
