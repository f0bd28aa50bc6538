"""`benchmarks/`: every script stands on the shared package `bench` and on no other script, none edits Python's
import path (the package is installed; Python puts a script's own folder on the path), CONTRIBUTING.md lists every
script of the folder, a chip's peak FLOP/s comes from the planner's one table (`meshdistill.planner.TPU_CHIPS`),
and every package name a script reads exists.

Read from the source with `ast`; only `tpu_step` is imported, as the tests of its rendering import it."""

import ast
import importlib
import importlib.util
import pathlib
import re

from helpers import bench_module

from meshdistill.planner import TPU_CHIPS

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def _tree(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text(encoding="utf-8"), str(path))


def imported_roots(path: pathlib.Path) -> set[str]:
  """The first part of every module a file imports (``from bench.harness import x`` -> ``bench``)."""
  out = set()
  for node in ast.walk(_tree(path)):
    if isinstance(node, ast.Import):
      out |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      out.add(node.module.split(".")[0])
  return out


def path_edits(path: pathlib.Path) -> list[int]:
  """Lines that change Python's import path (``sys.path.insert`` / ``append`` / ``extend``, or an assignment)."""
  out = []
  for node in ast.walk(_tree(path)):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == \
        "sys.path":
      out.append(node.lineno)
    elif isinstance(node, ast.Assign) and any(ast.unparse(t) == "sys.path" for t in node.targets):
      out.append(node.lineno)
  return out


def test_the_readers_find_a_path_edit_and_the_bench_import(tmp_path):
  script = tmp_path / "s.py"
  script.write_text("import sys\nsys.path.insert(0, 'x')\nfrom bench.harness import timed\nimport other\n")
  assert path_edits(script) == [2] and imported_roots(script) == {"sys", "bench", "other"}


def test_no_benchmark_edits_the_import_path():
  found = {str(p.relative_to(ROOT)): path_edits(p) for p in sorted(BENCHMARKS.rglob("*.py")) if path_edits(p)}
  assert not found, f"sys.path edits (install the package; Python puts a script's folder on the path): {found}"


def test_every_script_stands_on_bench_and_imports_no_other_script():
  names = {p.stem for p in SCRIPTS}
  assert len(SCRIPTS) >= 30
  without = [p.name for p in SCRIPTS if "bench" not in imported_roots(p)]
  assert not without, f"scripts that use no module of benchmarks/bench/: {without}"
  crossing = {p.name: sorted(imported_roots(p) & (names - {p.stem})) for p in SCRIPTS if imported_roots(p) & names}
  assert not crossing, f"scripts importing another script (move what they share into bench/): {crossing}"


def test_contributing_lists_every_script_of_the_folder():
  text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
  section = text[text.index("## Benchmarks"):]
  section = section[:section.index("\n## ")] if "\n## " in section else section
  listed = set(re.findall(r"^python benchmarks/(\w+)\.py", section, flags=re.M))
  folder = {p.stem for p in SCRIPTS}
  assert listed == folder, f"in the folder, not listed: {sorted(folder - listed)}; listed, not in the folder: " \
                           f"{sorted(listed - folder)}"


def test_a_chips_peak_flops_has_one_table():
  """No benchmark holds a FLOP/s-sized number of its own (a peak is 1e14 and more), a chip's peak is written once in
  the package (the chip table, `core/chips.py`: the planner's and the chip calibration's), and `tpu_step`'s MFU
  divides by that table's."""
  big = [f"{p.relative_to(ROOT)}:{n.lineno}: {n.value}" for p in sorted(BENCHMARKS.rglob("*.py"))
         for n in ast.walk(_tree(p)) if isinstance(n, ast.Constant) and isinstance(n.value, float) and n.value >= 1e13]
  assert not big, big
  peaks = {c.peak_bf16_flops for c in TPU_CHIPS.values()}
  written = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py") for n in ast.walk(_tree(p))
                   if isinstance(n, ast.Constant) and n.value in peaks and isinstance(n.value, float))
  assert set(written) == {"src/meshdistill/core/chips.py"}, written
  bench_module("results")  # puts benchmarks/ on the path, as running the script does
  tpu_step = importlib.import_module("tpu_step")
  for chip in TPU_CHIPS.values():
    assert tpu_step.peak_flops(chip.device_kind) == chip.peak_bf16_flops
  assert tpu_step.peak_flops("cpu") is None


def package_names(path: pathlib.Path) -> list[tuple[int, str, str]]:
  """``(line, module, name)`` for every name a file reads from the package: ``from meshdistill.m import name`` and,
  where that name is a module, every ``name.attribute`` the file reads."""
  out, modules = [], {}
  tree = _tree(path)
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "meshdistill":
      for a in node.names:
        out.append((node.lineno, node.module, a.name))
        full = f"{node.module}.{a.name}"
        if importlib.util.find_spec(node.module) and _is_module(full):
          modules[a.asname or a.name] = full
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
      out.append((node.lineno, modules[node.value.id], node.attr))
  return out


def _is_module(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ModuleNotFoundError:
    return False


def test_every_package_name_a_benchmark_reads_exists():
  """A benchmark that reads a name the package moved or renamed fails here, not on the chip."""
  missing = []
  for path in sorted(BENCHMARKS.rglob("*.py")):
    for line, module, name in package_names(path):
      if not hasattr(importlib.import_module(module), name) and not _is_module(f"{module}.{name}"):
        missing.append(f"{path.relative_to(ROOT)}:{line}: {module}.{name}")
  assert not missing, "benchmarks read names the package does not have:\n" + "\n".join(missing)
