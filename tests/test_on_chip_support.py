"""What the TPU support adds that a CPU can check: the splash kernel's block sizes and kept residuals, `plan --devices
local` refused off a TPU, the devices line of a job, the profile benchmarks' reading of a compiled step's HLO, and the
chip test run's check for a TPU that JAX could not take."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest
from helpers import bench_module

import meshdistill as md
from meshdistill.jobs._setup import describe_devices
from meshdistill.models import _attention, splash_block_sizes
from meshdistill.planner import parse_target


@pytest.mark.parametrize("T", [128, 384, 1536, 2048, 8192])
def test_splash_blocks_divide_every_multiple_of_128_and_use_the_fused_backward_kernel(T):
  sizes = splash_block_sizes(T)
  for name in ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute"):
    assert T % getattr(sizes, name) == 0, (name, getattr(sizes, name))
  assert sizes.block_kv % sizes.block_kv_compute == 0
  assert sizes.use_fused_bwd_kernel and sizes.block_q_dq is None and sizes.block_kv_dq is None


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
@pytest.mark.parametrize("dtype, head_dim, cap, precision, backward_block", [
    ("bfloat16", 128, 5.0, None, 1024),  # the models' own case: the larger backward blocks
    ("bfloat16", 256, None, None, 1024),  # Gemma 3's heads
    ("bfloat16", 256, 5.0, None, 512),  # Gemma 2's heads (soft-capped scores): 17.4 MiB at 1024
    ("float32", 128, 5.0, "highest", 512),  # the chip's float32 test: 23.2 MiB at 1024
    ("float32", 256, 5.0, None, 512),
    ("bfloat16", 128, None, "highest", 1024),  # Mosaic has no 'highest' bfloat16 product: the kernel runs at default
], ids=["bf16-128-cap", "bf16-256", "bf16-256-cap", "f32-128-cap-highest", "f32-256-cap", "bf16-128-highest"])
def test_splash_forward_and_backward_fit_a_v5e_chips_on_chip_memory(dtype, head_dim, cap, precision, backward_block):
  """Compiled for one v5e chip (libtpu here, nothing runs): the kernel's blocks fit its 16 MiB of scoped on-chip memory
  for every input dtype, head size and soft-cap (too large a block fails the compile: CompileTimeScopedVmemOom), and
  the backward kernel takes the larger blocks where they fit."""
  import contextlib
  import re

  from jax.sharding import SingleDeviceSharding

  from meshdistill.planner._hardware import tpu_target

  device = SingleDeviceSharding(tpu_target("v5e:2x2").devices[0])
  shape = lambda heads: jax.ShapeDtypeStruct((1, heads, 2048, head_dim), jnp.dtype(dtype), sharding=device)  # noqa: E731

  def loss(q, k, v):
    return jnp.sum(_attention._splash_attention(q, k, v, interpret=False, cap=cap).astype(jnp.float32))

  with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape(4), shape(2), shape(2)).compile().as_text()
  blocks = re.findall(r"block_q_dkv\W+(\d+)", hlo)
  assert blocks and {int(b) for b in blocks} == {backward_block}, blocks


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
def test_the_dots_policies_keep_the_splash_kernels_residuals_so_its_forward_runs_once_per_step():
  """Compiled for one v5e chip: a rematerialised attention's value and gradient run the splash forward kernel once
  under the "dots" policies (its output and log-sum-exp are kept, `ATTENTION_RESIDUALS`) and twice under "full";
  the gradients are the same either way (interpreted on this CPU, bit for bit: the same kernel on the same
  inputs)."""
  from jax.sharding import SingleDeviceSharding

  from meshdistill.models import REMAT_POLICIES
  from meshdistill.planner._hardware import tpu_target

  def attend(q, k, v, interpret):
    return jnp.sum(_attention._splash_attention(q, k, v, interpret=interpret).astype(jnp.float32) ** 2)

  device = SingleDeviceSharding(tpu_target("v5e:2x2").devices[0])
  shape = lambda heads: jax.ShapeDtypeStruct((1, heads, 256, 128), jnp.bfloat16, sharding=device)  # noqa: E731
  forwards = {}
  for name in ("full", "dots", "dots_no_batch"):
    step = jax.value_and_grad(jax.checkpoint(lambda q, k, v: attend(q, k, v, False), policy=REMAT_POLICIES[name]),
                              argnums=(0, 1, 2))
    hlo = jax.jit(step).lower(shape(4), shape(2), shape(2)).compile().as_text()
    calls = [line for line in hlo.splitlines() if "custom-call" in line and "tpu_custom_call" in line]
    forwards[name] = sum("splash_mqa_fwd" in line for line in calls)
    assert sum("splash_mqa_dkv" in line for line in calls) == 1, (name, calls)
  assert forwards == {"full": 2, "dots": 1, "dots_no_batch": 1}

  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, h, 256, 128), jnp.bfloat16) for key, h in zip(keys, (4, 2, 2)))
  grads = {name: jax.jit(jax.grad(jax.checkpoint(lambda q, k, v: attend(q, k, v, True), policy=REMAT_POLICIES[name]),
                                  argnums=(0, 1, 2)))(q, k, v) for name in ("full", "dots")}
  for full, dots in zip(grads["full"], grads["dots"]):
    assert jnp.array_equal(full, dots)


def test_plan_for_local_devices_off_a_tpu_is_refused_naming_what_would_work():
  with pytest.raises(ValueError, match=r"devices=local .*'cpu' \(cpu\).*devices=cpu:N.*v5e:4x4"):
    parse_target(None, "local")
  with pytest.raises(ValueError, match="local"):  # the list of what works names local too
    parse_target(None, "gpu:2")


def test_a_job_names_its_devices_and_the_mesh_its_step_runs_on():
  mesh = md.make_mesh(data=2, tensor=4)
  assert describe_devices(mesh) == "devices: 8 x cpu (cpu); the step runs on mesh data=2 x tensor=4"
  assert describe_devices(None).endswith("the step runs on one device")


def test_profile_roles_follow_the_source_files_of_each_instructions_stack():
  op_kinds = bench_module("op_kinds")

  def loss_like(x):
    return jnp.sum(jnp.exp(x @ x))

  hlo = jax.jit(loss_like).lower(jnp.ones((8, 8))).compile().as_text()
  kinds = op_kinds.hlo_kinds(hlo)
  assert "matmul" in kinds.values()
  roles = op_kinds.hlo_roles(hlo, (("test_on_chip_support.py", "here"),))
  assert set(roles) == set(kinds) and "here" in roles.values()  # every instruction traced from this file's function
  nowhere = op_kinds.hlo_roles(hlo, (("no_such_file.py", "elsewhere"),))
  assert nowhere == kinds  # no rule matches: each keeps its kind


def test_dropped_expert_assignments_stay_zero_whatever_ragged_dot_leaves_past_its_groups(monkeypatch):
  """On a TPU `ragged_dot` leaves the rows past its last group unspecified (the chip's test set found NaN there,
  where the CPU writes zeros): a capacity-dropped assignment must not carry them into the output."""
  from meshdistill.models.moe import MoeConfig, dense_experts, grouped_experts, route

  true_ragged_dot = jax.lax.ragged_dot

  def nan_past_groups(rows, group_sizes):
    past = jnp.arange(rows.shape[0]) >= jnp.sum(group_sizes)
    return jnp.where(past[:, None], jnp.nan, rows)

  @jax.custom_vjp
  def like_a_tpu(lhs, rhs, group_sizes):  # NaN past the groups, in the value and in the lhs gradient
    return nan_past_groups(true_ragged_dot(lhs, rhs, group_sizes), group_sizes)

  def forward(lhs, rhs, group_sizes):
    return like_a_tpu(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

  def backward(res, ct):
    lhs, rhs, group_sizes = res
    d_lhs, d_rhs = jax.vjp(lambda a, b: true_ragged_dot(a, b, group_sizes), lhs, rhs)[1](ct)
    return nan_past_groups(d_lhs, group_sizes), d_rhs, None

  like_a_tpu.defvjp(forward, backward)

  monkeypatch.setattr(jax.lax, "ragged_dot", like_a_tpu)
  N, D, F, E = 48, 8, 16, 4
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (N, D))
  weights, experts = route(jax.random.normal(keys[1], (N, E)), MoeConfig(n_experts=E, top_k=2))
  w = [jax.random.normal(k, s) for k, s in zip(keys[2:], [(E, D, F), (E, D, F), (E, F, D)])]
  keep = jnp.arange(2 * N).reshape(N, 2) % 3 != 0
  def loss(fn):
    return jax.value_and_grad(lambda x, w: jnp.sum(fn(x, experts, weights, *w, keep) ** 2), argnums=(0, 1))

  (got, got_grads), (want, want_grads) = loss(grouped_experts)(x, w), loss(dense_experts)(x, w)
  assert bool(jnp.isfinite(got)) and jnp.allclose(got, want, rtol=1e-4)
  for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert bool(jnp.all(jnp.isfinite(g))) and jnp.allclose(g, r, rtol=1e-3, atol=1e-3)


def test_a_tpu_on_the_pci_bus_is_found_whatever_jax_makes_of_it(tmp_path):
  """The chip's test run stops with an error, not a skip, where a TPU is on the machine but JAX cannot take it."""
  path = pathlib.Path(__file__).parent / "tpu" / "conftest.py"
  spec = importlib.util.spec_from_file_location("tpu_conftest", path)
  tpu_conftest = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tpu_conftest)
  for name, vendor in [("0000:00:04.0", "0x8086\n"), ("0000:00:05.0", "0x1af4\n")]:
    (tmp_path / name).mkdir()
    (tmp_path / name / "vendor").write_text(vendor)
  assert not tpu_conftest.tpu_on_this_machine(str(tmp_path))
  (tmp_path / "0000:00:06.0").mkdir()
  (tmp_path / "0000:00:06.0" / "vendor").write_text("0x1ae0\n")
  assert tpu_conftest.tpu_on_this_machine(str(tmp_path))
  assert not tpu_conftest.tpu_on_this_machine(str(tmp_path / "missing"))
