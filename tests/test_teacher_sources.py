"""Teacher sources behind one contract (`meshdistill.teachers.kinds`): ``teacher.source`` chooses one, each source
checks its own settings, strategies are accepted by their declared capabilities, and a new source is one new file."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import meshdistill as md
from helpers import STUDENT_CFG, TEACHER_CFG, write_corpus
from meshdistill import jobs
from meshdistill.config import ConfigError, load_config
from meshdistill.jobs._training import _cache_safeguards
from meshdistill.models.generate import SamplingConfig
from meshdistill.strategies import ChunkedLogitKD, LogitKD
from meshdistill.teachers import kinds
from meshdistill.teachers.cache import TopKTeacher


# --------------------------------------------------------------------------- the config
def test_the_keys_of_a_config_without_teacher_source_choose_the_source_it_always_meant():
  assert load_config("tiny").models.teacher_kind == "pretrained"
  assert load_config("tiny", ["teacher.cache=some/cache"]).models.teacher_kind == "cache"
  assert load_config("tiny", ["teacher.devices={data: 1, tensor: 4}"]).models.teacher_kind == "submesh"
  assert load_config("tiny", ["teacher.quantize=int8"]).models.teacher_kind == "pretrained"
  assert "source" not in load_config("tiny").to_dict()["teacher"]  # configs that named none are written as they were
  cfg = load_config("tiny", ["teacher.source=cache", "teacher.cache=some/cache"])
  assert cfg.to_dict()["teacher"]["source"] == "cache" and type(kinds.for_config(cfg)).__name__ == "Cached"


@pytest.mark.parametrize("sets, message", [
    (["teacher.source=cache", "teacher.cache=x", "teacher.devices={data: 1, tensor: 4}"],
     r"teacher.devices is not a setting of teacher.source=cache; its settings: \['teacher.cache', 'teacher.hf'\] "
     r"\(teacher.devices belongs to teacher.source=submesh\)"),
    (["teacher.source=hf", "teacher.hf=x", "teacher.cache=x"],
     r"teacher.cache is not a setting of teacher.source=hf; its settings: \['teacher.hf', 'teacher.quantize'\]"),
    (["teacher.cache=x", "teacher.quantize=int8"],  # an older spelling: the cache's keys are checked the same way
     r"teacher.quantize and teacher.cache exclude each other: teacher.quantize is not a setting of "
     r"teacher.source=cache; its settings: \['teacher.cache', 'teacher.hf'\]"),
    (["teacher.source=none", "teacher.quantize=int8"], r"teacher.quantize is not a setting of teacher.source=none; "
                                                       r"its settings: \[\]"),
    (["teacher.source=cache"], r"teacher.source=cache needs teacher.cache"),
    (["teacher.source=oracle"], r"teacher.source='oracle' is not a teacher source; choose one of \['cache', 'hf', "
                                r"'none', 'pretrained', 'remote', 'submesh'\]"),
    (["teacher.source=remote"], r"teacher.source=remote needs teacher.url"),
    (["teacher.source=remote", "teacher.url=localhost:8000"], r"teacher.url='localhost:8000' must be the server's"),
    (["teacher.source=remote", "teacher.url=http://h:1", "teacher.devices={data: 1, tensor: 4}"],
     r"teacher.devices is not a setting of teacher.source=remote"),
    (["teacher.devices={data: 1, tensor: 4}", "teacher.cache=x"], r"teacher.cache and teacher.devices exclude each "
                                                                  r"other.*choose with teacher.source"),
    (["teacher.source=submesh", "teacher.devices={data: 1}"], r"teacher.devices=\{'data': 1\} must be the teacher's"),
])
def test_a_teacher_setting_the_chosen_source_does_not_have_is_an_error_naming_both(sets, message):
  with pytest.raises(ConfigError, match=message):
    load_config("tiny", sets)


# --------------------------------------------------------------------------- strategies by their capabilities
@pytest.mark.parametrize("sets, message", [
    (["distill.kind=chunked_logit_kd"], r"teacher.devices sends the student the teacher's top-k only .*but "
                                        r"distill.kind=chunked_logit_kd needs more: set distill.kind to one of "
                                        r"\[.*'logit_kd'.*\] with distill.top_k"),
    (["distill.kind=attention_transfer"], r"distill.kind=attention_transfer needs more"),
])
def test_a_top_k_source_refuses_a_strategy_that_needs_the_full_head_from_the_config_alone(sets, message):
  cfg = load_config("tiny", ["teacher.devices={data: 1, tensor: 4}", "mesh.data=2", "mesh.tensor=2", *sets])
  assert ChunkedLogitKD.needs_head and not ChunkedLogitKD.accepts_topk  # what the check reads
  with pytest.raises(ConfigError, match=message):
    kinds.for_config(cfg).check()
  kinds.for_config(load_config("tiny", ["teacher.devices={data: 1, tensor: 4}", "mesh.data=2", "mesh.tensor=2",
                                        "distill.top_k=4"])).check()  # logit_kd with a top-k: served


def test_no_teacher_serves_only_strategies_that_declare_they_need_none():
  with pytest.raises(ConfigError, match=r"teacher.source=none gives no teacher, but distill.kind=logit_kd needs one"):
    kinds.for_config(load_config("tiny", ["teacher.source=none"])).check()
  kinds.for_config(load_config("tiny", ["teacher.source=none", "distill.kind=hard_label_ce"])).check()
  with pytest.raises(ValueError, match=r"needs a strategy that uses none .*; LogitKD needs a teacher"):
    md.Distiller(md.init_model(STUDENT_CFG, seed=0), None, strategy=LogitKD())
  alone = md.Distiller(md.init_model(STUDENT_CFG, seed=0), None, strategy=md.strategies.HardLabelCE())
  # the divergence guard's logit-MSE fallback needs a teacher's logits: without one it only restores
  assert _cache_safeguards({"fallback": LogitKD()}, alone)["fallback"] is alone.strategy


def test_a_top_k_teacher_reads_capabilities_not_the_strategy_class():
  """A strategy that declares ``accepts_topk`` trains from a top-k teacher whatever its class (before: only
  ``type(s) is LogitKD``); one that needs the LM head is refused by name."""
  @md.strategies.register("test_topk_kd")
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class TopKOwn(LogitKD):  # pylint: disable=unused-variable
    pass

  spec = TopKTeacher(cfg=TEACHER_CFG, k=4, temperature=2.0, vocab=TEACHER_CFG.vocab_size, source="teacher.cache=c")
  spec.check_strategy(TopKOwn(top_k=4, temperature=2.0))
  spec.check_strategy(TopKOwn(top_k=2, temperature=2.0))
  with pytest.raises(ValueError, match=r"teacher.cache=c gives the teacher's top-4 tokens only, but strategy "
                                       r"ChunkedLogitKD needs a live teacher"):
    spec.check_strategy(ChunkedLogitKD())
  with pytest.raises(ValueError, match=r"but TopKOwn.top_k=5"):
    spec.check_strategy(TopKOwn(top_k=5, temperature=2.0))


# --------------------------------------------------------------------------- no teacher, end to end
def test_distill_with_no_teacher_trains_the_student_on_the_data_alone(tmp_path):
  """teacher.source=none end to end: distil, then evaluate and generate with the student alone; the teacher is
  refused by name (generate --model teacher, cache-teacher), never pretrained."""
  corpus = write_corpus(tmp_path / "c")
  cfg = load_config("tiny", [
      f"data.source={corpus}", "data.seq_len=16", "data.val_fraction=0.25", "data.max_chars=null",
      "teacher.max_len=16", "student.max_len=16", "train.warmup=1", "train.eval_every=0", "train.log_every=1",
      "checkpoint.every=0", "mesh.backend=single", "mesh.data=1", "mesh.tensor=1", "train.steps=2",
      f"pretrain.cache_dir={tmp_path / 'cache'}", f"run.run_dir={tmp_path / 'run'}",
      "teacher.source=none", "distill.kind=hard_label_ce"])
  summary = jobs.distill(cfg)
  assert summary["teacher"] is None and summary["teacher_dir"] is None and summary["step"] == 2
  assert not (tmp_path / "cache").exists()  # no teacher was pretrained
  assert json.loads((tmp_path / "run" / "summary.json").read_text())["student"]["loss"] == summary["student"]["loss"]
  assert jobs.summary_table(summary).endswith("(no teacher: the student alone)")
  # the jobs after training go through the source: the student alone, the teacher refused by name
  evaluated = jobs.evaluate(cfg)
  assert evaluated["teacher"] is None and evaluated["step"] == 2
  assert evaluated["student"]["loss"] == pytest.approx(summary["student"]["loss"], rel=1e-5)
  assert len(jobs.generate(cfg, ["ab"], sampling=SamplingConfig(max_new_tokens=2))) == 1
  no_model = r"teacher.source=none gives no teacher: this run has no teacher model to evaluate or generate with"
  with pytest.raises(kinds.NoTeacherModel, match=no_model):
    jobs.generate(cfg, ["ab"], model="teacher")
  with pytest.raises(ConfigError, match=r"cache-teacher writes the top-k of the run's teacher, but teacher.source="
                                        r"none gives no teacher"):
    jobs.cache_teacher(cfg, str(tmp_path / "topk"))
  assert not (tmp_path / "topk").exists() and not (tmp_path / "cache").exists()
  cached = load_config("tiny", ["teacher.source=cache", f"teacher.cache={tmp_path / 'topk'}"])
  with pytest.raises(kinds.NoTeacherModel, match=r"teacher.source=cache gives the teacher's top-k only"):
    jobs.run_teacher(cached, {"teacher_dir": str(tmp_path / "topk")}, None, None)


# --------------------------------------------------------------------------- the recipe: one new module
def test_a_new_teacher_source_is_one_new_module(tmp_path):
  """Copy the package, add one file to teachers/kinds/, and choose the source from a config: its own setting is
  checked by its own class, a setting of another source beside it is refused, and every job that takes a teacher
  runs it: distill (prepared, and as the model a teacher of its own tokenizer or a cache runs), serve-teacher and a
  member of several teachers."""
  src = os.path.dirname(os.path.dirname(os.path.abspath(md.__file__)))
  shutil.copytree(os.path.join(src, "meshdistill"), tmp_path / "meshdistill",
                  ignore=shutil.ignore_patterns("__pycache__"))
  (tmp_path / "meshdistill" / "teachers" / "kinds" / "seeded.py").write_text(textwrap.dedent('''
      from meshdistill.core.typed_yaml import ConfigError
      from meshdistill.models import init_model
      from meshdistill.teachers.kinds._base import ModelSource, option, register

      @register
      class Seeded(ModelSource):
        """a fresh teacher of the configured shape, e.g. teacher.seed: 3"""

        name = "seeded"
        settings = ("seed",)
        required = ("seed",)

        @classmethod
        def check_settings(cls, values):
          if not isinstance(values["seed"], int) or values["seed"] < 0:
            raise ConfigError(f"teacher.seed={values['seed']!r} must be an integer >= 0")

        def model(self, data, mesh, services):
          seed = option(self.cfg, "seed")
          services.report(f"teacher: seeded {seed}")
          return init_model(self.cfg.teacher, seed=seed, mesh=mesh), f"seeded:{seed}"
  '''))
  probe = textwrap.dedent('''
      import jax
      from flax import nnx
      from meshdistill import jobs
      from meshdistill.config import ConfigError, dump_config, load_config
      from meshdistill.models import init_model
      from meshdistill.teachers import kinds

      cfg = load_config("tiny", ["teacher.source=seeded", "teacher.seed=3"])
      assert type(kinds.for_config(cfg)).__name__ == "Seeded" and cfg.to_dict()["teacher"]["seed"] == 3
      lines = []
      got = jobs.prepare_teacher(cfg, None, None, None, report=lines.append)
      assert got.identity == "seeded:3" and lines == ["teacher: seeded 3"], (got.identity, lines)
      want = init_model(cfg.teacher, seed=3)
      assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), nnx.state(got.teacher),
                                              nnx.state(want))))
      lines.clear()
      # the model cache-teacher and a teacher of its own tokenizer (data.teacher_tokenizer) run
      model, identity = jobs.obtain_teacher(cfg, None, None, report=lines.append)
      assert identity == "seeded:3" and lines == ["teacher: seeded 3"], (identity, lines)
      import io
      said = io.StringIO()
      app, batcher, served = jobs.build_server(cfg, jobs.ServeSettings(k=4, warm_up=False), stream=said)
      batcher.close()
      assert "teacher: seeded 3" in said.getvalue() and served["k"] == 4, said.getvalue()
      corpora = "{a: CORPUS_DIR, b: CORPUS_DIR}"
      members = [f"{{name: {n}, source: seeded, seed: {seed}, takes: [{c}]}}" for n, seed, c in (("s", 3, "a"),
                                                                                                ("t", 4, "b"))]
      several = load_config("tiny", [f"data.corpora={corpora}", "data.max_chars=null", "distill.top_k=4",
                                     "distill.temperature=1.0", f"teachers={{sources: [{', '.join(members)}]}}"])
      lines.clear()
      mesh = jobs.build_mesh(several)
      got = jobs.prepare_teacher(several, jobs.load_data(several, mesh=mesh), mesh, None, report=lines.append)
      assert "teacher: seeded 3" in lines and "teacher: seeded 4" in lines, lines
      assert "seeded:3" in got.identity and "seeded:4" in got.identity, got.identity
      for sets in (["teacher.source=seeded", "teacher.seed=-1"],
                   ["teacher.source=hf", "teacher.hf=x", "teacher.seed=3"]):
        try:
          load_config("tiny", sets)
        except ConfigError as e:
          print(e)
        else:
          raise SystemExit(f"{sets} was accepted")
  ''')
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for n in range(6):
    (corpus / f"d{n}.txt").write_text(f"def f{n}(x):\n  return x + {n}\n" * 40)
  probe = probe.replace("CORPUS_DIR", str(corpus))
  env = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr
  assert "teacher.seed=-1 must be an integer >= 0" in run.stdout
  assert ("teacher.seed is not a setting of teacher.source=hf; its settings: ['teacher.hf', 'teacher.quantize'] "
          "(teacher.seed belongs to teacher.source=seeded)") in run.stdout
