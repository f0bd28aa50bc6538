"""Cross-tokenizer losses against plain numpy references written from TRL's GOLD formulas (ULD, span merging,
the hybrid matched-KL + unmatched-ULD loss), on fixed inputs."""

import numpy as np
import pytest
from helpers import all_gather_shapes

import jax
import jax.numpy as jnp

from meshdistill import losses
from meshdistill.data.alignment import row_alignment
from meshdistill.models import ModelOutput
from meshdistill.strategies import ByteKL, SpanKL, ULD

EPS = 1e-8
VS, VT, TS, TT = 12, 20, 7, 5
S_PIECES = ["a", "b", "c", " ", "d", "e", "f"]  # student targets
T_PIECES = ["abc", " d", "e", "f", ""]  # teacher targets (the last is padding)
MATCHED_T = np.array([1, 4, 5, 9, 13])
MATCHED_S = np.array([0, 3, 7, 2, 11])


def ends(pieces):
  return np.cumsum([len(p) for p in pieces if p])


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(3)
  align = row_alignment(ends(S_PIECES), ends(T_PIECES), np.ones(7), np.ones(4), student_len=TS, teacher_len=TT,
                        spans=5)
  return {
      "s_logits": rng.normal(size=(TS, VS)).astype(np.float32) * 2,
      "t_logits": rng.normal(size=(TT, VT)).astype(np.float32) * 2,
      "s_targets": rng.integers(0, VS, TS).astype(np.int32),
      "t_targets": rng.integers(0, VT, TT).astype(np.int32),
      "align": align,
  }


def softmax(x, tau):
  z = np.exp((x - x.max(-1, keepdims=True)) / tau)
  return z / z.sum(-1, keepdims=True)


def groups_of(span_ids, n):
  return [list(np.flatnonzero(span_ids == s)) for s in range(n)]


def merge(probs, groups, ids):
  """TRL's "bayesian" merge: the last position's distribution times the earlier actual tokens' probabilities."""
  out = []
  for g in groups:
    base = probs[g[-1]].copy()
    for i in g[:-1]:
      base = base * max(probs[i, ids[i]], EPS)
    out.append(base)
  return np.stack(out)


def sorted_l1(a, b, k=None):
  a, b = -np.sort(-a, -1), -np.sort(-b, -1)
  if k is not None:
    a, b = a[:, :k], b[:, :k]
  n = max(a.shape[1], b.shape[1])
  a = np.pad(a, ((0, 0), (0, n - a.shape[1])))
  b = np.pad(b, ((0, 0), (0, n - b.shape[1])))
  return np.abs(a - b).sum()


def reference_aligned(case, tau):
  al = case["align"]
  n = int((al.span_bytes > 0).sum())
  s = merge(softmax(case["s_logits"], tau), groups_of(al.student_span, n), case["s_targets"])
  t = merge(softmax(case["t_logits"], tau), groups_of(al.teacher_span, n), case["t_targets"])
  return s, t, n


def reference_hybrid(s, t, weight):
  """TRL's `_compute_hybrid_uld_loss` summed over spans (TRL divides both terms by the span count)."""
  ps, pt = s[:, MATCHED_S], t[:, MATCHED_T]
  lq, lp = np.log(np.maximum(pt, EPS)), np.log(np.maximum(ps, EPS))
  kl = (np.exp(lq) * (lq - lp)).sum()
  keep_s = np.ones(VS, bool)
  keep_s[MATCHED_S] = False
  keep_t = np.ones(VT, bool)
  keep_t[MATCHED_T] = False
  rest = sorted_l1(s[:, keep_s], t[:, keep_t])
  w = len(MATCHED_T) / VT if weight is None else weight
  return w * kl + (1 - w) * rest, kl, rest


def aligned_teacher(case):
  al = case["align"]
  return losses.Aligned(jnp.asarray(case["t_logits"]), jnp.asarray(case["t_targets"]), *map(jnp.asarray, (
      al.teacher_span, al.student_span, al.teacher_last, al.student_last, al.span_bytes)))


def run(strategy, case):
  student = ModelOutput(logits=jnp.asarray(case["s_logits"]))
  mask = jnp.ones(TS, jnp.float32)
  return jax.jit(lambda s, t: strategy.per_sequence({}, s, t, jnp.asarray(case["s_targets"]), mask, 0))(
      student, aligned_teacher(case))


def test_the_alignment_of_the_fixed_case(case):
  np.testing.assert_array_equal(case["align"].student_span, [0, 0, 0, 1, 1, 2, 3])
  np.testing.assert_array_equal(case["align"].teacher_span, [0, 1, 2, 3, -1])


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_uld_equals_the_sorted_l1_of_merged_span_probabilities(case, tau):
  s, t, _ = reference_aligned(case, tau)
  got = run(ULD(alpha=1.0, temperature=tau), case)
  np.testing.assert_allclose(got["uld"], sorted_l1(s, t), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got["loss"], sorted_l1(s, t), rtol=1e-5, atol=1e-6)


def test_uld_on_the_top_k_of_each_side(case):
  s, t, _ = reference_aligned(case, 1.0)
  got = run(ULD(alpha=1.0, top_k=3), case)
  np.testing.assert_allclose(got["uld"], sorted_l1(s, t, k=3), rtol=1e-5, atol=1e-6)
  assert abs(sorted_l1(s, t, k=3) - sorted_l1(s, t)) > 1e-3  # the truncation matters on this case


def test_uld_mixes_hard_label_ce_with_alpha(case):
  s, t, _ = reference_aligned(case, 1.0)
  logp = np.log(softmax(case["s_logits"], 1.0))
  ce = -logp[np.arange(TS), case["s_targets"]].sum()
  got = run(ULD(alpha=0.25), case)
  np.testing.assert_allclose(got["ce"], ce, rtol=1e-5)
  np.testing.assert_allclose(got["loss"], 0.25 * sorted_l1(s, t) + 0.75 * ce, rtol=1e-5)


@pytest.mark.parametrize("weight", [None, 0.7])
def test_span_kl_equals_the_hybrid_matched_kl_and_unmatched_uld(case, weight):
  s, t, _ = reference_aligned(case, 1.0)
  want, kl, rest = reference_hybrid(s, t, weight)
  got = run(SpanKL(alpha=1.0, matched_weight=weight).with_matched(MATCHED_T, MATCHED_S), case)
  np.testing.assert_allclose(got["matched_kl"], kl, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got["unmatched_uld"], rest, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got["loss"], want, rtol=1e-5, atol=1e-6)


def test_span_log_probability_is_the_sum_of_token_log_probabilities(case):
  al = case["align"]
  merged = losses.span_logprobs(jnp.asarray(case["s_logits"]), jnp.asarray(case["s_targets"]),
                                jnp.asarray(al.student_span), jnp.asarray(al.student_last))
  logp = np.log(softmax(case["s_logits"], 1.0))
  token = logp[np.arange(TS), case["s_targets"]]
  for span in range(4):
    at = np.flatnonzero(al.student_span == span)
    np.testing.assert_allclose(merged[span, case["s_targets"][at[-1]]], token[at].sum(), rtol=1e-5)


def test_uncounted_spans_and_their_tokens_give_nothing(case):
  al = case["align"]._replace(span_bytes=np.array([0, 2, 1, 1, 0], np.int32))
  masked = dict(case, align=al)
  full, part = run(ULD(alpha=1.0), case), run(ULD(alpha=1.0), masked)
  s, t, _ = reference_aligned(case, 1.0)
  np.testing.assert_allclose(part["uld"], sorted_l1(s[1:], t[1:]), rtol=1e-5, atol=1e-6)
  assert float(part["spans"]) == 3 and float(full["spans"]) == 4


def test_strategies_refuse_a_teacher_of_the_same_tokenizer_and_a_missing_matched_vocabulary(case):
  student = ModelOutput(logits=jnp.asarray(case["s_logits"]))
  with pytest.raises(ValueError, match="data.teacher_tokenizer"):
    ULD().per_sequence({}, student, student, jnp.zeros(TS, jnp.int32), jnp.ones(TS), 0)
  with pytest.raises(ValueError, match="matched_vocabulary"):
    run(SpanKL(), case)
  with pytest.raises(ValueError, match="ULD.top_k=0"):
    ULD(top_k=0)


# --------------------------------------------------------------------------- next-byte KL (byte_kl)
T_VOCAB = [b"a", b"b", b"c", b" ", b"d", b"e", b"f", b"ab", b"abc", b" d", b"de", b"def", b"\xc3\xa9", None, None,
           b"ac"]  # teacher: EOS 13, PAD 14
S_BPE = [b"a", b"b", b"c", b" ", b"d", b"e", b"f", b"bc", b" de", None, None, b"\xc3", b"\xa9", b"c "]  # EOS 9, PAD 10
S_BPE_PIECES = [b"a", b"b", b"c ", b"d", b"\xc3", b"\xa9", b"f"]  # "c " starts 2 bytes into the teacher's "abc"
BYTE_VOCAB = [bytes([i]) if i < 256 else None for i in range(264)]  # the byte tokenizer: EOS 258, PAD 256
TEXT = "abc déf"  # 8 bytes, then the end-of-text marker


def n_bytes(v, vocab, eos):
  return 1 if v == eos else len(vocab[v] or b"")


def reference_byte_kl(t_logits, t_targets, s_logits, s_targets, counted, s_vocab, s_eos, max_depth, tau):
  """Loops over the vocabularies: the teacher's tokens whose bytes start with the known prefix, by their next byte;
  the student's tokens by their first byte; KL(teacher || student) at each counted student position."""
  total, positions = 0.0, 0
  for i, x in enumerate(s_targets):
    o = sum(n_bytes(y, s_vocab, s_eos) for y in s_targets[:i])
    start = 0
    for j, y in enumerate(t_targets):
      if start <= o < start + n_bytes(y, T_VOCAB, 13):
        break
      start += n_bytes(y, T_VOCAB, 13)
    d = o - start
    if not counted[i] or d > max_depth:
      continue
    prefix = (T_VOCAB[t_targets[j]] or b"")[:d]
    p, q = softmax(t_logits[j].astype(np.float64), tau), np.zeros(257)
    for v, b in enumerate(T_VOCAB):
      if d == 0:
        q[b[0] if b else 256] += p[v]
      elif b is not None and len(b) > d and b.startswith(prefix):
        q[b[d]] += p[v]
    q /= q.sum()
    ps, qs = softmax(s_logits[i].astype(np.float64), tau), np.zeros(257)
    for v, b in enumerate(s_vocab):
      qs[b[0] if b else 256] += ps[v]
    total += sum(q[b] * np.log(q[b] / qs[b]) for b in range(257) if q[b] > 0)
    positions += 1
  return total, positions


def byte_case(s_vocab, s_pieces, s_eos, s_pad):
  t_pieces = [8, 9, 12, 6, 13]  # "abc" " d" "é" "f" EOS
  t_text = b"".join(T_VOCAB[v] or b"" for v in t_pieces)
  assert t_text == TEXT.encode()
  s_ids = [s_vocab.index(p) for p in s_pieces] + [s_eos]
  t_ends = np.cumsum([n_bytes(v, T_VOCAB, 13) for v in t_pieces])
  s_ends = np.cumsum([n_bytes(v, s_vocab, s_eos) for v in s_ids])
  ts, tt = len(s_ids) + 2, len(t_pieces) + 2
  align = row_alignment(s_ends, t_ends, np.ones(len(s_ids)), np.ones(len(t_pieces)), student_len=ts, teacher_len=tt,
                        spans=min(ts, tt))
  rng = np.random.default_rng(5)
  return {
      "s_logits": rng.normal(size=(ts, len(s_vocab))).astype(np.float32) * 2,
      "t_logits": rng.normal(size=(tt, len(T_VOCAB))).astype(np.float32) * 2,
      "s_targets": np.asarray(s_ids + [s_pad] * 2, np.int32),
      "t_targets": np.asarray(t_pieces + [14] * 2, np.int32),
      "align": align,
  }


def run_byte_kl(case, s_vocab, s_eos, max_depth, tau):
  tables = losses.byte_tables(T_VOCAB, s_vocab, teacher_eos=13, student_eos=s_eos, max_depth=max_depth)
  strategy = ByteKL(alpha=1.0, temperature=tau, max_depth=max_depth).with_tables(tables)
  student = ModelOutput(logits=jnp.asarray(case["s_logits"]))
  mask = jnp.ones(case["s_targets"].shape, jnp.float32)
  return jax.jit(lambda s, t: strategy.per_sequence({}, s, t, jnp.asarray(case["s_targets"]), mask, 0))(
      student, aligned_teacher(case))


@pytest.mark.parametrize("max_depth,tau", [(16, 1.0), (0, 1.0), (1, 2.0)])
def test_byte_kl_of_a_byte_student_equals_the_projection_by_prefix(max_depth, tau):
  case = byte_case(BYTE_VOCAB, [bytes([b]) for b in TEXT.encode()], 258, 256)
  al = case["align"]
  counted = (al.student_span >= 0) & (al.span_bytes[np.maximum(al.student_span, 0)] > 0)
  want, positions = reference_byte_kl(case["t_logits"], case["t_targets"], case["s_logits"], case["s_targets"],
                                      counted, BYTE_VOCAB, 258, max_depth, tau)
  got = run_byte_kl(case, BYTE_VOCAB, 258, max_depth, tau)
  np.testing.assert_allclose(got["byte_kl"], want, rtol=1e-5)
  assert got["byte_positions"] == positions == {16: 9, 0: 5, 1: 8}[max_depth]  # 8 bytes and the end of text


def test_byte_kl_of_a_student_with_multi_byte_tokens_compares_their_first_bytes():
  case = byte_case(S_BPE, S_BPE_PIECES, 9, 10)
  al = case["align"]
  counted = (al.student_span >= 0) & (al.span_bytes[np.maximum(al.student_span, 0)] > 0)
  want, positions = reference_byte_kl(case["t_logits"], case["t_targets"], case["s_logits"], case["s_targets"],
                                      counted, S_BPE, 9, 16, 1.0)
  got = run_byte_kl(case, S_BPE, 9, 16, 1.0)
  np.testing.assert_allclose(got["byte_kl"], want, rtol=1e-5)
  assert got["byte_positions"] == positions == 8


def test_byte_kl_refuses_missing_or_mismatched_tables(case):
  with pytest.raises(ValueError, match="byte_tables_of"):
    run(ByteKL(), case)
  tables = losses.byte_tables(T_VOCAB, S_BPE, teacher_eos=13, student_eos=9, max_depth=2)
  with pytest.raises(ValueError, match="max_depth=2"):
    ByteKL().with_tables(tables)
  with pytest.raises(ValueError, match="vocabularies of 16"):
    run(ByteKL(max_depth=2).with_tables(tables), case)
  with pytest.raises(ValueError, match="ByteKL.top_k=8 is not used"):
    ByteKL(top_k=8)
  with pytest.raises(ValueError, match="ByteKL.max_depth=-1"):
    ByteKL(max_depth=-1)


def test_byte_kl_keeps_both_vocabularies_split_over_tensor():
  """Compiled on a 2x4 mesh with both sides' logits split over tensor along the vocabulary, the loss and its
  gradient hold no all-gather of a vocabulary (a scatter-add into the byte buckets once gathered the teacher's)."""
  mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  case = byte_case(S_BPE * 2 + [None] * 4, S_BPE_PIECES, 9, 10)  # 32 student ids, 16 teacher ids: split by 4
  tables = losses.byte_tables(T_VOCAB, S_BPE * 2 + [None] * 4, teacher_eos=13, student_eos=9, max_depth=16)
  strategy = ByteKL(alpha=1.0).with_tables(tables)
  mask = jnp.ones(case["s_targets"].shape, jnp.float32)

  def loss(s_logits, t_logits):
    t = aligned_teacher(dict(case, t_logits=t_logits))
    return strategy.per_sequence({}, ModelOutput(logits=s_logits), t, jnp.asarray(case["s_targets"]), mask, 0)["loss"]

  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor"))
  args = [jax.device_put(jnp.asarray(case[k]), split) for k in ("s_logits", "t_logits")]
  hlo = jax.jit(jax.value_and_grad(loss)).lower(*args).compile().as_text()
  assert "all-reduce" in hlo  # the sums over the split vocabularies
  assert not [s for s in all_gather_shapes(hlo) if 32 in s or 16 in s], all_gather_shapes(hlo)
