"""One checkpoint step directory, below `meshdistill.storage.checkpoint.Checkpointer`: the check of its
``checksums.json`` (complete and matching), the uint4 leaves tensorstore cannot store, and short error lines."""

from __future__ import annotations

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


def narrow_uint4(tree, like):
  """The inverse of `widen_uint4`: leaves of ``tree`` back to the dtypes of ``like`` where those are uint4."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return jax.tree.map(lambda x, w: x.astype(jnp.uint4) if w.dtype == jnp.uint4 else x, tree, like)
