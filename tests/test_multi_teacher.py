"""Several teachers in one run: routing and mixing against plain numpy references, the per-teacher metrics, the
multi-teacher step on 2x4 against one device, and the ``teachers:`` config's refusals."""

import jax
import optax
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, VOCAB, assert_trees_close, make_batch, run_steps

import meshdistill as md
from meshdistill import losses
from meshdistill.teachers.cache import TopKTeacher

K, N, B, T = 4, 2, 8, 8
TAU = 1.5


def random_topk(rng, b=B, t=T, k=K, vocab=VOCAB, tail_mass=0.2):
  """A top-k teacher per token: k distinct ids, log-probabilities in decreasing order, the tail bin (sums to 1)."""
  ids = np.stack([rng.permutation(vocab)[:k] for _ in range(b * t)]).reshape(b, t, k)
  p = np.sort(rng.dirichlet(np.ones(k), (b, t)), axis=-1)[..., ::-1] * (1 - tail_mass)
  return losses.TopK(ids.astype(np.int32), np.log(p).astype(np.float32), np.full((b, t), np.log(tail_mass), np.float32))


def mix_reference(topks, weights, k=K):
  """The mixture per token in plain Python: a dict id -> mass over the union, the k largest kept, the rest tail."""
  w = np.asarray(weights, np.float64) / np.sum(weights)
  b, t = topks[0].tail.shape
  ids, logp, tail = np.zeros((b, t, k), np.int32), np.zeros((b, t, k)), np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      mass, rest = {}, 0.0
      for wn, tk in zip(w, topks):
        p = np.exp(np.asarray(tk.logprobs[i, j], np.float64))
        z = p.sum() + np.exp(float(tk.tail[i, j]))
        for v, pv in zip(np.asarray(tk.indices[i, j]), p):
          mass[int(v)] = mass.get(int(v), 0.0) + wn * pv / z
        rest += wn * np.exp(float(tk.tail[i, j])) / z
      order = sorted(mass, key=lambda v: -mass[v])
      ids[i, j] = order[:k]
      logp[i, j] = np.log([mass[v] for v in order[:k]])
      tail[i, j] = np.log(rest + sum(mass[v] for v in order[k:]))
  return ids, logp, tail


def forward_kl_reference(student_BxTxV, ids, logp, tail, mask, tau):
  """Forward KL on the k+1 bins (teacher renormalised; the student's tail is its mass off the k ids), per token."""
  s = np.asarray(student_BxTxV, np.float64) / tau
  s = s - s.max(-1, keepdims=True)
  ps = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
  top_s = np.take_along_axis(ps, ids, -1)
  bins_s = np.concatenate([top_s, 1 - top_s.sum(-1, keepdims=True)], -1)
  bins_t = np.exp(np.concatenate([logp, tail[..., None]], -1).astype(np.float64))
  bins_t /= bins_t.sum(-1, keepdims=True)
  return (bins_t * (np.log(bins_t) - np.log(bins_s))).sum(-1) * mask


def test_route_takes_each_rows_teacher():
  rng = np.random.default_rng(0)
  topks = [random_topk(rng) for _ in range(N)]
  teacher_B = rng.integers(0, N, B)
  got = losses.route_topk(topks, teacher_B)
  for f in range(3):
    want = np.stack([np.asarray(topks[teacher_B[b]][f][b]) for b in range(B)])
    np.testing.assert_array_equal(np.asarray(got[f]), want)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0)])
def test_mix_equals_the_union_mixture(weights):
  rng = np.random.default_rng(1)
  # small vocabulary: the teachers' ids overlap often, so the union's shared ids are exercised
  topks = [random_topk(rng, vocab=8, tail_mass=m) for m in (0.1, 0.3)]
  got = jax.jit(losses.mix_topk, static_argnums=1)(topks, weights)
  ids, logp, tail = mix_reference(topks, weights)
  np.testing.assert_allclose(np.exp(np.asarray(got.logprobs)), np.exp(logp), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(got.tail), tail, rtol=1e-5, atol=1e-6)
  # ids: equal where the mixture's probabilities are not tied
  gaps = np.diff(np.exp(logp), axis=-1)
  untied = np.concatenate([np.abs(gaps) > 1e-6, np.ones_like(gaps[..., :1], bool)], -1) & np.concatenate(
    [np.ones_like(gaps[..., :1], bool), np.abs(gaps) > 1e-6], -1)
  np.testing.assert_array_equal(np.asarray(got.indices)[untied], ids[untied])
  total = np.exp(np.asarray(got.logprobs)).sum(-1) + np.exp(np.asarray(got.tail))
  np.testing.assert_allclose(total, 1.0, rtol=1e-5)


# --------------------------------------------------------------------------- the step
def multi_batch(combine: str, seed: int = 0):
  """A host batch with two teachers' top-k, combined by ``combine`` (route: rows alternate), and the route."""
  rng = np.random.default_rng(seed)
  batch = make_batch(seed, batch=B, seq=T)
  topks = [random_topk(rng) for _ in range(N)]
  if combine == "route":
    teacher_B = np.arange(B) % N
    combined = losses.route_topk(topks, teacher_B)
    rows = np.eye(N, dtype=np.float32)[teacher_B]
  else:
    combined = losses.mix_topk(topks, (2.0, 1.0))
    rows = np.ones((B, N), np.float32)
  batch.update(dict(zip(md.train.step.TOPK_KEYS, map(np.asarray, combined))))
  each = [np.stack([np.asarray(t[f]) for t in topks], axis=1) for f in range(3)]
  batch.update(dict(zip(md.train.step.MULTI_KEYS, (*each, rows))))
  return batch, topks, rows


def make_multi(mesh):
  teacher = TopKTeacher(cfg=TEACHER_CFG, k=K, temperature=TAU, vocab=VOCAB, source="two teachers",
                        names=("python", "prose"))
  student = md.init_model(STUDENT_CFG, seed=1)
  strategy = md.strategies.LogitKD(temperature=TAU, alpha=0.7, top_k=K)
  return md.Distiller(student, teacher, strategy=strategy, mesh=mesh, optimizer=optax.adam(1e-2))


@pytest.fixture(scope="module")
def runs():
  """Two steps of a routed and a mixed batch on one device and on 2x4 (one compiled step per layout)."""
  batches = [multi_batch("route", 0)[0], multi_batch("mix", 1)[0]]
  single, logits, metrics = make_multi(None), [], []
  state = single.init_state()
  for b in batches:  # the student's logits before each step: what its loss and metrics are taken on
    logits.append(np.asarray(single.student(state)(b["inputs"]).logits))
    state, m = single.step(state, b)
    metrics.append(jax.device_get(m))
  return {"single": (jax.device_get(state.params), metrics), "logits": logits,
          "2x4": run_steps(make_multi(md.make_mesh(data=2, tensor=4)), batches)}


def test_multi_teacher_step_on_2x4_equals_one_device(runs):
  (p1, m1), (p8, m8) = runs["single"], runs["2x4"]
  assert_trees_close(p8, p1, rtol=1e-5, atol=1e-6)
  for a, b in zip(m1, m8):
    assert set(a) == set(b) and {"kl/python", "agreement/prose", "tokens/prose"} <= set(a)
    for k in a:
      np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("index, combine", [(0, "route"), (1, "mix")])
def test_loss_and_teacher_metrics_equal_numpy(runs, index, combine):
  batch, topks, rows = multi_batch(combine, index)
  metrics = runs["single"][1][index]
  logits, mask = runs["logits"][index], batch["mask"]
  combined = [batch[k] for k in md.train.step.TOPK_KEYS]
  kl = forward_kl_reference(logits, *combined, mask, TAU)
  logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  ce = -np.take_along_axis(np.asarray(logp), batch["targets"][..., None], -1)[..., 0] * mask
  want = (0.7 * TAU**2 * kl.sum() + 0.3 * ce.sum()) / mask.sum()
  np.testing.assert_allclose(metrics["loss"], want, rtol=2e-5)
  for n, name in enumerate(("python", "prose")):
    served = mask * rows[:, n, None]
    kl_n = forward_kl_reference(logits, *(np.asarray(topks[n][f]) for f in range(3)), served, TAU)
    np.testing.assert_allclose(metrics[f"kl/{name}"], kl_n.sum() / served.sum(), rtol=2e-5)
    top1 = np.asarray(topks[n].indices)[..., 0]
    agree = (np.take_along_axis(logits, top1[..., None], -1)[..., 0] >= logits.max(-1)) * served
    np.testing.assert_allclose(metrics[f"agreement/{name}"], agree.sum() / served.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics[f"tokens/{name}"], served.sum())
