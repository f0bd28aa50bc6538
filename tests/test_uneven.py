"""Uneven splits: a vocabulary `tensor` does not divide is padded, fewer key/value heads than `tensor` replicated."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import STUDENT_CFG, TEACHER_CFG, all_gather_shapes, make_batch
from safetensors.numpy import load_file, save_file

import meshdistill as md
from meshdistill.models.hf import export_hf, load_hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ODD = 61  # prime: no tensor size > 1 divides it


@pytest.fixture(scope="module")
def mesh():
  return md.make_mesh(data=2, tensor=4)


def _run(student, teacher, mesh, steps=2):
  d = md.Distiller(student, teacher, mesh=mesh)
  state, out = d.init_state(), []
  for i in range(steps):
    state, m = d.step(state, make_batch(seed=i, vocab=ODD))
    out.append(jax.device_get(m))
  return d, state, out


def test_odd_vocab_distils_on_2x4_like_one_unpadded_device(mesh):
  tcfg, scfg = TEACHER_CFG.replace(vocab_size=ODD), STUDENT_CFG.replace(vocab_size=ODD, tie_embeddings=False)
  teacher, student = md.init_model(tcfg, 0), md.init_model(scfg, 1)  # unpadded, one device
  _, ref_state, ref = _run(student, teacher, None)
  d, state, got = _run(student, teacher, mesh)
  assert d.student_cfg.vocab_multiple == 4 and d.student_cfg.padded_vocab == 64 and d.student_cfg.replicate_kv
  for r, g in zip(ref, got):
    for k in r:
      np.testing.assert_allclose(g[k], r[k], rtol=1e-5, atol=1e-7, err_msg=k)
  learnt = d.student(state)
  assert learnt.embed.embedding[...].shape == (64, 16) and learnt.head.kernel[...].shape == (16, 64)
  # the padding rows took no gradient and no decay; the real rows equal the unpadded run
  np.testing.assert_array_equal(np.asarray(learnt.embed.embedding[...])[ODD:], 0.0)
  np.testing.assert_array_equal(np.asarray(learnt.head.kernel[...])[:, ODD:], 0.0)
  ref_student = md.Distiller(student, teacher).student(ref_state)
  np.testing.assert_allclose(np.asarray(learnt.head.kernel[...])[:, :ODD], np.asarray(ref_student.head.kernel[...]),
                             rtol=1e-5, atol=1e-6)
  # the padded vocabulary stays split over tensor: no vocabulary-sized all-gather in the step
  hlo = d.lower(d.init_state(), make_batch(vocab=ODD)).compile().as_text()
  assert not [s for s in all_gather_shapes(hlo) if s and s[-1] in (ODD, 64)], all_gather_shapes(hlo)


def test_init_on_mesh_pads_with_zeros_and_keeps_the_real_rows(mesh):
  cfg = TEACHER_CFG.replace(vocab_size=ODD, n_kv_heads=1)
  one, split = md.init_model(cfg, 3), md.init_model(cfg, 3, mesh)
  emb = np.asarray(split.embed.embedding[...])
  np.testing.assert_array_equal(emb[ODD:], 0.0)
  np.testing.assert_allclose(emb[:ODD], np.asarray(one.embed.embedding[...]), rtol=1e-6)
  k = split.blocks[0].attn.k.kernel[...]
  assert k.sharding.spec == jax.sharding.PartitionSpec(None, None)  # 1 kv head on tensor=4: replicated
  tokens = make_batch(vocab=ODD)["inputs"]
  got = split(jnp.asarray(tokens)).logits
  assert got.shape[-1] == ODD and split.head_weight().shape == (32, ODD)
  np.testing.assert_allclose(np.asarray(got), np.asarray(one(jnp.asarray(tokens)).logits), rtol=1e-5, atol=1e-5)


def test_query_heads_tensor_cannot_split_name_the_setting():
  cfg = md.ModelConfig(vocab_size=64, d_model=24, n_heads=3, n_kv_heads=1, head_dim=2, mlp_hidden=64)
  with pytest.raises(ValueError, match=r"n_heads \* head_dim=6.*n_heads=3, head_dim=2"):
    cfg.for_tensor(4)
  assert cfg.for_tensor(2).replicate_kv  # n_heads * head_dim = 6 splits in two (inside a head)


def _odd_vocab_fixture(name, vocab, tmp_path) -> pathlib.Path:
  """``name`` with its vocabulary cut to ``vocab`` rows: for tokens below ``vocab`` the model's
  logits are transformers' reference logits restricted to those columns (the rows dropped only
  ever enter as output columns)."""
  dst = tmp_path / f"{name}_v{vocab}"
  shutil.copytree(FIXTURES / name, dst)
  cfg = json.loads((dst / "config.json").read_text())
  cfg["vocab_size"] = vocab
  (dst / "config.json").write_text(json.dumps(cfg))
  for f in dst.glob("*.safetensors"):
    t = load_file(f)
    t = {k: (v[:vocab] if k in ("model.embed_tokens.weight", "lm_head.weight") else v) for k, v in t.items()}
    save_file(t, str(f), metadata={"format": "pt"})
  return dst


@pytest.mark.parametrize("name", ["hf_qwen2", "hf_qwen3"])  # untied and tied heads
def test_2x4_odd_vocab_hf_logits_equal_transformers_and_export_drops_padding(name, mesh, tmp_path):
  ref = np.load(FIXTURES / name / "reference.npz")
  tokens, want = ref["tokens"], ref["logits"]
  vocab = 125  # 5**3; the reference tokens are all below it
  assert tokens.max() < vocab
  path = _odd_vocab_fixture(name, vocab, tmp_path)
  model = load_hf(path, mesh)
  assert model.cfg.padded_vocab == 128 and model.embed.embedding[...].shape[0] == 128
  got = np.asarray(model(jnp.asarray(tokens)).logits)
  np.testing.assert_allclose(got, want[..., :vocab], atol=1e-4, rtol=0)
  out = export_hf(model, tmp_path / "export")
  assert json.loads((out / "config.json").read_text())["vocab_size"] == vocab
  assert load_file(out / "model.safetensors")["model.embed_tokens.weight"].shape[0] == vocab
  again = load_hf(out)
  np.testing.assert_allclose(np.asarray(again(jnp.asarray(tokens)).logits), got, atol=1e-5, rtol=0)
