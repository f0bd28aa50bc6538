"""Which student layer is compared with which teacher layer.

A layer map is a tuple of ``(student_layer, teacher_layer)`` pairs. Indices count the
entries of the captured tuple they refer to:

* attention maps (``ModelOutput.attn``, one per block): ``0 .. n_layers - 1``;
* hidden states (``ModelOutput.hidden``, embeddings first): ``0 .. n_layers``, where
  ``0`` is the embedding output and ``i`` the output of block ``i``.

The default spreads the student's blocks evenly over the teacher's: student block ``i``
(0-based) is paired with teacher block ``round((i + 1) * Lt / Ls) - 1`` (halves round
up), so the last student block always meets the last teacher block.
"""

from __future__ import annotations

import operator
from typing import Sequence

import einops
import jax

LayerMap = tuple[tuple[int, int], ...]


def default_layer_map(n_student: int, n_teacher: int, offset: int = 0) -> LayerMap:
  """Evenly spaced pairs for ``n_student`` and ``n_teacher`` blocks.

  ``offset`` is added to both indices: 0 for attention maps (block ``i`` is entry ``i``),
  1 for hidden states (block ``i`` is entry ``i + 1``, entry 0 being the embeddings).

  >>> default_layer_map(2, 4)
  ((0, 1), (1, 3))
  >>> default_layer_map(2, 4, offset=1)
  ((1, 2), (2, 4))
  """
  if n_student < 1 or n_teacher < 1:
    raise ValueError(f"layer counts must be positive, got student {n_student}, teacher {n_teacher}")
  # floor((i + 1) * Lt / Ls + 1/2) in integers: round half up, no float error.
  return tuple(
      (i + offset, (2 * (i + 1) * n_teacher + n_student) // (2 * n_student) - 1 + offset) for i in range(n_student)
  )


def check_layer_map_shape(owner: str, layer_map: Sequence | None) -> LayerMap | None:
  """Static checks (no model sizes needed): a non-empty tuple of non-negative int pairs."""
  if layer_map is None:
    return None
  try:
    pairs = tuple((operator.index(s), operator.index(t)) for s, t in layer_map)
  except (TypeError, ValueError):
    pairs = ()
  if not pairs:
    raise ValueError(
        f"{owner}.layer_map={layer_map!r} must be a non-empty tuple of (student_layer, teacher_layer) "
        "integer pairs, e.g. ((0, 1), (1, 3)); or None for evenly spaced layers"
    )
  for s, t in pairs:
    if s < 0 or t < 0:
      raise ValueError(f"{owner}.layer_map pair ({s}, {t}) has a negative layer; layers count from 0")
  return pairs


def resolve_layer_map(
    owner: str, layer_map: LayerMap | None, n_student: int, n_teacher: int, what: str, offset: int
) -> LayerMap:
  """The explicit ``layer_map`` checked against the models, or the default one.

  ``n_student`` / ``n_teacher`` are the number of captured entries (``n_layers`` for
  attention maps, ``n_layers + 1`` for hidden states); ``what`` names them in errors.

  Raises:
    ValueError: a pair names a layer that does not exist; the message names the
      setting, the layer and the valid range.
  """
  if layer_map is None:
    return default_layer_map(n_student - offset, n_teacher - offset, offset)
  for s, t in layer_map:
    for role, idx, n in (("student", s, n_student), ("teacher", t, n_teacher)):
      if not 0 <= idx < n:
        raise ValueError(
            f"{owner}.layer_map pair ({s}, {t}) names {role} {what} {idx}, which does not exist: "
            f"valid {role} {what}s are 0..{n - 1}"
        )
  return tuple(layer_map)


def mean_groups(x: jax.Array, n: int, axis: int, mismatch: str) -> jax.Array:
  """Averages axis ``axis`` of ``x`` (size ``N``) into ``n`` groups of ``N / n`` consecutive entries.

  Bridges a teacher dimension to the student's (heads, width); identity when ``N == n``.
  Raises ``ValueError(mismatch.format(N=N, n=n))`` when ``n`` does not divide ``N``.
  """
  N = x.shape[axis]
  if N == n:
    return x
  if N % n:
    raise ValueError(mismatch.format(N=N, n=n))
  moved = jax.numpy.moveaxis(x, axis, 0)
  return jax.numpy.moveaxis(einops.reduce(moved, "(g r) ... -> g ...", "mean", g=n), 0, axis)
