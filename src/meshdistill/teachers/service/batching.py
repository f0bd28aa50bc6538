"""Dynamic batching: the prompts of concurrent requests gathered into one call of one compiled teacher program.

A `Batcher` owns one worker thread. `Batcher.submit` queues a request's prompts and returns a future; the worker
takes the oldest request, then keeps taking requests for at most ``max_wait_ms`` or until ``max_rows`` prompts are
gathered, and answers them all with ONE call of ``fn`` on a ``[B, L]`` block: ``L`` the smallest length bucket
that holds the longest prompt, ``B`` the smallest row bucket (8 rows or ``row_multiple`` times a power of two,
at most ``max_rows`` rounded up) that holds them. Padding (id 0) goes after a prompt's ids and in rows of its own: the
teacher is causal, so a position's top-k never sees it. A few fixed shapes mean the program compiles a few times,
never per request (`warm_up` compiles them all before the first request).

A request whose future is cancelled before a call takes it (its client hung up) is dropped, never computed
(``stats.dropped``). Should the worker thread die (any error outside a teacher call), ``failed`` says why, every queued
request fails at once and later ones are refused (`BatcherFailed`): nothing waits for a thread that is gone.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)


class BatcherFailed(RuntimeError):
  """The batching thread has died or the server is shutting down: the request is not answered (503)."""


def length_buckets(max_len: int, smallest: int = 64) -> tuple[int, ...]:
  """Powers of two from ``smallest`` below ``max_len``, then ``max_len``: the padded lengths a program runs at."""
  out, n = [], smallest
  while n < max_len:
    out.append(n)
    n *= 2
  return (*out, max_len)


@dataclasses.dataclass
class Stats:
  """What the server reports on ``/health``: requests answered, program calls, rows and real tokens computed, and
  the requests of a call held before it runs (``held``: the test hook of `Batcher`), requests dropped because their
  client hung up before a call took them (``dropped``)."""

  requests: int = 0
  calls: int = 0
  rows: int = 0
  tokens: int = 0
  shapes: set = dataclasses.field(default_factory=set)
  held: int = 0
  dropped: int = 0

  def as_dict(self) -> dict:
    return {"requests": self.requests, "calls": self.calls, "rows": self.rows, "tokens": self.tokens,
            "shapes": sorted(self.shapes), "held": self.held, "dropped": self.dropped}


class Batcher:
  """Gathers concurrent requests into calls of ``fn(tokens [B, L] int32) -> (ids [B, L, K], logprobs [B, L, K],
  tail [B, L])`` (host arrays).

  Args:
    fn: the compiled teacher program (B a multiple of ``row_multiple``).
    max_rows: prompts per call at most (a request never holds more: the server's limit).
    max_wait_ms: how long the first request of a call waits for others.
    row_multiple: B is a multiple of it (the mesh's ``data`` size).
    lengths: the length buckets, increasing; the last is the longest prompt (less its last id) accepted.
    hold: testing only: while it returns True, a gathered call waits before it runs (its requests counted in
      ``stats.held``), so a test can hold a request in flight (e.g. across a SIGTERM).
  """

  def __init__(self, fn: Callable, *, max_rows: int, max_wait_ms: float, row_multiple: int, lengths: tuple[int, ...],
               hold: Callable[[], bool] | None = None):
    if max_rows < 1 or row_multiple < 1 or not lengths or min(lengths) < 1:
      raise ValueError(f"max_rows={max_rows}, row_multiple={row_multiple}, lengths={lengths}: need positive sizes")
    if not (math.isfinite(max_wait_ms) and max_wait_ms >= 0):
      raise ValueError(f"max_wait_ms={max_wait_ms} must be a finite number >= 0")
    self.fn, self.max_rows, self.max_wait, self.hold = fn, max_rows, max_wait_ms / 1000.0, hold
    self.lengths = tuple(sorted(lengths))
    rows, n = [], row_multiple * max(1, 8 // row_multiple)  # from 8 rows: a smaller call saves little
    n = min(n, -(-max_rows // row_multiple) * row_multiple)
    while n < max_rows:
      rows.append(n)
      n *= 2
    self.row_buckets = (*rows, n)
    self.stats = Stats()
    self._queue: collections.deque = collections.deque()
    self._cond = threading.Condition()
    self._closed = False
    self.failed: str | None = None  # why the worker thread died (None while it runs)
    self._inflight: list = []  # the requests of the call being computed
    self._worker = threading.Thread(target=self._run, name="teacher-batcher", daemon=True)
    self._worker.start()

  def warm_up(self) -> None:
    """Compiles the program at every (rows, length) bucket before the first request."""
    for b in self.row_buckets:
      for length in self.lengths:
        self.fn(np.zeros((b, length), np.int32))

  def submit(self, prompts: list[list[int]]) -> concurrent.futures.Future:
    """Queues ``prompts`` (each of 2 .. ``lengths[-1] + 1`` ids); the future's result is one ``(ids [n - 1, K],
    logprobs [n - 1, K], tail [n - 1])`` per prompt of ``n`` ids."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._cond:
      if self.failed is not None:
        raise BatcherFailed(f"the teacher server's batching stopped ({self.failed}); restart the server")
      if self._closed:
        raise BatcherFailed("the teacher server is shutting down")
      self._queue.append((prompts, future))
      self._cond.notify()
    return future

  def close(self) -> None:
    """Answers every queued request, then stops the worker."""
    with self._cond:
      self._closed = True
      self._cond.notify()
    self._worker.join()

  # ------------------------------------------------------------------ the worker
  def _pop(self):
    """The oldest queued request its client still waits for (marked running: no longer cancellable), or None when
    the queue holds none; requests cancelled before are dropped."""
    while self._queue:
      item = self._queue.popleft()
      if item[1].set_running_or_notify_cancel():
        return item
      self.stats.dropped += 1
    return None

  def _take(self) -> list | None:
    with self._cond:
      first = None
      while first is None:
        while not self._queue and not self._closed:
          self._cond.wait()
        if not self._queue:
          return None
        first = self._pop()
      taken, rows = [first], len(first[0])
      self._inflight = taken  # failed with the rest should the thread die before the call
      deadline = time.monotonic() + self.max_wait
      while rows < self.max_rows and not self._closed:
        while self._queue and self._queue[0][1].cancelled():  # a client gone while it waited
          self._queue.popleft()
          self.stats.dropped += 1
        if self._queue:
          if rows + len(self._queue[0][0]) > self.max_rows:
            break
          item = self._pop()
          if item is not None:
            taken.append(item)
            rows += len(item[0])
          continue
        left = deadline - time.monotonic()
        if left <= 0:
          break
        self._cond.wait(left)
      return taken

  def _run(self) -> None:
    try:
      self._serve()
    except BaseException as e:  # noqa: BLE001 -- the thread is gone: say so, and let no request wait for it
      log.exception("the teacher server's batching thread died")
      with self._cond:
        self.failed = f"{type(e).__name__}: {e}"
        waiting, self._queue = list(self._queue), collections.deque()
      error = BatcherFailed(f"the teacher server's batching stopped ({self.failed}); restart the server")
      for _, future in self._inflight:
        if not future.done():
          future.set_exception(error)
      for _, future in waiting:
        if future.set_running_or_notify_cancel():
          future.set_exception(error)

  def _serve(self) -> None:
    while True:
      self._inflight = []
      taken = self._take()
      if taken is None:
        return
      if self.hold is not None and self.hold():
        self.stats.held = len(taken)
        while self.hold():
          time.sleep(0.01)
        self.stats.held = 0
      try:
        answers = self._call([p for prompts, _ in taken for p in prompts])
      except Exception as e:  # noqa: BLE001 -- handed to each waiting request
        log.exception("teacher call failed")
        for _, future in taken:
          future.set_exception(e)
        continue
      self.stats.requests += len(taken)  # counted before any answer leaves: /health never lags an answer
      start = 0
      for prompts, future in taken:
        future.set_result(answers[start:start + len(prompts)])
        start += len(prompts)

  def _call(self, prompts: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    longest = max(len(p) - 1 for p in prompts)
    length = next(n for n in self.lengths if n >= longest)
    rows = next(n for n in self.row_buckets if n >= len(prompts))
    tokens_BxL = np.zeros((rows, length), np.int32)
    for i, p in enumerate(prompts):
      tokens_BxL[i, :len(p) - 1] = p[:-1]  # the last id's distribution is not asked for
    ids, logprobs, tail = (np.asarray(x) for x in self.fn(tokens_BxL))
    self.stats.calls += 1
    self.stats.rows += len(prompts)
    self.stats.tokens += sum(len(p) - 1 for p in prompts)
    self.stats.shapes.add((rows, length))
    return [(ids[i, :len(p) - 1], logprobs[i, :len(p) - 1], tail[i, :len(p) - 1]) for i, p in enumerate(prompts)]
