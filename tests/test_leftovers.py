"""What merges and moves leave behind: the decoder's weight table has a row for every weight a model holds, and a
name has one home (old module paths kept only for tests are gone)."""

import ast
import importlib
import pathlib
import re

import pytest
from flax import nnx

import meshdistill as md
from meshdistill.models import decoder
from meshdistill.models.moe import MoeConfig


def weight_table(doc: str) -> list[tuple[str, ...]]:
  """The logical-name column of the first ``=====`` table in ``doc``: one tuple of names per alternative of a row
  (``heads / kv_heads`` gives two; ``--`` is None)."""
  lines = doc.splitlines()
  borders = [i for i, line in enumerate(lines) if line.startswith("=====")]
  if len(borders) < 3:
    return []
  spans, start = [], None
  for j, ch in enumerate(lines[borders[0]] + " "):
    if ch == "=" and start is None:
      start = j
    elif ch != "=" and start is not None:
      spans.append((start, j))
      start = None
  a, b = spans[2]
  out = []
  for line in lines[borders[1] + 1:borders[2]]:
    for alternative in line[a:b].strip().split(" / "):
      out.append(tuple(None if n == "--" else n for n in alternative.split(", ")))
  return out


def test_the_table_reader_reads_alternatives_and_unsplit_dimensions():
  border = "======  ====  ===============  ==="
  doc = (f"x\n\n{border}\nweight  s     names            t\n{border}\n"
         f"w       [D]   embed, --        --\nb       [H]   heads / kv       h\n{border}\n")
  assert weight_table(doc) == [("embed", None), ("heads",), ("kv",)]


def test_the_decoders_weight_table_has_a_row_for_every_weight_a_model_holds():
  cfg = md.ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=32, max_len=8,
                       qk_norm=True, qkv_bias=True, tie_embeddings=False,
                       moe=MoeConfig(n_experts=2, top_k=1, expert_hidden=8, dense_layers=(0,)))
  _, state, _ = md.models.abstract_params(cfg)
  held = {tuple(v.out_sharding) for _, v in nnx.to_flat_state(state)}
  rows = set(weight_table(decoder.__doc__))
  assert len(held) >= 10 and held <= rows, f"weights without a row in models/decoder.py's table: {held - rows}"


def aliases() -> list[str]:
  """The package's modules that put another module in their own place (``sys.modules[__name__] = ...``): an old
  path kept importing after its module moved."""
  from test_imports import modules

  out = []
  for name, path in modules().items():
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      targets = node.targets if isinstance(node, ast.Assign) else []
      if any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.modules" for t in targets):
        out.append(name)
  return out


def test_a_moved_module_lives_at_its_new_path_only():
  assert not aliases(), f"modules that alias another in sys.modules (import the real home instead): {aliases()}"
  for old in ("meshdistill.storage.fsutil", "meshdistill.storage.ownership", "meshdistill.config.typed_yaml",
              "meshdistill.train.schedules"):
    with pytest.raises(ModuleNotFoundError):
      importlib.import_module(old)


REPO = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"(?<!`)`(meshdistill(?:\.\w+)+)`(?!`)")  # `meshdistill.a.b` (a ``literal`` is not a name)


def resolves(dotted: str) -> bool:
  """Whether ``dotted`` names a module of the package or an attribute reached from one."""
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ModuleNotFoundError:
      continue
    return all((obj := getattr(obj, p, None)) is not None for p in parts[i:])
  return False


def test_every_name_the_docstrings_and_docs_point_at_is_where_they_say():
  assert resolves("meshdistill.core.batch.MULTI_KEYS") and resolves("meshdistill.train.router_losses")
  assert not resolves("meshdistill.losses.router") and not resolves("meshdistill.parallel.layout.ShardMapLayout")
  files = sorted((REPO / "src").rglob("*.py")) + sorted((REPO / "docs").glob("*.md")) + [
      REPO / "CONTRIBUTING.md", REPO / "README.md"] + sorted((REPO / "benchmarks" / "results").glob("*_notes.md"))
  stale = [f"{path.relative_to(REPO)}:{n}: {m.group(1)}" for path in files
           for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
           for m in REFERENCE.finditer(line) if not resolves(m.group(1))]
  assert not stale, "names pointed at where they no longer are:\n" + "\n".join(stale)


def test_top_k_teacher_has_one_home_and_one_public_name():
  """`TopKTeacher` is defined in `meshdistill.train.teacher` (below the teachers, which give it) and public as
  `meshdistill.teachers.cache.TopKTeacher`: every import of it names one of the two."""
  from meshdistill.teachers.cache import TopKTeacher
  from meshdistill.train import teacher

  assert TopKTeacher is teacher.TopKTeacher and TopKTeacher.__module__ == "meshdistill.train.teacher"
  sources = set()
  for folder in ("src", "tests", "benchmarks", "examples"):
    for path in (REPO / folder).rglob("*.py"):
      for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and any(a.name == "TopKTeacher" for a in node.names):
          sources.add(node.module)
  assert sources <= {"meshdistill.train.teacher", "meshdistill.teachers.cache"}, sources
