"""Identities that pin the on-policy path: a teacher equal to the student gives zero reverse KL and zero sampled-token
advantages; a sampled token's reward reads both models at that token and position (a hand-built teacher shows where
it lands); prompt and padding positions never count; samples come from the parameters of the step that trains on them;
every arm divides its loss by the same global count of completion tokens."""

import copy
import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from helpers import STUDENT_CFG, VOCAB, make_batch

import meshdistill as md
from meshdistill.models.generate import generate
from meshdistill.strategies import LogitKD, SampledTokenKD
from meshdistill.teachers.cache import TopKTeacher
from meshdistill.train.distiller import Distiller
from meshdistill.train.onpolicy import OnPolicyConfig, OnPolicyDistiller
from meshdistill.train.step import TOPK_KEYS

SEQ, NEW = 12, 5  # prompts: the first SEQ + 1 - NEW = 8 tokens of each row
WIDTH = SEQ + 1 - NEW
BATCHES = [make_batch(seed=s, seq=SEQ, pad_from=None) for s in range(2)]
REVERSE = LogitKD(temperature=1.0, alpha=1.0, divergence="reverse_kl")


def _on(lmbda=1.0, eos=-1):
  return OnPolicyConfig(lmbda=lmbda, max_new_tokens=NEW, temperature=1.0, eos_id=_eos() if eos == -1 else eos)


@functools.cache
def _eos() -> int:
  """The token the student (seed 1) samples most often in the first completion positions of ``BATCHES[1]``: as the
  EOS, some rows stop early, so sampled batches hold padding after their EOS."""
  d = OnPolicyDistiller(md.init_model(STUDENT_CFG, seed=1), md.init_model(STUDENT_CFG, seed=0),
                        strategy=SampledTokenKD(), on_policy=_on(eos=None), seed=3)
  sampled = d.sample_batch(d.init_state(), d.as_prompt_batch(BATCHES[1]), 0)
  early = np.asarray(sampled["targets"])[:, WIDTH - 1: WIDTH - 2 + NEW]
  values, counts = np.unique(early, return_counts=True)
  return int(values[np.argmax(counts)])


def _distiller(strategy, teacher_seed=1, lmbda=1.0, teacher=None, **kw):
  """A student of ``STUDENT_CFG`` (seed 1) and a teacher of the same shape: seed 1 is the student itself."""
  teacher = md.init_model(STUDENT_CFG, seed=teacher_seed) if teacher is None else teacher
  return OnPolicyDistiller(md.init_model(STUDENT_CFG, seed=1), teacher, strategy=strategy, on_policy=_on(lmbda),
                           optimizer=optax.sgd(1.0), seed=3, **kw)


def _step(d, batch):
  """``(sampled batch, metrics)`` of one on-policy step from a fresh state."""
  state = d.init_state()
  sampled = d.sample_batch(state, d.as_prompt_batch(batch), 0)
  return sampled, jax.device_get(Distiller.step(d, state, sampled)[1])


# ------------------------------------------------------------------------------ teacher = student
@pytest.mark.parametrize("strategy", [REVERSE, SampledTokenKD(), SampledTokenKD(discount=1.0)],
                         ids=["gkd_reverse_kl", "sampled_token", "sampled_token_discount_1"])
def test_a_teacher_equal_to_the_student_gives_zero_reverse_kl_and_zero_advantages(strategy):
  same = _distiller(strategy, teacher_seed=1)
  other = _distiller(strategy, teacher_seed=0)
  for batch in BATCHES:
    _, m = _step(same, batch)
    _, o = _step(other, batch)
    assert m["tokens"] > 0 and o["tokens"] == m["tokens"]  # the same samples: only the teacher differs
    if isinstance(strategy, SampledTokenKD):
      # every per-token reward log p_t - log p_s is 0, so is every advantage: their sum is 0, and so is the gradient
      # sum_t A_t grad log p_s(y_t) (advantages of opposite signs would cancel in the sum, not in the gradient)
      assert abs(m["reverse_kl"]) < 1e-6 and abs(m["advantage"]) < 1e-6 and m["grad_norm"] < 1e-6
      assert o["reverse_kl"] > 0.1 and o["grad_norm"] > 1e-3  # another teacher: the same check fails
    else:
      assert abs(m["kl"]) < 1e-6 and m["grad_norm"] < 1e-6
      assert o["kl"] > 0.1 and o["grad_norm"] > 1e-3


# ------------------------------------------------------------------------- where a reward lands
K = 1


def _hand_built(where):
  """A top-1 teacher that is uniform over the vocabulary at every position except one, where it puts all its mass
  on ``where(batch) -> (row, position, token)``; records the batches it scored."""
  seen = []

  def topk_of(batch):
    B, T = np.shape(batch["inputs"])
    ids = np.zeros((B, T, K), np.int32)  # token 0 at 1/V; the tail holds the other V - 1 at 1/V each
    logprobs = np.full((B, T, K), -np.log(VOCAB), np.float32)
    tail = np.full((B, T), np.log((VOCAB - 1) / VOCAB), np.float32)
    r, t, token = where(batch)
    ids[r, t, 0], logprobs[r, t, 0], tail[r, t] = token, 0.0, -80.0
    seen.append(dict(batch))
    return {**batch, TOPK_KEYS[0]: ids, TOPK_KEYS[1]: logprobs, TOPK_KEYS[2]: tail}

  return topk_of, seen


def _student_logp(batch):
  """The student's (seed 1) log-probability of each target at its position, computed outside the step ``[B, T]``."""
  logits = md.init_model(STUDENT_CFG, seed=1)(np.asarray(batch["inputs"])).logits
  logp = jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1)
  return np.take_along_axis(np.asarray(logp), np.asarray(batch["targets"])[..., None], -1)[..., 0]


def _completion_position(batch, n=1):
  """Row 0's ``n``-th completion position (a position whose target counts)."""
  return 0, int(np.flatnonzero(np.asarray(batch["mask"])[0])[n])


def _target_at(batch, r, t):
  return int(np.asarray(batch["targets"])[r, t])


def _topk_distiller(where, floor=-20.0):
  topk_of, seen = _hand_built(where)
  teacher = TopKTeacher(cfg=STUDENT_CFG, k=K, temperature=1.0, vocab=VOCAB, source="a hand-built teacher")
  d = OnPolicyDistiller(md.init_model(STUDENT_CFG, seed=1), teacher, strategy=SampledTokenKD(floor=floor),
                        on_policy=_on(), topk_of=topk_of, optimizer=optax.sgd(1.0), seed=3)
  state = d.init_state()
  _, m = d.step(state, BATCHES[0])
  return seen[0], jax.device_get(m)


def test_a_sampled_tokens_reward_reads_both_models_at_that_token_and_position():
  def on_the_sampled_token(batch):
    r, t = _completion_position(batch)
    return r, t, _target_at(batch, r, t)

  batch, m = _topk_distiller(on_the_sampled_token)
  mask = np.asarray(batch["mask"])
  n = mask.sum()
  logp_s = _student_logp(batch)
  # The teacher: log(1/V) for every sampled token but the one it is sure of (log 1 = 0).
  np.testing.assert_allclose(m["teacher_ce"] * n, (n - 1) * np.log(VOCAB), rtol=1e-5)
  # The student: its own log-probability of each sampled token at its position (computed outside the step).
  np.testing.assert_allclose(m["ce"] * n, -np.sum(mask * logp_s), rtol=1e-5)
  # The reward r_t = log p_t(y_t) - log p_s(y_t), summed: -reverse_kl.
  r, t = _completion_position(batch)
  rewards = np.where(mask > 0, -np.log(VOCAB) - logp_s, 0.0)
  rewards[r, t] = -logp_s[r, t]
  np.testing.assert_allclose(-m["reverse_kl"] * n, rewards.sum(), rtol=1e-5)

  # All its mass one position later (the next completion token), or on another token at that position: the
  # sampled token there gets the teacher's tail, clipped at the floor (-20), and the numbers say so.
  def one_later(batch):
    r, t = _completion_position(batch, 2)
    return r, t, _target_at(batch, r, t - 1)

  def another_token(batch):
    r, t = _completion_position(batch)
    return r, t, (_target_at(batch, r, t) + 1) % VOCAB

  for where in (one_later, another_token):
    moved, m2 = _topk_distiller(where)
    np.testing.assert_array_equal(moved["targets"], batch["targets"])  # the same samples (same key, same params)
    r2, t2, token = where(moved)
    hit = token == _target_at(moved, r2, t2)
    want = (n - 1) * np.log(VOCAB) + (0.0 if hit else 20.0)
    np.testing.assert_allclose(m2["teacher_ce"] * n, want, rtol=1e-5)
    assert not np.isclose(m2["teacher_ce"], m["teacher_ce"])


def test_a_teacher_sure_of_a_prompt_or_padding_position_changes_nothing():
  def prompt(batch):
    return 0, 2, _target_at(batch, 0, 2)  # inside the prompt (positions < WIDTH - 1 predict prompt tokens)

  def padding(batch):
    mask = np.asarray(batch["mask"])
    r = int(np.argmin(mask.sum(1)))  # the row with the shortest completion
    pads = np.flatnonzero(mask[r] == 0)
    pads = pads[pads >= WIDTH - 1]
    if not len(pads):
      pytest.skip("no sampled row stopped early at this seed")
    return r, int(pads[0]), _target_at(batch, r, int(pads[0]))

  batch, base = _topk_distiller(prompt)
  n = np.asarray(batch["mask"]).sum()
  np.testing.assert_allclose(base["teacher_ce"] * n, n * np.log(VOCAB), rtol=1e-5)  # uniform on every counted token
  _, pad = _topk_distiller(padding)
  assert pad["teacher_ce"] == base["teacher_ce"] and pad["loss"] == base["loss"] and pad["ce"] == base["ce"]


def test_scrambled_prompt_and_padding_targets_change_no_number_of_any_arm():
  for strategy in (REVERSE, SampledTokenKD(), LogitKD(temperature=1.0, alpha=1.0)):
    d = _distiller(strategy, teacher_seed=0)
    sampled = d.sample_batch(d.init_state(), d.as_prompt_batch(BATCHES[1]), 0)
    keep = np.asarray(sampled["mask"]) > 0
    assert (~keep[:, WIDTH - 1:]).any(), "a sampled row stops early: padding after its EOS"
    scrambled = dict(sampled, targets=np.where(keep, sampled["targets"], (np.asarray(sampled["targets"]) + 11) % VOCAB))
    base = jax.device_get(Distiller.step(d, d.init_state(), sampled)[1])
    other = jax.device_get(Distiller.step(d, d.init_state(), scrambled)[1])
    for k in base:
      assert float(base[k]) == float(other[k]), (type(strategy).__name__, k)


# ----------------------------------------------------------------------------- no lag in sampling
class _Recording(OnPolicyDistiller):
  """Records the student parameters each sampled batch was generated from, and the batch."""

  def sample_batch(self, state, batch, step):
    out = super().sample_batch(state, batch, step)
    self.record.append((jax.device_get(state.params["student"]), step, out))
    return out


def test_samples_come_from_the_parameters_of_the_step_that_trains_on_them():
  d = _Recording(md.init_model(STUDENT_CFG, seed=1), md.init_model(STUDENT_CFG, seed=0), strategy=SampledTokenKD(),
                 on_policy=_on(), optimizer=optax.sgd(1.0), seed=3)
  d.record = []
  state, params_before = d.init_state(), []
  for b in BATCHES:
    params_before.append(jax.device_get(state.params["student"]))
    state, _ = d.step(state, b)
  assert [s for _, s, _ in d.record] == [0, 1]
  for (used, step, sampled), before in zip(d.record, params_before):
    jax.tree.map(np.testing.assert_array_equal, used, before)  # the very parameters this step starts from
    prompts = np.asarray(sampled["inputs"])[:, :WIDTH]
    gen = generate((d.student_def, before), prompts, np.ones_like(prompts, bool),
                   jax.random.fold_in(jax.random.key(3), step), d.on_policy.sampling())
    for r in range(len(prompts)):
      n = int(gen.lengths_B[r])
      np.testing.assert_array_equal(sampled["targets"][r, WIDTH - 1: WIDTH - 1 + n], np.asarray(gen.tokens_BxN[r, :n]))
  # the first step moved the student, so step 1's samples from the step-0 parameters would differ
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: np.any(a != b), params_before[0], params_before[1]))
  assert any(changed)


# ------------------------------------------------------------------------------ normalisation
@pytest.mark.parametrize("strategy", [LogitKD(temperature=1.0, alpha=1.0), REVERSE, SampledTokenKD()],
                         ids=["offpolicy_forward_kl", "gkd_reverse_kl", "sampled_token"])
def test_every_arm_divides_by_the_global_count_of_completion_tokens(strategy):
  """The loss of a batch is sum over its completion tokens / their count (a token mean over the whole batch), so
  ``loss(AB) * n(AB) == loss(A) * n(A) + loss(B) * n(B)`` for any split of its rows -- a mean of per-row means, or a
  division by rows or by all positions, fails it when rows have completions of different lengths."""
  d = _distiller(strategy, teacher_seed=0)
  sampled = d.sample_batch(d.init_state(), d.as_prompt_batch(BATCHES[1]), 0)
  lengths = np.asarray(sampled["mask"]).sum(1)
  assert len(set(lengths.tolist())) > 1, lengths  # rows of different completion lengths
  first, second = ({k: np.asarray(v)[rows] for k, v in sampled.items()} for rows in (slice(0, 2), slice(2, None)))
  whole, a, b = (jax.device_get(Distiller.step(d, d.init_state(), x)[1]) for x in (sampled, first, second))
  assert whole["tokens"] == lengths.sum() == a["tokens"] + b["tokens"]
  np.testing.assert_allclose(whole["loss"] * whole["tokens"], a["loss"] * a["tokens"] + b["loss"] * b["tokens"],
                             rtol=1e-5)
  per_row_means = (a["loss"] * 2 + b["loss"] * (len(lengths) - 2)) / len(lengths)
  assert not np.isclose(whole["loss"], per_row_means, rtol=1e-4)


def test_lambda_zero_and_one_train_on_the_same_token_mean():
  """Off-policy (data completions) and on-policy (samples) batches of one run: each step's loss is the mean over that
  batch's completion tokens; the metric ``tokens`` is that count for both."""
  d = _distiller(REVERSE, teacher_seed=0, lmbda=1.0)
  off = copy.copy(d)
  off.on_policy = dataclasses.replace(d.on_policy, lmbda=0.0)
  _, on_m = d.step(d.init_state(), BATCHES[0])
  _, off_m = off.step(off.init_state(), BATCHES[0])
  assert off_m["tokens"] == len(BATCHES[0]["mask"]) * NEW  # every data completion token
  assert on_m["tokens"] == on_m["sample_len"] * len(BATCHES[0]["mask"])  # every sampled token, EOS included


def test_the_expected_sampled_token_gradient_is_the_reverse_kl_gradient():
  """Averaged over the student's own distribution at a position (every token y weighted by p_s(y), exactly), the
  sampled-token gradient (discount 0) is the gradient of that position's reverse KL(p_s || p_t): the form is an
  unbiased one-sample estimate of reverse-KL GKD, and only its variance differs."""
  V = 11
  k1, k2 = jax.random.split(jax.random.key(4))
  student, teacher = jax.random.normal(k1, (1, V)), 3 * jax.random.normal(k2, (1, V))
  mask = np.ones((1,), np.float32)
  strategy = SampledTokenKD()
  from meshdistill.models import ModelOutput

  def sampled_loss(s, y):
    return strategy.per_sequence({}, ModelOutput(logits=s), ModelOutput(logits=teacher), np.array([y]), mask, 0)["loss"]

  p_s = np.asarray(jax.nn.softmax(student[0]))
  expected = sum(p_s[y] * np.asarray(jax.grad(sampled_loss)(student, y)) for y in range(V))
  want = jax.grad(lambda s: REVERSE.per_sequence({}, ModelOutput(logits=s), ModelOutput(logits=teacher),
                                                 np.array([0]), mask, 0)["loss"])(student)
  np.testing.assert_allclose(expected, np.asarray(want), rtol=1e-4, atol=1e-6)
  one = np.asarray(jax.grad(sampled_loss)(student, int(np.argmax(p_s))))
  assert not np.allclose(one, want, atol=1e-3)  # a single sample is not the expectation
