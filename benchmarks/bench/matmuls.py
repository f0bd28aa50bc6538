"""Matmuls of a compiled program, read from its StableHLO, and timed alone at their shapes (used by
`matmul_shapes.py` and `throughput.py`)."""

from __future__ import annotations

import collections
import math
import re

import jax
import jax.numpy as jnp

from bench.harness import median_call

_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.]+)\(")
_CALL = re.compile(r"call @([\w.]+)\(")
_DOT = re.compile(r"stablehlo\.dot_general .*?(?:batching_dims = \[([\d, ]*)\] x \[([\d, ]*)\], )?"
                  r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\].*?: \(tensor<([\dx]+)xf32>, "
                  r"tensor<([\dx]+)xf32>\)")

Dot = collections.namedtuple("Dot", "lhs rhs lhs_contract rhs_contract lhs_batch rhs_batch")


def _ints(s: str | None) -> tuple[int, ...]:
  return tuple(int(x) for x in s.split(",") if x.strip()) if s else ()


def dots_of(stablehlo: str) -> collections.Counter:
  """Every float32 ``dot_general`` of a StableHLO module -> how often one run of ``main`` runs it. Calls to
  private functions are followed (a dot in a function called twice counts twice); the programs measured
  here have no loops (checked: a ``while`` raises)."""
  if "stablehlo.while" in stablehlo:
    raise ValueError("a program with a loop: the runs of the dots inside it are not counted here")
  body: dict[str, list[str]] = collections.defaultdict(list)
  current = None
  for line in stablehlo.splitlines():
    m = _FUNC.search(line)
    if m:
      current = m.group(1)
    elif current is not None:
      body[current].append(line)

  def count(fn: str) -> collections.Counter:
    out = collections.Counter()
    for line in body[fn]:
      m = _DOT.search(line)
      if m:
        lb, rb, lc, rc, lhs, rhs = m.groups()
        out[Dot(_ints(lhs.replace("x", ",")), _ints(rhs.replace("x", ",")), _ints(lc), _ints(rc), _ints(lb),
                _ints(rb))] += 1
      elif "stablehlo.dot_general" in line:
        raise ValueError(f"a dot this reader does not parse: {line.strip()[:160]}")
      for called in _CALL.findall(line):
        out.update(count(called))
    return out

  return count("main")


def flops(d: Dot) -> float:
  """2 x every index of the output x the contracted size."""
  batch = math.prod(d.lhs[i] for i in d.lhs_batch)
  contract = math.prod(d.lhs[i] for i in d.lhs_contract)
  free_l = math.prod(n for i, n in enumerate(d.lhs) if i not in d.lhs_batch + d.lhs_contract)
  free_r = math.prod(n for i, n in enumerate(d.rhs) if i not in d.rhs_batch + d.rhs_contract)
  return 2.0 * batch * free_l * free_r * contract


def time_alone(d: Dot, calls: int, copies: int) -> float:
  """Seconds per run of ``d`` with nothing else to do: ``copies`` copies of it on different left operands in
  one jitted program (different data, so XLA cannot merge them; independent, so its CPU runtime may run them
  side by side, as it may run independent dots of a step), per copy."""
  dims = ((d.lhs_contract, d.rhs_contract), (d.lhs_batch, d.rhs_batch))

  @jax.jit
  def run(lhs, rhs):
    return [jax.lax.dot_general(a, rhs, dims) for a in lhs]  # every output returned: none is dead code

  keys = jax.random.split(jax.random.key(0), copies + 1)
  lhs = [jax.random.normal(k, d.lhs, jnp.float32) for k in keys[:-1]]
  rhs = jax.random.normal(keys[-1], d.rhs, jnp.float32)
  return median_call(lambda: run(lhs, rhs), calls) / copies




def cost(counts: collections.Counter, alone: dict) -> tuple[float, float]:
  """(FLOPs, seconds) of a program's dots (`dots_of`), each run taking its time alone (``alone``, by dot)."""
  return sum(flops(d) * n for d, n in counts.items()), sum(alone[d] * n for d, n in counts.items())


def ceiling(stablehlo: str, calls: int = 15, copies: int = 20, alone: dict | None = None) -> tuple[float, float]:
  """(FLOPs of a program's dots, seconds of its dots each timed alone at its shape, `time_alone`): its FLOPs over
  those seconds is the rate its matmul shapes reach with nothing else in the program. ``alone``: a cache of
  times already measured, by dot."""
  alone = {} if alone is None else alone
  counts = dots_of(stablehlo)
  for d in counts:
    if d not in alone:
      alone[d] = time_alone(d, calls, copies)
  return cost(counts, alone)
