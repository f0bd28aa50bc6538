"""The defaults are the fast path where the job runs: `auto` attention, dtypes and mesh, each decided for the
target (a TPU's choices are checked here on the CPU by naming the platform, as the planner does)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshdistill.config import Config, ConfigError, MeshSettings, load_config
from meshdistill.models import ModelConfig, frozen_model, init_model
from meshdistill.planner._entry import _concrete


CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_len=256)


def test_auto_attention_is_splash_on_a_tpu_where_it_applies_and_xla_elsewhere():
  assert CFG.kernel(2048, platform="tpu", tensor=1) == "splash"
  assert CFG.kernel(2048, platform="tpu", tensor=4) == "splash"  # 4 divides n_heads: each device its heads
  assert CFG.kernel(2048, platform="tpu", tensor=8) == "xla"  # the kernel cannot split a head
  assert CFG.kernel(2000, platform="tpu", tensor=1) == "xla"  # not a multiple of the kernel's 128 lanes
  assert CFG.kernel(2048, platform="tpu", tensor=1, decoding=True) == "xla"
  assert CFG.kernel(2048, platform="tpu", tensor=1, probs=True) == "explicit"
  assert CFG.kernel(2048, platform="cpu", tensor=1) == "xla"
  assert CFG.kernel(2048, platform="gpu", tensor=1) == "xla"
  capped = CFG.replace(attn_softcap=50.0)
  assert capped.kernel(2048, platform="tpu", tensor=1) == "splash"  # the kernel soft-caps
  assert capped.kernel(2048, platform="cpu", tensor=1) == "explicit"  # dot_product_attention cannot
  assert CFG.replace(attention="xla").kernel(2048, platform="tpu", tensor=1) == "xla"  # a choice given stays


def test_auto_dtypes_compute_bfloat16_on_a_tpu_and_store_a_frozen_teacher_so():
  assert CFG.dtype == CFG.param_dtype == "auto"
  assert CFG.for_platform("tpu").compute_dtype == jnp.bfloat16
  assert CFG.for_platform("cpu").compute_dtype == jnp.float32
  assert CFG.weight_dtype == jnp.float32  # a model that trains keeps float32 weights
  assert CFG.frozen("tpu").param_dtype == "bfloat16"
  assert CFG.frozen("cpu").param_dtype == "float32"
  assert CFG.replace(param_dtype="float32").frozen("tpu").param_dtype == "float32"  # given: kept
  assert CFG.replace(dtype="float16").frozen("tpu").param_dtype == "float16"
  # this process runs on the CPU: auto computes in float32, the main job's numbers as before
  assert CFG.compute_dtype == jnp.float32


def test_a_frozen_teacher_is_stored_in_its_compute_dtype_by_rounding_each_weight():
  bf16 = CFG.replace(dtype="bfloat16")
  teacher = init_model(bf16, seed=0)
  x = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
  logits = np.asarray(teacher(x).logits, np.float32)
  before = [np.asarray(a) for a in jax.tree.leaves(nnx.state(teacher))]
  stored = frozen_model(teacher, "cpu")
  leaves = jax.tree.leaves(nnx.state(stored))
  assert stored is teacher  # in place: the float32 arrays are not kept beside the rounded ones
  assert stored.cfg.param_dtype == "bfloat16" and {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
  for a, b in zip(before, leaves):
    np.testing.assert_array_equal(np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float32),
                                  np.asarray(b, np.float32))
  # bfloat16 compute casts float32 weights to bfloat16 where they are used: the same logits either way
  np.testing.assert_array_equal(logits, np.asarray(stored(x).logits, np.float32))
  float_teacher = init_model(CFG, seed=0)
  assert frozen_model(float_teacher, "cpu") is float_teacher and float_teacher.cfg.weight_dtype == jnp.float32


def test_the_planner_makes_auto_concrete_for_its_target():
  tpu = _concrete(CFG, "tpu", 2048).frozen("tpu")
  assert (tpu.dtype, tpu.param_dtype, tpu.attention) == ("bfloat16", "bfloat16", "splash")
  cpu = _concrete(CFG, "cpu", 2048)
  assert (cpu.dtype, cpu.param_dtype, cpu.attention) == ("float32", "auto", "xla")


def test_auto_scan_layers_stacks_the_blocks_on_an_accelerator_where_they_stack():
  assert CFG.scan_layers == "auto"
  assert CFG.scanned_on("tpu") and CFG.scanned_on("gpu") and not CFG.scanned_on("cpu")
  # weights split over tensor: per layer (a scanned step all-gathered its activations in every layer; the MoE test of
  # tests/test_moe.py compiles the default pair at mesh 1x4 and counts no all-gather)
  assert not CFG.scanned_on("tpu", tensor=4) and CFG.replace(scan_layers=True).scanned_on("tpu", tensor=4)
  assert CFG.with_scan("tpu").scan_layers is True and CFG.with_scan("cpu").scan_layers is False
  assert CFG.replace(scan_layers=False).scanned_on("tpu") is False  # a choice given stays
  assert CFG.replace(scan_layers=True).scanned_on("cpu") is True
  mixed = CFG.replace(n_layers=2, moe={"n_experts": 4, "top_k": 2, "dense_layers": (0,)})  # dense and expert blocks
  assert mixed.scanned_on("tpu") is False
  with pytest.raises(ValueError, match="mixes dense and expert layers"):
    mixed.replace(scan_layers=True)
  with pytest.raises(ValueError, match="must be true, false or auto"):
    CFG.replace(scan_layers="yes")
  built = init_model(CFG, seed=0)  # a built model's config says which layout it has
  assert built.cfg.scan_layers is False and isinstance(built.blocks, nnx.List)


def test_a_lora_student_keeps_per_layer_blocks_under_auto_and_names_the_setting_when_stacked():
  assert load_config(None, ["student.lora.rank=4"]).student.scan_layers is False  # qwix adapts blocks/<i>/... by path
  with pytest.raises(ConfigError, match="student.scan_layers=false or auto"):
    load_config(None, ["student.lora.rank=4", "student.scan_layers=true"])


@pytest.mark.parametrize("backend, accelerators, batch, want", [
    ("shard_map", None, 8, (2, 4)),  # no accelerator: the reference layout on 8 simulated devices
    ("shard_map", 1, 4, (1, 1)),  # one chip
    ("shard_map", 8, 8, (8, 1)),
    ("shard_map", 8, 4, (4, 2)),  # data divides the batch; the rest splits weights
    ("pmap", None, 8, (8, 1)),  # pmap has no tensor axis
    ("pmap", 8, 4, (8, 1)),
    ("single", None, 8, (1, 1)),
])
def test_an_auto_mesh_uses_the_devices_present(backend, accelerators, batch, want):
  m = MeshSettings(backend=backend).resolved(accelerators, batch)
  assert (m.data, m.tensor) == want


def test_a_mesh_size_given_is_kept_and_the_other_fills_the_devices():
  assert MeshSettings(data=1).resolved(8, 8).tensor == 8
  assert MeshSettings(tensor=2).resolved(8, 8).data == 4
  assert MeshSettings(tensor=2).resolved(None, 8).data == 2  # CPU: the reference layout's data


def test_the_config_checks_an_auto_mesh_as_it_resolves_here():
  with pytest.raises(Exception, match="mesh.data=2"):
    Config().replace(train=Config().train.__class__(batch_size=3))


def test_bfloat16_splash_under_highest_precision_and_remat_traces_each_kernel_in_its_own_trace():
  # bfloat16 is the default compute dtype on a TPU; there the splash kernel runs at the default precision under a
  # higher one (a custom_vjp) and a remat policy traces it again: a kernel made outside those traces leaked its mask
  cfg = ModelConfig(vocab_size=64, d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=128, mlp_hidden=128,
                    max_len=128, attention="splash", dtype="bfloat16", remat="full", scan_layers=True)
  graphdef, params = nnx.split(init_model(cfg, seed=0))
  x = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 128)), jnp.int32)
  loss = lambda p: nnx.merge(graphdef, p)(x).logits.astype(jnp.float32).mean()  # noqa: E731
  with jax.default_matmul_precision("highest"):
    grads = jax.jit(jax.grad(loss))(params)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def test_remat_auto_keeps_none_without_a_memory_limit_and_the_same_numbers():
  from helpers import STUDENT_CFG, TEACHER_CFG, make_batch

  import meshdistill as md

  assert STUDENT_CFG.remat == "auto"
  runs = {}
  for remat in ("auto", "none"):
    d = md.Distiller(init_model(STUDENT_CFG.replace(remat=remat), seed=1), init_model(TEACHER_CFG, seed=0))
    state = d.init_state()
    state, metrics = d.step(state, make_batch())
    runs[remat] = (d.student_cfg.remat, float(metrics["loss"]))
  assert runs["auto"] == runs["none"] and runs["auto"][0] == "none"  # a CPU reports no memory limit


def test_remat_auto_takes_the_first_policy_that_fits_and_keeps_the_choice_by_program(tmp_path, monkeypatch):
  from helpers import STUDENT_CFG, TEACHER_CFG, make_batch

  import meshdistill as md
  from meshdistill.train import memory, tuning

  monkeypatch.setenv("MESHDISTILL_TUNING", str(tmp_path / "tuning.json"))
  d = md.Distiller(init_model(STUDENT_CFG, seed=1), init_model(TEACHER_CFG, seed=0))
  state, batch = d.init_state(), make_batch()
  need = memory.step_memory(d.with_remat("none"), state, batch).need_bytes
  chosen, choice = tuning.auto_tune(d, state, batch, budget_bytes=2 * need)
  assert (chosen.student_cfg.remat, choice.fits, choice.cached) == ("none", True, False)
  kept = list(__import__("json").loads((tmp_path / "tuning.json").read_text()).values())
  assert kept == [{"remat": "none", "micro_batch": 8, "chunk": None, "fits": True}]

  def no_compiling(*a, **k):
    raise AssertionError("a known program must not be measured again")

  measure_step = tuning.measure_step
  monkeypatch.setattr(tuning, "measure_step", no_compiling)
  again, choice = tuning.auto_tune(d, state, batch, budget_bytes=2 * need)
  assert (again.student_cfg.remat, choice.cached) == ("none", True)
  with pytest.raises(AssertionError, match="measured again"):  # another program (batch) is measured
    tuning.auto_tune(d, state, make_batch(batch=4), budget_bytes=2 * need)
  monkeypatch.setattr(tuning, "measure_step", measure_step)
  # a budget no policy meets: the leanest measured, reported as not fitting, kept so a restart compiles nothing
  _, choice = tuning.auto_tune(d, state, batch, budget_bytes=need // 100)
  assert not choice.fits and choice.remat in memory.REMAT_ORDER and not choice.cached
  line = choice.line()
  assert "; the leanest, which needs " in line and line.endswith(f"over 90% of {tuning.size(need // 100)})"), line
  monkeypatch.setattr(tuning, "measure_step", no_compiling)
  _, again = tuning.auto_tune(d, state, batch, budget_bytes=need // 100)
  assert (again.chosen, again.fits, again.cached) == (choice.chosen, False, True)
  assert again.line().endswith(f"; the leanest, none of the candidates fits 90% of {tuning.size(need // 100)})")


def test_the_default_loss_is_chunked_on_a_large_vocabulary_and_gives_the_full_logit_numbers():
  import meshdistill as md
  from meshdistill.strategies import CHUNKED_FROM_VOCAB, default_recipe

  kd = md.LogitKD(temperature=2.0, alpha=0.5)
  big = default_recipe(kd, CHUNKED_FROM_VOCAB, model_teacher=True)
  assert isinstance(big, md.ChunkedLogitKD) and (big.temperature, big.alpha, big.chunk_size) == (2.0, 0.5, 1024)
  assert default_recipe(kd, CHUNKED_FROM_VOCAB - 1, model_teacher=True) is kd  # the main job's 264: as before
  assert default_recipe(kd, CHUNKED_FROM_VOCAB, model_teacher=False) is kd  # a top-k teacher has no LM head
  assert default_recipe(md.LogitKD(top_k=8), CHUNKED_FROM_VOCAB, model_teacher=True).top_k == 8  # named: kept

  from helpers import make_batch
  cfg = CFG.replace(vocab_size=CHUNKED_FROM_VOCAB, d_model=16, n_heads=2, n_kv_heads=1, mlp_hidden=32, max_len=8)
  student, teacher = init_model(cfg, seed=1), init_model(cfg.replace(n_layers=2), seed=0)
  auto = md.Distiller(student, teacher, optimizer=__import__("optax").sgd(0.1))
  named = md.Distiller(student, teacher, strategy=md.LogitKD(), optimizer=__import__("optax").sgd(0.1))
  assert isinstance(auto.strategy, md.ChunkedLogitKD) and isinstance(named.strategy, md.LogitKD)
  assert (auto.chunk_size, named.chunk_size) == ("auto", None)  # the loss the Distiller chose: its chunk is tuned
  batch = make_batch(batch=2, seq=8, vocab=CHUNKED_FROM_VOCAB)
  _, got = auto.step(auto.init_state(), batch)
  assert auto.chunk_size == auto.strategy.chunk_size == 1024  # nothing measured on a CPU: the default chunk
  _, want = named.step(named.init_state(), batch)
  for key in ("loss", "kl", "ce"):  # float32 sums over 32k logits in another order: a few ulps of the loss
    np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=2e-5)


def test_a_compilers_out_of_memory_refusal_is_a_measurement_that_does_not_fit():
  from meshdistill.train import memory

  # libtpu refuses to compile a step larger than the chip (remat none at 4 x 2048 on a v5e): that is a size, not an
  # error, for the choice of remat
  said = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (20.22G) "
          "exceeds available HBM (15.75G).")
  report = memory.out_of_memory_report(said)
  assert report is not None and report.need_bytes == int(20.22 * 2**30)
  assert memory.out_of_memory_report("INVALID_ARGUMENT: something else") is None
  choice = memory.choose_remat(lambda r: report if r == "none" else memory.MemoryReport(1, 1, 1, 0),
                               budget_bytes=int(15.75 * 2**30))
  assert (choice.remat, choice.fits) == ("dots", True)


def test_a_run_written_with_float32_before_auto_existed_resumes_under_the_auto_defaults(tmp_path):
  import yaml

  from meshdistill.config import load_config
  from meshdistill.jobs._distill_job import _changed_settings

  run = tmp_path / "run"
  run.mkdir()
  old = Config().to_dict()
  for who in ("teacher", "student"):  # what config.yaml held before the auto defaults
    old[who].update(dtype="float32", param_dtype="float32", attention="auto", remat="none")
  old["mesh"].update(data=2, tensor=4)
  (run / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
  cfg = load_config(None, [f"run.run_dir={run}"])
  _changed_settings(cfg)  # on this CPU auto is float32: the same run
  with pytest.raises(Exception, match="student.dtype: trained with 'float32', now 'bfloat16'"):
    _changed_settings(load_config(None, [f"run.run_dir={run}", "student.dtype=bfloat16"]))
