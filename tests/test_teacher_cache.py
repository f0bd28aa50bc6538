"""The offline top-k teacher cache: compact encoding, exact equality with a live top-k teacher, resume, refusals."""

import json
import os
import shutil

import numpy as np
import optax
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, write_corpus

import meshdistill as md
from meshdistill.teachers import cache as tc
from meshdistill.config import Config, ConfigError
from meshdistill.jobs import prepare_teacher
from meshdistill.train.loop.safeguards import safeguarded
from meshdistill.teachers.sources import ModelSources
from meshdistill.strategies import AttentionTransfer, LogitKD

K, TAU = 4, 2.0
STRATEGY = LogitKD(top_k=K, temperature=TAU, alpha=0.5)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("cache")
  data = md.data.build_data(md.data.DataConfig(source=write_corpus(root / "corpus", 8), seq_len=16, val_fraction=0.0),
                            batch_size=8)
  vocab = data.tokenizer.vocab_size
  mesh = md.make_mesh(data=2, tensor=4)
  teacher = md.init_model(TEACHER_CFG.replace(vocab_size=vocab), seed=0, mesh=mesh)
  student_cfg = STUDENT_CFG.replace(vocab_size=vocab)
  program = tc.TeacherTopK(teacher, k=K, temperature=TAU, mesh=mesh)
  identity = {"teacher": tc.teacher_identity(teacher), "data": tc.data_identity(data.train, data.tokenizer)}
  caches = {}
  for precision in ("float32", "float16"):
    out = str(root / precision)
    tc.write_cache(program, data.train, out, identity=identity, precision=precision, rows_per_shard=128, batch_size=32)
    caches[precision] = out
  return dict(root=root, data=data, mesh=mesh, teacher=teacher, student_cfg=student_cfg, program=program,
              identity=identity, caches=caches)


def _losses(distiller, data, student_cfg, mesh, steps=2):
  student = md.init_model(student_cfg, seed=1, mesh=mesh)
  state = distiller.init_state(student)
  it = data.train_iterator()
  out = []
  for _ in range(steps):
    state, metrics = distiller.step(state, next(it))
    out.append(float(metrics["loss"]))
  it.close()
  return np.array(out)


def test_ids_pack_into_ceil_log2_vocab_bits_and_round_trip():
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 128_000, (5, 32 * 3))
  bits = tc.id_bits(128_000)
  packed = tc.pack_ids(ids, bits)
  assert bits == 17 and packed.shape == (5, 32 * 3 * 17 // 8)
  np.testing.assert_array_equal(tc.unpack_ids(packed, bits, ids.shape[1]), ids)


def test_run_from_float32_cache_equals_live_topk_run(setup):
  s = setup
  # written on a 2x4 mesh, read by a student on one device (the layouts agree on the numbers)
  student = md.init_model(s["student_cfg"], seed=1)
  live = md.Distiller(student, s["teacher"], strategy=STRATEGY)
  cache = tc.TeacherCache(s["caches"]["float32"], verify=True)
  cached = md.Distiller(student, cache.spec(), strategy=STRATEGY)
  assert cached.teacher_def is None and cached.teacher_params == {}  # no teacher weights beside the student
  want = _losses(live, s["data"], s["student_cfg"], None)
  got = _losses(cached, tc.CachedTeacherData(s["data"], cache), s["student_cfg"], None)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  compact = _losses(cached, tc.CachedTeacherData(s["data"], tc.TeacherCache(s["caches"]["float16"])),
                    s["student_cfg"], None)
  assert np.max(np.abs(compact - want) / want) < 1e-3  # float16 log-probs: a small, bounded error
  assert not np.array_equal(compact, want)


def test_cache_feeds_a_student_over_the_batch_like_a_live_teacher(setup):
  s = setup
  cache = tc.TeacherCache(s["caches"]["float32"])
  rows = md.Distiller(md.init_model(s["student_cfg"], seed=1, mesh=s["mesh"]), cache.spec(), strategy=STRATEGY,
                      mesh=s["mesh"], student_split="batch")  # the top-k arrays reach each device's rows
  live = md.Distiller(md.init_model(s["student_cfg"], seed=1), s["teacher"], strategy=STRATEGY)
  want = _losses(live, s["data"], s["student_cfg"], None)
  got = _losses(rows, tc.CachedTeacherData(s["data"], cache), s["student_cfg"], s["mesh"])
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_killed_write_resumes_to_the_same_cache(setup, tmp_path):
  s = setup
  out = str(tmp_path / "resumed")
  first = tc.write_cache(s["program"], s["data"].train, out, identity=s["identity"], precision="float32",
                         rows_per_shard=128, batch_size=32, stop_after_shards=1)
  assert first == {} and os.path.isfile(os.path.join(out, "progress-0.json"))
  # a write cut off mid-file: a partial next shard that progress.json does not list
  with open(os.path.join(out, "shard-00001.safetensors"), "wb") as f:
    f.write(b"\0" * 100)
  with pytest.raises(tc.CacheError, match="unfinished"):
    tc.TeacherCache(out)
  done = tc.write_cache(s["program"], s["data"].train, out, identity=s["identity"], precision="float32",
                        rows_per_shard=128, batch_size=32)
  whole = tc.TeacherCache(s["caches"]["float32"]).manifest
  assert len(whole["shards"]) > 1
  assert done["content_sha256"] == whole["content_sha256"]
  tc.TeacherCache(out, verify=True)


def test_writers_split_the_shards_and_a_rerun_on_another_process_count_finishes(setup, tmp_path):
  """Writer 1 of 2 alone writes the odd shards and no manifest; a one-process rerun writes only the even ones
  (writer 1's files are kept as they are) and ends with the uninterrupted cache and no progress files."""
  s = setup
  out = tmp_path / "split"
  kw = dict(identity=s["identity"], precision="float32", rows_per_shard=128, batch_size=32)
  assert tc.write_cache(s["program"], s["data"].train, str(out), process_index=1, process_count=2, **kw) == {}
  odd = {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out) if n.startswith("shard-")}
  whole = tc.TeacherCache(s["caches"]["float32"]).manifest
  assert sorted(odd) == [sh["name"] for sh in whole["shards"][1::2]] and os.path.isfile(out / "progress-1.json")
  done = tc.write_cache(s["program"], s["data"].train, str(out), **kw)
  assert done["content_sha256"] == whole["content_sha256"]
  assert {n: os.stat(out / n).st_mtime_ns for n in odd} == odd
  assert not any(n.startswith("progress-") for n in os.listdir(out))


def test_cache_for_other_settings_or_damaged_is_refused(setup, tmp_path):
  s = setup
  path = s["caches"]["float16"]
  cache = tc.TeacherCache(path)
  other = dict(s["identity"]["data"], tokens_sha256="0" * 64)
  with pytest.raises(tc.CacheError, match="data.tokens_sha256"):
    cache.check(data=other)
  with pytest.raises(tc.CacheError, match="another tokenizer"):
    cache.check(data=dict(s["identity"]["data"], tokenizer="bpe-1234"))
  with pytest.raises(tc.CacheError, match="vocab_size is 128"):
    cache.check(vocab=128)
  with pytest.raises(tc.CacheError, match="teacher.weights_sha256"):
    cache.check(teacher={"weights_sha256": "x"})
  cache.check(data=s["identity"]["data"], vocab=s["student_cfg"].vocab_size, teacher=s["identity"]["teacher"])
  # writing into it with another k is refused, naming k
  program = tc.TeacherTopK(s["teacher"], k=K + 1, temperature=TAU, mesh=s["mesh"])
  with pytest.raises(tc.CacheError, match="k: cache 4, this run 5"):
    tc.write_cache(program, s["data"].train, path, identity=s["identity"], rows_per_shard=128)
  # a truncated shard
  broken = tmp_path / "broken"
  broken.mkdir()
  for name in os.listdir(path):
    data = open(os.path.join(path, name), "rb").read()
    (broken / name).write_bytes(data[:-10] if name == "shard-00000.safetensors" else data)
  with pytest.raises(tc.CacheError, match="truncated"):
    tc.TeacherCache(str(broken))
  # strategies that need a live teacher, or other top-k settings
  student = md.init_model(s["student_cfg"], seed=1)
  refused = ((AttentionTransfer(), "needs a live teacher"), (LogitKD(top_k=K + 1, temperature=TAU), "top_k"),
             (LogitKD(top_k=K, temperature=1.0), "temperature"))
  for strategy, match in refused:
    with pytest.raises(ValueError, match=match):
      md.Distiller(student, cache.spec(), strategy=strategy)


def test_a_loss_scaled_step_trains_from_a_cache_like_the_unscaled_one(setup):
  """Static loss scaling (the step's ``loss_scale``) with a top-k `LogitKD`: the cache serves it; the loss values and,
  with the optimizer unscaling by the same factor, the whole trajectory are the unscaled run's. A strategy that needs a
  live teacher is refused by its own name (the scale does not wrap it)."""
  s = setup
  cache = tc.TeacherCache(s["caches"]["float32"])
  data = tc.CachedTeacherData(s["data"], cache)
  student = md.init_model(s["student_cfg"], seed=1)
  plain = md.Distiller(student, cache.spec(), strategy=STRATEGY, optimizer=safeguarded(optax.sgd(0.1)))
  scaled = md.Distiller(student, cache.spec(), strategy=STRATEGY, loss_scale=1024.0,
                        optimizer=safeguarded(optax.sgd(0.1), loss_scale=1024.0))
  np.testing.assert_allclose(_losses(scaled, data, s["student_cfg"], None),
                             _losses(plain, data, s["student_cfg"], None), rtol=1e-5)
  with pytest.raises(ValueError, match=r"but strategy AttentionTransfer needs a live teacher"):
    md.Distiller(student, cache.spec(), strategy=AttentionTransfer(), loss_scale=8.0)
  with pytest.raises(ValueError, match=r"but LogitKD.top_k=5"):
    md.Distiller(student, cache.spec(), strategy=LogitKD(top_k=K + 1, temperature=TAU), loss_scale=8.0)


def test_a_config_naming_another_teacher_is_refused_and_an_older_cache_reads_as_float32(setup, tmp_path):
  """`distill` with ``teacher.cache``: the run's teacher settings must be those that wrote the cache (how it
  computes -- remat, scanned layers -- may differ); a cache written before ``teacher.param_dtype`` was a setting
  (no such key in its manifest) was made from float32 weights."""
  s = setup
  teacher_cfg = s["teacher"].cfg

  def open_with(path, **teacher):
    cfg = Config(teacher=teacher_cfg.replace(**teacher), student=s["student_cfg"],
                 models=ModelSources(teacher_cache=path), data=md.data.DataConfig(seq_len=s["data"].train.seq_len))
    return prepare_teacher(cfg, s["data"], None, None, report=lambda *_: None)

  path = s["caches"]["float32"]
  assert open_with(path).identity == path
  assert open_with(path, remat="full").identity == path  # how the teacher computes, not what
  for key, value in (("n_layers", teacher_cfg.n_layers + 1), ("param_dtype", "bfloat16")):
    with pytest.raises(ConfigError, match=f"teacher.{key}: cache .*, this config {value!r}"):
      open_with(path, **{key: value})

  # the same cache as an older version wrote it: no param_dtype in the manifest's teacher config
  old = tmp_path / "old"
  shutil.copytree(path, old)
  manifest = json.loads((old / tc.MANIFEST).read_text())
  del manifest["teacher"]["config"]["param_dtype"]
  (old / tc.MANIFEST).write_text(json.dumps(manifest))
  assert open_with(str(old)).identity == str(old)
  with pytest.raises(ConfigError, match="teacher.param_dtype: cache 'float32', this config 'bfloat16'"):
    open_with(str(old), param_dtype="bfloat16")


# --------------------------------------------------------------------------- the config as written, not as fitted
def test_a_cache_written_on_a_mesh_opens_with_the_teacher_config_as_written(setup):
  """The manifest holds the teacher's config fitted to the writer's mesh (`ModelConfig.for_tensor`: 2 key/value heads
  replicated over tensor=4); the run's config is the one the user wrote, without that placement."""
  s = setup
  fitted = s["teacher"].cfg
  assert fitted.replicate_kv  # the fixture's teacher: 2 key/value heads on tensor=4
  written = fitted.replace(replicate_kv=False, vocab_multiple=1)
  cfg = Config(teacher=written, student=s["student_cfg"], models=ModelSources(teacher_cache=s["caches"]["float32"]),
               data=md.data.DataConfig(seq_len=s["data"].train.seq_len))
  assert prepare_teacher(cfg, s["data"], None, None, report=lambda *_: None).identity == s["caches"]["float32"]
