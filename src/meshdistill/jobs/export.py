"""A distillation run's student as a Hugging Face checkpoint (``meshdistill export RUN_DIR OUT_DIR``).

`export_run` reads the run's ``config.yaml``, restores only the student of a checkpoint (the
latest, or ``step``; no optimizer state, no teacher) onto the run's mesh, each device reading its
own shards, and writes it with `meshdistill.models.export_hf`:
``config.json``, ``model.safetensors`` and the tokenizer files -- those of ``teacher.hf`` (or of
``data.tokenizer`` when it is a path), a ``tokenizer.json`` for a trained BPE; a byte-level run
has no Hugging Face tokenizer, which the returned record says. With ``quantized`` (a quantization-aware run) the
student is written with its integer weights and scales instead, in the compressed-tensors format
(`meshdistill.models.compress.export_quantized`: ``config.json`` with its ``quantization_config``,
``model.safetensors`` with the packed integers and the scales, the tokenizer files; the ``compress`` extra).

Every check (run directory, checkpoint step, dtype, output directory) runs before anything is
written. The checkpoint is written to a temporary sibling of ``OUT_DIR`` and renamed into place,
so ``OUT_DIR`` is either absent, untouched (on an error) or complete; a non-empty ``OUT_DIR`` is
refused unless ``overwrite``, and replaced only when its owner marker proves an export wrote it.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid

from meshdistill.config import Config, run_config
from meshdistill import jobs
from meshdistill.jobs import load_data
from meshdistill.models import default_family, param_count
from meshdistill.models.compress.qat import dequantized
from meshdistill.models.compress import compressed_export
from meshdistill.models.compress.quantized_export import export_quantized
from meshdistill.models.hf import export_hf, export_kind, read_hf_config
from meshdistill.models.lora import adapter_count, merge_lora
from meshdistill.models.peft import adapter_kind, export_adapter
from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.core.ownership import check_owned

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


def check_out_dir(out_dir: str, overwrite: bool, adapter: bool = False) -> None:
  """Raises unless ``out_dir`` may receive the export.

  Even with ``overwrite`` only a directory an earlier export wrote (its owner marker proves it) holding
  nothing but checkpoint files (``config.json``, ``*.safetensors``, the index, tokenizer files; with
  ``adapter`` the adapter files and ``base/``) is replaced (`meshdistill.core.ownership.check_owned`): a
  downloaded model holds the same files and is never deleted.
  """
  import dataclasses  # pylint: disable=g-import-not-at-top

  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise FileExistsError(f"OUT_DIR={out_dir!r} is a file; give a directory path")
  kind = dataclasses.replace(adapter_kind() if adapter else export_kind(), what="OUT_DIR")
  check_owned(out_dir, kind, overwrite=overwrite, flag="--overwrite")


def check_quantized(cfg: Config, run_dir: str, adapter: bool = False) -> None:
  """Raises ValueError unless ``run_dir``'s student can be written with ``--quantized``: a quantization-aware run
  (``student.quantize_aware.weights`` int8, int4 or fp8), not with ``--adapter``, the ``compressed-tensors`` package
  installed (the ``compress`` extra)."""
  settings = cfg.models.student_quantize_aware
  if adapter:
    raise ValueError("--quantized and --adapter exclude each other: --adapter writes a LoRA run's adapters, "
                     "--quantized a quantization-aware student's integer weights")
  if not settings.enabled:
    raise ValueError(f"--quantized writes a quantization-aware student's quantized weights, but RUN_DIR={run_dir!r} "
                     "trained a float student (student.quantize_aware.weights is null); export it without "
                     "--quantized")
  try:
    compressed_export.require()
  except ImportError as e:
    raise ValueError(f"--quantized: {e}; or export without --quantized (the dequantized float weights, on the "
                     "quantization grid, which any transformers loads)") from None


def _tokenizer_source(cfg: Config):
  """(what export_hf takes as ``tokenizer``, a description), without building the data when avoidable."""
  if cfg.models.teacher_hf:
    return cfg.models.teacher_hf, f"teacher.hf {cfg.models.teacher_hf}"
  tok = cfg.data.tokenizer
  if tok == "byte":
    return None, "none (byte-level run: token ids are UTF-8 bytes, 256 PAD, 257 BOS, 258 EOS)"
  if tok != "bpe":
    return os.path.expanduser(tok), f"data.tokenizer {tok}"

  return load_data(cfg).tokenizer, "the run's trained BPE"


def export_run(
    run_dir: str,
    out_dir: str,
    *,
    dtype: str = "float32",
    step: int | None = None,
    overwrite: bool = False,
    cfg: Config | None = None,
    adapter: bool = False,
    quantized: bool = False,
) -> dict:
  """Writes the student of ``run_dir``'s checkpoint (latest, or ``step``) to ``out_dir`` as a Hugging Face model.

  With ``adapter`` (a LoRA run) ``out_dir`` instead receives the adapters as a PEFT adapter directory
  (`meshdistill.models.peft.export_adapter`): ``adapter_config.json`` and ``adapter_model.safetensors``,
  plus the frozen base in ``base/`` unless the run's ``student.hf`` is that base exactly (a float base).
  With ``quantized`` (a quantization-aware run) ``out_dir`` receives the integer weights and scales in the
  compressed-tensors format (`export_quantized`); ``dtype`` is then that of the tensors that stay float (embedding,
  norms, LM head).

  Returns ``{"out_dir", "step", "family", "dtype", "params", "tokenizer"}`` (with ``adapter``: ``"base"``; with
  ``quantized``: ``"quantization"``, the settings and the compressed-tensors format described).

  Raises:
    FileNotFoundError: no config.yaml or no checkpoint in ``run_dir``.
    FileExistsError: ``out_dir`` is non-empty (without ``overwrite``) or a file.
    ValueError: a bad ``dtype`` or ``step``, a run that is not a distillation run, or ``quantized`` for a run
      that is not quantization-aware or without the ``compressed-tensors`` package.
  """
  if dtype not in DTYPES:
    raise ValueError(f"--dtype={dtype!r}; choose one of {list(DTYPES)}")
  cfg = cfg or run_config(run_dir)
  if quantized:
    check_quantized(cfg, run_dir, adapter)
  out_dir = os.path.abspath(out_dir)
  lora = cfg.models.student_lora
  if adapter and not lora.enabled:
    raise ValueError(f"--adapter writes LoRA adapters, but RUN_DIR={run_dir!r} trained the whole student "
                     "(student.lora.rank is 0); export it without --adapter")
  check_out_dir(out_dir, overwrite, adapter)
  if not os.path.isdir(cfg.checkpoint_dir):
    raise FileNotFoundError(
        f"RUN_DIR={run_dir!r} has no checkpoint ({cfg.checkpoint_dir} does not exist): run `meshdistill distill` "
        "to at least its first checkpoint; nothing was written"
    )
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0, read_only=True)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(
          f"RUN_DIR={run_dir!r} has no finished checkpoint in {cfg.checkpoint_dir}: run `meshdistill distill` to at "
          "least its first checkpoint; nothing was written"
      )
    if step is not None and step not in steps:
      raise ValueError(f"--step={step} is not a checkpoint of {run_dir!r}; its checkpoints: {sorted(steps)}")
    meta = ckpt.read_meta(step)
    if meta.get("kind") != "distill":
      raise ValueError(f"RUN_DIR={run_dir!r} holds a {meta.get('kind')!r} run, not a distillation run")
    tokenizer, tok_note = _tokenizer_source(cfg)
    # Without --step: the newest intact step (a damaged one, or one that fails to restore, is named in a warning)
    mesh = jobs.build_mesh(cfg)
    student = ckpt.restore_student(jobs.stored_student_config(cfg, mesh), mesh, step, lora=lora)
    step = ckpt.restored_step
    if adapter:
      base = cfg.models.student_hf if lora.quantize is None else None  # else the base is written beside

      written = str(export_adapter(student, out_dir, base=base, tokenizer=tokenizer, dtype=dtype,
                                   overwrite=overwrite))

      return {"out_dir": written, "step": int(step), "family": "PEFT LoRA adapter", "dtype": dtype,
              "params": adapter_count(student), "tokenizer": tok_note,
              "base": base or os.path.join(written, "base")}
    if lora.enabled:  # adapters folded into the (dequantised) base weights
      student = merge_lora(student)
    if cfg.models.student_quantize_aware.enabled and not quantized:  # the weights it trained through: on the grid
      student = dequantized(student, cfg.models.student_quantize_aware)
  finally:
    ckpt.close()
  if quantized:
    settings = cfg.models.student_quantize_aware
    written = str(export_quantized(student, settings, out_dir, tokenizer, dtype=dtype, overwrite=overwrite))
    log.info("exported step %d of %s to %s (%s)", step, run_dir, written, settings.describe())
    fmt = read_hf_config(written)["quantization_config"]["format"]
    return {"out_dir": written, "step": int(step), "family": default_family(student.cfg), "dtype": dtype,
            "params": param_count(student), "tokenizer": tok_note,
            "quantization": f"{settings.describe()} (compressed-tensors, {fmt})"}
  written = _write_atomically(out_dir, student, tokenizer, dtype)

  log.info("exported step %d of %s to %s", step, run_dir, written)
  return {"out_dir": written, "step": int(step), "family": default_family(student.cfg), "dtype": dtype,
          "params": param_count(student), "tokenizer": tok_note}


def _write_atomically(out_dir: str, model, tokenizer, dtype: str) -> str:
  """`export_hf` into a temporary sibling of ``out_dir``, then renamed to it (an old ``out_dir`` replaced)."""
  import jax  # pylint: disable=g-import-not-at-top

  if jax.process_index() != 0:  # every process gathers the weights; process 0 writes
    export_hf(model, out_dir, tokenizer=tokenizer, dtype=dtype)
    return out_dir
  parent, name = os.path.split(out_dir)
  os.makedirs(parent, exist_ok=True)
  tag = uuid.uuid4().hex[:8]
  tmp, old = os.path.join(parent, f".{name}.tmp-{tag}"), os.path.join(parent, f".{name}.old-{tag}")
  try:
    export_hf(model, tmp, tokenizer=tokenizer, dtype=dtype)
    if os.path.exists(out_dir):
      os.rename(out_dir, old)
    os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.exists(old) and not os.path.exists(out_dir):
      os.rename(old, out_dir)
    raise
  shutil.rmtree(old, ignore_errors=True)
  return out_dir


__all__ = ["DTYPES", "check_out_dir", "check_quantized", "export_run"]
