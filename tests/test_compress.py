"""Pruning by importance (`meshdistill.models.compress`): known-answer scores, the pruned student equals the teacher with the
pruned units zeroed (every dense family), layouts equal one device, the exported student equals transformers'
logits of it, and the errors of bad targets."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import VOCAB, make_batch

import meshdistill as md
from meshdistill.models.compress import Importance, Kept, PruneTargets, prune, prune_weights, score, zeroed
from meshdistill.models.hf import export_hf, load_hf, read_hf_config
from meshdistill.parallel.backends import make_layout

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
DENSE = ("hf_llama", "hf_qwen3", "hf_qwen2", "hf_mistral", "hf_gemma2", "hf_gemma3")
# multi-head attention (every head its own group), three blocks: each unit of the known-answer model is its own unit
KNOWN_CFG = md.ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, n_kv_heads=4, mlp_hidden=64,
                           max_len=16)
DEAD_NEURON, DEAD_HEAD, TWIN, ORIGINAL, IDENTITY_LAYER, DEAD_CHANNEL = 5, 3, 2, 1, 1, 7


def _calibration(n=3, vocab=VOCAB, seq=8):
  return [make_batch(seed=s, batch=4, seq=seq, vocab=vocab, pad_from=6) for s in range(n)]


def _edit(model, fn):
  """A copy of ``model`` whose parameters are ``fn(dict path -> numpy array)`` edited in place."""
  graphdef, state = nnx.split(model)
  flat = {k: np.array(v.get_value()) for k, v in nnx.to_flat_state(state)}
  fn(flat)
  return nnx.merge(graphdef, nnx.from_flat_state([(k, v.replace(jnp.asarray(flat[k])))
                                                  for k, v in nnx.to_flat_state(state)]))


def _known_model():
  """Block 0: MLP unit DEAD_NEURON never fires (its gate and up columns are 0), head DEAD_HEAD outputs 0 (its value
  columns are 0), head TWIN is a copy of head ORIGINAL; block IDENTITY_LAYER adds nothing (its output projections
  are 0); embedding channel DEAD_CHANNEL is 0 in the embedding and in every projection writing the residual."""
  K = KNOWN_CFG.hd

  def edit(w):
    b0 = ("blocks", 0)
    w[(*b0, "mlp", "gate", "kernel")][:, DEAD_NEURON] = 0
    w[(*b0, "mlp", "up", "kernel")][:, DEAD_NEURON] = 0
    w[(*b0, "attn", "v", "kernel")][:, DEAD_HEAD * K:(DEAD_HEAD + 1) * K] = 0
    for x in "qkv":
      kernel = w[(*b0, "attn", x, "kernel")]
      kernel[:, TWIN * K:(TWIN + 1) * K] = kernel[:, ORIGINAL * K:(ORIGINAL + 1) * K]
    for proj in (("attn", "o"), ("mlp", "down")):
      w[("blocks", IDENTITY_LAYER, *proj, "kernel")][:] = 0
      for i in range(KNOWN_CFG.n_layers):
        w[("blocks", i, *proj, "kernel")][:, DEAD_CHANNEL] = 0
    w[("embed", "embedding")][:, DEAD_CHANNEL] = 0

  return _edit(md.init_model(KNOWN_CFG, seed=3), edit)


@pytest.fixture(scope="module")
def known():
  return score(_known_model(), _calibration())


def test_dead_neuron_dead_head_identity_layer_and_dead_channel_score_least(known):
  assert known.mlp[0, DEAD_NEURON] == 0 and np.argmin(known.mlp[0]) == DEAD_NEURON
  assert (np.delete(known.mlp[0], DEAD_NEURON) > 0).all()
  assert known.heads[0, DEAD_HEAD] == 0 and np.argmin(known.heads[0]) == DEAD_HEAD
  assert np.argmin(known.embed) == DEAD_CHANNEL and known.embed[DEAD_CHANNEL] == 0
  assert np.argmin(known.layer_loss) == IDENTITY_LAYER and abs(known.layer_loss[IDENTITY_LAYER]) < 1e-6
  assert np.argmin(known.layer_cosine) == IDENTITY_LAYER and abs(known.layer_cosine[IDENTITY_LAYER]) < 1e-6
  assert (np.delete(known.layer_loss, IDENTITY_LAYER) > 1e-3).all()


def test_a_duplicated_head_scores_exactly_as_its_original(known):
  # activation importance sees each head alone: a copy is as important as what it copies, and both outrank the rest
  np.testing.assert_allclose(known.heads[0, TWIN], known.heads[0, ORIGINAL], rtol=1e-6)
  assert known.groups.shape == (KNOWN_CFG.n_layers, KNOWN_CFG.n_kv_heads)
  np.testing.assert_allclose(known.groups, known.heads)  # one head per group


def test_pruning_one_of_each_removes_exactly_the_known_units(known):
  targets = PruneTargets(mlp=63, heads=3, embed=31, layers=2)
  out = prune(_known_model(), (), targets, importance=known)
  removed = out.report["removed"]
  assert removed["layers"] == [IDENTITY_LAYER] and removed["embed"] == [DEAD_CHANNEL]
  assert removed["mlp"][0] == [DEAD_NEURON] and removed["groups"][0] == [DEAD_HEAD]
  cfg = out.student.cfg
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.mlp_hidden, cfg.hd) == (2, 31, 3, 3, 63, 8)
  assert out.report["student"]["params"] == md.param_count(out.student) < out.report["teacher"]["params"]
  assert md.prune is prune and md.PruneTargets is PruneTargets  # the public names


@pytest.mark.parametrize("name", DENSE)
def test_pruned_logits_equal_the_teacher_with_the_pruned_units_zeroed(name):
  teacher = load_hf(FIXTURES / name)
  cfg = teacher.cfg
  batches = _calibration(2, vocab=cfg.vocab_size)
  targets = PruneTargets(mlp=cfg.mlp_hidden // 2, heads=cfg.n_heads // 2, embed=cfg.d_model * 3 // 4,
                         layers=max(1, cfg.n_layers - 1))
  out = prune(teacher, batches, targets)
  tokens = jnp.asarray(batches[0]["inputs"])
  got = np.asarray(out.student(tokens).logits)
  want = np.asarray(zeroed(teacher, out.kept)(tokens).logits)
  full = np.asarray(teacher(tokens).logits)
  scale = np.abs(want).max()
  # The norms' eps (1e-6) is added to a mean square over D' channels instead of D: relative error ~1e-5 on
  # these random fixtures; the units themselves change the logits by far more (checked below)
  np.testing.assert_allclose(got, want, atol=2e-4 * scale, rtol=0)
  assert np.abs(full - want).max() > 100 * 2e-4 * scale


def test_width_pruning_without_embed_is_exact():
  teacher = md.init_model(KNOWN_CFG.replace(n_kv_heads=2), seed=0)
  out = prune(teacher, _calibration(1), mlp=16, heads=2, layers=2)
  tokens = jnp.asarray(_calibration(1)[0]["inputs"])
  np.testing.assert_allclose(np.asarray(out.student(tokens).logits),
                             np.asarray(zeroed(teacher, out.kept)(tokens).logits), rtol=1e-5, atol=1e-5)


def _fsdp_placed(model, mesh):
  layout = make_layout("shard_map", mesh, fsdp=True)
  graphdef, state = nnx.split(layout.fit_model(md.shard_model(model, mesh)))
  return nnx.merge(graphdef, layout.place_params(state))


@pytest.mark.parametrize("layout", ["2x4", "2x4 fsdp"])
def test_pruning_on_a_mesh_equals_one_device(layout):
  cfg = KNOWN_CFG.replace(n_heads=8, n_kv_heads=4, mlp_hidden=64, d_model=64)
  teacher = md.init_model(cfg, seed=0)
  batches = _calibration(2)
  targets = PruneTargets(mlp=32, heads=4, embed=48, layers=2)
  one = prune(teacher, batches, targets)
  mesh = md.make_mesh(data=2, tensor=4)
  placed = _fsdp_placed(teacher, mesh) if "fsdp" in layout else md.shard_model(teacher, mesh)
  kernel = placed.blocks[0].mlp.up.kernel.get_value()
  assert tuple(kernel.sharding.spec) == (("data", "tensor") if "fsdp" in layout else (None, "tensor"))
  got = prune(placed, batches, targets, mesh=mesh)
  for field in ("mlp", "heads", "groups", "embed", "layer_loss", "layer_cosine"):
    np.testing.assert_allclose(getattr(got.importance, field), getattr(one.importance, field), rtol=1e-5,
                               atol=1e-6, err_msg=field)
  assert got.kept == one.kept
  assert tuple(got.student.blocks[0].mlp.up.kernel.get_value().sharding.spec) == (None, "tensor")
  tokens = md.host_to_global(batches[0]["inputs"], mesh)
  np.testing.assert_allclose(np.asarray(got.student(tokens).logits),
                             np.asarray(one.student(jnp.asarray(batches[0]["inputs"])).logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", DENSE)
def test_exported_pruned_student_gives_transformers_logits(name, tmp_path):
  """scripts/make_hf_fixtures.py --pruned cut each fixture to the units in pruned/NAME.json, exported it and had
  transformers compute its logits (pruned/NAME.npz): the same cut here, exported and read back, gives them."""
  path = FIXTURES / name
  kept = Kept.from_dict(json.loads((FIXTURES / "pruned" / f"{name}.json").read_text()))
  student = prune_weights(load_hf(path), kept)
  out = export_hf(student, tmp_path / "out", family=read_hf_config(path)["model_type"].removesuffix("_text"))
  hf = read_hf_config(out)
  assert hf["architectures"] == read_hf_config(path)["architectures"]
  assert (hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"]) == (
      len(kept.embed), len(kept.layers), len(kept.mlp[0]))
  assert hf["num_key_value_heads"] == len(kept.groups[0]) and hf["head_dim"] == load_hf(path).cfg.hd
  ref = np.load(FIXTURES / "pruned" / f"{name}.npz")
  np.testing.assert_allclose(np.asarray(load_hf(out)(jnp.asarray(ref["tokens"])).logits), ref["logits"], atol=1e-4,
                             rtol=0)


def test_scores_save_and_load(known, tmp_path):
  again = Importance.load(known.save(str(tmp_path / "scores.npz")))
  np.testing.assert_array_equal(again.mlp, known.mlp)
  assert (again.tokens, again.sequences) == (known.tokens, known.sequences)


@pytest.mark.parametrize("targets, match", [
    (dict(heads=3), r"--heads=3: .*groups of n_heads / n_kv_heads = 2 .*choose one of \[2, 4\]"),
    (dict(mlp=65), r"--mlp=65 keeps more than the teacher has \(mlp_hidden=64\); choose at most 64"),
    (dict(layers=0), r"--layers=0 must be a positive integer"),
    (dict(depth="norm"), r"--depth='norm'; choose one of \['loss', 'cosine'\]"),
])
def test_bad_targets_name_the_flag_and_what_would_work(targets, match):
  with pytest.raises(ValueError, match=match):
    PruneTargets(**targets).check(KNOWN_CFG.replace(n_kv_heads=2))


def test_a_mixture_of_experts_teacher_is_refused():
  with pytest.raises(ValueError, match="mixture-of-experts"):
    prune(load_hf(FIXTURES / "hf_qwen3_moe"), _calibration(1), mlp=8)


def test_prune_command_writes_the_student_that_student_init_pruned_starts_from(tmp_path, capsys):
  from meshdistill import cli
  from meshdistill.config import load_config
  from meshdistill.data import ByteTokenizer
  from meshdistill.teachers.checkpoint import save_teacher
  from meshdistill.teachers.sources import build_student

  where = [f"run.run_dir={tmp_path / 'run'}", f"pretrain.teacher={tmp_path / 'teacher'}", "data.max_chars=20000"]
  cfg = load_config("tiny", where)
  teacher = md.init_model(cfg.teacher, seed=0)
  save_teacher(str(tmp_path / "teacher"), teacher, ByteTokenizer(), {})
  out = tmp_path / "pruned"
  argv = ["prune", "--config", "tiny", *[x for w in where for x in ("--set", w)], "--out", str(out), "--mlp", "32",
          "--heads", "2", "--embed", "24", "--layers", "1", "--batches", "1"]
  assert cli.main(argv) == 0
  printed = capsys.readouterr().out
  report = json.loads((out / "report.json").read_text())
  assert f"student: {report['student']['params']:,} params, d_model 24, 1 blocks, 2 heads (1 key/value), mlp 32" in printed
  assert report["teacher"]["params"] == md.param_count(teacher) and len(report["removed"]["layers"]) == 1
  assert Importance.load(str(out / "scores.npz")).mlp.shape == (2, 64)
  assert cli.main(argv) == 2 and "--overwrite" in capsys.readouterr().err  # an existing OUT is kept

  config = tmp_path / "distil.yaml"
  tiny = (pathlib.Path(md.config.__file__).parent / "presets" / "tiny.yaml").read_text()
  config.write_text(tiny.replace("student: {d_model: 16, n_layers: 1, n_heads: 4, n_kv_heads: 2, mlp_hidden: 32, "
                                 "max_len: 32}", f"student: {{init: {{pruned: {out}}}, max_len: 32}}"))
  run = load_config(str(config), where)
  student = build_student(run, None, None)
  assert (student.cfg.d_model, student.cfg.n_layers, student.cfg.mlp_hidden) == (24, 1, 32)
  exported = load_hf(out / "hf")
  tokens = jnp.asarray(make_batch(batch=2, vocab=256)["inputs"])
  np.testing.assert_allclose(np.asarray(student(tokens).logits), np.asarray(exported(tokens).logits), rtol=1e-5,
                             atol=1e-5)
  kept = Kept.from_dict(report["kept"])
  np.testing.assert_allclose(np.asarray(student(tokens).logits), np.asarray(zeroed(teacher, kept)(tokens).logits),
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("student, match", [
    ({"init": {"pruned": "/x", "from_teacher": True, "layers": [0]}}, "student.init.pruned and student.init.from_teacher"),
    ({"init": {"pruned": "/x"}, "d_model": 8}, r"student.d_model is set, but with student.init.pruned .*derived \(the "
                                               r"pruned student\)"),
    ({"init": {"pruned": "/nowhere"}}, "student.init.pruned='/nowhere' holds no student/teacher.json"),
])
def test_student_init_pruned_errors_name_the_setting(student, match, tmp_path):
  from meshdistill.config import ConfigError, load_config

  config = tmp_path / "c.yaml"
  config.write_text(json.dumps({"student": student}))
  with pytest.raises(ConfigError, match=match):
    load_config(str(config))
