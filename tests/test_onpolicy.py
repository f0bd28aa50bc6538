"""On-policy distillation (GKD): layout parity with sampling, completion-only losses, lambda=0 is
off-policy KD, prompt files and the run-level generate job."""

import copy
import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, assert_sgd_steps_agree, make_batch, run_steps

import meshdistill as md
from meshdistill import cli, jobs
from meshdistill.config import ConfigError, load_config
from meshdistill.models.generate import SamplingConfig, generate, left_pad
from meshdistill.train.loop.monitor import Monitor
from meshdistill.train.onpolicy import OnPolicyConfig, OnPolicyDistiller
from meshdistill.data.prompts import completion_batch, cut_prompts, pair_batch, read_prompts
from meshdistill.train.loop.trainer import fit

SEQ, NEW = 12, 5  # prompts: the first SEQ + 1 - NEW = 8 tokens of each row
GKD = md.LogitKD(temperature=1.0, alpha=0.5, divergence="jsd", beta=0.5)


def _distiller(mesh, lmbda, cls=OnPolicyDistiller, **kw):
  teacher = md.init_model(TEACHER_CFG, seed=0, mesh=mesh)
  student = md.init_model(STUDENT_CFG, seed=1, mesh=mesh)
  if cls is OnPolicyDistiller:
    kw["on_policy"] = OnPolicyConfig(lmbda=lmbda, max_new_tokens=NEW, temperature=1.0, eos_id=7)
  # plain SGD: the layouts' parameters after a step then compare their gradients (`assert_sgd_steps_agree`)
  return cls(student, teacher, strategy=GKD, mesh=mesh, seed=3, optimizer=optax.sgd(1.0), **kw)


BATCHES = [make_batch(seed=s, seq=SEQ, pad_from=None) for s in range(2)]


@pytest.fixture(scope="module")
def single():
  return _distiller(None, 1.0)


def test_gkd_steps_on_2x4_equal_one_device(single):
  """The layouts agree on the loss and metrics of each step, the gradients (a plain SGD step's parameter change,
  and its norm) and so the samples of the next step."""
  metrics = assert_sgd_steps_agree(single, _distiller(md.make_mesh(data=2, tensor=4), 1.0), BATCHES,
                                   ("loss", "kl", "sample_len", "sample_nll", "tokens"))
  assert all(m["on_policy"] == 1 and 0 < m["sample_len"] <= NEW for m in metrics)


def test_lambda_zero_is_off_policy_kd_on_the_completions_exactly(single):
  off = copy.copy(single)  # the same compiled step
  off.on_policy = dataclasses.replace(single.on_policy, lmbda=0.0)
  params, metrics = run_steps(off, BATCHES)
  width = SEQ + 1 - NEW
  state, ref = off.init_state(), []
  for b in BATCHES:  # the plain distillation step on rows whose loss mask covers the completions
    state, m = md.Distiller.step(off, state, cut_prompts(b, width))
    ref.append(jax.device_get(m))
  jax.tree.map(np.testing.assert_array_equal, params, jax.device_get(state.params))
  assert [m["loss"] for m in metrics] == [m["loss"] for m in ref] and all(m["on_policy"] == 0 for m in metrics)
  assert metrics[0]["tokens"] == len(BATCHES[0]["mask"]) * (SEQ - width + 1)  # completion targets only


def test_prompt_tokens_never_count_in_the_loss(single):
  d = single
  sampled = d.sample_batch(d.init_state(), d.as_prompt_batch(BATCHES[0]), step=0)
  width = SEQ + 1 - NEW
  assert not sampled["mask"][:, : width - 1].any()  # targets inside the prompts
  assert (sampled["mask"].sum(1) >= 1).all()
  # Scrambling the targets at prompt (and padding) positions changes no number of the step.
  scrambled = dict(sampled, targets=np.where(sampled["mask"] > 0, sampled["targets"], (sampled["targets"] + 11) % 64))
  base = md.Distiller.step(d, d.init_state(), sampled)[1]
  other = md.Distiller.step(d, d.init_state(), scrambled)[1]
  for k in ("loss", "kl", "ce", "teacher_ce"):
    assert float(base[k]) == float(other[k]), k


class _Batches:
  """A data bundle cycling through ``batches`` (fit's interface)."""

  def __init__(self, batches):
    self.batches = batches

  def val_batches(self, max_batches=None):
    return self.batches[:1]

  def train_iterator(self, state=None):
    return _Cycle(self.batches)


class _Cycle:
  def __init__(self, batches):
    self.batches, self.i = batches, 0

  def __next__(self):
    self.i += 1
    return self.batches[(self.i - 1) % len(self.batches)]

  def get_state(self):
    return {"next_batch": self.i}

  def close(self):
    pass


class _TokenLog(Monitor):
  def __init__(self, steps):
    super().__init__(None, steps)
    self.tokens, self.metrics = [], []

  def step(self, step, metrics, tokens):
    super().step(step, metrics, tokens)
    self.tokens.append(tokens)
    self.metrics.append(jax.device_get(metrics))


@pytest.mark.parametrize("lmbda", [1.0, 0.0])
def test_tokens_per_s_counts_the_completion_tokens_trained_on(single, lmbda):
  d = copy.copy(single)  # the same compiled step
  d.on_policy = dataclasses.replace(single.on_policy, lmbda=lmbda)
  log = _TokenLog(2)
  fit(d, _Batches(BATCHES), steps=2, monitor=log, log_every=1)
  rows = len(BATCHES[0]["mask"])
  for m, n, b in zip(log.metrics, log.tokens, BATCHES):
    assert n < np.sum(b["mask"])  # not the data's mask: prompt tokens are never trained on
    if lmbda:
      assert m["on_policy"] == 1 and n == pytest.approx(m["sample_len"] * rows)
    else:
      assert n == rows * NEW  # the data's completion targets
  assert log.tokens == [float(m["tokens"]) for m in log.metrics]


def test_generated_completions_are_laid_out_from_position_zero():
  prompts, mask = left_pad([[4, 5, 6], [9]], width=4)
  tokens = np.array([[1, 2, 7, 0], [3, 3, 3, 3]])
  gen_mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
  b = completion_batch(prompts, mask, tokens, gen_mask, seq_len=7)
  np.testing.assert_array_equal(b["inputs"], [[4, 5, 6, 1, 2, 7, 0], [9, 3, 3, 3, 3, 0, 0]])
  np.testing.assert_array_equal(b["mask"], [[0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(b["prompt_len"], [3, 1])


def test_a_student_completion_matches_its_own_generation(single):
  """The sampled batch holds exactly what `generate` decodes for the same key and step."""
  d = single
  state = d.init_state()
  batch = d.as_prompt_batch(BATCHES[0])
  got = d.sample_batch(state, batch, step=4)
  width = SEQ + 1 - NEW
  prompts = np.asarray(batch["inputs"])[:, :width]
  gen = generate((d.student_def, state.params["student"]), prompts, np.ones_like(prompts, bool),
                 jax.random.fold_in(jax.random.key(3), 4), d.on_policy.sampling())
  for r in range(len(prompts)):
    n = int(gen.lengths_B[r])
    np.testing.assert_array_equal(got["targets"][r, width - 1 : width - 1 + n], np.asarray(gen.tokens_BxN[r, :n]))


def test_seq_kd_samples_come_from_the_teacher(single):
  d = copy.copy(single)
  d.on_policy = dataclasses.replace(single.on_policy, seq_kd=True)
  batch = d.as_prompt_batch(BATCHES[0])
  got = d.sample_batch(d.init_state(), batch, step=2)
  width = SEQ + 1 - NEW
  prompts = np.asarray(batch["inputs"])[:, :width]
  gen = generate((d.teacher_def, d.teacher_params), prompts, np.ones_like(prompts, bool),
                 jax.random.fold_in(jax.random.key(3), 2), d.on_policy.sampling())
  for r in range(len(prompts)):
    n = int(gen.lengths_B[r])
    np.testing.assert_array_equal(got["targets"][r, width - 1 : width - 1 + n], np.asarray(gen.tokens_BxN[r, :n]))


def test_multi_process_on_policy_is_refused_by_name(monkeypatch):
  import meshdistill.train.onpolicy as onpolicy

  monkeypatch.setattr(onpolicy, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"distill\.on_policy\.lambda=1\.0.*one process.*has 2"):
    _distiller(None, 1.0)


def test_prompt_files_and_pairs_report_bad_input(tmp_path):
  good = tmp_path / "p.jsonl"
  good.write_text(json.dumps({"prompt": "ab", "completion": "cd"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
  assert read_prompts(str(good)) == [{"prompt": "ab", "completion": "cd"}, {"prompt": "x", "completion": None}]
  with pytest.raises(ValueError, match="line 2 has no 'completion' field"):
    read_prompts(str(good), need_completion=True)
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no prompt"}) + "\n")
  with pytest.raises(ValueError, match="line 2 has no 'prompt' field"):
    read_prompts(str(bad))
  text = tmp_path / "p.txt"
  text.write_text("first prompt\n\nsecond\n")
  assert [r["prompt"] for r in read_prompts(str(text))] == ["first prompt", "second"]
  with pytest.raises(ValueError, match="seq_len=4"):
    pair_batch([([1, 2, 3, 4, 5], [6])], seq_len=4)
  b = pair_batch([([1, 2], [3, 4, 5]), ([9], [8])], seq_len=4)
  np.testing.assert_array_equal(b["mask"], [[0, 1, 1, 1], [1, 0, 0, 0]])


def test_on_policy_settings_are_checked_and_named():
  cfg = load_config("tiny", ["distill.on_policy.lambda=0.5", "distill.on_policy.top_p=0.9"])
  assert cfg.distill.on_policy.active and cfg.distill.on_policy.config(eos_id=2).lmbda == 0.5
  assert not load_config("tiny").distill.on_policy.active
  for override, match in (
      ("distill.on_policy.lambda=1.5", r"distill.on_policy.lambda=1.5 must be a number in \[0, 1\]"),
      ("distill.on_policy.top_p=0", r"distill.on_policy.top_p=0.0 must be a number in \(0, 1\]"),
      ("distill.on_policy.top_k=-1", r"distill.on_policy.top_k=-1 must be an integer >= 0"),
      ("distill.on_policy.max_new_tokens=40", "max_new_tokens=40 leaves no prompt"),
  ):
    with pytest.raises(ConfigError, match=match):
      load_config("tiny", ["distill.on_policy.lambda=1", override])


def test_generate_job_prints_the_teachers_greedy_completion(tmp_path, capsys):
  from meshdistill.teachers.checkpoint import save_teacher
  from meshdistill.data import ByteTokenizer

  where = [f"run.run_dir={tmp_path / 'run'}", f"pretrain.teacher={tmp_path / 'teacher'}"]
  cfg = load_config("tiny", where + ["mesh.backend=single", "mesh.data=1", "mesh.tensor=1"])
  teacher = md.init_model(cfg.teacher, seed=0)
  save_teacher(str(tmp_path / "teacher"), teacher, ByteTokenizer(), {})
  greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
  texts = jobs.generate(cfg, ["def f", "x"], model="teacher", sampling=greedy)
  tok = ByteTokenizer()
  gen = generate(teacher, *left_pad([tok.encode("def f"), tok.encode("x")]), None,
                 SamplingConfig(max_new_tokens=6, temperature=0.0, eos_id=tok.eos_id))
  want = [[t for t, m in zip(gen.tokens_BxN[r], gen.mask_BxN[r]) if m and t != tok.eos_id] for r in range(2)]
  assert texts == [tok.decode(np.asarray(w, int)) for w in want]
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    jobs.generate(cfg, ["x"], model="student", sampling=greedy)
  assert not (tmp_path / "run").exists()  # generating creates nothing in the run directory
  sets = [x for w in where + ["mesh.backend=single", "mesh.data=1", "mesh.tensor=1"] for x in ("--set", w)]
  assert cli.main(["generate", "--config", "tiny", *sets, "--model", "teacher", "--prompt", "x",
                   "--max-new-tokens", "3", "--temperature", "0"]) == 0
  assert "--- 'x'\nx" in capsys.readouterr().out  # the CLI prints each prompt and its completion
  assert not (tmp_path / "run").exists()


def test_prompt_data_masks_completions_resumes_and_holds_out_pairs(tmp_path):
  from meshdistill.data import ByteTokenizer
  from meshdistill.data.prompts import PromptData

  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"q{i}:", "completion": " a" * (i % 4)}) + "\n" for i in range(40)))
  tok = ByteTokenizer()
  data = PromptData(read_prompts(str(path), need_completion=True), tok, seq_len=12, batch_size=8, val_fraction=0.2)
  assert len(data.val_batches()) == 1 and data.stats["pairs"] == 40
  it = data.train_iterator()
  batches = [next(it) for _ in range(6)]  # more than one epoch (4 batches)
  for b in batches:
    for r in range(8):
      n = int(b["prompt_len"][r])
      assert not b["mask"][r, : n - 1].any() and b["mask"][r, n - 1] == 1
      completion = b["targets"][r][b["mask"][r] > 0]
      assert completion[-1] == tok.eos_id and tok.decode(completion).strip(" a") == ""
  resumed = data.train_iterator({"index": 5})
  np.testing.assert_array_equal(next(resumed)["inputs"], batches[5]["inputs"])
  with pytest.raises(ValueError, match="need at least batch_size=64"):
    PromptData(read_prompts(str(path), need_completion=True), tok, seq_len=12, batch_size=64)


def test_on_policy_samples_of_a_student_padded_for_the_tensor_axis_stay_in_the_vocabulary():
  """Vocabulary 10 on a 2x4 mesh is padded to 12 rows; the sampled completions the step trains on hold real ids only."""
  mesh = md.make_mesh(data=2, tensor=4)
  teacher = md.init_model(TEACHER_CFG.replace(vocab_size=10), seed=0, mesh=mesh)
  student = md.init_model(STUDENT_CFG.replace(vocab_size=10), seed=1, mesh=mesh)
  assert student.cfg.padded_vocab == 12
  d = OnPolicyDistiller(student, teacher, strategy=GKD, mesh=mesh, seed=3,
                        on_policy=OnPolicyConfig(lmbda=1.0, max_new_tokens=NEW, temperature=2.0))
  state = d.init_state()
  batch = d.as_prompt_batch(make_batch(seed=0, seq=SEQ, pad_from=None, vocab=10))
  width = SEQ + 1 - NEW
  sampled = np.concatenate([np.asarray(d.sample_batch(state, batch, step=s)["targets"])[:, width - 1:]
                            for s in range(12)])
  assert sampled.size == 12 * 8 * NEW and sampled.max() < 10, np.unique(sampled)


def test_distill_job_reads_the_data_share_from_a_teacher_cache_and_runs_the_teacher_live_on_samples(tmp_path,
                                                                                                      monkeypatch):
  """``teacher.cache`` with ``distill.on_policy`` through the `distill` job: the batches of the data's completions read
  the cache (by their rows), the generated ones run the teacher that wrote it live; a float32 cache gives the run of a
  live teacher, step by step."""
  from helpers import write_corpus

  from meshdistill.teachers import cache as tc
  from meshdistill.teachers.checkpoint import save_teacher

  corpus = write_corpus(tmp_path / "c")
  base = [f"data.source={corpus}", "data.seq_len=16", "data.val_fraction=0.25", "data.max_chars=null",
          "teacher.max_len=16", "student.max_len=16", "train.warmup=1", "train.eval_every=0", "train.log_every=1",
          "checkpoint.every=0", f"pretrain.cache_dir={tmp_path / 'cache'}", "mesh.backend=single", "mesh.data=1",
          "mesh.tensor=1", "train.steps=6", "distill.top_k=2", "distill.temperature=1.0", "distill.alpha=1.0",
          "distill.on_policy.lambda=0.5", "distill.on_policy.max_new_tokens=4"]
  cfg = load_config("tiny", base + [f"run.run_dir={tmp_path / 'live'}"])
  data = jobs.load_data(cfg)
  save_teacher(jobs.teacher_dir(cfg, data.tokenizer), md.init_model(cfg.teacher, seed=0), data.tokenizer)
  jobs.cache_teacher(cfg, str(tmp_path / "tc"), k=2, precision="float32", rows_per_shard=8)
  live = jobs.distill(cfg)

  reads = []
  rows = tc.TeacherCache.rows
  monkeypatch.setattr(tc.TeacherCache, "rows", lambda self, ids: reads.append(len(ids)) or rows(self, ids))
  cached_cfg = load_config("tiny", base + [f"run.run_dir={tmp_path / 'cached'}", f"teacher.cache={tmp_path / 'tc'}"])
  cached = jobs.distill(cached_cfg)

  def steps(run):
    lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m.get("kind") == "train" or "on_policy" in m]

  live_steps, cached_steps = steps("live"), steps("cached")
  assert len(cached_steps) == 6 and [m["on_policy"] for m in cached_steps] == [m["on_policy"] for m in live_steps]
  off = sum(1 for m in cached_steps if m["on_policy"] == 0)
  assert 0 < off < 6  # both shares ran
  assert reads == [cfg.train.batch_size] * off  # the cache was read for the data's batches only
  for a, b in zip(live_steps, cached_steps):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
  assert cached["teacher_dir"] == str(tmp_path / "tc") and cached["teacher"] is not None  # the live teacher evaluated
  np.testing.assert_allclose(cached["student"]["loss"], live["student"]["loss"], rtol=1e-5)

  # a cache written by another teacher than the one that would run live is refused, naming both settings
  other = tmp_path / "other"
  save_teacher(str(other), md.init_model(cfg.teacher, seed=1), data.tokenizer)
  with pytest.raises(ConfigError, match=r"written by another teacher.*pretrain.teacher=DIR"):
    jobs.distill(load_config("tiny", base + [f"run.run_dir={tmp_path / 'other_run'}",
                                             f"teacher.cache={tmp_path / 'tc'}", f"pretrain.teacher={other}"]))
  with pytest.raises(ConfigError, match=r"prompts_file.*teacher.cache"):
    jobs.distill(load_config("tiny", base + [f"run.run_dir={tmp_path / 'p'}", f"teacher.cache={tmp_path / 'tc'}",
                                             f"distill.on_policy.prompts_file={tmp_path / 'x.jsonl'}"]))
