"""The vocabulary-padding rule: the token range a teacher and a student are compared on.

The step, the `Distiller` and every teacher source that checks a teacher against the student (a sub-mesh teacher,
a served teacher, several teachers, a Hugging Face teacher's tokenizer) apply the same rule, so it lives here.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PADDING_TOLERANCE = 0.01  # vocabularies this close (relative to the larger) differ by padding rows


def resolve_shared_vocab(teacher_vocab: int, student_vocab: int, shared_vocab: int | None = None) -> int | None:
  """The token range both models are compared on, or ``None`` when their vocabularies are equal.

  One tokenizer's models often pad the embedding to different sizes (Qwen2.5: 152064 for 7B,
  151936 for 0.5B); the rows past the tokenizer are never produced by it. Sizes within
  ``PADDING_TOLERANCE`` (1 %) of each other are taken as such padding and compared on
  ``[0, min(sizes))``, with a logged note. Other differences mean different tokenizers and
  raise, unless ``shared_vocab`` names the range explicitly (then 1 <= shared_vocab <= both).
  Inside the step both models' logits are sliced ``logits[..., :shared]``; keep it a
  multiple of the ``tensor`` size so the slice stays vocabulary-parallel.
  """
  small, large = sorted((teacher_vocab, student_vocab))
  if shared_vocab is not None:
    if not isinstance(shared_vocab, int) or not 1 <= shared_vocab <= small:
      raise ValueError(
          f"shared_vocab={shared_vocab!r} must be an integer in [1, {small}] (teacher vocab_size={teacher_vocab}, "
          f"student vocab_size={student_vocab})"
      )
    return None if shared_vocab == large else shared_vocab
  if small == large:
    return None
  if large - small > PADDING_TOLERANCE * large:
    raise ValueError(
        f"teacher vocab_size={teacher_vocab} != student vocab_size={student_vocab}; distillation compares "
        "distributions token by token, so both models need the same tokenizer (build the student with "
        f"vocab_size={teacher_vocab}); if they do share one and the larger is only padded, pass "
        f"shared_vocab=<tokenizer size, at most {small}>; if the tokenizers differ, set data.teacher_tokenizer and "
        "distill.kind: byte_kl, span_kl or uld (they align the two tokenizations)"
    )
  log.info(
      "teacher vocab_size=%d, student vocab_size=%d: treating the extra %d rows as padding of one tokenizer and "
      "distilling over token ids [0, %d)", teacher_vocab, student_vocab, large - small, small,
  )
  return small

