"""Progressive layer freezing: frozen parameters never move, thawed ones do, one compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import STUDENT_CFG, TEACHER_CFG, assert_trees_close, make_batch

import meshdistill as md
from meshdistill.train.freezing import (
    Stage,
    check_stages,
    default_stages,
    describe_stages,
    freeze_status,
    progressive_freeze,
    trainable_mask,
)

N_LAYERS = 4
# Stage 1 freezes blocks 0-2 (floor(0.75 * 4)) and, following block 0, the tied embedding;
# stage 2 freezes blocks 0-1 by index; stage 3 trains everything.
STAGES = [
    Stage(start_step=0, freeze=0.75, lr=1e-3),
    Stage(start_step=2, freeze=(0, 1), lr=5e-4),
    Stage(start_step=4, freeze=0.0, lr=2e-4),
]
STEPS = 6
EXPECTED_MOVING = [
    {"block 3", "final_norm"},
    {"block 2", "block 3", "final_norm"},
    {"block 0", "block 1", "block 2", "block 3", "embed", "final_norm"},
]


def _part(path) -> str:
  keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
  return f"block {keys[1]}" if keys[0] == "blocks" else keys[0]


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint32) if x.dtype == np.float32 else x


def _moved(before, after) -> set[str]:
  """Student parts with any bit changed between two host copies of the student params."""
  out = set()
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after)):
    if not np.array_equal(_bits(a), _bits(b)):
      out.add(_part(path))
  return out


@pytest.fixture(scope="module")
def staged_run():
  """Six steps through three stages on a 2x4 mesh, AdamW with weight decay 0.1."""
  mesh = md.make_mesh(data=2, tensor=4)
  student = md.init_model(STUDENT_CFG.replace(n_layers=N_LAYERS), seed=1, mesh=mesh)
  teacher = md.init_model(TEACHER_CFG, seed=0, mesh=mesh)
  tx = progressive_freeze(STAGES, N_LAYERS, optax.adamw(1.0, weight_decay=0.1))
  d = md.Distiller(student, teacher, optimizer=tx, mesh=mesh)
  state = d.init_state()
  snaps, statuses, losses = [jax.device_get(state.params["student"])], [], []
  for i in range(STEPS):
    state, metrics = d.step(state, make_batch(seed=i))
    snaps.append(jax.device_get(state.params["student"]))
    statuses.append(freeze_status(state.opt_state))
    losses.append(float(metrics["loss"]))
  return {"d": d, "state": state, "snaps": snaps, "statuses": statuses, "losses": losses}


def test_frozen_blocks_bitwise_unchanged_through_their_stage_with_weight_decay(staged_run):
  snaps = staged_run["snaps"]
  all_parts = EXPECTED_MOVING[-1]
  for k, stage in enumerate(STAGES):
    start, end = stage.start_step, STAGES[k + 1].start_step if k + 1 < len(STAGES) else STEPS
    frozen = all_parts - EXPECTED_MOVING[k]
    assert frozen.isdisjoint(_moved(snaps[start], snaps[end])), f"stage {k + 1}: a frozen part moved"


def test_each_step_moves_exactly_the_trainable_parts_and_thawed_blocks_start_moving(staged_run):
  snaps = staged_run["snaps"]
  for step in range(STEPS):
    k = sum(step >= s.start_step for s in STAGES) - 1
    assert _moved(snaps[step], snaps[step + 1]) == EXPECTED_MOVING[k], f"step {step}"
  assert np.all(np.isfinite(staged_run["losses"]))


def test_one_compilation_serves_every_stage_with_its_learning_rate(staged_run):
  d, state = staged_run["d"], staged_run["state"]
  assert d.compiled_step(state)._cache_size() == 1
  assert [s["stage"] for s in staged_run["statuses"]] == [0, 0, 1, 1, 2, 2]
  assert [s["next_stage"] for s in staged_run["statuses"]] == [0, 1, 1, 2, 2, 2]
  np.testing.assert_allclose([s["lr"] for s in staged_run["statuses"]], [1e-3, 1e-3, 5e-4, 5e-4, 2e-4, 2e-4], rtol=1e-6)


def test_optimizer_moments_shard_like_their_params(staged_run):
  state = staged_run["state"]
  adam = state.opt_state.inner[0]
  for moments in (adam.mu, adam.nu):
    for m, p in zip(jax.tree.leaves(moments), jax.tree.leaves(state.params)):
      assert m.sharding.is_equivalent_to(p.sharding, p.ndim)
  assert adam.count.shape == (N_LAYERS + 2,)  # one step count per group: 4 blocks, embedding, final norm


def test_replicated_params_and_optimizer_state_identical_on_every_device(staged_run):
  state = staged_run["state"]
  for leaf in jax.tree.leaves((state.params, state.opt_state)):
    by_index = {}
    for shard in leaf.addressable_shards:
      by_index.setdefault(str(shard.index), []).append(_bits(shard.data))
    assert len(leaf.addressable_shards) == 8
    for copies in by_index.values():
      assert len(copies) >= 2  # replicated at least over `data`
      for c in copies[1:]:
        assert np.array_equal(copies[0], c)


# ------------------------------------------------------------------ optax-level behaviour (no mesh)
def _toy_params(n_layers=2):
  blocks = {i: {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3) * (i + 1)} for i in range(n_layers)}
  return {"student": {"blocks": blocks, "embed": {"embedding": jnp.ones((4, 3))}, "final_norm": {"scale": jnp.ones(3)}},
          "strategy": {"proj": jnp.full((3,), 0.5)}}


def _run(tx, params, grads, n):
  state, ups, update = tx.init(params), [], jax.jit(tx.update)
  for _ in range(n):
    u, state = update(grads, state, params)
    ups.append(u)
    params = optax.apply_updates(params, u)
  return params, ups


def test_single_unfrozen_stage_equals_adamw_at_that_learning_rate():
  params = _toy_params()
  grads = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x) + 0.01 * x, params)
  ours, _ = _run(progressive_freeze([Stage(start_step=0, lr=3e-3)], 2, optax.adamw(1.0, weight_decay=0.1), clip=None),
                 params, grads, 3)
  ref, _ = _run(optax.adamw(3e-3, weight_decay=0.1), params, grads, 3)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), ours, ref)


def test_group_frozen_from_the_start_begins_like_fresh_adamw_at_thaw():
  params = _toy_params()
  grads = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x) + 0.01 * x, params)
  stages = [Stage(start_step=0, freeze=(0,), lr=1e-2), Stage(start_step=3, lr=1e-2)]
  tx = progressive_freeze(stages, 2, optax.adamw(1.0, weight_decay=0.1), clip=None)
  _, ups = _run(tx, params, grads, 4)
  for u in ups[:3]:
    assert np.all(np.asarray(u["student"]["blocks"][0]["w"]) == 0.0)
  _, fresh = _run(optax.adamw(1e-2, weight_decay=0.1), params, grads, 1)
  np.testing.assert_allclose(ups[3]["student"]["blocks"][0]["w"], fresh[0]["student"]["blocks"][0]["w"], rtol=1e-6)
  # block 1 trained throughout: its 4th update is AdamW's 4th, not a fresh start
  _, ref = _run(optax.adamw(1e-2, weight_decay=0.1), params, grads, 4)
  np.testing.assert_allclose(ups[3]["student"]["blocks"][1]["w"], ref[3]["student"]["blocks"][1]["w"], rtol=1e-6)


def test_clipping_sees_only_trainable_gradients():
  params = _toy_params()
  grads = jax.tree.map(lambda x: 0.01 * jnp.ones_like(x), params)
  grads["student"]["blocks"][0]["w"] = jnp.full((2, 3), 1e3)  # huge, but block 0 is frozen
  tx = progressive_freeze([Stage(start_step=0, freeze=(0,), lr=0.5)], 2, optax.sgd(1.0), clip=1.0)
  _, ups = _run(tx, params, grads, 1)
  np.testing.assert_allclose(ups[0]["student"]["blocks"][1]["w"], -0.5 * 0.01 * np.ones((2, 3)), rtol=1e-6)


def test_full_freeze_freezes_head_and_embeddings_but_never_strategy_params():
  params = _toy_params()
  mask = trainable_mask(params, Stage(start_step=0, freeze=1.0, lr=1e-3), 2)
  assert not any(jax.tree.leaves(mask["student"]))
  assert all(jax.tree.leaves(mask["strategy"]))
  grads = jax.tree.map(jnp.ones_like, params)
  new, _ = _run(progressive_freeze([Stage(start_step=0, freeze=1.0, lr=1e-3)], 2), params, grads, 2)
  for a, b in zip(jax.tree.leaves(params["student"]), jax.tree.leaves(new["student"])):
    assert np.array_equal(_bits(a), _bits(b))
  assert not np.array_equal(new["strategy"]["proj"], params["strategy"]["proj"])


def test_explicit_embedding_flag_overrides_block_zero_rule():
  params = _toy_params()
  follows = trainable_mask(params, Stage(start_step=0, freeze=(0,), lr=1e-3), 2)
  thawed = trainable_mask(params, Stage(start_step=0, freeze=(0,), lr=1e-3, freeze_embeddings=False), 2)
  assert follows["student"]["embed"]["embedding"] is False and thawed["student"]["embed"]["embedding"] is True


def test_default_recipe_and_fraction_rounding():
  stages = default_stages((10, 20))
  assert [(s.start_step, s.freeze, s.lr) for s in stages] == [(0, 0.8, 1e-4), (10, 0.5, 5e-5), (30, 0.0, 1e-5)]
  assert stages[0].frozen_blocks(5) == (0, 1, 2, 3)
  assert stages[0].frozen_blocks(4) == (0, 1, 2)  # floor(3.2)
  assert "frozen blocks [0, 1, 2]" in describe_stages(stages, 4)[0]
  assert freeze_status({"no": jnp.zeros(())}) is None


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: check_stages([Stage(start_step=0, lr=1e-3), Stage(start_step=0, lr=1e-4)], 4), "start_step"),
        (lambda: check_stages([Stage(start_step=5, lr=1e-3), Stage(start_step=2, lr=1e-4)], 4), "start_step"),
        (lambda: check_stages([Stage(start_step=0, lr=1e-3), Stage(start_step=9, lr=1e-4),
                               Stage(start_step=3, lr=1e-5)], 4), "strictly increase"),
        (lambda: Stage(start_step=0, freeze=1.5, lr=1e-3), "Stage.freeze=1.5"),
        (lambda: Stage(start_step=0, freeze=-0.1, lr=1e-3), "Stage.freeze"),
        (lambda: progressive_freeze([Stage(start_step=0, freeze=(0, 4), lr=1e-3)], 4), "n_layers=4"),
        (lambda: Stage(start_step=0, lr=-1.0), "Stage.lr"),
        (lambda: Stage(start_step=-1, lr=1e-3), "Stage.start_step"),
        (lambda: progressive_freeze([], 4), "stages is empty"),
        (lambda: default_stages((10,)), "stage_steps"),
    ],
)
def test_bad_schedule_raises_naming_the_setting(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_block_index_beyond_n_layers_in_params_raises():
  tx = progressive_freeze([Stage(start_step=0, lr=1e-3)], 1)
  with pytest.raises(ValueError, match="n_layers=1"):
    tx.init(_toy_params(n_layers=2))


# ------------------------------------------------------------------ stacked blocks (scan_layers=true)
SCAN_LAYERS = 2
# block 0 frozen from the start, thawed for one step, frozen again (with moments of its own to hold)
SCAN_STAGES = [Stage(start_step=0, freeze=(0,), lr=1e-2), Stage(start_step=2, lr=5e-3),
               Stage(start_step=3, freeze=(0,), lr=5e-3)]
SCAN_STEPS = 5


def _stacked_block0(tree):
  """Slice 0 (block 0) of every stacked block leaf of a student params-shaped tree, as host bits."""
  return [_bits(x[0]) for x in jax.tree.leaves(jax.device_get(tree["student"]["blocks"]))]


def _scan_run(scan: bool, mesh, fsdp: bool = False):
  from meshdistill.models.stacking import to_scanned, to_unrolled

  student = md.init_model(STUDENT_CFG.replace(n_layers=SCAN_LAYERS), seed=1, mesh=mesh)
  student = to_scanned(student) if scan else student
  teacher = md.init_model(TEACHER_CFG, seed=0, mesh=mesh)
  # eps 1e-3: a thawed block takes AdamW's first step, ~g / (|g| + eps) per element, so the last-bit gradient
  # differences of the two layouts on a mesh (~1e-8 here) would change an element whose gradient is ~1e-7 by a
  # few percent with eps 1e-8 (measured: 1.3e-5 on one weight); eps 1e-3 bounds that amplification by 1 / eps.
  tx = progressive_freeze(SCAN_STAGES, SCAN_LAYERS, optax.adamw(1.0, eps=1e-3, weight_decay=0.1))
  d = md.Distiller(student, teacher, optimizer=tx, mesh=mesh, fsdp=fsdp)
  state = d.init_state()
  losses, block0 = [], []

  def snapshot():
    adam = state.opt_state.inner[0]
    block0.append((_stacked_block0(state.params), _stacked_block0(adam.mu), _stacked_block0(adam.nu),
                   int(jax.device_get(adam.count)[0])))

  for i in range(SCAN_STEPS):
    if scan:
      snapshot()
    state, metrics = d.step(state, make_batch(seed=i))
    losses.append(float(metrics["loss"]))
  if scan:
    snapshot()
  return {"losses": losses, "student": jax.device_get(nnx.state(to_unrolled(d.student(state)), nnx.Param)),
          "block0": block0, "state": state, "mesh": mesh}


_UNROLLED_RUNS = {}


@pytest.fixture(scope="module", params=["1dev", "2x4", "2x4-fsdp"])
def scan_runs(request):
  """The same freezing run with unrolled and stacked student blocks (one device, the 2x4 mesh, fsdp on it);
  the stacked run with fsdp is compared with the replicated unrolled one."""
  shape = None if request.param == "1dev" else (2, 4)
  mesh = None if shape is None else md.make_mesh(*shape)
  if shape not in _UNROLLED_RUNS:
    _UNROLLED_RUNS[shape] = _scan_run(False, mesh)
  return _UNROLLED_RUNS[shape], _scan_run(True, mesh, request.param.endswith("fsdp"))


def test_stacked_blocks_freeze_like_per_layer_blocks(scan_runs):
  unrolled, scanned = scan_runs
  np.testing.assert_allclose(scanned["losses"], unrolled["losses"], rtol=1e-5)
  assert_trees_close(scanned["student"], unrolled["student"], rtol=1e-5, atol=1e-6)
  adam, params = scanned["state"].opt_state.inner[0], scanned["state"].params
  for m, p in zip(jax.tree.leaves((adam.mu, adam.nu)), 2 * jax.tree.leaves(params)):  # stacked moments shard like
    assert m.shape == p.shape and m.sharding.is_equivalent_to(p.sharding, p.ndim)   # their params (fsdp included)
  assert scanned["state"].opt_state.inner[0].count.shape == (SCAN_LAYERS + 2,)  # per block, embedding, final norm
  np.testing.assert_array_equal(scanned["state"].opt_state.inner[0].count, unrolled["state"].opt_state.inner[0].count)


def test_frozen_slice_of_stacked_blocks_bitwise_unchanged_then_thaws(scan_runs):
  block0 = scan_runs[1]["block0"]  # before each step and after the last: block 0's (params, mu, nu) slices, its count
  same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b))  # noqa: E731
  for step in range(SCAN_STEPS):
    before, after = block0[step], block0[step + 1]
    k = sum(step >= s.start_step for s in SCAN_STAGES) - 1
    if 0 in SCAN_STAGES[k].frozen_blocks(SCAN_LAYERS):  # weight decay, nonzero gradients: any update changes bits
      assert all(same(a, b) for a, b in zip(before[:3], after[:3])) and before[3] == after[3], f"step {step}"
    else:
      assert not any(np.array_equal(x, y) for x, y in zip(before[0], after[0])) and after[3] == before[3] + 1
  assert block0[-1][3] == 1 and not all(np.all(x == 0) for x in block0[-1][1])  # held moments of its own
