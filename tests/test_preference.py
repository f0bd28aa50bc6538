"""Preference strategies (DPO / IPO / DPO + KL) with the teacher as the reference model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, VOCAB, assert_trees_close

import meshdistill as md
from meshdistill.models import ModelOutput
from meshdistill.data import preference_batch, read_preferences
from meshdistill.strategies import PreferenceLoss
from meshdistill.strategies._preference import pair_loss

ROWS = [
    {"prompt": "def f(x):", "chosen": " return x", "rejected": " x return("},
    {"prompt": "for i in", "chosen": " range(3):", "rejected": " ):3(egnar"},
    {"prompt": "import", "chosen": " os", "rejected": " so"},
    {"prompt": "class A", "chosen": "(object):", "rejected": ":)tcejbo("},
]


def _encode(text):
  return [b % VOCAB for b in text.encode()]


def test_dpo_loss_and_gradient_equal_the_published_sigmoid_formula():
  margin = jnp.asarray([-2.0, -0.3, 0.0, 0.7, 5.0])
  beta = 0.1
  # -log sigmoid(beta * margin) (the DPO paper's loss, TRL's `-F.logsigmoid(beta * logits)`), in float64 numpy
  m = np.asarray(margin, np.float64)
  want = np.log1p(np.exp(-beta * m))
  want_grad = -beta / (1.0 + np.exp(beta * m))
  np.testing.assert_allclose(pair_loss(margin, beta), want, rtol=1e-6)
  np.testing.assert_allclose(pair_loss(jnp.zeros(1), beta), [np.log(2.0)], rtol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(pair_loss(x, beta)))(margin), want_grad, rtol=1e-5)
  np.testing.assert_allclose(pair_loss(margin, beta, "ipo"), (m - 1 / (2 * beta)) ** 2, rtol=1e-6)


def _logps(logits, targets, mask):
  lp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
  picked = np.take_along_axis(np.asarray(lp), targets[..., None], axis=-1)[..., 0]
  return np.sum(picked * mask, axis=-1)


def test_strategy_loss_is_the_formula_on_completion_log_probs_and_prompt_tokens_never_count():
  batch = preference_batch(ROWS, _encode, seq_len=16)
  rng = np.random.default_rng(0)
  s_logits = rng.normal(size=(8, 16, VOCAB)).astype(np.float32)
  t_logits = rng.normal(size=(8, 16, VOCAB)).astype(np.float32)
  strat = PreferenceLoss(beta=0.5)

  def run(s, t, targets):
    sums = strat.per_batch({}, ModelOutput(jnp.asarray(s)), ModelOutput(jnp.asarray(t)), None, jnp.asarray(targets),
                           jnp.asarray(batch["mask"]), 0)
    return {k: float(v) for k, v in sums.items()}

  got = run(s_logits, t_logits, batch["targets"])
  pol = _logps(s_logits, batch["targets"], batch["mask"])
  ref = _logps(t_logits, batch["targets"], batch["mask"])
  margin = (pol[0::2] - ref[0::2]) - (pol[1::2] - ref[1::2])
  np.testing.assert_allclose(got["loss"], np.sum(np.log1p(np.exp(-0.5 * margin))), rtol=1e-5)
  np.testing.assert_allclose(got["accuracy"], np.sum(margin > 0), rtol=0)
  np.testing.assert_allclose(got["logp_chosen"], np.sum(pol[0::2]), rtol=1e-5)
  # the prompt tokens (mask 0) of every row: change their logits and targets, nothing may change
  prompt = batch["mask"] == 0
  assert prompt.sum() > 8 and batch["mask"].sum() > 8
  s2, t2, y2 = s_logits.copy(), t_logits.copy(), batch["targets"].copy()
  s2[prompt] += 10 * rng.normal(size=s2[prompt].shape).astype(np.float32)
  t2[prompt] -= 3.0 * rng.normal(size=t2[prompt].shape).astype(np.float32)
  y2[prompt] = (y2[prompt] + 7) % VOCAB
  assert run(s2, t2, y2) == got


def test_preference_batch_masks_exactly_the_completion_targets():
  batch = preference_batch(ROWS[:1], _encode, seq_len=24)
  assert batch["inputs"].shape == (2, 24)
  p, c = len(_encode(ROWS[0]["prompt"])), len(_encode(ROWS[0]["chosen"]))
  assert batch["mask"][0].sum() == c and batch["mask"][0, : p - 1].sum() == 0
  np.testing.assert_array_equal(batch["targets"][0, p - 1 : p - 1 + c], _encode(ROWS[0]["chosen"]))


@pytest.fixture(scope="module")
def dpo_steps():
  batch = preference_batch(ROWS, _encode, seq_len=16)
  out = {}
  for layout in ("single", "2x4"):
    mesh = None if layout == "single" else md.make_mesh(data=2, tensor=4)
    d = md.Distiller(md.init_model(STUDENT_CFG, seed=1, mesh=mesh), md.init_model(TEACHER_CFG, seed=0, mesh=mesh),
                     strategy=PreferenceLoss(beta=0.1, loss="sigmoid_kl"), mesh=mesh)
    state, m = d.step(d.init_state(), batch)
    out[layout] = (jax.device_get(state.params), {k: float(v) for k, v in m.items()})
  return out


def test_one_dpo_step_on_2x4_equals_one_device(dpo_steps):
  (p1, m1), (p8, m8) = dpo_steps["single"], dpo_steps["2x4"]
  assert set(m1) >= {"loss", "reward_margin", "accuracy", "logp_chosen", "logp_rejected", "kl"}
  for k in m1:
    np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert_trees_close(p8, p1, rtol=1e-5, atol=1e-7)  # by path: k/v are replicated on 2x4 (2 kv heads < tensor=4)
  # the first step: student != teacher, loss is a mean over the 4 pairs of log(1 + exp(-beta * margin)) + kl
  assert m1["loss"] == pytest.approx(m1["preference_loss"] + 0.1 * m1["kl"], rel=1e-5)


def test_preference_row_missing_rejected_is_named(tmp_path):
  path = tmp_path / "prefs.jsonl"
  path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
  with pytest.raises(ValueError, match=r"prefs.jsonl:2: preference row lacks \['rejected'\]"):
    read_preferences(str(path))
  path.write_text(json.dumps(ROWS[0]) + "\n")
  assert read_preferences(str(path)) == ROWS[:1]
  with pytest.raises(ValueError, match="PreferenceLoss.beta"):
    PreferenceLoss(beta=0.0)


def test_pairs_from_own_text_share_the_prompt_and_mask_only_the_completion():
  from meshdistill.data import own_pairs

  rng = np.random.default_rng(0)
  x = rng.integers(0, VOCAB, (3, 9))
  mask = np.ones((3, 8), np.float32)
  mask[2, 6:] = 0.0
  pairs = own_pairs({"inputs": x[:, :-1], "targets": x[:, 1:], "mask": mask}, prompt_fraction=0.5)
  assert pairs["inputs"].shape == (6, 8)
  chosen, rejected = {k: v[0::2] for k, v in pairs.items()}, {k: v[1::2] for k, v in pairs.items()}
  np.testing.assert_array_equal(chosen["inputs"], x[:, :-1])
  np.testing.assert_array_equal(rejected["inputs"][:, :4], x[:, :4])  # the same prompt
  np.testing.assert_array_equal(rejected["targets"][0, 3:], x[1, 4:])  # another row's continuation
  np.testing.assert_array_equal(rejected["inputs"][:, 1:], rejected["targets"][:, :-1])  # a consistent sequence
  assert chosen["mask"][:, :3].sum() == rejected["mask"][:, :3].sum() == 0  # prompt targets never count
  np.testing.assert_array_equal(chosen["mask"][:, 3:], mask[:, 3:])
  np.testing.assert_array_equal(rejected["mask"][1, 3:], mask[2, 3:])  # padding of the borrowed row stays masked
