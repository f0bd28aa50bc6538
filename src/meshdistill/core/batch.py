"""The batch schema: the keys of a host batch, as the data pipeline writes them and the step reads them.

Every batch holds `BATCH_KEYS`; a teacher that arrives with the batch adds its own keys (its top-k, a teacher of
another tokenizer, several teachers). The data pipeline, the teacher sources, the layouts and the step all name
these keys, so they live here, below all of them.
"""

# The keys of a batch the step reads: token ids and targets [B, T], the loss mask [B, T].
BATCH_KEYS = ("inputs", "targets", "mask")
# Batch keys of rows packed without crossing documents (``data.packing: documents``, `meshdistill.data._packing`):
# each token's document within its row, 1, 2, ... (0: padding) [B, T], and its position within that document's part of
# the row [B, T] (RoPE restarts there). The step hands both to the teacher and the student: attention then stays
# within a document (`meshdistill.models.decoder.Decoder`).
SEGMENT_KEYS = ("segment_ids", "positions")
# Batch keys of a teacher given by its top-k instead of its weights (`meshdistill.losses.TopK`):
# ids and log-probs [B, T, K], tail log-mass [B, T]; see `meshdistill.teachers.cache`.
TOPK_KEYS = ("teacher_ids", "teacher_logprobs", "teacher_tail")
# Batch keys of several teachers combined into the top-k above (`meshdistill.teachers.multi`): each teacher's own
# top-k [B, N, T, K] / [B, N, T] and the rows each one serves [B, N] (1: the row counts in its metrics); read for the
# per-teacher metrics ``kl/<name>`` and ``agreement/<name>`` (`meshdistill.losses.teacher_terms`) only.
MULTI_KEYS = ("teachers_ids", "teachers_logprobs", "teachers_tail", "teachers_rows")
# Batch keys of a teacher with its own tokenizer (`meshdistill.data._cross`): its tokens [B, Tt] and the alignment
# of the row's targets (span ids [B, Ts] / [B, Tt], last positions and bytes per span [B, S]); read when the
# strategy declares ``cross_tokenizer`` (`meshdistill.strategies.ULD`), which then gets a `meshdistill.losses.Aligned`.
CROSS_KEYS = (
    "teacher_inputs", "teacher_targets", "teacher_mask",
    "student_span", "teacher_span", "student_last", "teacher_last", "span_bytes",
)
# A cross-tokenizer cache's top-k (`TOPK_KEYS` per TEACHER token, [B, Tt, K]) comes with the log-probability of each
# teacher position's actual next token [B, Tt] (`meshdistill.losses.topk_logprobs`).
TARGET_LOGPROB_KEY = "teacher_target_logprobs"
