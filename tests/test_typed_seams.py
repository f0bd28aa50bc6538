"""Typed seams: the step's keywords are one checked set (a misspelt one is an error, never dropped), and every public
name of ``meshdistill`` is visible to a type checker (its ``TYPE_CHECKING`` imports) as the lazy table `_EXPORTS`
resolves it."""

import ast
import functools
import importlib
import pathlib

import optax
import pytest

import meshdistill as md
from meshdistill.core.state import SplitStep
from meshdistill.train.step import apply_gradients, per_device_gradients, per_device_step, step_halves

INIT = pathlib.Path(md.__file__)


def test_a_misspelt_step_keyword_is_an_error():
  step = functools.partial(per_device_step, strategy=md.LogitKD(), optimizer=optax.sgd(0.1), student_def=None,
                           teacher_def=None, lossscale=2.0)
  with pytest.raises(TypeError, match=r"\['lossscale'\] are taken by neither half.*loss_scale.*check the spelling"):
    step_halves(step)
  with pytest.raises(TypeError, match="lossscale"):
    step(None, None, {})
  with pytest.raises(TypeError, match="lossscale"):
    per_device_gradients(None, None, {}, student_def=None, teacher_def=None, strategy=md.LogitKD(), data_axis=None,
                         lossscale=2.0)
  with pytest.raises(TypeError, match="one_devices"):
    apply_gradients(None, {}, {}, optimizer=optax.sgd(0.1), one_devices=True)


def test_each_half_gets_the_keywords_it_names():
  seen = {}

  def gradients(state, teacher_params, batch, *, data_axis=None, strategy=None):
    seen["gradients"] = {"data_axis": data_axis, "strategy": strategy}
    return "grads", {}

  def update(state, grads, metrics, *, optimizer=None, one_device=False):
    seen["update"] = {"optimizer": optimizer, "one_device": one_device}
    return state, metrics

  split = SplitStep(gradients, update)
  split("state", None, {}, strategy="s", optimizer="o", data_axis="data")
  assert seen == {"gradients": {"data_axis": "data", "strategy": "s"}, "update": {"optimizer": "o", "one_device": False}}
  g, u = SplitStep.halves(functools.partial(split, strategy="s", optimizer="o"))
  assert g.keywords == {"strategy": "s"} and u.keywords == {"optimizer": "o"}


def _type_checking_imports() -> dict[str, tuple[str, str]]:
  """``{public name: (module, attribute)}`` from the ``if TYPE_CHECKING:`` imports of ``meshdistill/__init__.py``."""
  tree = ast.parse(INIT.read_text())
  block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
  out = {}
  for node in block.body:
    assert isinstance(node, ast.ImportFrom), ast.dump(node)
    for alias in node.names:
      out[alias.asname or alias.name] = (node.module, alias.name)
  return out


def test_every_public_name_is_visible_to_type_checkers_as_exported():
  seen = _type_checking_imports()
  assert sorted(seen) == sorted(md._EXPORTS)  # pylint: disable=protected-access
  for name, (module, attribute) in seen.items():  # the object a type checker reads is the one `md.<name>` gives
    assert _from_import(module, attribute) is getattr(md, name), name


def _from_import(module: str, attribute: str):
  """What ``from module import attribute`` binds: the attribute, else the submodule of that name."""
  owner = importlib.import_module(module)
  if hasattr(owner, attribute):
    return getattr(owner, attribute)
  return importlib.import_module(f"{module}.{attribute}")


def test_the_public_names_resolve_to_what_the_type_checkers_see():
  for name in ("Distiller", "LogitKD", "generate", "export", "schedules", "ModelConfig"):
    assert getattr(md, name) is not None
  assert md.generate is md.models.generate.generate and md.export is md.jobs.export.export_run
