"""The cross-tokenizer step: a teacher on its own (BPE) tokens, a student on bytes; one device = 2x4, masked tokens
and uncounted spans never count, clear errors for strategies that need one vocabulary."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import STUDENT_CFG, TEACHER_CFG, all_gather_shapes, assert_trees_close, summation_atol, write_corpus

import meshdistill as md
from meshdistill import jobs, losses
from meshdistill.config import load_config
from meshdistill.data import ByteTokenizer, pack_texts, train_bpe
from meshdistill.data._cross import tokenize_side
from meshdistill.data import StudentRows, cut_teacher_rows
from meshdistill.data.alignment import byte_tables_of, matched_vocabulary
from meshdistill.train.loop.evaluate import Evaluator
from meshdistill.strategies import ByteKL, SpanKL, ULD
from meshdistill.teachers import cache as tc
from meshdistill.models import ModelOutput
from meshdistill.teachers.cache._cross import CachedCrossRows
from meshdistill.train.step import TARGET_LOGPROB_KEY, TOPK_KEYS

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ALIGN_KEYS = ("teacher_targets", "teacher_span", "student_span", "teacher_last", "student_last", "span_bytes")

TEXTS = ["the cat sat on the mat; the dog sat on the log. " * 2, "héllo wörld 日本 ok", "def f(x): return x + 1\n"]


@pytest.fixture(scope="module")
def setup():
  bpe = train_bpe(TEXTS * 10, 300)
  byte = ByteTokenizer()
  packed = pack_texts(TEXTS, byte, bpe, 16, 8)
  rows = packed.arrays()
  idx = np.arange(8) % len(packed)
  batches = [{k: v[np.roll(idx, s)] for k, v in rows.items()} for s in range(2)]
  teacher_cfg = TEACHER_CFG.replace(vocab_size=bpe.vocab_size)
  student_cfg = STUDENT_CFG.replace(vocab_size=byte.vocab_size)
  return {"bpe": bpe, "byte": byte, "batches": batches, "teacher_cfg": teacher_cfg, "student_cfg": student_cfg}


def build(setup, strategy, shape=None):
  mesh = None if shape is None else md.make_mesh(*shape)
  teacher = md.init_model(setup["teacher_cfg"], seed=0, mesh=mesh)
  student = md.init_model(setup["student_cfg"], seed=1, mesh=mesh)
  return md.Distiller(student, teacher, strategy=strategy, mesh=mesh)


@pytest.fixture(scope="module")
def runs(setup):
  """Two steps of span_kl (its unmatched part is ULD on each side's top-k) on one device and on 2x4."""
  strategy = SpanKL(matched_weight=0.5, top_k=8).with_matched(*matched_vocabulary(setup["bpe"], setup["byte"]))
  out = {}
  for layout, shape in (("single", None), ("2x4", (2, 4))):
    d = build(setup, strategy, shape)
    state = d.init_state()
    metrics = []
    for b in setup["batches"]:
      state, m = d.step(state, b)
      metrics.append({k: float(v) for k, v in m.items()})
    out[layout] = (d, state, metrics)
  return out


def test_2x4_equals_one_device(runs):
  d0, s0, m0 = runs["single"]
  d1, s1, m1 = runs["2x4"]
  for a, b in zip(m0, m1):
    for k in a:
      np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert_trees_close(jax.device_get(d1.unreplicate(s1.params)), jax.device_get(s0.params), rtol=1e-5, atol=1e-6)
  assert m0[0]["spans"] > 0 and m0[0]["loss"] > 0 and m0[1]["loss"] != m0[0]["loss"]
  assert m0[0]["matched_kl"] > 0 and m0[0]["unmatched_uld"] > 0


def test_masked_tokens_and_uncounted_spans_never_count(setup, runs):
  d, _, _ = runs["single"]
  batch = setup["batches"][0]
  ref = d.step(d.init_state(), batch)[1]
  changed = {k: v.copy() for k, v in batch.items()}
  # padding of both sides, and the targets of student positions outside every counted span and masked
  pad_s, pad_t = batch["mask"] == 0, batch["teacher_targets"] == setup["bpe"].pad_id
  pad_t &= batch["teacher_span"] < 0
  changed["targets"][pad_s & (batch["student_span"] < 0)] = 7
  changed["teacher_targets"][pad_t] = 5
  changed["teacher_inputs"][:, -1][pad_t[:, -1]] = 9  # a padded last input is seen by no counted position
  got = d.step(d.init_state(), changed)[1]
  assert pad_s.any() and pad_t.any()
  for k in ("loss", "matched_kl", "unmatched_uld", "ce", "spans", "span_nll", "teacher_span_nll"):
    np.testing.assert_allclose(float(got[k]), float(ref[k]), rtol=1e-6, err_msg=k)


def test_teacher_never_moves_and_gets_no_optimizer_state(runs):
  d, state, _ = runs["single"]
  assert set(state.params) == {"student", "strategy"}
  fresh = nnx.state(md.init_model(d.teacher_cfg, seed=0))
  assert_trees_close(jax.device_get(d.teacher_params), jax.device_get(fresh))


def test_a_strategy_of_one_vocabulary_is_refused_with_two_tokenizations(setup):
  student = md.init_model(setup["student_cfg"].replace(vocab_size=setup["teacher_cfg"].vocab_size), seed=1)
  for strategy in (None, md.strategies.AttentionTransfer()):
    d = md.Distiller(student, md.init_model(setup["teacher_cfg"], seed=0), strategy=strategy)
    with pytest.raises(ValueError, match="refused"):
      d.check_batch(setup["batches"][0])
  d = md.Distiller(md.init_model(setup["student_cfg"], seed=1), md.init_model(setup["teacher_cfg"], seed=0),
                   strategy=ULD())
  with pytest.raises(ValueError, match="data.teacher_tokenizer"):
    d.check_batch({k: setup["batches"][0][k] for k in ("inputs", "targets", "mask")})


def test_different_vocabularies_with_logit_kd_name_the_cross_tokenizer_strategies(setup):
  with pytest.raises(ValueError, match="byte_kl, span_kl or uld"):
    md.Distiller(md.init_model(setup["student_cfg"], seed=1), md.init_model(setup["teacher_cfg"], seed=0))


def test_evaluation_gives_bits_per_byte_of_both_models_on_the_same_bytes(setup, runs):
  d, _, m = runs["single"]
  state = d.init_state()
  batch = setup["batches"][0]
  got = Evaluator.for_trainer(d)(state.params, [batch])
  # numpy: each side's NLL of the targets inside counted spans, over those spans' bytes
  def nll(logits, targets, span):
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    counted = (span >= 0) & (np.take_along_axis(batch["span_bytes"], np.maximum(span, 0), 1) > 0)
    return -np.take_along_axis(logp, targets[..., None], -1)[..., 0][counted].sum()

  forward = jax.jit(lambda graph, params, x: nnx.merge(graph, params)(x).logits, static_argnums=0)
  student_logits = forward(d.student_def, state.params["student"], batch["inputs"])
  teacher_logits = forward(d.teacher_def, d.teacher_params, batch["teacher_inputs"])
  bits = np.log(2) * batch["span_bytes"].sum()
  np.testing.assert_allclose(got["bpb"], nll(student_logits, batch["targets"], batch["student_span"]) / bits, rtol=1e-5)
  np.testing.assert_allclose(got["teacher_bpb"],
                             nll(teacher_logits, batch["teacher_targets"], batch["teacher_span"]) / bits, rtol=1e-5)
  np.testing.assert_allclose(got["bpb"], m[0]["span_nll"] / m[0]["bytes"] / np.log(2), rtol=1e-5)  # the step's
  assert 7.0 < got["bpb"] < 10.0  # an untrained byte model: about log2(264) bits per byte


def test_the_matched_kl_never_gathers_the_teachers_vocabulary_split_over_tensor(setup, runs):
  d, state, _ = runs["2x4"]
  W = setup["teacher_cfg"].vocab_size
  assert W not in (8, 16, 264, d.student_cfg.d_model, d.teacher_cfg.d_model)  # a dimension no other array has
  split = [x.sharding.spec for x in jax.tree.leaves(d.teacher_params) if W in x.shape]
  assert split and all("tensor" in spec for spec in split), split  # the teacher's vocabulary is split over tensor
  hlo = d.lower(state, setup["batches"][0]).compile().as_text()
  assert "all-reduce" in hlo
  assert not [shape for shape in all_gather_shapes(hlo) if W in shape], all_gather_shapes(hlo)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  """A 2-step distill job through `meshdistill.jobs` on one device: a BPE teacher (pretrained 1 step on its own
  tokens) and a byte student, distill.kind byte_kl."""
  root = tmp_path_factory.mktemp("cross_job")
  sets = [
      f"data.source={write_corpus(root / 'c', n_docs=12)}", "data.max_chars=null", "data.val_fraction=0.25",
      "mesh.backend=single", "mesh.data=1", "mesh.tensor=1", "data.seq_len=32", "data.teacher_tokenizer=bpe",
      "data.bpe_vocab_size=280", "data.teacher_seq_len=16",
      "teacher.vocab_size=280", "student.vocab_size=264", "distill.kind=byte_kl", "distill.alpha=0.5",
      "train.steps=2", "train.warmup=1", "train.eval_every=1", "train.log_every=1", "pretrain.steps=1",
      "pretrain.warmup=0", "pretrain.eval_every=0", f"pretrain.cache_dir={root / 'cache'}", "checkpoint.every=0",
      f"run.run_dir={root / 'run'}",
  ]
  cfg = load_config("tiny", sets)
  return cfg, jobs.distill(cfg)


def test_a_distill_job_with_two_tokenizers_reports_bits_per_byte_and_keeps_its_teacher(job):
  cfg, summary = job
  assert summary["step"] == 2
  assert 0 < summary["student"]["bpb"] < 10 and 0 < summary["teacher"]["bpb"] < 10
  metrics = [json.loads(line) for line in open(f"{cfg.run.run_dir}/metrics.jsonl")]
  train = [m for m in metrics if m["split"] == "train"]
  evals = [m for m in metrics if m["split"] == "val"]
  assert all(m["byte_kl"] > 0 and m["byte_positions"] > 0 for m in train), train
  # the teacher never moves: its bits per byte on the validation bytes after every step are the same number
  assert [m["step"] for m in evals] == [1, 2] and evals[0]["bpb"] != evals[1]["bpb"]  # the student does move
  assert evals[0]["teacher_bpb"] == evals[1]["teacher_bpb"] == summary["teacher"]["bpb"]


# --------------------------------------------------------------------------- the cross-tokenizer teacher cache
@pytest.fixture(scope="module")
def cached(setup, tmp_path_factory):
  """The BPE teacher of `setup` cached over rows cut on its own tokens (float32): k = its whole vocabulary, and
  k = 16; the same 8 rows read through each for a byte student (the shapes of `setup`'s batches: Ts 16, Tt 8)."""
  bpe, byte = setup["bpe"], setup["byte"]
  rows = cut_teacher_rows(tokenize_side(TEXTS, bpe), bpe, 8)
  teacher = md.init_model(setup["teacher_cfg"], seed=0)  # the teacher of `runs`
  identity = {"teacher": tc.teacher_identity(teacher), "cross": True, "data": tc.teacher_rows_identity(rows, bpe),
              "teacher_tokenizer": tc.tokenizer_identity(bpe, "bpe")}
  root, W = tmp_path_factory.mktemp("xcache"), setup["teacher_cfg"].vocab_size
  out = {}
  for k in (W, 16):
    tc.write_cache(tc.TeacherTopK(teacher, k=k), rows, str(root / f"k{k}"), identity=identity, precision="float32",
                   rows_per_shard=4, batch_size=4)
    cache = tc.TeacherCache(str(root / f"k{k}"))
    out[k] = (cache, CachedCrossRows(cache, StudentRows(bpe, byte, 16)).rows(np.arange(8) % len(rows)))
  return teacher, out


def live_part(batch):
  """The batch without the cached teacher (what a live teacher's step reads)."""
  return {k: v for k, v in batch.items() if k not in (*TOPK_KEYS, TARGET_LOGPROB_KEY)}


def test_the_cache_path_equals_the_live_path_in_float32(setup, runs, cached):
  """The same rows through the live teacher (`runs`' span_kl step) and through a cache of its whole vocabulary:
  every metric and the student after one step agree to float32 rounding."""
  live, _, _ = runs["single"]
  W = setup["teacher_cfg"].vocab_size
  cache, batch = cached[1][W]
  assert cache.cross and cache.manifest["format"] == tc.FORMAT_VERSION == 2
  assert cache.teacher_tokenizer == {"setting": "bpe", "fingerprint": setup["bpe"].fingerprint, "vocab_size": W}
  student = md.init_model(setup["student_cfg"], seed=1)
  from_cache = md.Distiller(student, cache.spec(), strategy=live.strategy, mesh=None)
  s_live, m_live = live.step(live.init_state(), live_part(batch))
  s_cache, m_cache = from_cache.step(from_cache.init_state(), batch)
  assert m_live["spans"] > 0 and m_live["matched_kl"] > 0 and set(m_cache) == set(m_live)
  for k in m_live:
    np.testing.assert_allclose(float(m_cache[k]), float(m_live[k]), rtol=2e-6, atol=1e-7, err_msg=k)
  assert_trees_close(jax.device_get(s_cache.params), jax.device_get(s_live.params), rtol=1e-6, atol=1e-7)


def test_every_cross_tokenizer_loss_reads_the_cache_as_the_live_teacher_and_a_small_k_stays_close(setup, cached):
  """The cached top-k spread over the teacher's vocabulary is its log-softmax at k = its vocabulary, so byte_kl,
  span_kl and uld read the live teacher (byte_kl's loss computed both ways); at k = 16 byte_kl is finite and close."""
  teacher, out = cached
  W = setup["teacher_cfg"].vocab_size
  batch = out[W][1]
  live = jax.jit(lambda x: teacher(x).logits)(batch["teacher_inputs"])
  keys = (*TOPK_KEYS, "teacher_targets", TARGET_LOGPROB_KEY)
  spread = jax.jit(jax.vmap(lambda i, lp, tail, tgt, own: losses.topk_logprobs(i, lp, tail, W, tgt, own)))
  dense = {k: spread(*(b[key] for key in keys)) for k, (_, b) in out.items()}
  # two programs' log-sum-exp over W logits: the sums of W exponentials (each at most 1 after the max) may differ by
  # the bound of two summation orders, which is the error of their logarithm too
  np.testing.assert_allclose(dense[W], jax.nn.log_softmax(live), atol=summation_atol(W, 1.0))
  rest = out[16][1]  # k = 16: the kept ids and the targets exact, the rest of the tail spread evenly
  np.testing.assert_allclose(np.exp(dense[16]).sum(-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(np.take_along_axis(dense[16], rest["teacher_targets"][..., None], -1)[..., 0],
                             np.take_along_axis(dense[W], rest["teacher_targets"][..., None], -1)[..., 0], atol=1e-6)
  student = jax.random.normal(jax.random.key(0), (*batch["inputs"].shape, setup["student_cfg"].vocab_size))
  aligned = lambda t, b: losses.Aligned(t, *(b[k] for k in ALIGN_KEYS))  # noqa: E731
  byte_kl = ByteKL(max_depth=4).with_tables(byte_tables_of(setup["bpe"], setup["byte"], max_depth=4))

  @jax.jit
  def byte_loss(teacher_logits, b):
    per = jax.vmap(lambda *a: byte_kl.per_sequence({}, *a, 0))(ModelOutput(logits=student),
                                                              aligned(teacher_logits, b), b["targets"], b["mask"])
    return jnp.sum(per["loss"]), jnp.sum(per["byte_positions"])

  part = lambda b: {k: b[k] for k in (*ALIGN_KEYS, "targets", "mask")}  # noqa: E731 (the same shapes: one compile)
  (l_live, counted), (l_full, _), (l_16, _) = (byte_loss(t, part(b)) for t, b in ((live, batch), (dense[W], batch),
                                                                                (dense[16], rest)))
  assert float(counted) > 0 and float(l_live) > 0
  np.testing.assert_allclose(l_full, l_live, rtol=1e-6)
  assert np.isfinite(float(l_16)) and abs(float(l_16) / float(l_live) - 1) < 0.05, (l_16, l_live)


def test_an_old_cache_still_loads(setup):
  """A format-1 cache (written before the manifest named a teacher tokenizer, tests/fixtures/teacher_cache_v1) reads
  as it was written: its rows are the top-k the same teacher gives today; with a student of another tokenizer it
  is refused, naming what to do."""
  cache = tc.TeacherCache(str(FIXTURES / "teacher_cache_v1"), verify=True)
  assert cache.manifest["format"] == 1 and not cache.cross and cache.teacher_tokenizer is None
  tokens = np.load(FIXTURES / "teacher_cache_v1" / "tokens.npy")
  got = cache.rows(np.arange(cache.num_rows))
  inputs = tokens[: cache.num_rows * cache.seq_len].reshape(cache.num_rows, cache.seq_len)
  now = tc.TeacherTopK(md.init_model(TEACHER_CFG, seed=0), k=cache.k)(inputs)
  np.testing.assert_array_equal(got["teacher_ids"], np.asarray(now.indices))
  np.testing.assert_allclose(got["teacher_logprobs"], np.asarray(now.logprobs), atol=1e-5)
  with pytest.raises(tc.CacheError, match="no byte offsets.*data.teacher_tokenizer set"):
    tc.check_cross(cache, setup["bpe"], "bpe")


def test_a_cross_tokenizer_cache_refuses_another_teacher_tokenizer_and_one_vocabulary_strategies(setup, cached):
  cache = cached[1][16][0]
  with pytest.raises(tc.CacheError, match="written for the teacher tokenizer 'bpe'.*set data.teacher_tokenizer"):
    tc.check_cross(cache, setup["byte"], "byte")
  tc.check_cross(cache, setup["bpe"], "bpe")  # its own: accepted
  with pytest.raises(tc.CacheError, match="set data.teacher_tokenizer='bpe' and distill.kind"):
    tc.check_not_cross(cache)
  student = md.init_model(setup["student_cfg"], seed=1)
  with pytest.raises(ValueError, match="byte_kl, span_kl or uld"):
    md.Distiller(student, cache.spec(), strategy=md.strategies.LogitKD(top_k=8))


def test_cache_teacher_then_distill_from_the_cache_with_two_tokenizers(job, tmp_path):
  """`jobs.cache_teacher` with data.teacher_tokenizer writes a cross-tokenizer cache (the job's pretrained teacher,
  rows of its own tokens); `jobs.distill` with teacher.cache reads it for the byte student: byte_kl trains, no
  teacher weights are loaded, the student's bits per byte are reported."""
  cfg, _ = job
  out = str(tmp_path / "xcache")
  manifest = jobs.cache_teacher(cfg, out, k=16, precision="float32")
  assert manifest["cross"] and manifest["format"] == 2 and manifest["seq_len"] == cfg.data.teacher_seq_len
  assert manifest["teacher_tokenizer"]["setting"] == "bpe" and manifest["vocab"] == cfg.teacher.vocab_size
  run = tmp_path / "run"
  cached = load_config(f"{cfg.run.run_dir}/config.yaml",
                       [f"teacher.cache={out}", f"run.run_dir={run}", "train.steps=1", "train.warmup=0", "train.eval_every=0"])
  summary = jobs.distill(cached)
  assert summary["teacher"] is None and summary["teacher_dir"] == out and 0 < summary["student"]["bpb"] < 10
  train = [json.loads(line) for line in open(run / "metrics.jsonl") if '"train"' in line]
  assert train and train[0]["byte_kl"] > 0 and train[0]["byte_positions"] > 0
  # the same cache for a run whose teacher tokenizer is another: refused before any step, naming the setting
  other = load_config(f"{cfg.run.run_dir}/config.yaml", [f"teacher.cache={out}", f"run.run_dir={tmp_path / 'run2'}",
                                                         "data.teacher_tokenizer=byte"])
  with pytest.raises(tc.CacheError, match="teacher tokenizer 'bpe'.*data.teacher_tokenizer='byte'"):
    jobs.distill(other)
