"""The final evaluation of a several-teacher run: each model teacher's validation loss and the student's KL / top-1
agreement against each teacher's top-k and the combined target, against numpy references; a cache member is named
as not evaluated."""

import types

import jax
import numpy as np
import pytest
from flax import nnx
from test_multi_teacher import K, TAU, WithTopK, forward_kl_reference, two_corpora

import meshdistill as md
from meshdistill import jobs
from meshdistill.config import load_config
from meshdistill.teachers import multi
from meshdistill.teachers.cache import TeacherTopK
from meshdistill.teachers.checkpoint import save_teacher


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
  """The corpora are named by relative paths (`sets_for`): documents are keyed by them, so the validation split (and
  the corpora its batches hold) is the same in every run, not a matter of the temporary folder's name."""
  monkeypatch.chdir(tmp_path)


def sets_for(tmp_path):
  two_corpora(tmp_path)  # tmp_path/code, tmp_path/prose: the current folder's (`_in_tmp_path`)
  return ["data.corpora={python: code, prose: prose}", "data.seq_len=8",
          "data.val_fraction=0.2", "data.max_chars=null", "teacher.max_len=16", "student.max_len=16",
          f"distill.top_k={K}", f"distill.temperature={TAU}", "train.batch_size=4", "train.steps=2", "train.warmup=0",
          "train.eval_every=0", "train.eval_batches=2", "checkpoint.every=0", "mesh.backend=single", "mesh.data=1",
          "mesh.tensor=1", f"pretrain.cache_dir={tmp_path / 'cache'}", f"run.run_dir={tmp_path / 'run'}"]


def two_teachers(tmp_path, sets):
  plain = load_config("tiny", sets)
  tokenizer = jobs.load_data(plain).tokenizer
  one = md.init_model(plain.teacher, seed=0)
  graphdef, params = nnx.split(one)
  other = nnx.merge(graphdef, jax.tree.map(lambda x: 1.5 * x, params))
  return [one, other], [save_teacher(str(tmp_path / f"t{n}"), t, tokenizer) for n, t in enumerate((one, other))]


def means(student_BxTxV, topk, served, targets_logits=None):
  """KL from ``topk`` (numpy reference) and top-1 agreement, token means over ``served``."""
  ids, logp, tail = (np.asarray(x) for x in topk)
  kl = forward_kl_reference(student_BxTxV, ids, logp, tail, served, TAU).sum() / served.sum()
  agree = ((np.take_along_axis(student_BxTxV, ids[..., :1], -1)[..., 0] >= student_BxTxV.max(-1)) * served).sum()
  return kl, agree / served.sum()


def test_a_routed_run_reports_each_teacher_and_the_routed_target(tmp_path):
  sets = sets_for(tmp_path)
  models, dirs = two_teachers(tmp_path, sets)
  members = [f"{{name: {n}, source: pretrained, dir: {d}, takes: [{c}]}}"
             for n, d, c in zip("ab", dirs, ("python", "prose"))]
  cfg = load_config("tiny", [*sets, f"teachers={{combine: route, sources: [{members[0]}, {members[1]}]}}"])
  summary = jobs.distill(cfg)

  val = jobs.load_data(cfg).val_batches(max_batches=2)
  student = md.load_run(str(tmp_path / "run")).student
  inputs = np.concatenate([b["inputs"] for b in val])
  targets = np.concatenate([b["targets"] for b in val])
  mask = np.concatenate([b["mask"] for b in val]).astype(np.float64)
  domain = np.concatenate([b["domain"] for b in val])  # python (0) -> a, prose (1) -> b
  logits = np.asarray(jax.jit(lambda x: student(x).logits)(inputs), np.float64)
  topks = [TeacherTopK(m, k=K, temperature=TAU)(inputs) for m in models]
  got = summary["teachers"]
  assert [e["name"] for e in got["members"]] == ["a", "b"] and got["combine"] == "route"
  for n, (entry, model) in enumerate(zip(got["members"], models)):
    served = mask * (domain == n)[:, None]
    assert served.sum() > 0 and entry["tokens"] == served.sum()
    kl, agree = means(logits, topks[n], served)
    np.testing.assert_allclose(entry["kl"], kl, rtol=1e-5)
    np.testing.assert_allclose(entry["agreement"], agree, rtol=1e-6)
    t_logp = np.asarray(jax.nn.log_softmax(jax.jit(lambda x: model(x).logits)(inputs)), np.float64)
    ce = -(np.take_along_axis(t_logp, targets[..., None], -1)[..., 0] * served).sum() / served.sum()
    np.testing.assert_allclose(entry["loss"], ce, rtol=1e-5)
    assert entry["params"] == md.models.param_count(model)
  routed = [np.where((domain == 0)[:, None, None] if x.ndim == 3 else (domain == 0)[:, None], np.asarray(a),
                     np.asarray(b)) for a, b, x in zip(topks[0], topks[1], topks[0])]
  kl, agree = means(logits, routed, mask)
  np.testing.assert_allclose(got["target"]["kl"], kl, rtol=1e-5)
  np.testing.assert_allclose(got["target"]["agreement"], agree, rtol=1e-6)
  table = jobs.summary_table(summary)
  assert "teacher a (pretrained)" in table and "teacher b (pretrained)" in table and "routed target" in table
  assert "not evaluated" not in table and f"{got['members'][0]['loss']:.4f}" in table


def test_a_cache_member_is_named_not_evaluated_and_the_others_are(tmp_path):
  """Mixed with a cache (its top-k covers the training rows only): the model teacher is evaluated, the cache and
  the mixed target are named as not evaluated."""
  cfg = load_config("tiny", sets_for(tmp_path))
  bundle = jobs.load_data(cfg)
  teacher = md.init_model(cfg.teacher, seed=0)
  student = md.init_model(cfg.student, seed=1)
  program = TeacherTopK(teacher, k=K, temperature=TAU)
  data = multi.MultiTeacherData(bundle, [multi.FromBatches(WithTopK(bundle, program)), multi.Live(program)], k=K,
                                route=None, weights=[1.0, 1.0])
  graphdef, params = nnx.split(student)
  runner = types.SimpleNamespace(layout=types.SimpleNamespace(eval_mesh=None), student_def=graphdef)
  members = [types.SimpleNamespace(name="cached", source="cache"), types.SimpleNamespace(name="live", source="hf")]
  val = bundle.val_batches(max_batches=1)
  got = multi.evaluate_teachers(runner, params, data, val, members, combine_name="mix", temperature=TAU)
  cached, live = got["members"]
  assert cached["kl"] is None and cached["loss"] is None and "cache holds" in cached["note"]
  assert got["target"] is None
  kl, agree = means(np.asarray(student(val[0]["inputs"]).logits, np.float64), program(val[0]["inputs"]),
                    val[0]["mask"].astype(np.float64))
  np.testing.assert_allclose(live["kl"], kl, rtol=1e-5)
  assert live["loss"] > 0 and live["params"] == md.models.param_count(teacher)
  summary = {"teachers": got, "student": {"params": 1, "loss": 1.0, "ppl": 2.7}, "teacher": None}
  table = multi.summary_table(summary)
  assert "cached: not evaluated (a cache holds the top-k of the training rows only)" in table
  assert "mixed target: not evaluated" in table and "live (" in table
