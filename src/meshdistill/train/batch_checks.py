"""A batch checked against the `meshdistill.Distiller` it is for, before anything is compiled: its keys and
shapes, its length against both models', its rows against the layout, and what its teacher and strategy need of it
(a teacher's top-k, packed documents' segment ids, a teacher's own tokens)."""

from __future__ import annotations

import numpy as np

from meshdistill.core.batch import BATCH_KEYS, CROSS_KEYS, MULTI_KEYS, SEGMENT_KEYS, TARGET_LOGPROB_KEY, TOPK_KEYS
from meshdistill.train.teacher import TeacherKind


def check_batch(trainer, batch: dict) -> None:
  """Raises a clear error for a malformed ``batch`` of ``trainer`` (a `meshdistill.Distiller`): keys, shapes, length,
  divisibility, a teacher's top-k, packed documents, a teacher's own tokens."""
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise ValueError(f"batch is missing {missing}; a batch is a dict with {BATCH_KEYS}, each [batch, seq]")
  shapes = {k: tuple(np.shape(batch[k])) for k in BATCH_KEYS}
  if len(set(shapes.values())) != 1 or len(shapes["inputs"]) != 2:
    raise ValueError(f"batch arrays must share one [batch, seq] shape, got {shapes}")
  B, T = shapes["inputs"]
  if T > trainer.max_len:
    models = f"student {trainer.student_cfg.max_len}" + (
        "" if trainer.teacher_cfg is None else f", teacher {trainer.teacher_cfg.max_len}")
    raise ValueError(f"sequence length {T} exceeds max_len={trainer.max_len} ({models}); use seq_len <= "
                     f"{trainer.max_len}")
  trainer.layout.check_batch(B)
  _check_cross_batch(trainer, batch, B)
  _check_segments(trainer, batch, B, T)
  if trainer.teacher_output.kind is TeacherKind.TOPK:  # the decided teacher gives its top-k
    k = trainer.topk_teacher.k
    if trainer.cross_tokenizer:  # a cross-tokenizer cache: per teacher token, with the target's log-probability
      Tt = np.shape(batch["teacher_inputs"])[1]
      want = {TOPK_KEYS[0]: (B, Tt, k), TOPK_KEYS[1]: (B, Tt, k), TOPK_KEYS[2]: (B, Tt), TARGET_LOGPROB_KEY: (B, Tt)}
    else:
      want = {TOPK_KEYS[0]: (B, T, k), TOPK_KEYS[1]: (B, T, k), TOPK_KEYS[2]: (B, T)}
    got = {key: tuple(np.shape(batch[key])) if key in batch else None for key in want}
    n = len(trainer.topk_teacher.names)
    if n:  # several teachers: each one's own top-k too
      want |= dict(zip(MULTI_KEYS, ((B, n, T, k), (B, n, T, k), (B, n, T), (B, n))))
      got |= {key: tuple(np.shape(batch[key])) if key in batch else None for key in MULTI_KEYS}
    if got != want:
      raise ValueError(f"with {trainer.topk_teacher.source} every batch carries the teacher's top-k {want}, got "
                       f"{got}; read the data through meshdistill.teachers.cache.CachedTeacherData (or a teacher_mesh "
                       "source)")


def _check_segments(trainer, batch: dict, B: int, T: int) -> None:
  """Rows packed from several documents (`SEGMENT_KEYS`, ``data.packing: documents``) carry both keys at the
  tokens' shape, and go to models that run in the step (a top-k teacher's was computed without them)."""
  has = [k for k in SEGMENT_KEYS if k in batch]
  if not has:
    return
  if len(has) != len(SEGMENT_KEYS):
    raise ValueError(f"a batch of packed documents carries both {list(SEGMENT_KEYS)} (data.packing: documents), "
                     f"this one only {has}")
  shapes = {k: tuple(np.shape(batch[k])) for k in SEGMENT_KEYS}
  if set(shapes.values()) != {(B, T)}:
    raise ValueError(f"{list(SEGMENT_KEYS)} must be [batch, seq] = {(B, T)} like inputs, got {shapes}")
  if trainer.teacher_output.kind is TeacherKind.TOPK:  # the decided teacher gives its top-k
    raise ValueError(f"data.packing=documents with {trainer.topk_teacher.source}: the teacher's top-k was computed on "
                     "rows whose documents attend to each other, so it would not match the student's; use "
                     "data.packing=stream with it, or a teacher that runs in the step (its weights)")


def _check_cross_batch(trainer, batch: dict, B: int) -> None:
  """A batch of two tokenizations goes with a cross-tokenizer strategy, and only with one."""
  has = [k for k in CROSS_KEYS if k in batch]
  name = type(trainer.strategy).__name__
  if has and not trainer.cross_tokenizer:
    raise ValueError(
        f"the batch carries a teacher of another tokenizer ({has[0]}, ...; data.teacher_tokenizer is set) but "
        f"strategy {name} compares the two models token by token over one vocabulary, so it is refused here "
        "(attention transfer and feature losses also need the same tokens on both sides); use distill.kind: "
        "byte_kl, span_kl or uld, or drop data.teacher_tokenizer"
    )
  if not trainer.cross_tokenizer:
    return
  if len(has) != len(CROSS_KEYS):
    raise ValueError(f"strategy {name} needs the teacher's own tokens and the alignment in every batch "
                     f"({list(CROSS_KEYS)}); set data.teacher_tokenizer (missing: "
                     f"{[k for k in CROSS_KEYS if k not in batch]})")
  Tt = np.shape(batch["teacher_inputs"])[1]
  if Tt > trainer.teacher_cfg.max_len:
    raise ValueError(f"teacher sequence length {Tt} exceeds the teacher's max_len={trainer.teacher_cfg.max_len}; "
                     f"use data.teacher_seq_len <= {trainer.teacher_cfg.max_len}")
  rows = {k: tuple(np.shape(batch[k]))[:1] for k in CROSS_KEYS}
  if set(rows.values()) != {(B,)}:
    raise ValueError(f"cross-tokenizer batch arrays must have {B} rows like inputs, got {rows}")
