"""The distill job is composed, not branched: its teacher is a `meshdistill.teachers.kinds.Source` (every teacher
source, and several teachers combined) and its data a `meshdistill.data.TrainingData` (every kind of bundle), each a
Protocol the job calls without asking which kind it has; a wrapped bundle names what it takes from the bundle it
wraps (no ``__getattr__`` forwarding); a strategy's capabilities are asked, never its kind name, in the jobs and the
config; and the config's keys are read in the config and the jobs only, never in the strategies or the layouts.

The three source rules are read from the source as `test_imports` reads it (nothing of the package is imported to
find them), each finder first shown to find what it looks for in a small package written for it.
"""

import ast
import dataclasses
import json
import sys
import types

import numpy as np
import pytest
from helpers import write_corpus
from test_imports import PACKAGE, modules
from test_layers import _write_package

from meshdistill import data as data_lib
from meshdistill import jobs, strategies
from meshdistill.config import Config, load_config
from meshdistill.data.prompts import PromptData
from meshdistill.teachers import cache as tc
from meshdistill.teachers import kinds, multi
from meshdistill.teachers.kinds.remote import RemoteTeacherData
from meshdistill.teachers.mesh import TeacherMeshData

# The packages that read the config's keys, and those handed typed settings and explicit arguments instead.
READ_CONFIG = ("config", "jobs")
HANDED_SETTINGS = ("strategies", "parallel")
CONFIG_NAMES = ("cfg", "config")  # what a config object is called where one is read


def _in_order(found: list[str]) -> list[str]:
  """``module:line ...`` entries sorted by module, then line."""
  def key(entry):
    where = entry.split(" ", 1)[0]
    module, line = where.rsplit(":", 1)
    return module, int(line), entry
  return sorted(found, key=key)


def _package_modules(packages):
  for module, path in modules().items():
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in packages:
      yield module, path, ast.parse(path.read_text(encoding="utf-8"), str(path))


# --------------------------------------------------------------------------- the finders
def attribute_forwards() -> list[str]:
  """``module:line`` of every ``__getattr__`` but a package ``__init__``'s module-level one (its lazy public names,
  PEP 562): a class's forwards attribute reads to something else, and a plain module has no lazy face."""
  out = []
  for module, path in modules().items():
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
      if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
        if id(node) in top and path.name == "__init__.py":
          continue
        out.append(f"{module}:{node.lineno}")
  return _in_order(out)


def _strings(node) -> list[str]:
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return [node.value]
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return [s for e in node.elts for s in _strings(e)]
  return []


def kind_name_comparisons(names, packages=READ_CONFIG) -> list[str]:
  """``module:line compares 'name'`` for every comparison in ``packages`` with a strategy's registered name (one of
  ``names``) on either side, alone or in a tuple / list / set: a capability the strategy declares is asked instead."""
  out = []
  for module, _, tree in _package_modules(packages):
    for node in ast.walk(tree):
      if isinstance(node, ast.Compare):
        for s in (s for side in (node.left, *node.comparators) for s in _strings(side) if s in names):
          out.append(f"{module}:{node.lineno} compares {s!r}")
  return _in_order(out)


def _receiver(node) -> str | None:
  """The last name of ``node`` (``cfg`` of ``self.cfg``), or None."""
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    return node.attr
  return None


def _first_string(node) -> str | None:
  found = _strings(node)
  return found[0] if found else None


def config_key_reads(sections, keys, packages=HANDED_SETTINGS) -> list[str]:
  """``module:line reads KEY`` for every read of a config key in ``packages``: a section of a config object
  (``cfg.train``; a config object is a name in `CONFIG_NAMES`) or anything looked up in one (``config["mesh"]``,
  ``cfg.get("distill")``, ``getattr(cfg, "data")``), and a dotted key of ``keys`` looked up in anything
  (``settings["train.batch_size"]``, ``x.get("mesh.data")``). ``sections``: the config's sections."""
  out = []
  for module, _, tree in _package_modules(packages):
    for node in ast.walk(tree):
      on, key = None, None
      if isinstance(node, ast.Attribute) and node.attr in sections:
        on, key = node.value, node.attr
      elif isinstance(node, ast.Subscript):
        on, key = node.value, _first_string(node.slice)
      elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        on, key = node.func.value, _first_string(node.args[0]) if node.args else None
      elif isinstance(node, ast.Call) and _receiver(node.func) == "getattr" and len(node.args) > 1:
        on, key = node.args[0], _first_string(node.args[1])
      if key is not None and (key in keys or _receiver(on) in CONFIG_NAMES):
        out.append(f"{module}:{node.lineno} reads {key}")
  return _in_order(out)


def _flat(d: dict, prefix: str = "") -> set[str]:
  out = set()
  for k, v in d.items():
    out.add(f"{prefix}{k}")
    if isinstance(v, dict):
      out |= _flat(v, f"{prefix}{k}.")
  return out


def config_sections() -> set[str]:
  return {f.name for f in dataclasses.fields(Config)}


def config_keys() -> set[str]:
  """Every dotted key of the main job's config (``train.batch_size``, ``distill.on_policy.lambda`` ...)."""
  return {k for k in _flat(Config().to_dict()) if "." in k}


def test_the_finders_find_forwards_kind_names_and_config_reads_and_leave_the_rest(tmp_path, monkeypatch):
  import test_imports

  _write_package(tmp_path, {
      "__init__.py": "def __getattr__(name):\n  return name\n",  # the package's lazy public face: allowed
      "jobs/__init__.py": "def __getattr__(name):\n  return name\n",  # a package's lazy face too
      "jobs/run.py": ("class Wrap:\n  def __getattr__(self, name):\n    return getattr(self.inner, name)\n"
                      "def f(cfg, kind):\n  if kind == 'preference' or kind in ('uld', 'x'):\n    return cfg.train\n"
                      "  return kind != 'other'\n"),
      "jobs/plain.py": "def __getattr__(name):\n  return name\n",  # a module that is no package's face
      "strategies/__init__.py": "",
      "strategies/s.py": ("def f(cfg, settings, params, mesh):\n  a = cfg.train.steps\n  b = settings['mesh.data']\n"
                          "  c = getattr(self_cfg, 'x')\n  d = params['student']\n  e = mesh.shape['data']\n"
                          "  g = settings.get('train.batch_size')\n  h = config['whatever']\n  return a\n"),
  })
  monkeypatch.setattr(test_imports, "SRC", tmp_path)
  assert attribute_forwards() == ["meshdistill.jobs.plain:1", "meshdistill.jobs.run:2"]
  assert kind_name_comparisons({"preference", "uld"}) == ["meshdistill.jobs.run:5 compares 'preference'",
                                                          "meshdistill.jobs.run:5 compares 'uld'"]
  assert config_key_reads({"train", "mesh", "data"}, {"mesh.data", "train.batch_size"}) == [
      "meshdistill.strategies.s:2 reads train", "meshdistill.strategies.s:3 reads mesh.data",
      "meshdistill.strategies.s:7 reads train.batch_size", "meshdistill.strategies.s:8 reads whatever"]
  assert config_key_reads({"train"}, set(), packages=("jobs",)) == ["meshdistill.jobs.run:6 reads train"]


# --------------------------------------------------------------------------- the rules
def test_no_class_forwards_attribute_reads_with_getattr():
  found = attribute_forwards()
  assert not found, ("__getattr__ outside a package's lazy public face (name what a wrapper offers: "
                     "meshdistill.data.WrappedData names the inner bundle's tokenizers, stats and validation "
                     "batches):\n" + "\n".join(found))


def test_the_jobs_and_the_config_ask_a_strategys_capabilities_never_its_kind_name():
  found = kind_name_comparisons(set(strategies.names()))
  assert not found, ("strategy kind names compared in jobs/ or config/ (declare a capability on the strategy, e.g. "
                     "needs_pairs, chunked_form, and ask it):\n" + "\n".join(found))


def test_config_keys_are_read_in_the_config_and_the_jobs_only():
  found = config_key_reads(config_sections(), config_keys())
  assert not found, ("config keys read in strategies/ or parallel/ (read them in config/ or jobs/ and hand the value "
                     "down as a typed setting or an argument):\n" + "\n".join(found))


def test_the_distill_job_is_one_line_of_steps_with_no_branch_on_kinds():
  """`_distill` composes the run from its source, its data and its batches: no ``if``, no ``isinstance``."""
  path = next(p for m, p in modules().items() if m == f"{PACKAGE}.jobs._distill_job")
  fn = next(n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, ast.FunctionDef) and n.name == "_distill")
  branches = [n.lineno for n in ast.walk(fn) if isinstance(n, (ast.If, ast.IfExp, ast.Match))
              and not (isinstance(n, ast.If) and ast.unparse(n.test) == "is_primary()")]  # who writes summary.json
  kinds_asked = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and _receiver(n.func) == "isinstance"]
  assert branches == [] and kinds_asked == [], (branches, kinds_asked)


# --------------------------------------------------------------------------- the protocols
@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
  corpus = write_corpus(tmp_path_factory.mktemp("composition") / "c", n_docs=8)
  return data_lib.build_data(data_lib.DataConfig(source=corpus, seq_len=16, val_fraction=0.25), batch_size=4)


def test_every_kind_of_training_data_is_a_training_data_and_a_wrapper_answers_with_its_bundle(bundle, tmp_path):
  prompts = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(8)]
  wrapped = [data_lib.PreferencePairs(bundle), tc.CachedTeacherData(bundle, None), tc.RowIdData(bundle, None),
             TeacherMeshData(bundle, None), RemoteTeacherData(bundle, None, None),
             multi.MultiTeacherData(bundle, [], k=1, route=None, weights=[])]
  plain = [bundle, PromptData(prompts, bundle.tokenizer, seq_len=16, batch_size=2, val_fraction=0.25)]
  for d in plain + wrapped:
    assert isinstance(d, data_lib.TrainingData), type(d).__name__
  for d in wrapped:
    assert isinstance(d, data_lib.WrappedData)
    assert d.tokenizer is bundle.tokenizer and d.teacher_tokenizer is None and d.stats is bundle.stats
    assert [b["inputs"].tolist() for b in d.val_batches()] == [b["inputs"].tolist() for b in bundle.val_batches()]
    assert not hasattr(d, "config"), f"{type(d).__name__} reads the inner bundle's config through itself"
  assert wrapped[0].global_batch_size == 2 * bundle.global_batch_size  # pairs: two rows of each inner row
  ours = {c.__name__ for c in _subclasses(data_lib.WrappedData) if c.__module__.startswith(f"{PACKAGE}.")}
  assert ours == {type(d).__name__ for d in wrapped} | {"CachedCrossData"}  # every wrapper of the package


def _subclasses(cls):
  for sub in cls.__subclasses__():
    yield sub
    yield from _subclasses(sub)


def test_every_teacher_source_and_several_teachers_are_a_source():
  cfg = load_config("tiny")
  for name in kinds.names():
    assert isinstance(kinds.get(name)(cfg), kinds.Source), name
  assert isinstance(multi.Teachers(cfg), kinds.Source)
  assert type(jobs._teacher.teacher_source(cfg)).__name__ == "Pretrained"


def test_a_model_source_obtains_a_teacher_of_its_own_tokenizer_on_its_own_tokens_through_prepare():
  """The cross-tokenizer path is `prepare`'s like every other: the model is obtained on the data of the teacher's
  tokens (`DataBundle.teacher_side`), and the run keeps the data of both tokenizations."""
  seen = []

  class Recording(kinds.ModelSource):
    name = "recording"

    def model(self, data, mesh, services):
      seen.append(data)
      return "model", "identity"

  class Data:
    def teacher_side(self):
      return "the teacher's tokens"

  data = Data()
  for own, want in ((None, data), ("bpe", "the teacher's tokens")):
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(teacher_tokenizer=own))
    got = Recording(cfg).prepare(data, None, None, kinds.Services(pretrain=None, report=print))
    assert got == kinds.Prepared(data, "model", "identity") and seen[-1] == want


def test_a_bundle_of_two_tokenizations_gives_the_teacher_its_own_tokens(bundle, tmp_path):
  assert bundle.teacher_side() is bundle  # one tokenizer: the bundle itself
  cross = data_lib.build_data(dataclasses.replace(bundle.config, teacher_tokenizer="bpe", bpe_vocab_size=280),
                              batch_size=4)
  own = cross.teacher_side()
  assert own.tokenizer is cross.teacher_tokenizer and own.teacher_tokenizer is None
  assert own.global_batch_size == cross.global_batch_size and own.config.tokenizer == "bpe"
  text = "def return class"
  assert own.tokenizer.decode(own.tokenizer.encode(text)) == text


def test_a_preference_run_pretrains_its_teacher_on_the_corpus_and_trains_on_pairs(tmp_path):
  """The pairs are made from the prepared data (`TrainingBatches`), so the teacher the run pretrains is pretrained on
  the corpus rows (before, the pairs reached pretraining and stopped it with a TypeError)."""
  corpus = write_corpus(tmp_path / "c", n_docs=8)
  cfg = load_config("tiny", [
      f"data.source={corpus}", "data.seq_len=16", "data.val_fraction=0.25", "data.max_chars=null",
      "teacher.max_len=16", "student.max_len=16", "mesh.backend=single", "mesh.data=1", "mesh.tensor=1",
      "distill.kind=preference", "train.steps=1", "train.warmup=0", "train.eval_every=0", "train.batch_size=4",
      "train.log_every=1", "pretrain.steps=1", "pretrain.warmup=0", "pretrain.eval_every=0", "checkpoint.every=0",
      f"pretrain.cache_dir={tmp_path / 'cache'}", f"run.run_dir={tmp_path / 'run'}"])
  summary = jobs.distill(cfg)
  assert summary["step"] == 1 and (tmp_path / "cache").is_dir()  # a teacher was pretrained and cached
  train = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"train"' in line]
  assert train and 0 <= train[0]["accuracy"] <= 1 and "reward_margin" in train[0]  # the preference loss trained


def test_the_preference_rows_live_in_data_and_the_strategies_names_alias_them(tmp_path):
  path = tmp_path / "prefs.jsonl"
  rows = [{"prompt": "ab", "chosen": "cd", "rejected": "ef"}]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  assert strategies.read_preferences(str(path)) == data_lib.read_preferences(str(path)) == rows
  encode = lambda text: list(text.encode())  # noqa: E731
  want = data_lib.preference_batch(rows, encode, seq_len=6)
  got = strategies.preference_batch(rows, encode, seq_len=6)
  assert all(np.array_equal(got[k], want[k]) for k in want) and want["mask"].sum() == 2 * 2
  assert "read_preferences" not in vars(sys.modules["meshdistill.strategies._preference"])  # the loss alone
