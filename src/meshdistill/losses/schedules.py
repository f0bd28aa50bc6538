"""Schedules for temperature, alpha, beta and loss-term weights.

A schedule is a function of the step number returning a float -- the same contract as
`optax.Schedule`, and built from `optax.schedules`. Strategies evaluate it on the
traced ``int32`` step inside the jitted train step (`value_at`), so a changing value
never recompiles the step.

A strategy setting that may change over training (temperature, alpha, beta, skew, term
weights) is a `Scalar`: a number, a schedule function or a spec dict. `check_scalar` is
the one place such a setting is checked against its allowed range (and a spec dict turned
into a schedule); `check_integer` does the same for counts (top-k, chunk sizes).

Kinds (``from_spec`` keys in brackets; ``begin`` defaults to 0):

=========  ====================================  ===============================================
kind       spec                                  value at step ``n``
=========  ====================================  ===============================================
constant   ``{value}`` or a bare number          ``value``
linear     ``{start, end, steps, begin}``        ``start`` until ``begin``, then a straight line
                                                 reaching ``end`` at ``begin + steps``; ``end`` after
cosine     ``{start, end, steps, begin}``        as linear, along a half cosine
                                                 ``end + (start - end) (1 + cos(pi u)) / 2``
step       ``{values, boundaries}``              ``values[i]`` for ``boundaries[i-1] <= n < boundaries[i]``
=========  ====================================  ===============================================

>>> tau = from_spec({"kind": "linear", "start": 3.0, "end": 1.0, "steps": 1000})
>>> float(tau(500))
2.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

Schedule = Callable[[jax.Array], jax.Array]
Scalar = float | Schedule  # a strategy setting: a constant or a schedule

KINDS = ("constant", "linear", "cosine", "step")
_KEYS = {
    "constant": (("value",), ()),
    "linear": (("start", "end", "steps"), ("begin",)),
    "cosine": (("start", "end", "steps"), ("begin",)),
    "step": (("values", "boundaries"), ()),
}  # kind -> (required keys, optional keys), besides "kind"


def constant(value: float) -> Schedule:
  """``value`` at every step."""
  return optax.constant_schedule(float(value))


def linear(start: float, end: float, steps: int, begin: int = 0) -> Schedule:
  """``start`` until ``begin``, linear to ``end`` over ``steps`` steps, then ``end``."""
  return optax.linear_schedule(float(start), float(end), transition_steps=int(steps), transition_begin=int(begin))


def cosine(start: float, end: float, steps: int, begin: int = 0) -> Schedule:
  """``start`` until ``begin``, half-cosine to ``end`` over ``steps`` steps, then ``end``.

  ``optax.cosine_decay_schedule`` decays a multiplier from 1 to 0; mapping it affinely
  onto ``[end, start]`` allows any start/end (rising, or starting at 0).
  """
  start, end = float(start), float(end)
  unit = optax.cosine_decay_schedule(1.0, decay_steps=int(steps))

  def body(count):
    return end + (start - end) * unit(count)

  return body if not begin else optax.join_schedules([optax.constant_schedule(start), body], [int(begin)])


def step(values: Sequence[float], boundaries: Sequence[int]) -> Schedule:
  """Piecewise constant: ``values[0]`` before ``boundaries[0]``, ``values[i]`` from ``boundaries[i-1]``.

  Built with ``optax.join_schedules`` of constants (``optax.piecewise_constant_schedule``
  multiplies by scales, which cannot leave or reach 0).
  """
  pieces = [optax.constant_schedule(float(v)) for v in values]
  return pieces[0] if len(pieces) == 1 else optax.join_schedules(pieces, [int(b) for b in boundaries])


# ----------------------------------------------------------------------- specs (YAML)
def _number(spec: dict, key: str, where: str) -> float:
  v = spec[key]
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    raise ValueError(f"{where}: {key}={v!r} must be a finite number")
  return float(v)


def _count(spec: dict, key: str, where: str, minimum: int) -> int:
  v = spec[key]
  if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
    raise ValueError(f"{where}: {key}={v!r} must be an integer >= {minimum}")
  return v


def _validated(spec: Any, name: str) -> dict:
  """The spec as a checked dict ``{"kind": ..., ...}``; raises ValueError naming the bad key."""
  where = f"schedule {name}" if name else "schedule"
  if isinstance(spec, bool) or not isinstance(spec, (int, float, dict)):
    raise ValueError(
        f"{where}={spec!r}: give a number or a dict with 'kind' in {KINDS}, "
        "e.g. {'kind': 'linear', 'start': 3.0, 'end': 1.0, 'steps': 1000}"
    )
  if not isinstance(spec, dict):
    spec = {"kind": "constant", "value": spec}
  kind = spec.get("kind")
  if kind not in KINDS:
    raise ValueError(f"{where}: kind={kind!r}; choose one of {KINDS}")
  required, optional = _KEYS[kind]
  missing = [k for k in required if k not in spec]
  if missing:
    raise ValueError(f"{where}: kind={kind!r} needs keys {list(required)}; missing {missing}")
  unknown = sorted(set(spec) - {"kind", *required, *optional})
  if unknown:
    raise ValueError(f"{where}: unknown key(s) {unknown} for kind={kind!r}; allowed: {['kind', *required, *optional]}")
  out = {"kind": kind}
  if kind == "constant":
    out["value"] = _number(spec, "value", where)
  elif kind in ("linear", "cosine"):
    out.update(start=_number(spec, "start", where), end=_number(spec, "end", where))
    out["steps"] = _count(spec, "steps", where, 1)
    out["begin"] = _count(spec, "begin", where, 0) if "begin" in spec else 0
  else:
    values, boundaries = spec["values"], spec["boundaries"]
    if not isinstance(values, (list, tuple)) or not values:
      raise ValueError(f"{where}: values={values!r} must be a non-empty list of numbers")
    if not isinstance(boundaries, (list, tuple)) or len(boundaries) != len(values) - 1:
      raise ValueError(
          f"{where}: boundaries={boundaries!r} must be a list of len(values) - 1 = {len(values) - 1} steps "
          "(values[i] holds from boundaries[i-1] on)"
      )
    out["values"] = [_number({"values": v}, "values", where) for v in values]
    out["boundaries"] = [_count({"boundaries": b}, "boundaries", where, 1) for b in boundaries]
    if any(b >= c for b, c in zip(out["boundaries"], out["boundaries"][1:])):
      raise ValueError(f"{where}: boundaries={boundaries!r} must be strictly increasing")
  return out


def from_spec(spec: float | dict | Schedule, name: str = "") -> Schedule:
  """A schedule from a config value: a number (constant), a dict spec, or a callable (as is).

  Args:
    spec: ``3.0``, or e.g. ``{"kind": "linear", "start": 3.0, "end": 1.0, "steps": 1000}``
      (kinds and keys in the module docstring), or any ``step -> value`` callable.
    name: the setting's name, used in error messages (e.g. ``"temperature"``).

  Raises:
    ValueError: unknown kind, missing or unknown key, or a bad value; the message names
      the key and what is allowed.
  """
  if callable(spec):
    return spec
  s = _validated(spec, name)
  kind = s.pop("kind")
  return {"constant": constant, "linear": linear, "cosine": cosine, "step": step}[kind](**s)


def value_range(spec: float | dict, name: str = "") -> tuple[float, float]:
  """``(lowest, highest)`` value a number or dict spec ever takes (for range checks of settings)."""
  s = _validated(spec, name)
  if s["kind"] == "constant":
    vals = [s["value"]]
  elif s["kind"] == "step":
    vals = s["values"]
  else:
    vals = [s["start"], s["end"]]
  return min(vals), max(vals)


# ----------------------------------------------------------------------- strategy settings
def value_at(x: Scalar, step: jax.Array) -> jax.Array:
  """A constant, or a schedule (a function of the step number) evaluated at ``step``."""
  return jnp.asarray(x(step) if callable(x) else x, jnp.float32)


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
  if high == math.inf:
    return f"{'>' if low_open else '>='} {low}"
  if low == -math.inf:
    return f"{'<' if high_open else '<='} {high}"
  return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_scalar(
    where: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    example: str = "",
) -> Scalar:
  """Checks a `Scalar` setting against ``low .. high``; returns it ready for `value_at`.

  A number must lie in the interval; a spec dict must stay in it at every step (see
  `value_range`) and comes back as a schedule function; a schedule function is returned
  as is (it cannot be checked without running it). ``where`` names the setting in errors
  (e.g. ``"LogitKD.alpha"``), ``example`` is a value that would work.

  >>> check_scalar("LogitKD.alpha", 0.5, 0.0, 1.0)
  0.5
  >>> check_scalar("LogitKD.alpha", 1.5, 0.0, 1.0)
  Traceback (most recent call last):
  ...
  ValueError: LogitKD.alpha=1.5 must be in [0.0, 1.0]

  Raises:
    ValueError: naming ``where``, the value and the allowed interval.
  """
  if callable(value):
    return value
  hint = f" (e.g. {example})" if example else ""
  if isinstance(value, dict):
    lo, hi = value_range(value, where)
    shown = f"{value} (takes values in [{lo}, {hi}])"
  else:
    try:
      if isinstance(value, (bool, str)):
        raise TypeError
      lo = hi = float(value)
    except (TypeError, ValueError):
      raise ValueError(
          f"{where}={value!r} must be a number, a schedule function or a schedule spec dict{hint}"
      ) from None
    shown = repr(value)
  ok = (lo > low if low_open else lo >= low) and (hi < high if high_open else hi <= high)
  if not ok:
    raise ValueError(f"{where}={shown} must be {_interval(low, high, low_open, high_open)}{hint}")
  return from_spec(value, where) if isinstance(value, dict) else value


def check_integer(where: str, value: Any, minimum: int, *, allow_none: bool = False, meaning: str = "") -> int | None:
  """Checks a count setting (an ``int`` >= ``minimum``, or None when ``allow_none``); returns it.

  ``meaning`` completes the error message (e.g. ``": tokens per chunk (e.g. 1024)"``).
  """
  if value is None and allow_none:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    raise ValueError(f"{where}={value!r} must be {'None or ' if allow_none else ''}{what}{meaning}")
  return value
