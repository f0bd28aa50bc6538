"""Private means private: a name or module whose dotted path holds an underscore part (``meshdistill.models._build``,
``meshdistill.data._tokenizer._x``) is for its own first-level package only. A module of another package imports
what the owner makes public in its ``__init__`` (`meshdistill.models.abstract_params`), and the benchmarks and tests
import a public name by its public path where the package exports it.

Read from the source as `test_imports` reads it (every import statement, function-local and ``TYPE_CHECKING`` ones
too): nothing of the package is imported to find them. The splash kernel's blocks, once patched into a private
function by a benchmark, are set through `meshdistill.models.splash_blocks`.
"""

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest
from test_imports import PACKAGE, SRC, modules
from test_layers import _write_package

import meshdistill.models as models

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _private(parts) -> bool:
  return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _imports(path: pathlib.Path, module: str, is_package: bool):
  """``(line, source module, imported name or None)`` of every import of the package in ``path``: ``import a.b``
  gives ``(line, "a.b", None)``, ``from a import b`` gives ``(line, "a", "b")`` (relative imports resolved)."""
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith(PACKAGE + "."):
          yield node.lineno, alias.name, None
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module or ""
      if source == PACKAGE or source.startswith(PACKAGE + "."):
        for alias in node.names:
          yield node.lineno, source, alias.name


def cross_package_private_imports() -> list[str]:
  """``module:line imports path`` for every import, in a package's module, of a private module or name of another
  first-level package (the package's own ``__init__`` / ``__main__``, its public face, are left out)."""
  out = []
  for module, path in modules().items():
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
      continue
    for line, source, name in _imports(path, module, path.name == "__init__.py"):
      dotted = source.split(".") + ([name] if name else [])
      if len(dotted) > 1 and dotted[1] != parts[1] and _private(dotted[2:]):
        out.append(f"{module}:{line} imports {'.'.join(dotted)}")
  return out


def _exported(package: str) -> set[str]:
  """The names a package's ``__init__.py`` binds by ``from ... import`` or lists in ``__all__``."""
  init = SRC / pathlib.Path(*package.split(".")) / "__init__.py"
  if not init.is_file():
    return set()
  names = set()
  for node in ast.parse(init.read_text(encoding="utf-8")).body:
    if isinstance(node, ast.ImportFrom):
      names |= {a.asname or a.name for a in node.names}
    elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
      if isinstance(node.value, (ast.List, ast.Tuple)):
        names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
  return names


def private_paths_to_public_names(folder: pathlib.Path) -> list[str]:
  """``file:line imports a._b.name (public as a.name)`` for every ``from <private module> import <public name>``
  under ``folder`` whose name the public package above that module exports."""
  out = []
  for path in sorted(folder.rglob("*.py")):
    for line, source, name in _imports(path, "x", False):
      parts = source.split(".")
      first_private = next((i for i, p in enumerate(parts) if _private([p])), None)
      if name is None or first_private is None or _private([name]):
        continue
      public = ".".join(parts[:first_private])
      if name in _exported(public):
        out.append(f"{path.relative_to(ROOT)}:{line} imports {source}.{name} (public as {public}.{name})")
  return out


def test_the_finder_names_private_imports_across_packages_and_leaves_a_packages_own_alone(tmp_path, monkeypatch):
  import test_imports

  _write_package(tmp_path, {
      "__init__.py": "from meshdistill.a._x import f\n",  # the package's public face may read anything
      "a/__init__.py": "from meshdistill.a._x import f\n", "a/_x.py": "def f(): pass\ndef _g(): pass\n",
      "a/y.py": "from meshdistill.a._x import _g\nfrom . import _x\n",  # its own package: allowed
      "b/__init__.py": "", "b/m.py": "from meshdistill.a._x import f\nimport meshdistill.a._x\n",
      "b/n.py": "def h():\n  from meshdistill.a import _x\n  from ..a.y import _z\n  from meshdistill.a import f\n",
  })
  monkeypatch.setattr(test_imports, "SRC", tmp_path)
  monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
  assert cross_package_private_imports() == [
      "meshdistill.b.m:1 imports meshdistill.a._x.f", "meshdistill.b.m:2 imports meshdistill.a._x",
      "meshdistill.b.n:2 imports meshdistill.a._x", "meshdistill.b.n:3 imports meshdistill.a.y._z"]


def test_no_package_imports_another_packages_private_names():
  found = cross_package_private_imports()
  assert not found, ("private names imported across packages (make the name public in its package's __init__ and "
                     "import it from there):\n" + "\n".join(found))


@pytest.mark.parametrize("folder", ["benchmarks", "tests"])
def test_benchmarks_and_tests_import_an_exported_name_by_its_public_path(folder):
  found = private_paths_to_public_names(ROOT / folder)
  assert not found, "\n".join(found)


def test_splash_blocks_sets_the_kernels_blocks_for_what_is_traced_inside_it_only():
  from meshdistill.models._attention import _splash_attention  # the kernel itself: no public path

  seen = []

  def sizes(T, **kw):
    seen.append((T, kw))
    return models.splash_block_sizes(T, **kw)

  q = jax.ShapeDtypeStruct((1, 2, 256, 8), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1, 256, 8), jnp.bfloat16)
  with models.splash_blocks(sizes):
    jax.eval_shape(lambda q, k, v: _splash_attention(q, k, v, interpret=True), q, kv, kv)
  assert seen == [(256, {"itemsize": 2, "head_dim": 8, "capped": False})]
  jax.eval_shape(lambda q, k, v: _splash_attention(q, k, v, interpret=True, cap=5.0), q, kv, kv)  # after: its own
  assert len(seen) == 1
  with pytest.raises(TypeError, match="splash_blocks takes a function"):
    with models.splash_blocks("q512-kv1024"):
      pass
