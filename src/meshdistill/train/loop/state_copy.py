"""Copies of a train state that survive the step's donation of it: on the devices or in host memory, and where a
guarded run keeps its good states (`meshdistill.train.loop.guard.Recovery`, ``safeguards.guard.keep_in``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshdistill.train.memory import device_memory_limit

_COPIERS: dict = {}  # one compiled copy per (tree structure, shardings)


KEEP_IN = ("auto", "device", "host")  # where the good state's copies live (`Recovery`'s ``keep_in``)
# Steps between good-state copies for ``keep_every: auto``, by where they go. A copy on the devices is a pass over the
# state at memory bandwidth (a few ms); one to host memory crosses the host link: on a TPU v5e host, 4.6 GB (the
# headline student's float32 weights with AdamW) took 2 s, five 420-ms steps; every 100 steps that is 5% of the run.
KEEP_EVERY = {"device": 10, "host": 100}


def check_keep_every(keep_every) -> None:
  """Raises for a ``keep_every`` that is neither ``auto`` nor a positive integer, naming the setting."""
  if keep_every == "auto":
    return
  if not isinstance(keep_every, int) or isinstance(keep_every, bool) or keep_every < 1:
    raise ValueError(f"safeguards.guard.keep_every={keep_every!r}: give a positive integer (steps between good-state "
                     f"copies) or auto ({KEEP_EVERY['device']} where the copies stay on the devices, "
                     f"{KEEP_EVERY['host']} where they go to host memory)")


def keep_every_steps(keep_every, place: str) -> int:
  """Steps between good-state copies: ``keep_every`` as named, or for ``auto`` `KEEP_EVERY` of ``place``."""
  check_keep_every(keep_every)
  return KEEP_EVERY[place] if keep_every == "auto" else keep_every


def check_keep_in(keep_in: str) -> None:
  """Raises for a ``keep_in`` outside `KEEP_IN`, naming the setting."""
  if keep_in not in KEEP_IN:
    raise ValueError(f"safeguards.guard.keep_in={keep_in!r}; choose one of {', '.join(KEEP_IN)} (auto: host memory on "
                     "an accelerator, the devices on a CPU)")


def keep_place(keep_in: str, state) -> str:
  """Where copies of ``state`` go for ``keep_in``: ``device`` / ``host`` as named; ``auto``: host memory where the
  state's devices report a memory limit (an accelerator, whose memory the step needs: on one v5e chip a 0.6B
  student's float32 state with AdamW is 4.5 GB, and the loop holds up to two copies), the devices elsewhere (a CPU,
  whose device memory is host memory)."""
  check_keep_in(keep_in)
  if keep_in != "auto":
    return keep_in
  leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
  device = next(iter(leaves[0].devices())) if leaves else jax.devices()[0]
  return "host" if device_memory_limit(device) is not None else "device"


def on_host(state) -> bool:
  """Whether ``state`` is a host copy (`copy_state` with ``where="host"``)."""
  leaves = jax.tree.leaves(state)
  return bool(leaves) and not any(isinstance(x, jax.Array) for x in leaves)


def _on_cpu(x) -> bool:
  return isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.devices())


def copy_state(state, where: str = "device", shardings=None):
  """A copy of ``state`` safe from the donation of the original: on the devices (same shardings; ``where="device"``)
  or in host memory (``where="host"``: numpy arrays, read once; nothing of the devices' memory kept). A host copy
  copied to the devices takes ``shardings`` (the original state's, as `Recovery.start` keeps them).

  One compiled program copies every leaf (a train state has ~100 leaves: copying them one
  by one costs a dispatch each, several times the one program's time for the main job's state). Leaves that are not
  `jax.Array`s with a mesh or single-device sharding (e.g. stacked ``pmap`` states) are copied
  one by one.
  """
  if where not in ("device", "host"):
    raise ValueError(f"copy_state(where={where!r}): choose device or host")
  if on_host(state):
    return state if where == "host" else jax.device_put(state, shardings)  # host copies are never written to
  if where == "host":
    # a CPU device's arrays read as numpy views of their buffers (which the donating step then writes): copied
    return jax.tree.map(lambda h, x: np.array(h, copy=_on_cpu(x)), jax.device_get(state), state)
  leaves, treedef = jax.tree.flatten(state)
  shardings = tuple(getattr(x, "sharding", None) for x in leaves)
  if not leaves or not all(isinstance(sh, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding))
                           for sh in shardings):
    return jax.tree.map(jnp.copy, state)
  key = (treedef, shardings)
  if key not in _COPIERS:
    _COPIERS[key] = jax.jit(lambda *xs: [jnp.copy(x) for x in xs], out_shardings=list(shardings))
  copies = _COPIERS[key](*leaves)
  if any(c is x for c, x in zip(copies, leaves)):  # never hand back the original buffers
    return jax.tree.map(jnp.copy, state)
  return jax.tree.unflatten(treedef, copies)
