"""What the TPU support adds that a CPU can check: the splash kernel's block sizes, `plan --devices local` refused
off a TPU, the devices line of a job, and the profile benchmarks' reading of a compiled step's HLO."""

import jax
import jax.numpy as jnp
import pytest
from helpers import bench_module

import meshdistill as md
from meshdistill.jobs._setup import describe_devices
from meshdistill.models import _attention
from meshdistill.planner._hardware import parse_target


@pytest.mark.parametrize("T", [128, 384, 1536, 2048, 8192])
def test_splash_blocks_divide_every_multiple_of_128_and_use_the_fused_backward_kernel(T):
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  sizes = _attention._splash_block_sizes(splash, T)
  for name in ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute"):
    assert T % getattr(sizes, name) == 0, (name, getattr(sizes, name))
  assert sizes.block_kv % sizes.block_kv_compute == 0
  assert sizes.use_fused_bwd_kernel and sizes.block_q_dq is None and sizes.block_kv_dq is None


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
