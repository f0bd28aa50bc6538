"""One checkpoint step directory, below `meshdistill.storage.checkpoint.Checkpointer`: the check of its
``checksums.json`` (complete and matching), what shows a step the run did not write (links, another step number in
its ``meta``), the uint4 leaves tensorstore cannot store, and short error lines."""

from __future__ import annotations

import json
import os

import jax

from meshdistill.core.fsutil import file_digests

CHECKSUM_FILE = "checksums.json"


def first_line(e: BaseException) -> str:
  """The first line of ``e``'s message (tensorstore's run to a hundred lines), at most 300 characters."""
  text = str(e).strip().splitlines()
  return text[0][:300] if text else type(e).__name__


def widen_uint4(tree):
  """``tree`` with uint4 leaves (nf4 weights of a QLoRA base) as uint8: tensorstore stores no uint4.

  Arrays are converted (lossless: values 0..15); abstract leaves get the uint8 dtype."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def one(x):
    if getattr(x, "dtype", None) != jnp.uint4:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, jnp.uint8, sharding=x.sharding)
    return x.astype(jnp.uint8)

  return jax.tree.map(one, tree)


def verify_complete(step_dir: str, expected: dict) -> str | None:
  """None when ``expected`` (a step's ``checksums.json``) lists every file of the step and each matches; else what
  is wrong. A list that leaves files out (``{}``, a partial one) is damage: those files would restore unchecked."""
  have = file_digests(step_dir, exclude=(CHECKSUM_FILE,))
  found = {
    "missing": sorted(set(expected) - set(have)),
    "checksum mismatch in": sorted(k for k in expected if k in have and have[k] != expected[k]),
    f"{CHECKSUM_FILE} does not list": sorted(set(have) - set(expected)),
  }
  return "; ".join(f"{what} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                   for what, names in found.items() if names) or None


def links_in(step_dir: str) -> list[str]:
  """``[step_dir]`` when the step directory is a symbolic link, else every link inside it (sorted by directory):
  orbax and tensorstore follow them, so a link would restore what another run wrote."""
  if os.path.islink(step_dir):
    return [step_dir]
  found = []
  for d, dirs, files in os.walk(step_dir):
    found += [os.path.join(d, n) for n in sorted(dirs + files) if os.path.islink(os.path.join(d, n))]
  return found


def recorded_step(step_dir: str):
  """The step number a step's ``meta`` item records (``meta/metadata``, written with the step), or None when it
  cannot be read (damage, which the checksums report)."""
  try:
    with open(os.path.join(step_dir, "meta", "metadata"), encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, ValueError):
    return None
  return value.get("step") if isinstance(value, dict) else None


def narrow_uint4(tree, like):
  """The inverse of `widen_uint4`: leaves of ``tree`` back to the dtypes of ``like`` where those are uint4."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return jax.tree.map(lambda x, w: x.astype(jnp.uint4) if w.dtype == jnp.uint4 else x, tree, like)
