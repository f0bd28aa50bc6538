"""The next byte: a teacher's and a student's next-token distributions projected onto the next byte of the text.

Two tokenizers cut one text differently, but both models predict the same bytes. At a byte offset ``o`` of a
row, each model gives a distribution over the byte at ``o`` (256 values, plus one bucket, 256, for tokens that
spell no bytes: end of text and other special tokens), read off its next-token distribution at the position
whose target token covers ``o``, at DEPTH ``d`` (``o`` minus the offset where that token starts):

* ``d = 0`` (``o`` starts a token): ``P(next byte = b) = sum of P(v)`` over tokens ``v`` whose bytes start with
  ``b``. Exact: the first byte of the next token is the next byte.
* ``d > 0`` (inside a token whose first ``d`` bytes, the prefix, are known): by the chain rule,
  ``P(byte = b | prefix) = sum of P(v) over v with bytes prefix + b ... / sum of P(v) over v with bytes prefix +
  any``: the next-token distribution restricted to the tokens that continue the prefix (a prefix trie; the
  tables hold each token's prefix id at each depth). Tokens that END at the prefix are left out: the byte after
  them comes from the next token's distribution, on a context the model was not run on. So inside a token this is
  the model's next byte given that the token continues, not its exact byte marginal (and it ignores that a BPE
  only ever produces canonical tokenizations).

`next_byte_logprobs` does this for the positions of one sequence (the teacher: every depth up to the tables'
``max_depth``); `first_byte_logprobs` projects every position at depth 0 (the student: for a byte-level student
its own distribution, exactly; for a student with multi-byte tokens the marginal of its token's first byte, so
only the first byte of each of its tokens is compared: the deeper bytes of a student token are not trained).
`byte_offsets` gives the byte offset where each target starts, from the targets' byte lengths. All of it is sums
over the vocabulary (a comparison with each of the 257 buckets, reduced over the vocabulary), no sort or
scatter, so a vocabulary split over ``tensor`` stays split up to the ``[T, 257]`` result.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshdistill.losses._logits import log_softmax

BUCKETS = 257  # bytes 0..255, and 256: a token that spells no bytes (end of text, other special tokens)
OTHER = 256
FLOOR = 1e-30  # a bucket's probability is floored here before its log (after the max is taken out)


@dataclasses.dataclass(frozen=True, eq=False)
class ByteTables:
  """The constant tables of a vocabulary pair for the next-byte losses (numpy, built once on the host).

  Attributes:
    teacher_lengths ``[W]`` / student_lengths ``[V]`` int32: the bytes each id covers in a row (the end-of-text id
      counts one byte, as the two-tokenization rows count it; other special ids 0).
    teacher_prefix ``[W, D]`` int32: the id of the token's first ``d`` bytes (a node of the prefix trie) at each
      depth ``d < D = max_depth + 1``, -1 where the token does not continue past ``d`` bytes.
    teacher_byte ``[W, D]`` int32: the token's byte at depth ``d``, `OTHER` (256) where it has none.
    student_first ``[V]`` int32: each student id's first byte, `OTHER` for ids that spell no bytes.

  Compared and hashed by content (a strategy holding them stays a hashable setting).
  """

  teacher_lengths: np.ndarray
  teacher_prefix: np.ndarray
  teacher_byte: np.ndarray
  student_lengths: np.ndarray
  student_first: np.ndarray

  @property
  def max_depth(self) -> int:
    return int(self.teacher_prefix.shape[1]) - 1

  def _digest(self) -> str:
    h = hashlib.sha256()
    for f in dataclasses.fields(self):
      a = np.ascontiguousarray(getattr(self, f.name))
      h.update(f"{f.name}{a.shape}{a.dtype}".encode())
      h.update(a.tobytes())
    return h.hexdigest()

  def __hash__(self) -> int:
    return hash(self._digest())

  def __eq__(self, other) -> bool:
    return isinstance(other, ByteTables) and self._digest() == other._digest()


def byte_tables(teacher_bytes: Sequence[bytes | None], student_bytes: Sequence[bytes | None], *, teacher_eos: int,
                student_eos: int, max_depth: int) -> ByteTables:
  """`ByteTables` from each vocabulary's bytes per id (`meshdistill.data.alignment.token_bytes`: None for special
  ids), its end-of-text id, and the deepest byte inside a teacher token that is compared (0: first bytes only)."""
  depth = max_depth + 1
  W = len(teacher_bytes)
  prefix = np.full((W, depth), -1, np.int32)
  byte = np.full((W, depth), OTHER, np.int32)
  nodes: dict[bytes, int] = {}
  for v, b in enumerate(teacher_bytes):
    for d in range(min(len(b or b""), depth)):
      prefix[v, d] = nodes.setdefault(b[:d], len(nodes))
      byte[v, d] = b[d]

  def lengths(table, eos):
    out = np.asarray([len(b or b"") for b in table], np.int32)
    out[eos] = 1
    return out

  first = np.asarray([b[0] if b else OTHER for b in student_bytes], np.int32)
  return ByteTables(lengths(teacher_bytes, teacher_eos), prefix, byte, lengths(student_bytes, student_eos), first)


def byte_offsets(targets_T: jax.Array, lengths_V) -> tuple[jax.Array, jax.Array]:
  """``(starts [T], sizes [T])``: the byte offset where each target starts (from the row's first byte) and its
  byte count, from the ids' byte lengths ``[V]``."""
  sizes_T = jnp.asarray(lengths_V)[targets_T]
  return jnp.cumsum(sizes_T) - sizes_T, sizes_T


def _bucket_logprobs(logp_NxV: jax.Array, keep_NxV: jax.Array, bucket_NxV: jax.Array) -> jax.Array:
  """``[N, BUCKETS]``: per row, log of the probability mass of the kept ids in each bucket, over the kept mass.

  A sum over the vocabulary of the mass times a comparison with each bucket (fused into one reduction, never an
  ``[N, V, BUCKETS]`` array): with V split over ``tensor`` it is partial sums and one all-reduce of ``[N, BUCKETS]``
  (a scatter-add into the buckets made the compiler gather the vocabulary first).
  """
  kept = jnp.where(keep_NxV, logp_NxV, -jnp.inf)
  top_N = jax.lax.stop_gradient(jnp.max(kept, axis=-1, keepdims=True))
  top_N = jnp.where(jnp.isfinite(top_N), top_N, 0.0)
  mass_NxV = jnp.where(keep_NxV, jnp.exp(kept - top_N), 0.0)
  onehot_NxVxB = bucket_NxV[..., None] == jnp.arange(BUCKETS, dtype=bucket_NxV.dtype)
  q_NxB = jnp.sum(jnp.where(onehot_NxVxB, mass_NxV[..., None], 0.0), axis=1)
  total_N = jnp.sum(q_NxB, axis=-1, keepdims=True)
  return jnp.log(jnp.maximum(q_NxB, FLOOR)) - jnp.log(jnp.maximum(total_N, FLOOR))


def first_byte_logprobs(logits_TxV: jax.Array, first_V, temperature=1.0) -> jax.Array:
  """``[T, BUCKETS]`` log-probabilities of each position's next first byte (``first_V``: each id's first byte)."""
  logp_TxV = log_softmax(logits_TxV, temperature)
  bucket_TxV = jnp.broadcast_to(jnp.asarray(first_V), logp_TxV.shape)
  return _bucket_logprobs(logp_TxV, jnp.ones(logp_TxV.shape, bool), bucket_TxV)


def next_byte_logprobs(
    logits_TxW: jax.Array, targets_T: jax.Array, offsets_N: jax.Array, tables: ByteTables, temperature=1.0
) -> tuple[jax.Array, jax.Array]:
  """The model's distribution over the byte at each of ``offsets_N`` (bytes from the row's first byte), read at the
  position whose target covers it (see the module docstring).

  Returns:
    ``(logq [N, BUCKETS], ok [N] bool)``; ``ok`` is False where the offset lies deeper than ``tables.max_depth``
    inside its token or past the targets (its row of ``logq`` is then meaningless).
  """
  starts_T, sizes_T = byte_offsets(targets_T, tables.teacher_lengths)
  ends_T = starts_T + sizes_T
  T = targets_T.shape[0]
  pos_N = jnp.minimum(jnp.searchsorted(ends_T, offsets_N, side="right"), T - 1)
  depth_N = offsets_N - starts_T[pos_N]
  ok_N = (depth_N >= 0) & (depth_N <= tables.max_depth) & (offsets_N < ends_T[pos_N])
  d_N = jnp.clip(depth_N, 0, tables.max_depth)
  prefix_WxD, byte_WxD = jnp.asarray(tables.teacher_prefix), jnp.asarray(tables.teacher_byte)
  prefix_NxW, bucket_NxW = prefix_WxD[:, d_N].T, byte_WxD[:, d_N].T
  want_N = prefix_WxD[targets_T[pos_N], d_N]
  keep_NxW = (d_N[:, None] == 0) | ((prefix_NxW == want_N[:, None]) & (prefix_NxW >= 0))
  logp_NxW = log_softmax(logits_TxW, temperature)[pos_N]
  return _bucket_logprobs(logp_NxW, keep_NxW, bucket_NxW), ok_N


def byte_kl(teacher_NxB: jax.Array, student_NxB: jax.Array, mask_N: jax.Array) -> jax.Array:
  """KL(teacher || student) over the byte buckets per position ``[N]``, exactly 0 where ``mask_N`` is 0."""
  q_NxB = jnp.exp(teacher_NxB)
  kl_N = jnp.sum(jnp.where(q_NxB > 0, q_NxB * (teacher_NxB - student_NxB), 0.0), axis=-1)
  return jnp.where(mask_N > 0, kl_N, 0.0)
