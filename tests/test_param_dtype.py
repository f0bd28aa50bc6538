"""``ModelConfig.param_dtype``: a frozen teacher stored in bfloat16 computes the same numbers as its float32
weights cast at use (bfloat16 compute), in half the memory, through every path that builds or reloads a teacher;
the student trains float32 weights only."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import STUDENT_CFG, TEACHER_CFG, make_batch

import meshdistill as md
from meshdistill.teachers.checkpoint import load_teacher, save_teacher
from meshdistill.config import ConfigError, load_config
from meshdistill.data import ByteTokenizer
from meshdistill.models.quantize import quantize_model
from meshdistill.models.stacking import to_scanned

ROOT = pathlib.Path(__file__).resolve().parents[1]
QWEN3 = ROOT / "tests" / "fixtures" / "hf_qwen3"
BF16 = TEACHER_CFG.replace(dtype="bfloat16", qk_norm=True, tie_embeddings=False)  # every kind of weight


def _device_bytes(model) -> int:
  """Bytes of the weights on the first device (its addressable shards)."""
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(nnx.state(model)) for s in x.addressable_shards if s.device == dev)


def _logits(model, tokens):
  """The model's logits, one compiled program (eager, every op of the forward compiles on its own)."""
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x).logits)(state, tokens))


def _tokens():
  return jnp.asarray(make_batch(seed=3, batch=8)["inputs"])


@pytest.mark.parametrize("shape", [None, (2, 4)])
def test_bf16_stored_teacher_gives_bit_identical_logits_in_half_the_memory(shape):
  mesh = None if shape is None else md.make_mesh(*shape)
  f32 = md.init_model(BF16, seed=0, mesh=mesh)
  bf16 = md.init_model(BF16.replace(param_dtype="bfloat16"), seed=0, mesh=mesh)
  # the same seed, the same model: the float32 initialisation rounded
  for (k, a), (_, b) in zip(nnx.to_flat_state(nnx.state(f32)), nnx.to_flat_state(nnx.state(bf16))):
    assert b.get_value().dtype == jnp.bfloat16, k
    np.testing.assert_array_equal(np.asarray(b.get_value()), np.asarray(a.get_value().astype(jnp.bfloat16)), str(k))
    assert b.get_value().sharding == a.get_value().sharding, k
  tokens = _tokens()
  np.testing.assert_array_equal(_logits(bf16, tokens), _logits(f32, tokens))
  scanned = to_scanned(bf16)  # stacked bf16 weights: the same numbers as the stacked float32 ones
  np.testing.assert_array_equal(_logits(scanned, tokens), _logits(to_scanned(f32), tokens))
  assert _device_bytes(bf16) * 2 == _device_bytes(f32)
  assert _device_bytes(scanned) == _device_bytes(bf16)
  q, q32 = (quantize_model(m, "int8", mesh=mesh) for m in (bf16, f32))  # teacher.quantize of a bfloat16 teacher
  assert _device_bytes(q) < _device_bytes(bf16)
  np.testing.assert_allclose(_logits(q, tokens), _logits(q32, tokens), atol=0.05)


@pytest.fixture(scope="module")
def losses():
  """Two steps on 2x4 with fsdp (weights gathered from their data split): a float32-stored and a bf16-stored teacher."""
  mesh = md.make_mesh(2, 4)
  student_cfg = STUDENT_CFG.replace(dtype="bfloat16")
  out = {}
  for name in ("float32", "bfloat16"):
    teacher = md.init_model(BF16.replace(param_dtype=name), seed=0, mesh=mesh)
    student = md.init_model(student_cfg, seed=1, mesh=mesh)
    d = md.Distiller(student, teacher, mesh=mesh, fsdp=True)
    state = d.init_state()
    got = []
    for i in range(2):
      state, metrics = d.step(state, make_batch(seed=i))
      got.append(float(metrics["loss"]))
    out[name] = got
  return out


def test_2x4_fsdp_distill_steps_with_a_bf16_stored_teacher_equal_the_float32_stored(losses):
  assert np.isfinite(losses["bfloat16"]).all()
  assert losses["bfloat16"] == losses["float32"]


def test_student_weights_other_than_float32_are_refused():
  student = md.init_model(STUDENT_CFG.replace(param_dtype="bfloat16"), seed=1)
  with pytest.raises(ValueError, match=r"student.param_dtype='bfloat16': the student trains with float32 weights"):
    md.Distiller(student, md.init_model(TEACHER_CFG))
  with pytest.raises(ConfigError, match=r"student.param_dtype='bfloat16'.*set student.param_dtype=float32"):
    load_config(overrides=["student.param_dtype=bfloat16"])
  with pytest.raises(ConfigError, match=r"teacher.param_dtype='int8'; choose one of \('auto', 'float32', 'bfloat16', 'float16'\)"):
    load_config(overrides=["teacher.param_dtype=int8"])
  with pytest.raises(ValueError, match=r"ModelConfig.param_dtype='float64'"):
    md.ModelConfig(param_dtype="float64")


def test_teacher_hf_with_param_dtype_loads_bf16_weights_and_copies_float32_students():
  from meshdistill import jobs  # pylint: disable=g-import-not-at-top
  from meshdistill.models.hf import load_hf  # pylint: disable=g-import-not-at-top
  from meshdistill.teachers.sources import build_student  # pylint: disable=g-import-not-at-top

  mesh = md.make_mesh(2, 4)
  cfg = load_config(str(ROOT / "configs" / "hf_example.yaml"),
                    [f"teacher.hf={QWEN3}", f"data.source={QWEN3.parent / 'hf_text.jsonl'}", "teacher.dtype=bfloat16",
                     "teacher.param_dtype=bfloat16", "student.init={from_teacher: true, layers: [1]}"])
  assert cfg.teacher.param_dtype == "bfloat16" and cfg.student.param_dtype == "auto"  # auto: float32 for a student
  assert cfg.to_dict()["teacher"]["param_dtype"] == "bfloat16"  # written back beside teacher.hf
  teacher = jobs.obtain_teacher(cfg, None, mesh)[0]
  assert {x.dtype for x in jax.tree.leaves(nnx.state(teacher))} == {jnp.dtype(jnp.bfloat16)}
  want = load_hf(QWEN3, mesh, dtype="bfloat16")
  np.testing.assert_array_equal(np.asarray(teacher(_tokens()).logits), np.asarray(want(_tokens()).logits))
  student = build_student(cfg, teacher, mesh)  # copies of the teacher's bf16 block, stored float32
  got = student.blocks[0].mlp.up.kernel.get_value()
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(teacher.blocks[1].mlp.up.kernel.get_value(), np.float32))


def test_teacher_checkpoint_saved_float32_loads_as_bf16_and_the_cache_key_ignores_it(tmp_path):
  from meshdistill.jobs import teacher_key  # pylint: disable=g-import-not-at-top

  f32 = md.init_model(TEACHER_CFG, seed=0)
  save_teacher(str(tmp_path / "t"), f32, ByteTokenizer(), {})
  want_cfg = TEACHER_CFG.replace(param_dtype="bfloat16")
  got = load_teacher(str(tmp_path / "t"), want_cfg, md.make_mesh(2, 4), ByteTokenizer())
  assert got.cfg.param_dtype == "bfloat16"
  for (k, a), (_, b) in zip(nnx.to_flat_state(nnx.state(f32)), nnx.to_flat_state(nnx.state(got))):
    np.testing.assert_array_equal(np.asarray(b.get_value()), np.asarray(a.get_value().astype(jnp.bfloat16)), str(k))
  # pretraining trains and caches float32 weights whatever teacher.param_dtype: one cached teacher for both
  cfg = load_config()
  tok = ByteTokenizer()
  assert teacher_key(cfg, tok) == teacher_key(cfg.replace(teacher=cfg.teacher.replace(param_dtype="bfloat16")), tok)


def test_planner_keeps_teacher_param_dtype_for_presets_and_halves_teacher_weights():
  from meshdistill import planner  # pylint: disable=g-import-not-at-top

  pl = planner.make_planner("qwen3-1.7b", "qwen3-0.6b", devices="cpu:8", seq=16,
                            overrides=["teacher.param_dtype=bfloat16"])
  assert (pl.teacher.param_dtype, pl.student.weight_dtype.name) == ("bfloat16", "float32")
  a = md.plan(devices="cpu:8", mesh="2x4")
  b = md.plan(devices="cpu:8", mesh="2x4", overrides=["teacher.param_dtype=bfloat16"])
  assert a.memory["teacher_weights"] == 2 * b.memory["teacher_weights"] > 0
  assert a.memory["student_weights"] == b.memory["student_weights"]


@pytest.mark.parametrize("shape", [None, (2, 4)], ids=["1-device", "2x4"])
def test_the_callers_teacher_holds_the_weights_the_step_reads_so_no_second_copy_stays(shape):
  """A teacher the caller keeps (a run keeps it for its final evaluation) holds the Distiller's placed weights
  themselves, not its own copies beside them: frozen (``param_dtype`` auto computing in bfloat16: rounded) and laid
  out as the step reads them, its values unchanged."""
  mesh = None if shape is None else md.make_mesh(*shape)
  cfg = TEACHER_CFG.replace(dtype="bfloat16", param_dtype="auto")
  teacher = md.init_model(cfg, seed=0, mesh=mesh)
  before = jax.tree.map(np.asarray, jax.device_get(nnx.state(teacher)))
  d = md.Distiller(md.init_model(STUDENT_CFG, seed=1, mesh=mesh), teacher, mesh=mesh)
  held = jax.tree.leaves(nnx.state(teacher))
  placed = jax.tree.leaves(d.teacher_params)
  assert len(held) == len(placed) and all(a is b for a, b in zip(held, placed))
  assert teacher.cfg.weight_dtype == "bfloat16" and {x.dtype for x in held} == {jnp.dtype("bfloat16")}
  for want, got in zip(jax.tree.leaves(before), held):  # the float32 weights rounded, nothing else changed
    np.testing.assert_array_equal(np.asarray(got), want.astype(jnp.bfloat16))
