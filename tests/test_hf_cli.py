"""Hugging Face models from the command line: teacher.hf / student.hf / student.init, and `meshdistill export`.

The round trip runs the CLI in this process (the 8 simulated devices of conftest.py) on the
committed Qwen3 fixture: `meshdistill distill --config configs/hf_example.yaml` (a few steps),
`meshdistill export`, then the export is reloaded -- with transformers when torch is installed,
else with `load_hf` -- and its logits compared with the run's student restored from the checkpoint.
"""

import importlib.util
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

import meshdistill as md
from meshdistill import cli, jobs
from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.config import ConfigError, dump_config, load_config
from meshdistill.config import run_config
from meshdistill.jobs.export import export_run
from meshdistill.models.hf import load_hf
from meshdistill.teachers.sources import build_student, load_teacher_hf, student_from_teacher

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
QWEN3 = FIXTURES / "hf_qwen3"
EXAMPLE = str(ROOT / "configs" / "hf_example.yaml")
HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


def _example(*overrides, run_dir):
  """The CLI arguments of the example config with absolute fixture paths, a few steps, in ``run_dir``."""
  sets = [f"teacher.hf={QWEN3}", f"data.source={FIXTURES / 'hf_text.jsonl'}", f"run.run_dir={run_dir}", *overrides]
  return [EXAMPLE, *[a for s in sets for a in ("--set", s)]]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
  """`meshdistill distill` (4 steps, checkpoints at 2 and 4) then `meshdistill export` of the example config.

  On one device, to keep the compile time small; the 2x4 tests below cover sharded loading and copying.
  """
  root = tmp_path_factory.mktemp("hf_cli")
  run_dir, out_dir = root / "run", root / "export"
  args = _example("train.steps=4", "train.warmup=1", "train.eval_every=0", "checkpoint.every=2", "train.eval_batches=1",
                  "mesh.backend=single", "mesh.data=1", "mesh.tensor=1", run_dir=run_dir)
  assert cli.main(["distill", "--config", *args]) == 0
  assert cli.main(["export", str(run_dir), str(out_dir)]) == 0
  return run_dir, out_dir


def _run_student(run_dir, step=None):
  cfg = run_config(str(run_dir))
  mesh = jobs.build_mesh(cfg)
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0)
  meta = ckpt.read_meta(step)
  _, teacher = jobs.run_teacher(cfg, meta, mesh, None)
  distiller = jobs.make_distiller(cfg, teacher, mesh)
  state, _, _ = ckpt.restore(distiller, distiller.init_state(), step)
  ckpt.close()
  return distiller.student(state), teacher


def _tokens():
  return np.random.default_rng(0).integers(0, 128, (2, 16)).astype(np.int32)


def test_cli_distil_export_reload_has_the_run_students_logits(cli_run):
  run_dir, out_dir = cli_run
  student, _ = _run_student(run_dir)
  want = np.asarray(student(jnp.asarray(_tokens())).logits)
  if HAVE_TORCH:  # pragma: no cover - torch is not a test dependency
    import torch
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
      got = reloaded(torch.from_numpy(_tokens()).long()).logits.numpy()
  else:
    got = np.asarray(load_hf(out_dir)(jnp.asarray(_tokens())).logits)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  config = json.loads((out_dir / "config.json").read_text())
  assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("qwen3", 1, 48)
  assert (out_dir / "tokenizer.json").read_bytes() == (QWEN3 / "tokenizer.json").read_bytes()
  # the export is the trained student, not the teacher's copied block: training moved the weights
  teacher_block = load_hf(QWEN3).blocks[1].mlp.down.kernel[...]
  assert np.abs(np.asarray(load_hf(out_dir).blocks[0].mlp.down.kernel[...]) - np.asarray(teacher_block)).max() > 1e-4


def test_export_step_dtype_and_overwrite(cli_run, tmp_path):
  run_dir, out_dir = cli_run
  before = {p.name: p.read_bytes() for p in out_dir.iterdir()}
  assert cli.main(["export", str(run_dir), str(out_dir)]) == 2  # non-empty OUT_DIR refused, untouched
  assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before
  out = export_run(str(run_dir), str(tmp_path / "bf16"), dtype="bfloat16", step=2)
  assert out["step"] == 2 and json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  student2, _ = _run_student(run_dir, step=2)
  got = np.asarray(load_hf(tmp_path / "bf16")(jnp.asarray(_tokens())).logits)
  want = np.asarray(student2(jnp.asarray(_tokens())).logits)
  np.testing.assert_allclose(got, want, atol=0.1)  # bfloat16 weights: ~3 significant digits
  with pytest.raises(ValueError, match=r"--step=3 is not a checkpoint.*\[2, 4\]"):
    export_run(str(run_dir), str(tmp_path / "s3"), step=3)
  export_run(str(run_dir), str(tmp_path / "bf16"), overwrite=True)  # replaced in place by the latest float32 step
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "float32"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]  # no temporary siblings left behind


def test_2x4_student_hf_loads_a_pretrained_student_of_the_teachers_family(cli_run):
  _, out_dir = cli_run  # the exported student: qwen3, 1 block, the teacher's tokenizer.json
  mesh = md.make_mesh(data=2, tensor=4)
  cfg = load_config(EXAMPLE, [f"teacher.hf={QWEN3}", f"data.source={FIXTURES / 'hf_text.jsonl'}",
                              f"student.hf={out_dir}", "student.init=null"])
  assert (cfg.student.n_layers, cfg.student.d_model, cfg.models.student_hf) == (1, 48, str(out_dir))
  teacher = jobs.obtain_teacher(cfg, None, mesh)[0]
  distiller = jobs.make_distiller(cfg, teacher, mesh)
  student = distiller.student(distiller.init_state())
  tokens = jnp.asarray(_tokens())
  np.testing.assert_allclose(student(tokens).logits, load_hf(out_dir)(tokens).logits, rtol=1e-5, atol=1e-5)


def _direct_forward(teacher, layers, tokens):
  """The teacher's own modules applied with only ``layers``: embed, those blocks, final norm, head."""
  x = teacher.embed(tokens)
  for i in layers:
    x = teacher.blocks[i](x, False).x  # a BlockOutput: the residual stream after the block
  x = teacher.final_norm(x)
  return teacher.embed.attend(x) if teacher.head is None else teacher.head(x)


@pytest.mark.parametrize("layers", [(1,), (1, 0)])
def test_2x4_layer_subset_student_at_step_0_equals_the_teacher_with_only_those_blocks(layers):
  mesh = md.make_mesh(data=2, tensor=4)
  cfg = load_config(EXAMPLE, [f"teacher.hf={QWEN3}", f"data.source={FIXTURES / 'hf_text.jsonl'}",
                              f"student.init={{from_teacher: true, layers: {list(layers)}}}"])
  assert cfg.student == cfg.teacher.replace(n_layers=len(layers))  # the shape is derived, not typed
  teacher = jobs.obtain_teacher(cfg, None, mesh)[0]
  student = build_student(cfg, teacher, mesh)
  tokens = jnp.asarray(_tokens())
  want = np.asarray(_direct_forward(load_hf(QWEN3), layers, tokens))
  np.testing.assert_allclose(np.asarray(student(tokens).logits), want, rtol=1e-5, atol=1e-5)
  # copies, not aliases: the student owns its buffers, sharded like a fresh student
  t_flat = dict(nnx.to_flat_state(nnx.state(teacher)))
  for key, var in nnx.to_flat_state(nnx.state(student)):
    src = t_flat[(key[0], layers[key[1]], *key[2:]) if key[0] == "blocks" else key].get_value()
    assert var.get_value() is not src and var.get_value().sharding.is_equivalent_to(src.sharding, src.ndim)


def test_layer_subset_init_copies_a_built_in_teacher_too():
  teacher = md.init_model(md.ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, mlp_hidden=64), seed=0)
  student = student_from_teacher(teacher, (0, 2), teacher.cfg.replace(n_layers=2))
  tokens = jnp.asarray(_tokens() % 64)
  logits = nnx.jit(lambda m, t: m(t).logits)
  got = logits(student, tokens)
  np.testing.assert_allclose(got, nnx.jit(_direct_forward, static_argnums=1)(teacher, (0, 2), tokens), rtol=1e-5,
                             atol=1e-6)
  assert not np.allclose(got, logits(teacher, tokens), atol=1e-3)


# --------------------------------------------------------------------------- bad input
def _cli_error(capsys, args, *needles):
  assert cli.main(args) == 2
  err = capsys.readouterr().err
  for needle in needles:
    assert needle in err, err
  return err


def test_teacher_path_without_config_or_weights_is_named_and_nothing_is_written(tmp_path, capsys):
  empty, no_weights, run_dir = tmp_path / "empty", tmp_path / "no_weights", tmp_path / "run"
  empty.mkdir()
  no_weights.mkdir()
  shutil.copy(QWEN3 / "config.json", no_weights / "config.json")
  _cli_error(capsys, ["distill", "--config", *_example(f"teacher.hf={empty}", run_dir=run_dir)],
             "teacher.hf=", "holds no config.json")
  _cli_error(capsys, ["distill", "--config", *_example(f"teacher.hf={no_weights}", run_dir=run_dir)],
             "teacher.hf=", "no model.safetensors")
  _cli_error(capsys, ["distill", "--config", *_example(f"teacher.hf={tmp_path / 'missing'}", run_dir=run_dir)],
             "teacher.hf=", "is not a directory")
  assert not run_dir.exists()


def test_student_of_another_family_or_tokenizer_is_an_error_naming_both(tmp_path):
  base = [f"teacher.hf={QWEN3}", f"data.source={FIXTURES / 'hf_text.jsonl'}"]
  with pytest.raises(ConfigError, match=r"student.hf=.*hf_llama.* is a 'llama' model but teacher.hf=.* 'qwen3'"):
    load_config(EXAMPLE, [*base, f"student.hf={FIXTURES / 'hf_llama'}", "student.init=null"])
  other = tmp_path / "other_tok"
  shutil.copytree(QWEN3, other)
  spec = json.loads((other / "tokenizer.json").read_text())
  spec["padding"] = {"strategy": "BatchLongest", "pad_id": 0, "pad_token": "<|endoftext|>", "direction": "Right",
                     "pad_to_multiple_of": None, "pad_type_id": 0}
  (other / "tokenizer.json").write_text(json.dumps(spec))
  cfg = load_config(EXAMPLE, [*base, f"student.hf={other}", "student.init=null"])  # padding may differ
  assert cfg.student == cfg.teacher and cfg.models.student_hf == str(other)
  vocab = spec["model"]["vocab"]
  first = next(iter(vocab))
  vocab[first + "x"] = vocab.pop(first)
  (other / "tokenizer.json").write_text(json.dumps(spec))
  with pytest.raises(ConfigError, match=r"tokenizers of teacher.hf=.* and student.hf=.* differ .*\['model'\]"):
    load_config(EXAMPLE, [*base, f"student.hf={other}", "student.init=null"])
  (other / "tokenizer.json").unlink()
  with pytest.raises(ConfigError, match=r"teacher.hf=.* holds no tokenizer.json"):
    load_config(EXAMPLE, [f"teacher.hf={other}", f"data.source={FIXTURES / 'hf_text.jsonl'}"])


def test_layer_index_past_the_teacher_and_a_shape_typed_twice_are_named():
  base = [f"teacher.hf={QWEN3}", f"data.source={FIXTURES / 'hf_text.jsonl'}"]
  with pytest.raises(ConfigError, match=r"student.init.layers=\[0, 2\]: block 2 is past the teacher's depth .*0..1"):
    load_config(EXAMPLE, [*base, "student.init.layers=[0, 2]"])
  with pytest.raises(ConfigError, match=r"student.d_model is set, but with student.init.from_teacher"):
    load_config(EXAMPLE, [*base, "student.d_model=32"])
  with pytest.raises(ConfigError, match=r"teacher.n_layers is set, but with teacher.hf"):
    load_config(EXAMPLE, [*base, "teacher.n_layers=4"])
  with pytest.raises(ConfigError, match=r"data.tokenizer='bpe' .* teacher.hf"):
    load_config(EXAMPLE, [*base, "data.tokenizer=bpe"])
  # the main job's built-in teacher: 4 blocks
  with pytest.raises(ConfigError, match=r"block 4 is past the teacher's depth \(the teacher has 4 blocks"):
    load_config(None, ["student.init={from_teacher: true, layers: [0, 4]}"])


def test_config_with_sources_round_trips_through_config_yaml(tmp_path):
  cfg = load_config(EXAMPLE, [f"teacher.hf={QWEN3}", f"data.source={FIXTURES / 'hf_text.jsonl'}"])
  dump_config(cfg, tmp_path / "config.yaml")
  text = (tmp_path / "config.yaml").read_text()
  assert "d_model" not in text and "from_teacher: true" in text
  assert load_config(str(tmp_path / "config.yaml")) == cfg


def _with_positions(directory, positions):
  """A copy of the Qwen3 fixture in ``directory`` whose config.json says ``max_position_embeddings: positions`` (the
  fixture's own is 64; the weights, which do not depend on it, are the same)."""
  shutil.copytree(QWEN3, directory)
  hf = json.loads((directory / "config.json").read_text())
  hf["max_position_embeddings"] = positions
  (directory / "config.json").write_text(json.dumps(hf))
  return directory


def test_hf_models_are_bounded_by_config_json_unless_the_config_names_max_len(tmp_path, capsys):
  long = _with_positions(tmp_path / "qwen3_512", 512)
  base = [f"teacher.hf={long}", f"data.source={FIXTURES / 'hf_text.jsonl'}", "data.seq_len=256"]  # beyond 128
  copied = [*base, "student.init={from_teacher: true, layers: [1]}"]
  cfg = load_config(None, copied)  # no max_len named: the sections' 128 would refuse rows of 256
  assert (cfg.teacher.max_len, cfg.student.max_len) == (512, 512)
  teacher = load_teacher_hf(cfg, None)
  assert (teacher.cfg.max_len, build_student(cfg, teacher, None).cfg.max_len) == (512, 512)
  assert load_config(None, [*base, f"student.hf={long}"]).student.max_len == 512
  # a named max_len wins, shorter or longer than config.json's
  named = load_config(None, [*base, f"student.hf={long}", "teacher.max_len=300", "student.max_len=1024"])
  assert (named.teacher.max_len, named.student.max_len) == (300, 1024)
  assert load_teacher_hf(named, None).cfg.max_len == 300
  with pytest.raises(ConfigError, match=r"teacher.max_len=128 is shorter than data.seq_len=256; set teacher.max_len"):
    load_config(None, [*base, f"student.hf={long}", "teacher.max_len=128"])
  with pytest.raises(ConfigError, match=r"student.max_len=512 \(config.json's max_position_embeddings\) is shorter "
                                        r"than data.seq_len=1024"):
    load_config(None, [*base, "data.seq_len=1024", f"student.hf={long}", "teacher.max_len=1024"])
  # the bound got is printed by `meshdistill config` and named in a written config, which reloads equal
  assert cli.main(["config", *[a for s in copied for a in ("--set", s)]]) == 0
  printed = yaml.safe_load(capsys.readouterr().out)
  assert (printed["teacher"]["max_len"], printed["student"]["max_len"]) == (512, 512)
  dump_config(cfg, tmp_path / "config.yaml")
  assert load_config(str(tmp_path / "config.yaml")) == cfg
  assert cfg.replace(teacher=cfg.teacher.replace(max_len=1000)).teacher.max_len == 1000  # a replaced bound is kept
  assert load_config(None).teacher.max_len == load_config(None).student.max_len == 128  # the main job: no config.json


def test_export_of_a_run_without_checkpoint_writes_nothing(tmp_path, capsys):
  run_dir, out = tmp_path / "run", tmp_path / "out"
  _cli_error(capsys, ["export", str(run_dir), str(out)], "RUN_DIR=", "holds no config.yaml")
  run_dir.mkdir()
  dump_config(load_config(EXAMPLE, [f"teacher.hf={QWEN3}", f"run.run_dir={run_dir}"]),
                        run_dir / "config.yaml")
  _cli_error(capsys, ["export", str(run_dir), str(out)], "has no checkpoint", "nothing was written")
  _cli_error(capsys, ["export", str(run_dir), str(out), "--dtype", "int8"], "--dtype='int8'")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and os.listdir(run_dir) == ["config.yaml"]


def test_remat_and_attention_beside_teacher_hf_are_kept_and_change_no_logits():
  base = [f"teacher.hf={QWEN3}", f"data.source={FIXTURES / 'hf_text.jsonl'}"]
  cfg = load_config(EXAMPLE, [*base, "teacher.remat=full", "student.remat=dots", "teacher.attention=xla",
                              "student.attention=explicit"])
  teacher = load_teacher_hf(cfg, None)
  student = build_student(cfg, teacher, None)
  assert (teacher.cfg.remat, student.cfg.remat) == ("full", "dots")
  assert (teacher.cfg.attention, student.cfg.attention) == ("xla", "explicit")
  tokens = jnp.asarray(_tokens())
  logits = nnx.jit(lambda m, t: m(t).logits)
  np.testing.assert_allclose(logits(teacher, tokens), logits(load_hf(QWEN3), tokens), rtol=1e-5, atol=1e-6)


def _students_logits(run_dir):
  """The logits of the student in ``run_dir``'s newest checkpoint, read in the layout ``auto`` means here."""
  cfg = run_config(str(run_dir))
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0)
  student = ckpt.restore_student(cfg.student, None)
  ckpt.close()
  return student.cfg.scan_layers, np.asarray(student(jnp.asarray(_tokens())).logits)


def test_auto_stacks_the_blocks_on_an_accelerator_and_a_run_moves_between_layouts(tmp_path, monkeypatch):
  """``scan_layers: auto`` (the default) decided as on an accelerator (`ModelConfig.scanned_on` told ``tpu``): the
  teacher read from ``teacher.hf``, the student copied from its layers, trained and checkpointed, all with stacked
  blocks; the same run decided as on a CPU keeps per-layer blocks and reaches the same student. Then the stacked run
  resumes where ``auto`` means per layer (a run moved off the accelerator): in its checkpoint's layout, to the same
  numbers as the run that stayed on the CPU."""
  overrides = ("train.warmup=1", "train.eval_every=0", "checkpoint.every=2", "mesh.backend=single", "mesh.data=1",
               "mesh.tensor=1", "student.init={from_teacher: true, layers: [1, 0]}")
  run = lambda where, steps: cli.main(["distill", "--config", *_example(  # noqa: E731
      *overrides, f"train.steps={steps}", run_dir=tmp_path / where)])
  assert run("cpu", 2) == 0
  decide = md.ModelConfig.scanned_on
  with monkeypatch.context() as m:
    m.setattr(md.ModelConfig, "scanned_on", lambda self, platform, tensor=1: decide(self, "tpu", tensor))
    assert run("accelerator", 2) == 0
    stacked, teacher = _run_student(tmp_path / "accelerator")
    assert stacked.cfg.scan_layers is True and teacher.cfg.scan_layers is True
    assert stacked.blocks.mlp.down.kernel[...].shape[0] == 2  # one weight per name, [layers, ...]
    want = np.asarray(stacked(jnp.asarray(_tokens())).logits)
  per_layer, teacher = _run_student(tmp_path / "cpu")
  assert per_layer.cfg.scan_layers is False and teacher.cfg.scan_layers is False
  # the same arithmetic in another program: float32 rounding apart (logits of order 1 after two AdamW steps)
  np.testing.assert_allclose(np.asarray(per_layer(jnp.asarray(_tokens())).logits), want, rtol=1e-4, atol=1e-4)
  assert run("accelerator", 3) == 0 and run("cpu", 3) == 0  # the moved run resumes, stacked, on the CPU
  (moved_layout, moved), (cpu_layout, stayed) = _students_logits(tmp_path / "accelerator"), _students_logits(
      tmp_path / "cpu")
  assert moved_layout is cpu_layout is False  # read back per layer, as auto means here
  np.testing.assert_allclose(moved, stayed, rtol=1e-4, atol=1e-4)
  assert yaml.safe_load((tmp_path / "accelerator" / "config.yaml").read_text())["student"]["scan_layers"] == "auto"
