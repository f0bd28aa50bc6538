"""`meshdistill plan`: the planner compiles the step `distill` runs, and its report is consistent.

TPU tests compile for the abstract devices of a libtpu topology (``pip install 'meshdistill[tpu]'``,
part of the ``test`` extra); without libtpu they skip. The pair below is small enough to compile in
seconds but large enough that matmuls dominate its FLOPs and its weights overflow a 1 GiB budget on
a 2x2 mesh while fitting on 1x4.
"""

import json
import math
import os
import re

import numpy as np
import pytest

import meshdistill as md
from meshdistill import cli, jobs, planner
from meshdistill.config import load_config
from meshdistill.train.memory import step_memory
from meshdistill.train.loop.evaluate import Evaluator
from meshdistill.planner._compile import abstract_batch, compile_step

needs_libtpu = pytest.mark.skipif(not planner.libtpu_available(),
                                  reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")

TEACHER = md.ModelConfig(vocab_size=8192, d_model=512, n_layers=2, n_heads=8, n_kv_heads=4, mlp_hidden=2048,
                         max_len=16, tie_embeddings=False, dtype="float32", param_dtype="float32")  # counted as f32
# key/value heads divide tensor=4 on both models, so every split weight halves (fewer are replicated)
STUDENT = TEACHER.replace(d_model=256, n_heads=4, n_kv_heads=4, mlp_hidden=1024)
BATCH, SEQ = 4, 16


@pytest.fixture(scope="module")
def tpu_plans():
  """The pair on v5e:2x2: mesh 1x4 planned alone, and mesh 2x2 under a budget its weights overflow but 1x4 fits.

  The budget lies between the weights and optimizer state of 2x2 (a lower bound of its memory, known without
  compiling) and what the compiled 1x4 needs (`Plan.need_bytes`: the compiler's peak), so the planner must say "does not fit" for 2x2 and find 1x4.
  """
  b = md.plan(TEACHER, STUDENT, topology="v5e:2x2", mesh="1x4", batch=BATCH, seq=SEQ)
  pl = planner.make_planner(TEACHER, STUDENT, topology="v5e:2x2", seq=SEQ)
  static_2x2 = pl.static_bytes(planner.Knobs(2, 2, "none", None, BATCH))
  assert static_2x2 > b.need_bytes, "the test pair's weights must dominate its activations"
  budget_gib = (static_2x2 + b.need_bytes) / 2 / b.headroom / 2**30
  a = md.plan(TEACHER, STUDENT, topology="v5e:2x2", mesh="2x2", batch=BATCH, seq=SEQ, hbm_gib=budget_gib, suggest=1)
  return a, b


@needs_libtpu
def test_a_budget_too_small_does_not_fit_and_the_suggestion_replanned_fits(tpu_plans):
  a, b = tpu_plans
  assert a.fits is False and a.over_bytes > 0
  assert "DOES NOT FIT" in a.table() and "nearest configurations that fit" in a.table()
  assert len(a.suggestions) == 1
  s = a.suggestions[0]
  assert s.fits and s.need_bytes <= s.limit_bytes and s.mesh == (1, 4)
  assert s.memory == b.memory  # the suggestion and the same configuration planned on its own: one program
  # one truth: the suggestion's step time is that plan's calibrated estimate, printed as the plan prints it
  assert b.time["calibrated"] is not None and s.estimate_seconds == b.estimate_seconds == b.time["calibrated"]["step_s"]
  assert b.estimate_label().startswith("est. ") and b.estimate_label() in a.table()
  assert b.estimate_seconds != b.step_seconds  # the roofline is another figure
  # libtpu gives its own peak of live buffers: the fit is judged on it, and the table says so
  assert b.memory["need"] == b.memory["compiler_peak"] > 0 and "compiler peak (live at once)" in b.table()


@needs_libtpu
def test_weights_per_chip_halve_when_tensor_doubles(tpu_plans):
  a, b = tpu_plans
  assert (a.mesh[1], b.mesh[1]) == (2, 4)
  for key in ("teacher_weights", "student_weights", "optimizer_state"):
    ratio = b.memory[key] / a.memory[key]
    # norm scales (d_model floats per block) stay replicated: a shade over one half
    assert 0.5 <= ratio < 0.505, (key, ratio)


@needs_libtpu
def test_compiled_flops_match_the_analytic_count_within_15_percent(tpu_plans):
  for p in tpu_plans:
    f = p.flops  # counted: each loop body (scanned blocks, loss chunks) times its trips
    assert abs(f["counted"] / f["analytic"] - 1) < 0.15, f
  a = tpu_plans[0]
  assert a.time["step_s"] > 0 and 0 < a.time["mfu"] < 1
  assert {c["kind"] for c in a.collectives} >= {"all-reduce"}
  assert {c["axis"] for c in a.collectives} >= {"data", "tensor"}


def test_cpu_plan_of_the_main_job_equals_the_memory_of_the_step_distill_runs():
  cfg = load_config(None)  # the main job: default config, 2x4 mesh on 8 devices
  p = md.plan(devices="cpu:8")
  assert cfg.mesh.auto and p.mesh == (cfg.mesh.resolved(None).data, cfg.mesh.resolved(None).tensor) == (2, 4) and (p.batch, p.seq) == (cfg.train.batch_size, cfg.data.seq_len)

  mesh = jobs.build_mesh(cfg)
  teacher = md.init_model(cfg.teacher, seed=0, mesh=mesh)
  distiller = jobs.make_distiller(cfg, teacher, mesh)
  state = distiller.init_state()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.teacher.vocab_size, (cfg.train.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones(tokens[:, 1:].shape, np.float32)}
  real = step_memory(distiller, state, batch)
  planned = p.memory
  assert (planned["temp"], planned["arguments"], planned["output"], planned["alias"], planned["total"]) == (
      real.temp_bytes, real.argument_bytes, real.output_bytes, real.alias_bytes, real.total_bytes)
  parts = sum(planned[k] for k in ("teacher_weights", "student_weights", "optimizer_state", "other_state", "batch"))
  # the compiler counts the optimizer's boolean scalar (non-finite guard) differently from its 1-byte item size
  assert abs(parts - planned["arguments"]) <= 8
  assert p.fits is None and p.time["step_s"] is None  # a CPU device has no HBM or peak known


def test_cli_plan_json_parses(capsys):
  rc = cli.main(["plan", "--devices", "cpu:8", "--json", "--hbm-gib", "0.5", "--set", "train.batch_size=8"])
  assert rc == 0
  out = json.loads(capsys.readouterr().out)
  # on CPU devices with a budget, `auto` keeps the configured job's mesh (2x4) where its weights fit easily
  assert out["mesh"] == {"data": 2, "tensor": 4} and out["batch"] == 8 and out["fits"] is True
  assert out["memory"]["total"] > 0 and out["flops"]["compiled"] > 0


def test_a_plan_carries_every_mesh_axis_it_is_given_and_the_search_enumerates_the_declared_ones(capsys, monkeypatch):
  rc = cli.main(["plan", "--devices", "cpu:8", "--config", "tiny", "--json", "--mesh", "data=2,expert=2,tensor=2",
                 "--set", "train.batch_size=4"])
  assert rc == 0
  out = json.loads(capsys.readouterr().out)
  assert out["mesh"] == {"data": 2, "expert": 2, "tensor": 2} and out["memory"]["total"] > 0
  axes = {c["axis"] for c in out["collectives"]}
  assert axes and axes <= {"data", "expert", "tensor", "data+tensor", "data+expert", "expert+tensor",
                           "data+expert+tensor", "none"}, axes
  knobs = planner.Knobs.on({"data": 2, "expert": 1, "tensor": 4}, "none", None, 4)
  assert knobs == planner.Knobs(2, 4, "none", None, 4)  # an axis of size 1 changes nothing
  with pytest.raises(ValueError, match=r"mesh data=2,expert=2,tensor=4 \(data x expert x tensor\) needs 16 devices "
                                       r"but cpu:8 has 8; .*: 8x1, 4x2, 2x4, 1x8"):
    md.plan(devices="cpu:8", mesh="data=2,expert=2,tensor=4")
  with pytest.raises(ValueError, match=r"mesh: unknown mesh axis 'pipe'"):
    md.plan(devices="cpu:8", mesh="data=2,pipe=2,tensor=2")
  # a layout that declares the expert axis: the search enumerates it (the planner reads the layout's axes)
  from meshdistill.parallel.backends import ShardMapLayout
  monkeypatch.setattr(ShardMapLayout, "axes", ("data", "expert", "tensor"))
  pl = planner.make_planner(config="tiny", devices="cpu:8")
  shapes = pl.layouts(4)
  assert {"data": 2, "expert": 2, "tensor": 2} in shapes and {"data": 2, "expert": 1, "tensor": 4} in shapes
  assert len(shapes) == len({tuple(s.values()) for s in shapes})


def test_unknown_topology_lists_the_families():
  with pytest.raises(ValueError, match=r"v5e.*v5p|v5p.*v5e") as e:
    md.plan(topology="v9z:2x2")
  assert "topology='v9z:2x2'" in str(e.value)


@needs_libtpu
def test_a_slice_smaller_than_one_host_plans_its_own_chips_and_a_shape_no_host_holds_is_refused():
  """libtpu refuses ``v5e:1x1`` as a topology (a v5e host has 2x2 chips); the planner describes it as a host of one
  chip, so a one-chip plan compiles the program one chip runs: one device, no collective. A shape no host of the
  family holds stays libtpu's refusal, named."""
  assert [len(planner._hardware.tpu_target(t).devices) for t in ("v5e:1x1", "v5e:1x2", "v6e:1x1", "v5e:2x2")] == [1, 2, 1, 4]
  p = md.plan(TEACHER, STUDENT, topology="v5e:1x1", mesh="1x1", batch=BATCH, seq=SEQ)
  assert p.mesh == (1, 1) and p.collectives == [] and p.memory["need"] == p.memory["compiler_peak"] > 0
  four = md.plan(TEACHER, STUDENT, topology="v5e:2x2", mesh="4x1", batch=4 * BATCH, seq=SEQ)
  assert {c["kind"] for c in four.collectives} == {"all-reduce"}  # what planning one chip as a 2x2 slice added
  with pytest.raises(ValueError, match=r"topology='v5e:3x3' was rejected by libtpu .*chips_per_host_bounds"):
    planner._hardware.tpu_target("v5e:3x3")


def test_missing_libtpu_names_the_extra(monkeypatch):
  monkeypatch.setattr(planner._hardware, "libtpu_available", lambda: False)
  with pytest.raises(ValueError, match=r"meshdistill\[tpu\]"):
    md.plan(topology="v5e:2x2")


def test_compile_only_libtpu_gets_deep_fiber_stacks_and_keeps_the_users_flags(monkeypatch):
  """libtpu's default fiber stacks overflow on some real steps (a SIGSEGV, no error): a planning process asks for
  larger ones after whatever the user passed, names them in ``--undefok`` (libtpu exits on a flag it does not define,
  and a later libtpu may not define these), and a stack size the user chose stays theirs. Set while libtpu loads
  only: afterwards the environment is the user's (a subprocess started after planning, a job on this machine's TPU
  say, inherits no made-up accelerator type)."""
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_flag_of_mine=1 --undefok=a")
  monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "mine")
  with planner._hardware._quiet_libtpu():
    assert os.environ["LIBTPU_INIT_ARGS"].split() == [
        "--xla_tpu_flag_of_mine=1", "--undefok=a,fibers_default_thread_stack_size",
        f"--fibers_default_thread_stack_size={16 * 2**20}"]
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5litepod-4" and os.environ["TPU_WORKER_HOSTNAMES"] == "mine"
  assert os.environ["LIBTPU_INIT_ARGS"] == "--xla_tpu_flag_of_mine=1 --undefok=a"
  assert "TPU_ACCELERATOR_TYPE" not in os.environ and os.environ["TPU_WORKER_HOSTNAMES"] == "mine"
  with_stack = planner._hardware._with_stack_flags
  assert with_stack("").split() == [f"--fibers_default_thread_stack_size={16 * 2**20}",
                                    "--undefok=fibers_default_thread_stack_size"]
  assert with_stack("--fibers_default_thread_stack_size=1234") == "--fibers_default_thread_stack_size=1234"
  # a process that runs on an accelerator (no JAX_PLATFORMS=cpu) is left alone
  monkeypatch.setenv("JAX_PLATFORMS", "")
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--mine=1")
  with planner._hardware._quiet_libtpu():
    assert os.environ["LIBTPU_INIT_ARGS"] == "--mine=1" and "TPU_ACCELERATOR_TYPE" not in os.environ


@pytest.mark.skipif(not planner.libtpu_available(), reason="needs libtpu: pip install 'meshdistill[tpu]'")
def test_planning_for_a_tpu_leaves_the_environment_as_it_was(monkeypatch):
  """After a TPU target is described (libtpu loaded for compiling only) the process's environment holds none of the
  variables it was loaded with: a subprocess started after planning gets the user's environment."""
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  before = dict(os.environ)
  planner._hardware.tpu_target("v5e:1x1")
  assert dict(os.environ) == before


@pytest.mark.parametrize("argv, want", [([], 4), (["--max-compiles", "0"], 0), (["--max-compiles", "2"], 2),
                                         (["--search"], 12), (["--search", "--max-compiles", "0"], 0)])
def test_max_compiles_reaches_the_planner_and_zero_compiles_no_suggestion(monkeypatch, argv, want):
  seen = {}

  class Stub:
    def table(self):
      return ""

  def fake(*args, max_compiles, **kwargs):
    seen["max_compiles"] = max_compiles
    return [] if "batches" in kwargs else Stub()

  monkeypatch.setattr(planner, "plan", fake)
  monkeypatch.setattr(planner, "search", fake)
  monkeypatch.setattr(planner, "search_table", lambda plans: "")
  assert cli.main(["plan", "--devices", "cpu:8", *argv]) == 0
  assert seen["max_compiles"] == want


def test_mesh_not_matching_the_device_count_lists_layouts_that_do():
  with pytest.raises(ValueError, match=r"mesh 3x3 .* needs 9 devices but cpu:8 has 8; .*: 8x1, 4x2, 2x4, 1x8"):
    md.plan(devices="cpu:8", mesh="3x3")


def test_heads_that_cannot_split_over_tensor_name_the_model():
  odd = md.ModelConfig(vocab_size=264, d_model=96, n_layers=1, n_heads=3, n_kv_heads=1, head_dim=34, mlp_hidden=256,
                       max_len=128)
  with pytest.raises(ValueError, match=r"tensor=4: student .*n_heads \* head_dim=102"):
    md.plan(student=odd, devices="cpu:8", mesh="2x4")


def test_presets_match_their_published_sizes():
  sizes = {"llama3.2-1b": 1.24e9, "llama3.1-8b": 8.03e9, "llama3.1-70b": 70.6e9, "qwen3-0.6b": 0.596e9,
           "qwen3-8b": 8.19e9, "qwen3-32b": 32.8e9}
  for name, n in sizes.items():
    cfg, _ = planner.resolve_model(name, who="teacher")
    assert abs(_count(cfg) / n - 1) < 0.01, (name, _count(cfg))


def _count(c: md.ModelConfig) -> int:
  attn = c.d_model * c.hd * (2 * c.n_heads + 2 * c.n_kv_heads) + (2 * c.hd if c.qk_norm else 0)
  block = attn + 3 * c.d_model * c.mlp_hidden + 2 * c.d_model
  return c.n_layers * block + c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2) + c.d_model


def test_search_ranks_the_compiled_configurations_that_fit():
  plans = planner.search(devices="cpu:8", meshes=[(2, 4), (8, 1)], remats=["none"], chunk_sizes=[None],
                         hbm_gib=0.5, max_compiles=2)
  assert sorted(p.mesh for p in plans) == [(2, 4), (8, 1)] and all(p.fits for p in plans)
  totals = [p.memory["total"] for p in plans]
  assert totals == sorted(totals)  # no step time on CPU: ranked by memory
  assert "rank" in planner.search_table(plans)


@needs_libtpu
def test_splash_compiles_for_a_tpu_topology_to_the_mosaic_kernel_on_each_devices_heads():
  """The planner's program (abstract Distiller, libtpu's compiler, from this CPU host) with attention='splash' on
  v5e:2x2 as mesh 2x2: the kernel is the Mosaic custom call, not Pallas's interpreted loop (interpret mode follows
  the mesh's platform, not the host's backend), and each device runs it on its own 2 of the 4 query heads; the same
  for evaluation's program (a plain jit under the mesh)."""
  cfg = md.ModelConfig(vocab_size=1024, d_model=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, mlp_hidden=512,
                       max_len=128, attention="splash", dtype="bfloat16")
  pl = planner.make_planner(cfg, cfg.replace(remat="full"), topology="v5e:2x2", seq=128)
  hlo = compile_step(pl._distiller(planner.Knobs(2, 2, "full", None, 4)), 4, 128).hlo
  kernels = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  # the backward is the fused kernel (dq accumulated in the dk/dv pass: `splash_block_sizes`), no dq kernel of its own
  assert {re.search(r"%(splash_mqa_\w+?)(_no)?_residuals", k).group(1) for k in kernels} == {
      "splash_mqa_fwd", "splash_mqa_dkv"}
  assert " while(" not in hlo  # an interpreted kernel is a while loop over its grid
  forward = [k for k in kernels if "splash_mqa_fwd" in k]
  outs = {tuple(int(x) for x in dims.split(","))
          for k in forward for dims in re.findall(r"bf16\[([\d,]+)\]", k.split("custom-call(")[0])}
  # the attention output per device: batch 4 / data 2, heads 4 / tensor 2, 128 tokens, head_dim 64
  assert {math.prod(s) for s in outs} == {2 * 2 * 128 * 64}, outs

  # evaluation's plain jit runs under the mesh (jax.set_mesh): the kernel is placed there too
  d = pl._distiller(planner.Knobs(2, 2, "none", None, 4))
  params = d.init_state().params["student"]
  evaluator = Evaluator(d.student_def, mesh=d.mesh)
  hlo = evaluator.lower(params, abstract_batch(d.mesh, 4, 128)).compile().as_text()
  assert hlo.count('custom_call_target="tpu_custom_call"') == 1 and " while(" not in hlo


@needs_libtpu
def test_a_program_compiled_for_a_tpu_topology_is_not_written_to_the_persistent_cache():
  """An executable compiled for abstract TPU devices cannot be read back from JAX's persistent cache on a machine
  without that TPU (JAX warns and compiles again): the planner's compile writes none. The same program compiled for
  this machine's CPU is written (the suite runs with a persistent cache and no minimum compile time)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  from meshdistill.planner._compile import _compile  # pylint: disable=g-import-not-at-top
  from meshdistill.planner._hardware import tpu_target  # pylint: disable=g-import-not-at-top

  folder = jax.config.jax_compilation_cache_dir
  assert folder, "the suite's conftest sets a persistent compilation cache"

  def entries(name):
    return [f for f in os.listdir(folder) if f.startswith(f"jit_{name}-")] if os.path.isdir(folder) else []

  def probe_for_the_planners_cache_test(x):
    return jnp.tanh(x) * 3.0

  for devices, written in ((tpu_target("v5e:2x2").devices[:1], False), (jax.devices("cpu")[:1], True)):
    mesh = Mesh(np.array(devices).reshape(1, 1), ("data", "tensor"))
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    before = entries(probe_for_the_planners_cache_test.__name__)
    _compile(jax.jit(probe_for_the_planners_cache_test).trace(x).lower(), mesh)
    after = entries(probe_for_the_planners_cache_test.__name__)
    assert (len(after) > len(before)) == written, (devices[0].platform, before, after)


def test_a_v5e_plan_budgets_what_the_chip_gives_a_program_as_every_chip_row_measured_it():
  """The plan's budget for a v5e chip is the runtime's limit (``bytes_limit``), the number `distill`'s tuner reads
  on the chip, not the 16 GiB of HBM: the same fit from a host's plan and on the chip. Every v5e row of the chip's
  records measured that limit."""
  import pathlib

  from meshdistill.core.chips import TPU_CHIPS

  rows = [json.loads(line) for line in
          (pathlib.Path(__file__).parents[1] / "benchmarks/results/tpu_step.jsonl").read_text().splitlines() if line]
  limits = {r["bytes_limit"] for r in rows if r.get("device") == "TPU v5 lite" and r.get("bytes_limit")}
  assert limits == {TPU_CHIPS["v5e"].limit_bytes}
  v5e = planner._hardware.Target("v5e:1x1", (), TPU_CHIPS["v5e"])
  assert v5e.budget_bytes == TPU_CHIPS["v5e"].limit_bytes < TPU_CHIPS["v5e"].hbm_bytes
  assert planner._hardware.Target("v6e:1x1", (), TPU_CHIPS["v6e"]).budget_bytes == TPU_CHIPS["v6e"].hbm_bytes
