"""What each instruction of a compiled step is, read from its HLO text, for the profile benchmarks.

`hlo_kinds` puts every instruction in one kind by the ops it (or the fused computation it calls) holds;
`hlo_sources` names, for each instruction, the source file its metadata points at, so that a TPU trace can be
split by what the code was doing (the loss, the optimizer, the attention kernel) and not only by op kind.
"""

from __future__ import annotations

import collections
import re

KINDS = ("matmul", "collective", "reduction", "copy/transpose", "elementwise")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_CONTAINERS = ("while", "conditional", "call")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(")
_COMP = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s")
_SOURCE = re.compile(r'source_file="([^"]+)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")


def stack_frames(hlo: str) -> dict[int, list[tuple[str, int]]]:
  """Stack frame id -> ``(source file, line)`` of its call stack, innermost first, from the module's ``FileNames`` /
  ``FileLocations`` / ``StackFrames`` tables (how newer XLA writes source locations; older text has
  ``source_file=`` in each instruction's metadata instead)."""
  tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
  section = None
  for line in hlo.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = line
      continue
    if not line.strip() or line.startswith(("%", "ENTRY", "HloModule", " ", "}")):
      section = None
      continue
    if section:
      key, _, rest = line.partition(" ")
      if key.isdigit():
        tables[section][int(key)] = rest
  files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
  locs = {}
  for k, v in tables["FileLocations"].items():
    f, ln = re.search(r"file_name_id=(\d+)", v), re.search(r"line=(\d+)", v)
    locs[k] = (files.get(int(f.group(1)), "") if f else "", int(ln.group(1)) if ln else 0)
  frames = {}
  for k, v in tables["StackFrames"].items():
    loc, parent = re.search(r"file_location_id=(\d+)", v), re.search(r"parent_frame_id=(\d+)", v)
    frames[k] = (locs.get(int(loc.group(1)), ("", 0)) if loc else ("", 0), int(parent.group(1)) if parent else 0)
  out = {}
  for k in frames:
    chain, seen, cur = [], set(), k
    while cur in frames and cur not in seen:
      seen.add(cur)
      chain.append(frames[cur][0])
      cur = frames[cur][1]
    out[k] = chain
  return out


def _stack_files(hlo: str) -> dict[int, list[str]]:
  """Stack frame id -> the source files of its call stack, innermost first (`stack_frames` without the lines)."""
  return {k: [f for f, _ in chain] for k, chain in stack_frames(hlo).items()}


def _computations(hlo: str) -> dict[str, list[tuple[str, str, str]]]:
  """computation -> its instructions as ``(name, op, line)``."""
  comps: dict[str, list[tuple[str, str, str]]] = collections.defaultdict(list)
  current = None
  for line in hlo.splitlines():
    m = _COMP.match(line)
    if m and line.rstrip().endswith("{"):
      current = m.group(1)
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      comps[current].append((m.group(1), m.group(2), line))
  return comps


def _called_ops(comps, comp: str, seen=()) -> tuple[set[str], list[str]]:
  """The ops of ``comp`` and of what it calls, and their lines."""
  ops, lines = set(), []
  for _, op, line in comps.get(comp, ()):
    ops.add(op)
    lines.append(line)
    for called in re.findall(r"calls=%([\w.\-]+)", line):
      if called not in seen:
        o, ls = _called_ops(comps, called, (*seen, comp))
        ops |= o
        lines += ls
  return ops, lines


def _leaves(hlo: str):
  """``(name, ops, lines)`` of every instruction that does work (no containers, parameters or tuples)."""
  comps = _computations(hlo)
  for comp in comps.values():
    for name, op, line in comp:
      if op in _CONTAINERS or op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
        continue
      ops, lines = {op}, [line]
      for called in re.findall(r"calls=%([\w.\-]+)", line):
        o, ls = _called_ops(comps, called)
        ops |= o
        lines += ls
      yield name, ops, lines


def hlo_kinds(hlo: str) -> dict[str, str]:
  """Instruction name -> kind (`KINDS`, first match wins) for every non-container instruction of ``hlo``:
  a ``dot`` / ``convolution`` is a matmul (with what is fused into it), then collectives, reductions, copies and
  transposes, and everything else elementwise."""
  kinds = {}
  for name, ops, _ in _leaves(hlo):
    if ops & {"dot", "convolution"}:
      kind = "matmul"
    elif any(o.startswith(COLLECTIVES) for o in ops):
      kind = "collective"
    elif ops & {"reduce", "reduce-window"}:
      kind = "reduction"
    elif ops & {"copy", "transpose"}:
      kind = "copy/transpose"
    else:
      kind = "elementwise"
    kinds[name] = kind
  return kinds


def hlo_roles(hlo: str, rules: tuple[tuple[str, str], ...]) -> dict[str, str]:
  """Instruction name -> role: a custom call (a Pallas kernel) is ``"attention kernel"``; otherwise the role of the
  first ``(substring, role)`` of ``rules`` found in the source files of the instruction's call stack (innermost
  frame first; its fused computation's instructions after its own), else its `hlo_kinds` kind."""
  kinds = hlo_kinds(hlo)
  stacks = _stack_files(hlo)
  roles = {}
  for name, ops, lines in _leaves(hlo):
    if "custom-call" in ops:
      roles[name] = "attention kernel"
      continue
    sources = [s for line in lines for s in _SOURCE.findall(line)]
    sources += [f for line in lines for fid in _FRAME.findall(line) for f in stacks.get(int(fid), ())]
    role = next((r for src in sources for sub, r in rules if sub in src), None)
    roles[name] = role or kinds.get(name, "elementwise")
  return roles


_SHAPE = re.compile(r"=\s*(\(?[a-z0-9]+\[[^\]]*\][^ ]*)")
_OP_NAME = re.compile(r'op_name="([^"]+)"')


def describe(hlo: str, names) -> dict[str, str]:
  """``name`` -> its output shape and the ``op_name`` of its metadata (the JAX operation it came from), for each of
  ``names`` found in ``hlo``: how a profile's slowest instructions are told apart without the program's text."""
  want, out = set(names), {}
  for comp in _computations(hlo).values():
    for name, _, line in comp:
      if name in want and name not in out:
        shape = _SHAPE.search(line)
        op = _OP_NAME.search(line)
        out[name] = " ".join(x for x in (shape.group(1).split("{")[0] if shape else "",
                                         op.group(1) if op else "") if x)
  return out
