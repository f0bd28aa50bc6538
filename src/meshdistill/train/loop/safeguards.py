"""Training safeguards, gathered under one name: each lives with its concern.

* step side (`meshdistill.train.step`): static loss scaling, ``Distiller(..., loss_scale=S)`` (`scale_gradient`);
* optimizer side (`meshdistill.train.optimizers`): `safeguarded` (unscale, skip non-finite, clip) and
  `skipped_updates`;
* strategy side (`meshdistill.strategies`): `LogitMSE` and `fallback_strategy` (the loss after a divergence);
* host side (`meshdistill.train.loop.guard`): `DivergenceGuard`, `Recovery`, `copy_state`;
* the loop (`meshdistill.train.loop.trainer.fit`); `fit_guarded` is `fit` over a list of batches.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
import numpy as np

from meshdistill.data import BatchList
from meshdistill.train.loop.guard import DivergenceEvent, DivergenceGuard, NoRecovery, Recovery, copy_state  # noqa: F401
from meshdistill.train.loop.hooks import Hook
from meshdistill.train.optimizers import safeguarded, skipped_updates  # noqa: F401
from meshdistill.strategies import LogitMSE, Strategy, fallback_strategy  # noqa: F401
from meshdistill.train.loop.trainer import fit
from meshdistill.train.freezing import freeze_status


class _Records(Hook):
  """One record per step: its metrics as floats, the state's step before it, the strategy it ran with,
  ``skipped`` / ``stage`` of the state after it and the guard's events since the previous record."""

  def __init__(self, on_step):
    self.records, self.on_step, self.seen = [], on_step, 0

  def wants_metrics(self, run, step):
    return True  # every record holds all of its step's metrics

  def on_settled(self, run, info, state_after, reason):
    del reason
    host = {k: float(np.asarray(jax.device_get(v)).reshape(-1)[0]) for k, v in info.metrics.items()}
    rec = {"step": info.step - 1, "strategy": info.strategy, **host, "skipped": skipped_updates(state_after.opt_state)}
    status = freeze_status(state_after.opt_state)
    if status is not None:
      rec["stage"] = status["stage"]
    if len(run.recovery.events) > self.seen:
      rec["events"] = run.recovery.events[self.seen:]
      self.seen = len(run.recovery.events)
    self.records.append(rec)
    if self.on_step is not None:
      self.on_step(rec)


def fit_guarded(
    distiller,
    state,
    batches: Iterable[dict],
    guard: DivergenceGuard | None = None,
    *,
    fallback: Strategy | None = None,
    keep_every: int = 1,
    on_step: Callable[[dict], None] | None = None,
):
  """`meshdistill.train.loop.trainer.fit` over ``batches`` from ``state`` under ``guard``, reading each loss at once
  (``guard_lag=0``); returns ``(state, records)``, one record per batch (see `_Records`).

  On divergence the good state is restored and the strategy switches to ``fallback`` (default
  `fallback_strategy(distiller.strategy)`) for the rest of the freezing stage; the batch that
  diverged is not retried. Raises RuntimeError after ``guard.max_restores`` divergences.
  """
  records = _Records(on_step)
  result = fit(distiller, BatchList(batches), state=state, hooks=[records], steps=None, log_every=2**62,
               guard=guard if guard is not None else DivergenceGuard(), keep_every=keep_every, fallback=fallback,
               guard_lag=0)
  return result.state, records.records
