"""The training loop under its safeguards: divergence recovery, exact resume across it, remat by memory."""

import io
import re

import jax
import numpy as np
import pytest
from helpers import write_corpus

import meshdistill as md
from meshdistill import jobs
from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.config import ConfigError, load_config
from meshdistill.data import DataConfig, build_data
from meshdistill.train.memory import CPU_MEMORY_SCHEDULER, step_memory
from meshdistill.train.loop.monitor import Monitor, read_metrics
from meshdistill.train.loop.safeguards import DivergenceGuard, LogitMSE
from meshdistill.train.loop.trainer import fit, make_optimizer

VOCAB = 264  # byte tokenizer
TEACHER = md.ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_len=16)
STUDENT = TEACHER.replace(d_model=16, n_layers=2, mlp_hidden=32)
POISON = 3  # the 4th batch read (data position 3) holds a NaN: its step's loss is NaN
# Stage 1 (bottom block frozen) runs 6 updates, stage 2 trains everything.
FREEZE = "train.freeze=[{start_step: 0, freeze: [0], lr: 0.01}, {start_step: 6, lr: 0.01}]"


class PoisonedData:
  """A data bundle whose batch at each position in ``poison`` carries a NaN in its mask."""

  def __init__(self, bundle, poison=(POISON,)):
    self.bundle, self.poison = bundle, set(poison)

  def val_batches(self, max_batches=None):
    return self.bundle.val_batches(max_batches=max_batches)

  def train_iterator(self, state=None):
    return _PoisonedIterator(self.bundle.train_iterator(state), self.poison)


class _PoisonedIterator:
  def __init__(self, it, poison):
    self.it, self.poison = it, poison

  def __next__(self):
    position = self.it.get_state()["next_batch"]
    batch = dict(next(self.it))
    if position in self.poison:
      mask = batch["mask"].astype(np.float32)
      mask[0, 0] = np.nan
      batch["mask"] = mask
    return batch

  def get_state(self):
    return self.it.get_state()

  def close(self):
    self.it.close()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  src = write_corpus(tmp_path_factory.mktemp("corpus") / "c")
  return build_data(DataConfig(source=src, seq_len=16, val_fraction=0.25), batch_size=8)


@pytest.fixture(scope="module")
def mesh():
  return md.make_mesh(data=2, tensor=4)


def settings(steps=10):
  return load_config("tiny", [f"train.steps={steps}", "train.warmup=1", FREEZE]).train


def new_distiller(mesh, steps=10):
  return md.Distiller(
    md.init_model(STUDENT, seed=1, mesh=mesh),
    md.init_model(TEACHER, seed=0, mesh=mesh),
    optimizer=make_optimizer(settings(steps), STUDENT.n_layers),
    mesh=mesh,
    strategy=md.LogitKD(alpha=0.7),
  )


def guard():
  return DivergenceGuard(window=10, min_history=2)


def leaves_equal(a, b):
  la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def uninterrupted(data, mesh, tmp_path_factory):
  """10 guarded steps with a poisoned 4th batch, checkpoints every 4 steps, metrics in a run dir."""
  run = tmp_path_factory.mktemp("run")
  d = new_distiller(mesh)
  stream = io.StringIO()
  monitor = Monitor(str(run), 10, stream=stream, tensorboard=False)
  ckpt = Checkpointer(str(run / "ckpt"), every=4)
  try:
    result = fit(d, PoisonedData(data), steps=10, log_every=1, checkpointer=ckpt, monitor=monitor,
                 guard=guard(), keep_every=2)
  finally:
    monitor.close()
    ckpt.close()
  return d, result, read_metrics(str(run)), stream.getvalue(), ckpt


def test_divergence_in_the_trainer_restores_the_good_state_and_falls_back_for_the_rest_of_the_stage(uninterrupted):
  d, result, rows, shown, _ = uninterrupted
  # step 4 read the poisoned batch: NaN loss -> the state of step 2 (the last kept copy) comes back
  assert [(e["step"], e["kind"]) for e in result.events] == [(4, "diverged"), (6, "fallback_end")]
  diverged = result.events[0]
  assert diverged["restored_step"] == 2 and "non-finite" in diverged["reason"] and diverged["strategy"] == "fallback"
  assert "step 4: divergence (non-finite loss nan); restored step 2" in shown
  events = [r for r in rows if r["split"] == "event"]
  assert [(r["step"], r["event"]) for r in events] == [(4, "diverged"), (6, "fallback_end")]
  train = [r for r in rows if r["split"] == "train"]
  # steps 1-3, then 3-10 again from the restored state; the diverged step itself is not logged
  assert [r["step"] for r in train] == [1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10]
  assert [r["fallback"] for r in train] == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
  assert all(("mse" in r) == bool(r["fallback"]) for r in train)  # logit MSE is the loss while falling back
  assert [r["freeze_stage"] for r in train][-4:] == [1, 1, 1, 1]  # stage 2 started after 6 updates
  assert all(np.isfinite(r["loss"]) for r in train) and train[-1]["restores"] == 1
  assert train[-1]["skipped"] == 0  # the optimizer skipped the NaN update, but that state was discarded
  assert events[0]["loss"] == "nan"  # JSON has no NaN: non-finite losses are written as text
  assert int(jax.device_get(result.state.step)) == 10 and result.step == 10
  primary = result.trainer
  assert primary is d and primary.compiled_step(result.state)._cache_size() == 1  # one compile across restores
  fallback = d.with_strategy(md.safeguards.fallback_strategy(d.strategy))  # the one the run used, compiled once
  assert fallback.strategy.divergence == "mse" and fallback.compiled_step(result.state)._cache_size() == 1
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(jax.device_get(result.state.params)))


def test_resume_after_a_divergence_is_bitwise_identical(uninterrupted, data, mesh, tmp_path):
  d, full, _, _, full_ckpt = uninterrupted
  # Checkpoints hold states the guard accepted: step 4 was re-run after the restore.
  assert full_ckpt.all_steps() == [8, 10]
  ckpt = Checkpointer(str(tmp_path / "split"), every=4)
  first = fit(d, PoisonedData(data), steps=10, checkpointer=ckpt, stop_after=5, guard=guard(), keep_every=2)
  assert [e["kind"] for e in first.events] == ["diverged"] and ckpt.latest_step() == 4
  assert ckpt.read_meta()["guard"]["active"] == "fallback"
  ckpt.close()
  resumed_ckpt = Checkpointer(str(tmp_path / "split"), every=4)  # as in a new process: new distiller, new compile
  second = fit(new_distiller(mesh), PoisonedData(data), steps=10, checkpointer=resumed_ckpt, guard=guard(),
               keep_every=2)
  resumed_ckpt.close()
  assert second.resumed_from == 4
  assert [e["kind"] for e in second.events] == ["fallback_end"]  # the fallback carried over and ended on time
  assert leaves_equal(second.state.params, full.state.params)
  assert leaves_equal(second.state.opt_state, full.state.opt_state)


def test_good_states_kept_in_host_memory_restore_the_same_run_bit_for_bit(uninterrupted, data, mesh):
  """``keep_in="host"`` (the default on an accelerator, where the devices' memory is the step's): the good states are
  numpy copies, nothing of the devices' memory, and the divergence restores from them the same run as device copies
  (``auto`` on a CPU: the devices)."""
  from meshdistill.train.loop import guard as guard_lib
  from meshdistill.train.loop.state_copy import keep_place, on_host

  _, full, _, _, _ = uninterrupted
  kept, copied = [], []  # (place, on host, step, copy's identity); where each copy went
  real_keep, real_copy = guard_lib.Recovery.keep, guard_lib.copy_state

  def keep(self, state, step):
    kept.append((self.place, on_host(state), step, id(state)))
    return real_keep(self, state, step)

  def copy_state(state, where="device", shardings=None):
    copied.append(where)
    return real_copy(state, where, shardings)

  guard_lib.Recovery.keep, guard_lib.copy_state = keep, copy_state
  try:
    host = fit(new_distiller(mesh), PoisonedData(data), steps=10, guard=guard(), keep_every=2, keep_in="host")
  finally:
    guard_lib.Recovery.keep, guard_lib.copy_state = real_keep, real_copy
  assert kept and all(k[:2] == ("host", True) for k in kept)
  # the state of a step is copied to host memory once: at the start and after the restore the kept copy serves
  first = {}
  assert all(first.setdefault(step, i) == i for _, _, step, i in kept), kept
  assert len(first) < len(kept) and copied.count("host") < len(kept), (copied, kept)
  assert [(e["step"], e["kind"], e.get("restored_step")) for e in host.events] == [
      (e["step"], e["kind"], e.get("restored_step")) for e in full.events]
  assert leaves_equal(host.state.params, full.state.params) and leaves_equal(host.state.opt_state, full.state.opt_state)
  state = full.state
  assert keep_place("auto", state) == "device"  # a CPU device reports no memory limit
  assert keep_place("host", state) == "host" and keep_place("device", state) == "device"
  # keep_every auto: a copy to host memory crosses the host link, so it is taken 10 times less often
  recovery = guard_lib.Recovery(new_distiller(mesh), guard(), "auto", keep_in="host")
  recovery.start(state, 0)
  assert recovery.every == 100 and [s for s in range(250) if recovery.wants_copy(s)] == [0, 100, 200]
  assert recovery.wants_copy(7, checkpoint_due=True)
  recovery = guard_lib.Recovery(new_distiller(mesh), guard(), "auto", keep_in="auto")
  recovery.start(state, 0)
  assert recovery.every == 10 and recovery.place == "device"
  with pytest.raises(ValueError, match="safeguards.guard.keep_in='disk'; choose one of auto, device, host"):
    keep_place("disk", state)
  with pytest.raises(ConfigError, match="safeguards.guard.keep_in='gpu'"):
    load_config("tiny", ["safeguards.guard.keep_in=gpu"])


def test_repeated_divergence_stops_with_a_clear_error_and_keeps_the_checkpoint(uninterrupted, data, tmp_path):
  d = uninterrupted[0]
  ckpt = Checkpointer(str(tmp_path / "ckpt"), every=2)
  g = DivergenceGuard(window=10, min_history=2, max_restores=1)
  with pytest.raises(RuntimeError, match="diverged 2 times .*max_restores=1 \\(safeguards.guard.max_restores\\)"):
    fit(d, PoisonedData(data, poison=(3, 5)), steps=10, checkpointer=ckpt, guard=g, keep_every=2)
  assert ckpt.latest_step() == 2 and ckpt.read_meta()["step"] == 2
  ckpt.close()


def test_fit_turns_remat_on_when_the_step_exceeds_the_memory_budget(data, tmp_path):
  d = new_distiller(None)  # one device: compiles fastest, and all activations live there
  it = data.train_iterator()
  batch = next(it)
  it.close()
  state = d.init_state()
  # the step as fit measures it on CPU: under the memory-aware scheduler
  none = step_memory(d.with_compiler_options(CPU_MEMORY_SCHEDULER), state, batch).total_bytes
  budget = int(none * 0.999 / 0.9)  # with 90% headroom the plain step just misses
  stream = io.StringIO()
  monitor = Monitor(str(tmp_path), 2, stream=stream, tensorboard=False)
  result = fit(d, data, steps=2, auto_remat=True, memory_budget_bytes=budget, monitor=monitor)
  monitor.close()
  choice = result.remat
  assert choice.reports["none"].total_bytes == none
  assert choice.remat != "none" and choice.fits and choice.reports[choice.remat].total_bytes < none
  assert result.trainer.student_cfg.remat == choice.remat and d.student_cfg.remat == "none"
  # remat auto: decided with the other auto settings, in one line (`train.tuning`)
  assert f"auto: remat={choice.remat}, micro_batch=8, chunk=n/a (the first of" in stream.getvalue()
  (event,) = [r for r in read_metrics(str(tmp_path)) if r["split"] == "event"]
  assert event["event"] == "auto" and event["remat"] == choice.remat and event["micro_batch"] == 8
  assert event["step_mib"]["none"] > event["budget_mib"] * event["headroom"]
  # the remat run trains the same model: equal to a plain run up to float rounding
  plain = fit(d, data, steps=2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               jax.device_get(plain.state.params), jax.device_get(result.state.params))
  assert not leaves_equal(jax.device_get(state.params), result.state.params)
  # without a budget a CPU device has no known limit: nothing is measured, nothing changes
  unmeasured = fit(d, data, steps=1, auto_remat=True)
  assert unmeasured.remat is None and unmeasured.trainer is d


def test_safeguard_settings_build_the_guard_fallback_and_loss_scale(mesh):
  cfg = load_config("tiny", ["safeguards.guard.factor=3.0", "safeguards.guard.keep_every=5",
                             "safeguards.guard.fallback=reverse_kl", "safeguards.loss_scale=1024.0",
                             "safeguards.remat.budget_mib=512"])
  teacher = md.init_model(cfg.teacher, seed=0, mesh=mesh)
  d = jobs.make_distiller(cfg, teacher, mesh)
  assert d.loss_scale == 1024.0 and d.strategy == cfg.distill.strategy()  # a step setting; the strategy unwrapped
  kw = jobs.safeguard_kwargs(cfg, d.strategy)
  assert kw["guard"].factor == 3.0 and kw["keep_every"] == 5 and kw["memory_budget_bytes"] == 512 * 2**20
  assert kw["fallback"].divergence == "reverse_kl" and d.with_strategy(kw["fallback"]).loss_scale == 1024.0
  assert jobs.safeguard_kwargs(load_config("tiny", ["safeguards.guard.enabled=false"])).get("guard") is None
  assert jobs.safeguard_kwargs(cfg)["fallback"] is None  # hard-label training: restore only
  with pytest.raises(ConfigError, match="needs a strategy with a divergence setting"):
    jobs.safeguard_kwargs(cfg, md.strategies.AttentionTransfer())
  assert isinstance(jobs.safeguard_kwargs(load_config("tiny"), md.strategies.AttentionTransfer())["fallback"], LogitMSE)


@pytest.mark.parametrize(
  "override, match",
  [
    ("safeguards.guard.factor=1.0", "safeguards.guard.factor=1.0 must be a number > 1.0"),
    ("safeguards.guard.fallback=kl", "safeguards.guard.fallback='kl'; choose one of"),
    ("safeguards.guard.min_history=60", "min_history=60 must be <= safeguards.guard.window=50"),
    ("safeguards.guard.keep_every=0", "safeguards.guard.keep_every=0: give a positive integer"),
    ("safeguards.guard.keep_every=often", "or auto (10 where the copies stay on the devices, 100 where they go to"),
    ("safeguards.remat.headroom=0", "safeguards.remat.headroom=0.0 must be a number in (0.0, 1.0]"),
    ("safeguards.remat.budget_mib=-5", "safeguards.remat.budget_mib=-5.0 must be a number > 0"),
    ("safeguards.loss_scale=0", "safeguards.loss_scale=0.0 must be a number > 0"),
    ("safeguards.guard.windw=3", "did you mean 'safeguards.guard.window'"),
  ],
)
def test_bad_safeguard_settings_name_the_key(override, match):
  with pytest.raises(ConfigError, match=re.escape(match)):
    load_config("tiny", [override])


class _Probe:
  """A loss that records when the host reads it."""

  def __init__(self, x, step, log):
    self.x, self.step, self.log = x, step, log

  def _read(self):
    self.log.append(("read", self.step))
    return np.asarray(jax.device_get(self.x))

  def __array__(self, dtype=None, copy=None):
    return self._read() if dtype is None else self._read().astype(dtype)

  def __float__(self):
    return float(self._read())


class _Spy:
  """A trainer that records each dispatched step and hands out losses that record their reads."""

  def __init__(self, trainer, log):
    self.trainer, self.log = trainer, log

  def __getattr__(self, name):
    return getattr(self.trainer, name)

  def step(self, state, batch):
    state, metrics = self.trainer.step(state, batch)
    step = len([e for e in self.log if e[0] == "dispatch"]) + 1
    self.log.append(("dispatch", step))
    return state, {**metrics, "loss": _Probe(metrics["loss"], step, self.log)}


class _Counted(PoisonedData):
  def __init__(self, bundle, poison=(POISON,)):
    super().__init__(bundle, poison)
    self.read = 0

  def train_iterator(self, state=None):
    outer, it = self, super().train_iterator(state)

    class _It:
      def __next__(self):
        outer.read += 1
        return next(it)

      def get_state(self):
        return it.get_state()

      def close(self):
        it.close()

    return _It()


@pytest.mark.parametrize("lag", [1, 0])
def test_the_lagged_guard_reads_each_loss_only_after_the_next_step_is_dispatched(uninterrupted, data, lag):
  log = []
  fit(_Spy(uninterrupted[0], log), PoisonedData(data, poison=()), steps=6, guard=guard(), keep_every=2,
      guard_lag=lag)
  order = {e: i for i, e in reversed(list(enumerate(log)))}  # first occurrence of each event
  for k in range(1, 6):
    assert ("read", k) in order
    if lag:  # the step after k is already queued when k's loss is read: dispatch never waits for the guard
      assert order[("dispatch", k + 1)] < order[("read", k)]
    else:
      assert order[("read", k)] < order[("dispatch", k + 1)]


def test_the_lagged_guard_spends_one_more_batch_after_a_divergence_and_changes_nothing_without_one(
    uninterrupted, data):
  d = uninterrupted[0]
  lagged, at_once = _Counted(data), _Counted(data)
  a = fit(d, lagged, steps=6, guard=guard(), keep_every=2)
  b = fit(d, at_once, steps=6, guard=guard(), keep_every=2, guard_lag=0)
  assert [e["restored_step"] for e in a.events if e["kind"] == "diverged"] == [2]
  assert [e["restored_step"] for e in b.events if e["kind"] == "diverged"] == [2]
  # 4 steps, 2 restored, 4 more: 8 batches read at once; the lagged check also spends step 5's batch
  assert (at_once.read, lagged.read) == (8, 9)
  # without a divergence the guard changes no number, lagged or not
  plain = fit(d, PoisonedData(data, poison=()), steps=6)
  for lag in (0, 1):
    guarded = fit(d, PoisonedData(data, poison=()), steps=6, guard=guard(), keep_every=2, guard_lag=lag)
    assert guarded.events == [] and leaves_equal(guarded.state.params, plain.state.params)
