"""The packages form one stack: the package-level import graph, read from the source as `test_imports` reads the
module graph, has no pair of packages importing each other and no arrow pointing up the stack; ``core`` imports
nothing else of the package; and importing the package and building a `Distiller` loads neither the HTTP stack of the
served teacher nor the data pipeline's grain.

A package is a first-level entry of ``meshdistill/`` (``meshdistill.train.loop.run`` belongs to ``train``); imports
inside a package, and those of the package's own ``__init__`` / ``__main__`` (the lazy public face and the command's
entry point), are left out.
"""

import json
import os
import subprocess
import sys
import textwrap

from test_imports import PACKAGE, SRC, import_graph

# The packages from the bottom up: each may import only packages before it in this list. Two packages on one step
# (a tuple) import neither the other. CONTRIBUTING.md's code map draws the same stack.
STACK = (
    "core",                    # names every layer shares; imports nothing of the package
    "parallel",                # mesh, rules, layouts
    ("models", "losses"),      # the decoder and its families; per-sequence losses and schedules
    "data",                    # corpora, tokenizers, packing, the loader, preference rows
    "strategies",              # what to distil (its losses only; the preference names alias data's)
    "storage",                 # checkpoints of a run
    "train",                   # the step, the Distiller, the loop
    "teachers",                # where teacher outputs come from
    "config",                  # the run configuration (checks its sections with everything below)
    "jobs",                    # the jobs behind the command
    "planner",                 # meshdistill plan
    "cli",                     # the command
)
# Pairs of packages allowed to import each other, each with its reason (none today: CONTRIBUTING.md names any).
ALLOWED_MUTUAL: dict[frozenset, str] = {}
# Module imports that may point up the stack, each with its reason (none today).
ALLOWED_UP: dict[tuple[str, str], str] = {}
ENTRY_MODULES = {PACKAGE, f"{PACKAGE}.__main__"}


def package_of(module: str) -> str | None:
  """The first-level package of ``module`` (None for the package's own ``__init__`` and ``__main__``)."""
  if module in ENTRY_MODULES:
    return None
  return module.split(".")[1]


def package_graph(edges: dict[str, set[str]]) -> dict[str, dict[str, list[tuple[str, str]]]]:
  """Package -> package it imports -> the ``(module, imported module)`` arrows behind it."""
  out: dict[str, dict[str, list[tuple[str, str]]]] = {}
  for module, targets in edges.items():
    a = package_of(module)
    for target in sorted(targets):
      b = package_of(target)
      if a is not None and b is not None and a != b:
        out.setdefault(a, {}).setdefault(b, []).append((module, target))
  return out


def mutual_pairs(graph) -> list[tuple[str, str]]:
  """The pairs of packages that import each other, sorted."""
  return sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, {})})


def levels() -> dict[str, int]:
  out = {}
  for level, entry in enumerate(STACK):
    for name in (entry,) if isinstance(entry, str) else entry:
      out[name] = level
  return out


def upward(graph) -> list[tuple[str, str]]:
  """The module arrows that import a package on the same step or higher up `STACK` (``(module, imported)``)."""
  level = levels()
  return [arrow for a in graph for b in graph[a] if level[b] >= level[a] for arrow in graph[a][b]]


def _write_package(root, files: dict[str, str]):
  for name, text in files.items():
    path = root / PACKAGE / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_pair_finder_finds_two_packages_that_import_each_other(tmp_path, monkeypatch):
  _write_package(tmp_path, {
      "__init__.py": "", "a/__init__.py": "", "b/__init__.py": "", "c/__init__.py": "",
      "a/x.py": "from meshdistill.b import y\n",
      "b/y.py": "def f():\n  from meshdistill.a.x import g\n  return g\n",  # a function-local import counts too
      "c/z.py": "import meshdistill.a.x\n",
  })
  monkeypatch.setattr(sys.modules["test_imports"], "SRC", tmp_path)
  edges, _ = import_graph()
  graph = package_graph(edges)
  assert mutual_pairs(graph) == [("a", "b")]
  assert graph["c"] == {"a": [("meshdistill.c.z", "meshdistill.a.x")]}


def test_every_package_is_on_the_stack():
  edges, _ = import_graph()
  packages = {package_of(m) for m in edges} - {None}
  assert packages == set(levels()), f"packages missing from STACK: {sorted(packages - set(levels()))}; " \
                                    f"named in STACK but gone: {sorted(set(levels()) - packages)}"


def test_no_two_packages_import_each_other():
  graph = package_graph(import_graph()[0])
  pairs = [p for p in mutual_pairs(graph) if frozenset(p) not in ALLOWED_MUTUAL]
  detail = "\n".join(f"{a} <-> {b}:\n  " + "\n  ".join(f"{m} -> {t}" for m, t in graph[a][b] + graph[b][a])
                     for a, b in pairs)
  assert not pairs, ("packages that import each other (move the shared name down, e.g. into meshdistill.core, or "
                     "hand it in from above):\n" + detail)


def test_no_import_points_up_the_stack():
  graph = package_graph(import_graph()[0])
  up = [arrow for arrow in upward(graph) if arrow not in ALLOWED_UP]
  assert not up, ("imports of a package on the same step or higher up STACK (tests/test_layers.py; CONTRIBUTING.md's "
                  "code map):\n" + "\n".join(f"{m} -> {t}" for m, t in up))


def test_core_imports_nothing_else_of_the_package():
  graph = package_graph(import_graph()[0])
  assert not graph.get("core"), graph.get("core")


HEAVY = ("starlette", "uvicorn", "httpx", "grain")


def fresh_interpreter(code: str):
  """The JSON ``code`` prints last, run in a new interpreter on this checkout's sources (on the CPU)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
         "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_and_building_a_distiller_loads_no_http_stack_and_no_grain():
  """In a fresh interpreter (this one has imported everything): ``import meshdistill as md; md.Distiller`` and a tiny
  Distiller built and initialised; only the commands that serve a teacher or load data import these."""
  code = textwrap.dedent("""
      import json, sys
      import meshdistill as md
      md.Distiller
      after_import = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
      cfg = md.ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, mlp_hidden=32, max_len=8)
      d = md.Distiller(md.init_model(cfg, seed=0), md.init_model(cfg, seed=1), backend="single")
      d.init_state()
      after_build = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
      print(json.dumps([after_import, after_build]))
  """).replace("HEAVY", repr(HEAVY))
  after_import, after_build = fresh_interpreter(code)
  assert after_import == [], f"import meshdistill; md.Distiller loaded {after_import}"
  assert after_build == [], f"building a Distiller loaded {after_build}"


def test_the_jobs_and_the_remote_teacher_source_load_no_http_stack_until_one_serves_or_calls_a_teacher():
  """``import meshdistill.jobs`` (every command's job: distill, eval, ...) and the remote source's module leave
  starlette, uvicorn and httpx unloaded; the server and the client import them on first use."""
  code = textwrap.dedent("""
      import json, sys
      import meshdistill.jobs, meshdistill.teachers.kinds.remote
      before = sorted({m.split(".")[0] for m in sys.modules} & {"starlette", "uvicorn", "httpx"})
      from meshdistill.teachers.service import client, server
      server.require()
      client.TeacherClient("http://127.0.0.1:9", timeout_s=1.0)
      after = sorted({m.split(".")[0] for m in sys.modules} & {"starlette", "uvicorn", "httpx"})
      print(json.dumps([before, after]))
  """)
  before, after = fresh_interpreter(code)
  assert before == [], f"importing the jobs loaded {before}"
  assert after == ["httpx", "starlette", "uvicorn"], after
