"""Several teachers in one run: routing and mixing against plain numpy references, the per-teacher metrics, the
multi-teacher step on 2x4 against one device, and the ``teachers:`` config's refusals."""

import jax
import optax
from flax import nnx
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, VOCAB, assert_trees_close, make_batch, run_steps

import meshdistill as md
from meshdistill import losses
from meshdistill.data import DataConfig, build_data
from meshdistill.teachers import multi
from meshdistill.teachers.cache import TeacherTopK, TopKTeacher

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
  route = np.arange(B) % N if combine == "route" else None  # the data's `combine` (jitted): routed rows alternate
  batch.update({k: np.asarray(v) for k, v in multi.combine(topks, route, k=K, weights=(2.0, 1.0)).items()})
  return batch, topks, batch["teachers_rows"]


NEW = 3  # on-policy: tokens the student generates per row (prompts: the first T + 1 - NEW tokens)
ON_POLICY = [make_batch(s, batch=B, seq=T, pad_from=None) | {"domain": (np.arange(B) + s) % 2} for s in (0, 1)]


def make_multi(mesh, teachers):
  """The distiller of every step here: two teachers combined into one top-k, on-policy (lambda=1) with
  ``teachers`` (two models: their top-k programs on ``mesh``) scoring the generated rows, routed by domain (0 ->
  the second teacher, 1 -> the first). Its plain step (`md.Distiller.step`) is the multi-teacher step on given
  batches: one compiled step per layout serves both."""
  from meshdistill.train.onpolicy import OnPolicyConfig, OnPolicyDistiller

  teacher = TopKTeacher(cfg=TEACHER_CFG, k=K, temperature=TAU, vocab=VOCAB, source="two teachers",
                        names=("python", "prose"))
  programs = [TeacherTopK(t, k=K, temperature=TAU, mesh=mesh) for t in teachers]
  data = multi.MultiTeacherData(None, [multi.Live(p) for p in programs], k=K, route=[1, 0], weights=[1.0, 1.0])
  student = md.init_model(STUDENT_CFG, seed=1)
  strategy = md.strategies.LogitKD(temperature=TAU, alpha=0.7, top_k=K)
  d = OnPolicyDistiller(student, teacher, strategy=strategy, mesh=mesh, optimizer=optax.adam(1e-2), seed=3,
                        topk_of=data.score,
                        on_policy=OnPolicyConfig(lmbda=1.0, max_new_tokens=NEW, temperature=1.0, eos_id=7))
  return d, programs


def plain_steps(trainer, batches):
  """`run_steps` with the plain step (given top-k batches, no generation)."""
  state, out = trainer.init_state(), []
  for b in batches:
    state, m = md.Distiller.step(trainer, state, b)
    out.append(jax.device_get(m))
  return jax.device_get(trainer.unreplicate(state.params)), out


@pytest.fixture(scope="module")
def runs():
  """Two steps of a routed and a mixed batch on one device and on 2x4 (one compiled step per layout), and two
  on-policy steps (generated rows scored by two model teachers) on each."""
  batches = [multi_batch("route", 0)[0], multi_batch("mix", 1)[0]]
  teachers = [md.init_model(TEACHER_CFG, seed=s) for s in (0, 2)]
  (single, programs), logits, metrics = make_multi(None, teachers), [], []
  state = single.init_state()
  forward = jax.jit(lambda params, x: nnx.merge(single.student_def, params["student"])(x).logits)
  for b in batches:  # the student's logits before each step: what its loss and metrics are taken on
    logits.append(np.asarray(forward(state.params, b["inputs"])))
    state, m = md.Distiller.step(single, state, b)
    metrics.append(jax.device_get(m))
  on_mesh = make_multi(md.make_mesh(data=2, tensor=4), teachers)[0]
  return {"single": (jax.device_get(state.params), metrics), "logits": logits,
          "2x4": plain_steps(on_mesh, batches), "on_policy": (single, programs, run_steps(single, ON_POLICY)),
          "on_policy 2x4": run_steps(on_mesh, ON_POLICY)}


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


# --------------------------------------------------------------------------- the data and the producers
def two_corpora(tmp_path):
  """Two tiny corpora whose bytes do not overlap: ``code`` (letters a-e) and ``prose`` (letters v-z)."""
  rng = np.random.default_rng(0)
  for name, letters in (("code", "abcde"), ("prose", "vwxyz")):
    root = tmp_path / name
    root.mkdir()
    for i in range(12):
      (root / f"d{i}.txt").write_text("".join(rng.choice(list(letters + " "), size=120 + 7 * i)))
  return {"code": str(tmp_path / "code"), "prose": str(tmp_path / "prose")}


def test_corpora_rows_carry_their_corpus_and_never_mix_two(tmp_path):
  bundle = build_data(DataConfig(corpora=two_corpora(tmp_path), seq_len=16, val_fraction=0.2), 4)
  assert bundle.domains == ("code", "prose")
  rows = bundle.train.arrays()
  for domain, letters in ((0, b"abcde "), (1, b"vwxyz ")):
    text = rows["inputs"][rows["domain"] == domain]
    assert text.size and set(np.unique(text)) <= set(letters) | {bundle.tokenizer.pad_id, bundle.tokenizer.eos_id,
                                                                  bundle.tokenizer.bos_id}
  batch = next(bundle.train_iterator())
  assert batch["domain"].shape == (4,) and set(np.unique(rows["domain"])) == {0, 1}


class TableTeacher:
  """A stand-in teacher program: the top-k of a fixed random table of log-probabilities, row ``inputs[t]``."""

  def __init__(self, seed, vocab):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(vocab, vocab)).astype(np.float32)
    self.logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    self.calls = []  # the rows of each call

  def __call__(self, inputs_BxT):
    self.calls.append(np.asarray(inputs_BxT))
    ids_BxTxK = np.argsort(-self.logp[inputs_BxT], axis=-1)[..., :K]
    logp = np.take_along_axis(self.logp[inputs_BxT], ids_BxTxK, -1)
    tail = np.log1p(-np.exp(logp).sum(-1))
    return losses.TopK(ids_BxTxK.astype(np.int32), logp, tail.astype(np.float32))


def test_route_data_gives_each_row_its_teachers_topk_from_its_rows_alone_and_resumes(tmp_path, monkeypatch):
  two_corpora(tmp_path)
  monkeypatch.chdir(tmp_path)  # documents keyed by relative paths: the split and the order are the same in every run
  bundle = build_data(DataConfig(corpora={"code": "code", "prose": "prose"}, seq_len=8, val_fraction=0.2), 4)
  programs = [TableTeacher(s, bundle.tokenizer.vocab_size) for s in (3, 4)]
  data = multi.MultiTeacherData(bundle, [multi.Live(p) for p in programs], k=K, route=[1, 0],
                                weights=[1.0, 1.0])  # code -> teacher 1, prose -> teacher 0
  it = data.train_iterator()
  batch = next(it)
  first_calls = [p.calls[0] for p in programs]  # batch 0's (the iterator has read one batch ahead since)
  own = [programs[n](batch["inputs"]) for n in range(2)]
  assert set(batch["domain"]) == {0, 1}
  for b, domain in enumerate(batch["domain"]):
    n = 1 - domain
    np.testing.assert_array_equal(batch["teacher_ids"][b], own[n].indices[b])
    np.testing.assert_allclose(batch["teacher_logprobs"][b], own[n].logprobs[b], rtol=1e-6)
    np.testing.assert_array_equal(batch["teachers_rows"][b], np.eye(2)[n])
    np.testing.assert_array_equal(batch["teachers_ids"][b, n], own[n].indices[b])
  for n in range(2):  # each teacher ran on its own rows (padded to a power of two), or on all 4 when that is as many
    mine, call = batch["inputs"][batch["domain"] == 1 - n], first_calls[n]
    if multi.Live(programs[n]).block_rows(len(mine), 4) < 4:
      np.testing.assert_array_equal(call[:len(mine)], mine)
    else:
      np.testing.assert_array_equal(call, batch["inputs"])
  assert min(len(c) for c in first_calls) < 4  # one of two teachers serves at most half the rows
  state = it.get_state()
  again = data.train_iterator(state)
  np.testing.assert_array_equal(next(again)["inputs"], next(it)["inputs"])  # resumes at the batch handed out next


class WithTopK:
  """A data bundle whose batches carry ``program``'s top-k, as a top-k source's prepared data does (a cache)."""

  def __init__(self, bundle, program):
    self.bundle, self.program = bundle, program

  def train_iterator(self, state=None, **kw):
    return WithTopKIterator(self.bundle.train_iterator(state, **kw), self.program)


class WithTopKIterator:
  def __init__(self, it, program):
    self.it, self.program = it, program
    self.get_state, self.set_state, self.close = it.get_state, it.set_state, it.close

  def __next__(self):
    batch = next(self.it)
    return {**batch, **dict(zip(md.train.step.TOPK_KEYS, self.program(batch["inputs"])))}


def test_mix_of_a_topk_source_and_a_live_teacher_reads_both_side_by_side(tmp_path):
  bundle = build_data(DataConfig(corpora=two_corpora(tmp_path), seq_len=8, val_fraction=0.2), 4)
  programs = [TableTeacher(s, bundle.tokenizer.vocab_size) for s in (5, 6)]
  data = multi.MultiTeacherData(bundle, [multi.FromBatches(WithTopK(bundle, programs[0])), multi.Live(programs[1])],
                                k=K, route=None, weights=[3.0, 1.0])
  batch = next(data.train_iterator())
  want = multi.combine([p(batch["inputs"]) for p in programs], None, k=K, weights=(3.0, 1.0))  # the mix: tested above
  for key in ("teacher_ids", "teacher_logprobs", "teacher_tail", "teachers_logprobs"):
    np.testing.assert_allclose(batch[key], np.asarray(want[key]), rtol=1e-6, err_msg=key)
  np.testing.assert_array_equal(batch["teachers_rows"], np.ones((4, 2)))


# --------------------------------------------------------------------------- the config
def config_with(tmp_path, teachers, **data):
  from meshdistill.config import load_config

  corpora = {"python": str(tmp_path), "prose": str(tmp_path)}
  overrides = [f"teachers={teachers}", f"data.corpora={data.get('corpora', corpora)}", "distill.top_k=8"]
  return load_config(None, overrides + [f"{k}={v}" for k, v in data.items() if k != "corpora"])


ROUTE = "{sources: [{name: a, source: pretrained, takes: [python]}, {name: b, source: pretrained, takes: [prose]}]}"


@pytest.mark.parametrize("teachers, extra, message", [
  ("{sources: [{name: a, source: nope, takes: [python]}, {name: b, source: pretrained, takes: [prose]}]}", {},
   r"teachers.sources\[0\].source='nope' is not a teacher source"),
  ("{sources: [{name: a, source: pretrained, takes: [python]}, {name: b, source: pretrained, takes: [poetry]}]}",
   {}, "b takes domain 'poetry', which is not a corpus"),
  (ROUTE, {"corpora": "{python: /a, prose: /b, poetry: /c}"}, r"data.corpora \['poetry'\] go to no teacher"),
  ("{sources: [{name: a, source: pretrained, takes: [python]}, {name: b, source: pretrained, takes: [python]}]}",
   {}, "domain 'python' is taken by a and b"),
  ("{combine: mix, sources: [{name: a, source: pretrained, weight: 0}, {name: b, source: pretrained}]}", {},
   r"teachers.sources\[0\].weight=0 must be a positive number"),
  ("{sources: [{name: a, source: pretrained, takes: [python]}, {name: a, source: pretrained, takes: [prose]}]}",
   {}, "two teachers are named 'a'"),
  (ROUTE, {"teacher.source": "cache", "teacher.cache": "/x"}, "teachers and teacher.cache are both set"),
  (ROUTE, {"distill.top_k": "null"}, "without distill.top_k"),
  ("{sources: [{name: a, source: cache, takes: [python]}, {name: b, source: pretrained, takes: [prose]}]}", {},
   r"teachers.sources\[0\].source=cache needs teachers.sources\[0\].cache"),
  ("{combine: route, route_by: language, sources: []}", {}, "teachers.route_by='language' is not a field"),
])
def test_teachers_config_errors_name_the_setting(tmp_path, teachers, extra, message):
  from meshdistill.config import ConfigError

  with pytest.raises(ConfigError, match=message):
    config_with(tmp_path, teachers, **extra)


def test_route_needs_named_corpora_and_a_teacher_of_the_students_vocabulary(tmp_path):
  from meshdistill.config import ConfigError, load_config

  with pytest.raises(ConfigError, match="needs data.corpora"):
    load_config(None, [f"teachers={ROUTE}", "distill.top_k=8"])
  cfg = config_with(tmp_path, ROUTE)
  assert [m.name for m in cfg.teachers.members()] == ["a", "b"] and cfg.teachers.members()[0].takes == ("python",)
  with pytest.raises(ConfigError, match="teachers: b has another vocabulary than the student"):
    multi._shared_vocab(cfg.teachers.members()[1], 512, 264)


# --------------------------------------------------------------------------- on-policy: the student's own rows
def test_on_policy_with_two_model_teachers_on_2x4_equals_one_device(runs):
  (_, _, (p1, m1)), (p8, m8) = runs["on_policy"], runs["on_policy 2x4"]
  assert all(m["on_policy"] == 1 and 0 < m["sample_len"] <= NEW for m in m1)
  assert_trees_close(p8, p1, rtol=1e-5, atol=1e-6)
  for a, b in zip(m1, m8):
    assert {"kl/python", "kl/prose", "tokens/python", "tokens/prose"} <= set(a)
    for k in ("loss", "kl/python", "kl/prose", "agreement/prose", "tokens/python", "sample_len", "tokens"):
      np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_generated_rows_get_their_own_teachers_topk_and_prompt_tokens_never_count(runs):
  d, programs, _ = runs["on_policy"]
  state = d.init_state()
  sampled = d.sample_batch(state, d.as_prompt_batch(ON_POLICY[0]), step=0)
  np.testing.assert_array_equal(sampled["domain"], ON_POLICY[0]["domain"])  # a generated row keeps its corpus
  assert not sampled["mask"][:, : T - NEW].any() and (sampled["mask"].sum(1) >= 1).all()
  scored = d.topk_of(sampled)
  own = [jax.device_get(p(sampled["inputs"])) for p in programs]  # each teacher on the generated rows
  for b, domain in enumerate(sampled["domain"]):
    n = 1 - domain
    np.testing.assert_array_equal(scored["teacher_ids"][b], own[n].indices[b])
    np.testing.assert_allclose(scored["teacher_logprobs"][b], own[n].logprobs[b], rtol=1e-6)
    np.testing.assert_array_equal(scored["teachers_rows"][b], np.eye(2)[n])
  # Scrambling the targets and the teachers' top-k wherever the mask is 0 (prompts, padding) changes no number.
  off = sampled["mask"] == 0
  scrambled = dict(scored, targets=np.where(off, (scored["targets"] + 11) % VOCAB, scored["targets"]))
  for key in ("teacher_logprobs", "teachers_logprobs"):
    where = off[..., None] if key == "teacher_logprobs" else off[:, None, :, None]
    scrambled[key] = np.where(where, scored[key] - 3.0, scored[key])
  base = md.Distiller.step(d, d.init_state(), scored)[1]
  other = md.Distiller.step(d, d.init_state(), scrambled)[1]
  for k in ("loss", "kl/python", "kl/prose", "agreement/python", "tokens/prose"):
    assert float(base[k]) == float(other[k]), k
  # the teachers are data to the step (their top-k under stop_gradient): no teacher in the state, weights unchanged
  assert "teacher" not in set(jax.device_get(d.unreplicate(state.params))) and d.teacher_def is None
  before = jax.device_get(programs[0].params)
  d.step(d.init_state(), ON_POLICY[1])
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(programs[0].params), before)


def test_on_policy_refuses_a_teacher_that_cannot_score_generated_rows(tmp_path):
  from meshdistill.config import ConfigError

  cached = ("{sources: [{name: a, source: cache, cache: /c, takes: [python]}, "
            "{name: b, source: pretrained, takes: [prose]}]}")
  with pytest.raises(ConfigError, match=r"sources\[0\] \(a, source: cache\) cannot score the rows the student "
                                        "generates .*a cache holds the top-k of the corpus rows"):
    config_with(tmp_path, cached, **{"distill.on_policy.lambda": 1.0})
  with pytest.raises(ConfigError, match="seq_kd=true lets the teacher sample, but teachers lists several"):
    config_with(tmp_path, ROUTE, **{"distill.on_policy.seq_kd": "true"})
  assert config_with(tmp_path, ROUTE, **{"distill.on_policy.lambda": 1.0}).distill.on_policy.active


# --------------------------------------------------------------------------- one member's cache
def test_cache_teacher_writes_one_members_cache_which_a_run_reads_as_that_teacher(tmp_path):
  from meshdistill import jobs
  from meshdistill.config import ConfigError, load_config
  from meshdistill.teachers.checkpoint import save_teacher

  corpora = two_corpora(tmp_path)
  sets = [f"data.corpora={{python: {corpora['code']}, prose: {corpora['prose']}}}", "data.seq_len=8",
          "data.val_fraction=0.2", "data.max_chars=null", "teacher.max_len=16", "student.max_len=16",
          f"distill.top_k={K}", "distill.temperature=1.0", "train.batch_size=4", "mesh.backend=single",
          "mesh.data=1", "mesh.tensor=1", f"pretrain.cache_dir={tmp_path / 'cache'}"]
  plain = load_config("tiny", sets)
  tokenizer = jobs.load_data(plain).tokenizer
  one = md.init_model(plain.teacher, seed=0)
  graphdef, params = nnx.split(one)
  other = nnx.merge(graphdef, jax.tree.map(lambda x: 1.5 * x, params))  # another teacher (no second init: seconds)
  dirs = [save_teacher(str(tmp_path / f"t{n}"), t, tokenizer) for n, t in enumerate((one, other))]
  a_live = f"{{name: a, source: pretrained, dir: {dirs[0]}, temperature: {TAU}}}"
  b_live = f"{{name: b, source: pretrained, dir: {dirs[1]}, temperature: {TAU}}}"  # one top-k program for both
  live = load_config("tiny", [*sets, f"teachers={{combine: mix, sources: [{a_live}, {b_live}]}}"])
  with pytest.raises(ConfigError, match=r"several teachers \(\['a', 'b'\]\); pick one with --teacher NAME"):
    jobs.cache_teacher(live, str(tmp_path / "a_cache"))
  with pytest.raises(ConfigError, match=r"--teacher c is not in teachers.sources; choose one of \['a', 'b'\]"):
    jobs.cache_teacher(live, str(tmp_path / "a_cache"), teacher="c")
  manifest = jobs.cache_teacher(live, str(tmp_path / "a_cache"), k=K, precision="float32", teacher="a")
  assert manifest["temperature"] == TAU and manifest["k"] == K  # at the member's own temperature
  a_cached = f"{{name: a, source: cache, cache: {tmp_path / 'a_cache'}}}"
  cached = load_config("tiny", [*sets, f"teachers={{combine: mix, sources: [{a_cached}, {b_live}]}}"])
  batches = []
  for cfg in (live, cached):
    mesh = jobs.build_mesh(cfg)
    data = jobs.load_data(cfg, mesh=mesh)
    batches.append(next(jobs.prepare_teacher(cfg, data, mesh, None).data.train_iterator()))
  np.testing.assert_array_equal(batches[1]["inputs"], batches[0]["inputs"])
  np.testing.assert_array_equal(batches[1]["teachers_ids"], batches[0]["teachers_ids"])
  for key in ("teachers_logprobs", "teachers_tail", "teacher_logprobs"):  # float32 cache: the live numbers
    np.testing.assert_allclose(batches[1][key], batches[0][key], rtol=1e-5, atol=1e-6, err_msg=key)
