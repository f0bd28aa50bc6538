"""The package's import graph, read from the source: no module imports itself back through others, whether the
import sits at the top of a module or inside a function (a function-local import only hides a cycle: the two
modules still need each other), and the function-local imports of the package's own modules stay few.

No module is imported but the package itself (to find its source): every module under ``meshdistill/`` is parsed
with `ast`; relative imports are resolved against the module's package. ``from a import b`` counts as an import of
``a.b`` when that is a module, else of ``a``; a package's ``__init__`` counts as a module of its own (importing
``a.b`` is not counted as importing ``a``). An import under ``if TYPE_CHECKING:`` is left out (it never runs).
"""

import ast
import pathlib
import re

import pytest

import meshdistill

SRC = pathlib.Path(meshdistill.__file__).resolve().parents[1]  # the source tree of the package under test
PACKAGE = "meshdistill"
# Function-local import statements of meshdistill modules: 136 with four cycles hidden behind them; 122 once those
# were broken and the config's checks and the models' builders were imported at the top; 132 with the command's
# lazy start-up (`meshdistill.cli` imports each job's modules inside its command, so `--help` loads no JAX); 22 once
# every import that closes no cycle and costs the command's start-up nothing went to the top of its module (and
# `parallel.distributed.platforms` got the "has JAX started" check it needs from `parallel.mesh`). What stays local is the
# command's lazy start-up (20, in `meshdistill.cli`) and the data package behind the preference names `strategies`
# keeps as aliases of data's (1: data loads grain, which building a Distiller must not). A new one needs a reason on
# its line (`# lazy: ...`: a heavy or optional part, e.g. the planner or qwix), never a cycle.
MAX_LOCAL_IMPORTS = 21
# Modules whose function-local imports of the package may still lack a `# lazy:` reason (none now).
REASON_PENDING: set[str] = set()
LAZY_REASON = re.compile(r"#\s*lazy:\s*\S")


def modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of the package (a package is its ``__init__.py``)."""
  out = {}
  for path in sorted((SRC / PACKAGE).rglob("*.py")):
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def _is_type_checking(node: ast.AST) -> bool:
  test = node.test if isinstance(node, ast.If) else None
  return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
      isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
  """The package's modules an import statement loads (``from a import b``: ``a.b`` when that is a module)."""
  if isinstance(node, ast.Import):
    names = [alias.name for alias in node.names]
    return [n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")]
  if node.level:  # relative: against this module's package
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    source = ".".join(base + ([node.module] if node.module else []))
  else:
    source = node.module or ""
  if not (source == PACKAGE or source.startswith(PACKAGE + ".")):
    return []
  out = []
  for alias in node.names:
    sub = f"{source}.{alias.name}"
    out.append(sub if sub in known else source)
  return out


def import_graph():
  """``(edges, local)``: module -> the package's modules it imports anywhere in its body; and the list of
  ``(module, line, imported)`` for the imports inside a function."""
  mods = modules()
  known = set(mods)
  edges: dict[str, set[str]] = {m: set() for m in mods}
  local = []

  def visit(node, module, is_package, in_function):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.If) and _is_type_checking(child):
        continue
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        for target in sorted(set(_targets(child, module, is_package, known))):
          if target != module:
            edges[module].add(target)
            if in_function:
              local.append((module, child.lineno, target))
      inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      visit(child, module, is_package, inner)

  for module, path in mods.items():
    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), module, path.name == "__init__.py", False)
  return edges, local


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """One cycle (``[a, b, ..., a]``) through each strongly connected group of more than one module (Tarjan)."""
  index, low, on_stack, stack, groups = {}, {}, set(), [], []

  def connect(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        groups.append(set(group))

  for v in sorted(edges):
    if v not in index:
      connect(v)
  return [_cycle_in(group, edges) for group in groups]


def _cycle_in(group: set[str], edges) -> list[str]:
  """A shortest cycle through the first module of ``group`` (breadth-first inside the group)."""
  start = min(group)
  paths = {start: [start]}
  frontier = [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(edges[v] & group):
        if w == start:
          return paths[v] + [start]
        if w not in paths:
          paths[w] = paths[v] + [w]
          nxt.append(w)
    frontier = nxt
  return [start]


def test_the_cycle_finder_finds_a_cycle_behind_a_function_local_import(tmp_path, monkeypatch):
  pkg = tmp_path / PACKAGE
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from meshdistill.sub import b\n")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "sub" / "b.py").write_text("def f():\n  from ..a import x\n  return x\n")
  monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
  edges, local = import_graph()
  assert edges["meshdistill.a"] == {"meshdistill.sub.b"} and edges["meshdistill.sub.b"] == {"meshdistill.a"}
  assert local == [("meshdistill.sub.b", 2, "meshdistill.a")]
  assert find_cycles(edges) == [["meshdistill.a", "meshdistill.sub.b", "meshdistill.a"]]


def test_the_package_has_no_import_cycle():
  edges, _ = import_graph()
  assert len(edges) > 50  # the whole package was read
  cycles = find_cycles(edges)
  assert not cycles, "import cycles (module -> module it imports -> ...):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_function_local_imports_of_the_package_stay_under_the_ceiling():
  _, local = import_graph()
  listing = "\n".join(f"{m}:{line} imports {t}" for m, line, t in local)
  print(f"{len(local)} function-local imports of {PACKAGE} modules (ceiling {MAX_LOCAL_IMPORTS}):\n{listing}")
  assert len(local) <= MAX_LOCAL_IMPORTS, listing


def unreasoned(local) -> list[tuple[str, int, str]]:
  """The function-local imports of ``local`` (as `import_graph` lists them) whose first line has no ``# lazy:``
  reason comment."""
  paths = modules()
  out = []
  for module, line, target in local:
    text = paths[module].read_text(encoding="utf-8").split("\n")[line - 1]
    if not LAZY_REASON.search(text):
      out.append((module, line, target))
  return out


def test_the_reason_check_names_a_function_local_import_without_a_reason(tmp_path, monkeypatch):
  pkg = tmp_path / PACKAGE
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("X = 1\n")
  (pkg / "b.py").write_text(
      "def f():\n  from meshdistill.a import X  # lazy: a is heavy\n  return X\n\n\n"
      "def g():\n  from meshdistill.a import X  # pylint: disable=g-import-not-at-top\n  return X\n")
  monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
  _, local = import_graph()
  assert len(local) == 2
  assert unreasoned(local) == [("meshdistill.b", 7, "meshdistill.a")]


def test_every_function_local_import_of_the_package_says_why_it_is_local():
  _, local = import_graph()
  missing = [(m, line, t) for m, line, t in unreasoned(local) if m not in REASON_PENDING]
  assert not missing, "function-local imports without a `# lazy: <why>` comment (or move them to the top):\n" + (
      "\n".join(f"{m}:{line} imports {t}" for m, line, t in missing))


if __name__ == "__main__":
  pytest.main([__file__, "-q", "-s"])


def test_the_package_has_at_most_15_top_level_entries():
  """Modules, packages and data folders directly under ``meshdistill/`` (``__init__`` and ``__main__`` included):
  a new concept goes into the package it belongs to (CONTRIBUTING.md's code map), not beside them. 14 until the
  names every layer shares (the batch schema, the train state, ...) left ``train/`` for ``core/``, below all."""
  entries = sorted(p.name for p in (SRC / PACKAGE).iterdir()
                   if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py"))
  assert len(entries) <= 15, entries
