"""On-policy distillation on a task with checkable answers: the arithmetic task and its scorer, the sampled-token
loss (its gradient against plain REINFORCE, top-k teachers), its step on 2x4 against one device, task accuracy
by generation on every layout, and lambda mixing whose off-policy share reads an offline cache."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, assert_sgd_steps_agree, assert_trees_close, make_batch

import meshdistill as md
from meshdistill import losses
from meshdistill.data import ByteTokenizer
from meshdistill.data.prompts import PromptData
from meshdistill.data.tasks import ArithmeticTask, ChainTask, parse_task
from meshdistill.train.loop.task_eval import complete, task_accuracy
from meshdistill.models import ModelOutput
from meshdistill.strategies import LogitKD, SampledTokenKD
from meshdistill.teachers.cache import TeacherCache, TeacherTopK, TopKTeacher, teacher_identity, write_cache
from meshdistill.train.onpolicy import OnPolicyConfig, OnPolicyDistiller


# ----------------------------------------------------------------------------------------------- the task
def test_scorer_on_hand_made_answers():
  task = ArithmeticTask(digits=3, op="+")  # 47 + 985 = 1032, every number least significant digit first
  assert (task.prompt(47, 985), task.answer(47, 985)) == ("740+589=", "2301")
  assert task.score("740+589=", "2301")
  assert task.score("740+589=", " 2301 and more words")  # the final answer: the leading digits
  assert not task.score("740+589=", "2300")  # a wrong digit
  assert not task.score("740+589=", "23010")  # an extra digit
  assert not task.score("740+589=", "230")  # a missing one
  assert not task.score("740+589=", "")
  fwd = ArithmeticTask(digits=2, op="*", reverse=False)  # 12 * 34 = 408, fixed width 4
  assert (fwd.prompt(12, 34), fwd.answer(12, 34)) == ("12*34=", "0408") and fwd.score("12*34=", "0408")
  with pytest.raises(ValueError, match="not a prompt of this task"):
    task.score("12*34=", "0408")


def test_train_and_held_out_splits_never_share_a_problem():
  task = ArithmeticTask(digits=2, held_out=0.2)
  train, held = task.problems("train", 3000, seed=1), task.problems("held_out", 600, seed=2)
  assert len(set(train)) == 3000 and len(set(held)) == 600 and not set(train) & set(held)
  assert task.problems("held_out", 600, seed=2) == held  # reproducible
  assert all(task.split_of(a, b) for a, b in held) and not any(task.split_of(a, b) for a, b in train)
  assert parse_task("mul3") == ArithmeticTask(digits=3, op="*") and not parse_task("add2-fwd").reverse
  with pytest.raises(ValueError, match="held_out split holds about"):
    task.problems("held_out", 5000)
  with pytest.raises(ValueError, match="task digits=0"):
    ArithmeticTask(digits=0)
  with pytest.raises(ValueError, match="add<digits>"):
    parse_task("sub3")


def test_chain_task_answers_are_running_sums_and_one_early_error_ruins_the_rest():
  task = parse_task("chain8")
  assert task == ChainTask(length=8) and (task.prompt_len, task.answer_width) == (9, 8)
  assert (task.prompt(38205716), task.answer(38205716)) == ("38205716=", "31338562")
  assert task.prompt(5) == "00000005=" and task.answer(5) == "00000005"
  assert task.score("38205716=", "31338562") and task.score("38205716=", "31338562 more")
  # a wrong first digit, continued the short way (previous digit + prompt digit), makes every later digit wrong
  wrong, s = [], 4
  for d in "8205716":
    s = (s + int(d)) % 10
    wrong.append(str(s))
  continued = "4" + "".join(wrong)
  assert all(a != b for a, b in zip(continued, "31338562")) and not task.score("38205716=", continued)
  assert not task.score("38205716=", "3133856") and not task.score("38205716=", "313385620")
  train, held = task.problems("train", 2000, seed=1), task.problems("held_out", 300, seed=2)
  assert len(set(train)) == 2000 and len(set(held)) == 300 and not set(train) & set(held)
  assert all(task.score(r["prompt"], r["completion"]) for r in task.rows("held_out", 20))
  with pytest.raises(ValueError, match="not a prompt of this task"):
    task.score("740+589=", "2301")
  with pytest.raises(ValueError, match="length=1"):
    ChainTask(length=1)


# ---------------------------------------------------------------------------------- the sampled-token loss
def _reinforce_reference(student_TxV, teacher_TxV, targets_T, mask_T, discount):
  """Plain REINFORCE written out: rewards as numbers, returns by a Python loop, loss -sum A_t log p_s(y_t)."""
  logp_s = np.asarray(jax.nn.log_softmax(student_TxV))[np.arange(len(targets_T)), targets_T]
  logp_t = np.asarray(jax.nn.log_softmax(teacher_TxV))[np.arange(len(targets_T)), targets_T]
  r = np.where(mask_T, logp_t - logp_s, 0.0)
  A, running = np.zeros_like(r), 0.0
  for t in reversed(range(len(r))):
    if mask_T[t]:
      running = r[t] + discount * running
      A[t] = running

  def loss(s):
    return -jnp.sum(jnp.asarray(A * mask_T) * jax.nn.log_softmax(s)[jnp.arange(len(targets_T)), targets_T])

  return jax.grad(loss)(student_TxV), float(np.sum(A * mask_T))


@pytest.mark.parametrize("discount", [0.0, 0.7])
def test_sampled_token_gradient_equals_plain_reinforce(discount):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  T, V = 7, 11
  student, teacher = jax.random.normal(k1, (T, V)), 2 * jax.random.normal(k2, (T, V))
  targets = jax.random.randint(k3, (T,), 0, V)
  mask = np.array([0, 0, 1, 1, 1, 1, 0], np.float32)  # prompt, completion, padding
  strategy = SampledTokenKD(discount=discount)

  def loss(s):
    out = strategy.per_sequence({}, ModelOutput(logits=s), ModelOutput(logits=teacher), targets, jnp.asarray(mask), 0)
    return out["loss"], out

  (_, out), grad = jax.value_and_grad(loss, has_aux=True)(student)
  want_grad, want_adv = _reinforce_reference(student, teacher, np.asarray(targets), mask, discount)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["advantage"], want_adv, rtol=1e-5)
  assert np.all(np.asarray(grad)[mask == 0] == 0)  # masked tokens never count
  # the teacher only supplies a number: no gradient reaches it
  t_grad = jax.grad(lambda t: strategy.per_sequence({}, ModelOutput(logits=student), ModelOutput(logits=t), targets,
                                                    jnp.asarray(mask), 0)["loss"])(teacher)
  assert not np.any(np.asarray(t_grad))


def test_a_top_k_teacher_gives_the_sampled_tokens_log_prob_or_the_spread_tail():
  T, V, k = 6, 16, 4
  teacher = jax.random.normal(jax.random.key(1), (T, V)) * 3
  ids, logprobs = losses.teacher_topk(teacher, k)
  tail = losses.topk_tail(teacher, ids)
  logp = np.asarray(jax.nn.log_softmax(teacher))
  order = np.argsort(-logp, axis=-1)
  targets = jnp.asarray([order[0, 0], order[1, 3], order[2, 4], order[3, 15], order[4, 1], order[5, 9]])
  mask = jnp.ones((T,))
  live = SampledTokenKD().per_sequence({}, ModelOutput(logits=jnp.zeros((T, V))), ModelOutput(logits=teacher),
                                       targets, mask, 0)
  topk = SampledTokenKD().per_sequence({}, ModelOutput(logits=jnp.zeros((T, V))), losses.TopK(ids, logprobs, tail),
                                       targets, mask, 0)
  inside = np.array([True, True, False, False, True, False])
  assert float(topk["in_topk"]) == inside.sum() and float(live["in_topk"]) == T
  want = np.where(inside, logp[np.arange(T), np.asarray(targets)], np.asarray(tail) - np.log(V - k))
  np.testing.assert_allclose(float(topk["teacher_ce"]), -want.sum(), rtol=1e-5)
  floored = SampledTokenKD(floor=-0.5).per_sequence({}, ModelOutput(logits=jnp.zeros((T, V))),
                                                    ModelOutput(logits=teacher), targets, mask, 0)
  np.testing.assert_allclose(float(floored["teacher_ce"]), np.sum(np.minimum(-logp[np.arange(T), np.asarray(targets)],
                                                                             0.5)), rtol=1e-5)


def test_sampled_token_settings_are_checked_and_it_needs_a_temperature_one_top_k():
  with pytest.raises(ValueError, match="discount=1.5"):
    SampledTokenKD(discount=1.5)
  with pytest.raises(ValueError, match="floor=0"):
    SampledTokenKD(floor=0)
  cache = TopKTeacher(cfg=TEACHER_CFG, k=4, temperature=2.0, vocab=64, source="a cache")
  with pytest.raises(ValueError, match="temperature 1"):
    cache.check_strategy(SampledTokenKD())
  assert md.strategies.get("sampled_token") is SampledTokenKD


# ------------------------------------------------------------------------------------------- layouts
SEQ, NEW = 12, 5


def _sampled(mesh):
  teacher = md.init_model(TEACHER_CFG, seed=0, mesh=mesh)
  student = md.init_model(STUDENT_CFG, seed=1, mesh=mesh)
  on = OnPolicyConfig(lmbda=1.0, max_new_tokens=NEW, temperature=1.0, eos_id=7)
  # plain SGD: the layouts' parameters after a step then compare their gradients (`assert_sgd_steps_agree`)
  return OnPolicyDistiller(student, teacher, strategy=SampledTokenKD(discount=0.5), on_policy=on, mesh=mesh, seed=3,
                           optimizer=optax.sgd(1.0))


def test_sampled_token_steps_on_2x4_equal_one_device():
  """The layouts agree on the loss and metrics of each step, the gradients (a plain SGD step's parameter change,
  and its norm) and so the samples of the next step."""
  batches = [make_batch(seed=s, seq=SEQ, pad_from=None) for s in range(2)]
  metrics = assert_sgd_steps_agree(_sampled(None), _sampled(md.make_mesh(data=2, tensor=4)), batches,
                                   ("loss", "reverse_kl", "teacher_ce", "advantage", "sample_len", "tokens"))
  assert all(m["on_policy"] == 1 for m in metrics) and metrics[0]["reverse_kl"] > 0


# ----------------------------------------------------------------------------- the task's data and cache
TASK = ArithmeticTask(digits=2)
TOK = ByteTokenizer()
TASK_SEQ = TASK.prompt_len + TASK.answer_width  # prompt + answer + EOS = TASK_SEQ + 1 tokens
T_CFG = TEACHER_CFG.replace(vocab_size=TOK.vocab_size)
S_CFG = STUDENT_CFG.replace(vocab_size=TOK.vocab_size)
K = 8


@pytest.fixture(scope="module")
def task_data():
  return PromptData(TASK.rows("train", 32), TOK, seq_len=TASK_SEQ, batch_size=8, val_rows=TASK.rows("held_out", 8))


@pytest.fixture(scope="module")
def task_cache(task_data, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("cache"))
  teacher = md.init_model(T_CFG, seed=0)
  write_cache(TeacherTopK(teacher, k=K, temperature=1.0), task_data.train_rows(), out,
              identity={"teacher": teacher_identity(teacher), "data": {}}, precision="float32", rows_per_shard=16)
  return TeacherCache(out)


def _task_distiller(strategy, lmbda, cache=None, mesh=None):
  on = OnPolicyConfig(lmbda=lmbda, max_new_tokens=TASK.answer_width + 1, temperature=1.0, eos_id=TOK.eos_id,
                      pad_id=TOK.pad_id)
  return OnPolicyDistiller(md.init_model(S_CFG, seed=1, mesh=mesh), md.init_model(T_CFG, seed=0, mesh=mesh),
                           strategy=strategy, on_policy=on, cache=cache, mesh=mesh, seed=5)


def _run_task(d, data, steps=4):
  state, it, out = d.init_state(), data.train_iterator(row_ids=True), []
  for _ in range(steps):
    state, m = d.step(state, next(it))
    out.append(jax.device_get(m))
  return jax.device_get(d.unreplicate(state.params)), out


def test_lambda_mixing_with_the_cache_equals_the_live_teacher(task_data, task_cache):
  gkd = LogitKD(temperature=1.0, alpha=1.0, top_k=K)
  live_params, live = _run_task(_task_distiller(gkd, 0.5), task_data)
  cached_params, cached = _run_task(_task_distiller(gkd, 0.5, cache=task_cache), task_data)
  assert sorted({float(m["on_policy"]) for m in live}) == [0.0, 1.0]  # both shares ran
  for a, b in zip(live, cached):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
  assert_trees_close(cached_params, live_params, rtol=1e-5, atol=1e-6)


def test_sampled_token_trains_from_a_cache_on_the_off_policy_share(task_data, task_cache):
  params, metrics = _run_task(_task_distiller(SampledTokenKD(), 0.5, cache=task_cache), task_data)
  off = [m for m in metrics if m["on_policy"] == 0]
  live = [m for m in metrics if m["on_policy"] == 1]
  assert off and live and all(np.isfinite(m["loss"]) for m in metrics)
  assert all(m["in_topk"] == 1 for m in live)  # the live teacher knows every token's log-probability
  assert all(m["in_topk"] < 1 for m in off)  # the cache's top-8 of 264 misses data tokens: the spread tail serves
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))
  with pytest.raises(ValueError, match="temperature"):
    _task_distiller(LogitKD(temperature=2.0, alpha=1.0, top_k=K), 0.5, cache=task_cache)


def test_task_accuracy_is_the_scorers_on_every_layout():
  model = md.init_model(S_CFG, seed=2)
  prompts = [r["prompt"] for r in TASK.rows("held_out", 9)]  # 9: padded to a multiple of data=2 on the mesh
  texts = complete(model, prompts, TOK, max_new_tokens=TASK.answer_width + 1)
  got = task_accuracy(model, TASK, prompts, TOK, samples=3, seed=4)
  assert got["greedy"] == np.mean([TASK.score(p, c) for p, c in zip(prompts, texts)])
  assert 0 <= got["sampled"] <= got["pass@3"] <= 1
  mesh = md.make_mesh(data=2, tensor=4)  # the same text on the mesh: the same numbers (greedy here, one program)
  on_mesh = task_accuracy(md.init_model(S_CFG, seed=2, mesh=mesh), TASK, prompts, TOK, mesh=mesh)
  assert on_mesh == {"greedy": got["greedy"]}
  # a model that writes the right answers scores 1: the scorer reads what generation wrote
  assert all(TASK.score(r["prompt"], r["completion"]) for r in TASK.rows("held_out", 9))


def test_eval_task_command_scores_a_runs_model(tmp_path, capsys):
  from meshdistill import cli, jobs
  from meshdistill.config import load_config
  from meshdistill.teachers.checkpoint import save_teacher

  where = [f"run.run_dir={tmp_path / 'run'}", f"pretrain.teacher={tmp_path / 'teacher'}", "mesh.backend=single",
           "mesh.data=1", "mesh.tensor=1"]
  cfg = load_config("tiny", where)
  teacher = md.init_model(cfg.teacher, seed=0)
  save_teacher(str(tmp_path / "teacher"), teacher, TOK, {})
  got = jobs.evaluate_task(cfg, "add2", model="teacher", prompts=8)
  prompts = [r["prompt"] for r in TASK.rows("held_out", 8)]
  assert got["greedy"] == task_accuracy(teacher, TASK, prompts, TOK)["greedy"]
  sets = [x for w in where for x in ("--set", w)]
  assert cli.main(["eval", "--config", "tiny", *sets, "--task", "add2", "--model", "teacher", "--prompts", "8"]) == 0
  assert f"task add2 (8 held-out problems, teacher): greedy accuracy {got['greedy']:.4f}" in capsys.readouterr().out
  with pytest.raises(ValueError, match="add<digits>"):
    jobs.evaluate_task(cfg, "sub2", model="teacher")
  assert not (tmp_path / "run").exists()  # evaluating creates nothing in the run directory
