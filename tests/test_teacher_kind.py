"""The teacher's kind is decided once (`meshdistill.train.teacher.decide`, a `TeacherKind`) and asked of that decision
everywhere after it: the jobs, the evaluation, the guard and the loop read ``trainer.teacher_output.kind``, never which
of a trainer's attributes happen to be set. The teacher sources declare the same kinds (one constant set)."""

import pathlib
import re
import types

import pytest

import meshdistill as md
from meshdistill.jobs._training import _cache_safeguards
from meshdistill.strategies import HardLabelCE, LogitKD
from meshdistill.teachers import kinds
from meshdistill.train import teacher as teacher_lib
from meshdistill.train.loop.evaluate import Evaluator
from meshdistill.train.loop.guard import DivergenceGuard, Recovery
from meshdistill.train.loop.trainer import run_meta
from meshdistill.train.teacher import TeacherKind, TeacherOutput, TopKTeacher, decide

from helpers import STUDENT_CFG, TEACHER_CFG

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "meshdistill"

# What re-derives the kind from a trainer's attributes instead of asking its decision.
DERIVED = [
    re.compile(r"\.teacher_def is (not )?None"),
    re.compile(r"\.topk_teacher is (not )?None"),
    re.compile(r"getattr\([^)]*[\"']teacher_(cfg|def|params)[\"']"),
    re.compile(r"\.gives\s*[!=]=\s*[\"']"),
]
# The `Distiller` builds the decision: its constructor reads the `TopKTeacher` it decided on.
DECIDES = {"train/distiller.py"}


def test_no_module_works_out_the_teacher_kind_from_attributes():
  found = []
  for path in sorted(SRC.rglob("*.py")):
    rel = path.relative_to(SRC).as_posix()
    if rel in DECIDES:
      continue
    for n, line in enumerate(path.read_text().splitlines(), 1):
      found += [f"{rel}:{n}: {line.strip()}" for rx in DERIVED if rx.search(line)]
  assert not found, "ask trainer.teacher_output.kind (a TeacherKind) instead:\n" + "\n".join(found)


def test_one_set_of_teacher_kinds():
  assert kinds.MODEL is TeacherKind.MODEL and kinds.TOPK is TeacherKind.TOPK and kinds.NOTHING is TeacherKind.NONE
  assert teacher_lib.MODEL is TeacherKind.MODEL and teacher_lib.NONE is TeacherKind.NONE
  assert {kinds.get(n).gives for n in kinds.names()} == set(TeacherKind)
  # no module defines the kinds as strings of its own
  strings = re.compile(r"=\s*[\"'](model|nothing)[\"'],\s*[\"']topk[\"']")
  assert not [p for p in SRC.rglob("*.py") if strings.search(p.read_text())]


def test_a_source_declaring_a_kind_outside_the_set_is_refused():
  class Odd(kinds.TeacherSource):
    name = "odd-kind"
    gives = "nothing"

  with pytest.raises(ValueError, match=r"Odd.gives='nothing' is not a TeacherKind.*TeacherKind.NONE"):
    kinds.register(Odd)
  assert "odd-kind" not in kinds.names()


def test_decide_gives_the_kind():
  topk = TopKTeacher(cfg=TEACHER_CFG, k=4, temperature=1.0, vocab=TEACHER_CFG.vocab_size)
  assert decide(None, HardLabelCE()).kind is TeacherKind.NONE
  assert decide(topk, LogitKD()).kind is TeacherKind.TOPK
  assert decide(object(), LogitKD()).kind is TeacherKind.MODEL  # any model: decide reads no attribute of it
  assert TeacherOutput("topk").kind is TeacherKind.TOPK and TeacherOutput("topk").gives is TeacherKind.TOPK
  with pytest.raises(ValueError, match="'nothing' is not a valid TeacherKind"):
    TeacherOutput("nothing")


def _trainer(kind: TeacherKind, **attributes):
  """A trainer whose decided kind disagrees with what its attributes would suggest: only the kind may count."""
  return types.SimpleNamespace(teacher_output=TeacherOutput(kind), backend="single", mesh=None,
                               student_cfg=STUDENT_CFG, student_def="student", layout=types.SimpleNamespace(
                                   eval_mesh=None), unreplicate=lambda tree: tree, **attributes)


def test_run_meta_records_the_teacher_of_a_model_or_top_k_kind_only():
  assert run_meta(_trainer(TeacherKind.TOPK, teacher_cfg=TEACHER_CFG), "distill")["teacher"]["n_layers"] == 2
  assert run_meta(_trainer(TeacherKind.MODEL, teacher_cfg=TEACHER_CFG), "distill")["teacher"]["d_model"] == 32
  assert "teacher" not in run_meta(_trainer(TeacherKind.NONE, teacher_cfg=TEACHER_CFG), "pretrain")


def test_the_guard_falls_back_only_with_a_teacher_kind():
  guard = DivergenceGuard()
  assert Recovery(_trainer(TeacherKind.MODEL, teacher_cfg=None), guard).can_fall_back
  assert Recovery(_trainer(TeacherKind.TOPK, teacher_cfg=None), guard).can_fall_back
  assert not Recovery(_trainer(TeacherKind.NONE, teacher_cfg=TEACHER_CFG), guard).can_fall_back
  assert Recovery(_trainer(TeacherKind.NONE), guard, fallback=HardLabelCE()).can_fall_back


def test_the_evaluator_compares_with_a_teacher_model_only():
  topk = Evaluator.for_trainer(_trainer(TeacherKind.TOPK, teacher_def="teacher", teacher_params={}))
  assert topk.teacher_def is None and topk.teacher_params is None
  model = Evaluator.for_trainer(_trainer(TeacherKind.MODEL, teacher_def="teacher", teacher_params={"w": 1}))
  assert model.teacher_def == "teacher" and model.teacher_params == {"w": 1}
  alone = Evaluator.for_trainer(_trainer(TeacherKind.MODEL, teacher_def="teacher", teacher_params={}),
                                with_teacher=False)
  assert alone.teacher_def is None


def test_a_top_k_teacher_keeps_its_strategy_as_the_guards_fallback():
  strategy = LogitKD()
  kwargs = {"fallback": md.strategies.LogitMSE()}
  assert _cache_safeguards(kwargs, _trainer(TeacherKind.TOPK, strategy=strategy))["fallback"] is strategy
  assert _cache_safeguards(kwargs, _trainer(TeacherKind.NONE, strategy=strategy))["fallback"] is strategy
  assert _cache_safeguards(kwargs, _trainer(TeacherKind.MODEL, strategy=strategy)) is kwargs
