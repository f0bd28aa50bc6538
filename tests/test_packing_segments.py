"""Packing without crossing documents (``data.packing: documents``): a packed row's segment ids keep each document to
itself in every attention kernel, RoPE restarts at each document, and no trained target pairs one document's end with
the next one's start; so a packed row computes what its documents compute one by one.

The references run each document's part of a row alone: its tokens from the row's start, padded at the end to the
row's length (causal attention: the padding after them changes nothing before it), without segment ids. Float32
throughout; the two sides differ in the summation order of attention's softmax (masked keys add exact zeros) and of
the layouts' reductions, so they agree at the suite's 1e-5.
"""

import einops
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, rel_err

import meshdistill as md
from meshdistill.core.batch import SEGMENT_KEYS
from meshdistill.data import DataConfig, build_data, pack_documents
from meshdistill.models._attention import rope, rope_tables
from meshdistill.models._visible import segment_positions
from meshdistill.models._head_prep import norm_rope_heads

T = 128  # the splash kernel's lane width: the shortest row it takes
PAD = 0
EOS = 2
TEACHER = TEACHER_CFG.replace(max_len=T, dtype="float32", param_dtype="float32")
STUDENT = STUDENT_CFG.replace(max_len=T, n_layers=2, dtype="float32", param_dtype="float32")


def _packed_rows():
  """Rows of ``T`` packed from documents of 20-70 tokens (several per row, one cut between rows, padding at the
  end), with their segment ids and positions."""
  rng = np.random.default_rng(0)
  docs = [rng.integers(3, TEACHER.vocab_size, n) for n in (37, 20, 50, 61, 70, 24, 45)]
  packed = pack_documents(docs, T, eos_id=EOS, pad_id=PAD)
  return packed.arrays(segments=True)


ROWS = _packed_rows()


def _parts(batch):
  """``(row, start, stop)`` of every document's part of every row (padding excluded)."""
  out = []
  for b, ids in enumerate(batch["segment_ids"]):
    for s in np.unique(ids[ids > 0]):
      where = np.flatnonzero(ids == s)
      out.append((b, int(where[0]), int(where[-1]) + 1))
  return out


def _one_by_one(batch, rows: int | None = None):
  """Each document's part of each row alone in a row of its own (from the row's start, padded at the end, its
  padding never trained), without segment ids; ``rows``: pad the batch with untrained rows to that many."""
  parts = _parts(batch)
  n = len(parts) if rows is None else rows
  out = {"inputs": np.full((n, T), PAD, np.int32), "targets": np.full((n, T), PAD, np.int32),
         "mask": np.zeros((n, T), np.float32)}
  for i, (b, lo, hi) in enumerate(parts):
    for k in out:
      out[k][i, : hi - lo] = batch[k][b, lo:hi]
  return out


def _model(cfg, attention, seed=0, mesh=None):
  return md.init_model(cfg.replace(attention=attention), seed=seed, mesh=mesh)


def test_packed_rows_never_train_a_target_across_documents():
  """Every trained target belongs to its input's document: the target after a document's end (the next one's first
  token) is masked, as is padding; positions restart at 0 at each document and count up within it."""
  seg, pos, mask = ROWS["segment_ids"], ROWS["positions"], ROWS["mask"]
  assert ROWS["inputs"].shape[0] >= 3 and len(_parts(ROWS)) >= 8  # several documents per row, one cut between rows
  crosses = np.concatenate([seg[:, 1:] != seg[:, :-1], np.zeros_like(seg[:, :1], bool)], axis=1)
  assert crosses.sum() >= 5 and not np.any(mask[crosses] > 0)
  assert np.all(mask[seg == 0] == 0)
  for b, lo, hi in _parts(ROWS):
    np.testing.assert_array_equal(pos[b, lo:hi], np.arange(hi - lo))
  real = seg > 0
  np.testing.assert_array_equal(np.asarray(segment_positions(jnp.asarray(seg)))[real], pos[real])


LOCAL = {"scan_layers": True, "n_layers": 3, "sliding_window": 16,
         "layer_types": ("sliding_attention", "full_attention", "sliding_attention")}


@pytest.mark.parametrize("attention, options", [("explicit", {}), ("xla", {}), ("splash", {}), ("xla", LOCAL)],
                         ids=["explicit", "xla", "splash", "xla-scanned-local-layers"])
def test_a_packed_rows_logits_equal_its_documents_run_one_by_one(attention, options):
  """Each kernel (splash interpreted on the CPU; xla also with scanned blocks and sliding-window layers) with the
  rows' segment ids: the logits of every document's tokens equal those of the document alone; without them (documents
  attending to each other) they do not."""
  model = _model(TEACHER.replace(**options), attention)
  inputs = jnp.asarray(ROWS["inputs"])
  packed = np.asarray(model(inputs, segment_ids=ROWS["segment_ids"], positions=ROWS["positions"]).logits)
  derived = np.asarray(model(inputs, segment_ids=ROWS["segment_ids"]).logits)  # positions from the ids
  streamed = np.asarray(model(inputs).logits)
  # RoPE reads the positions given: twice them (other distances between tokens) changes the logits
  stretched = np.asarray(model(inputs, segment_ids=ROWS["segment_ids"], positions=2 * ROWS["positions"]).logits)
  alone = np.asarray(model(jnp.asarray(_one_by_one(ROWS)["inputs"])).logits)
  later = 0
  for i, (b, lo, hi) in enumerate(_parts(ROWS)):
    np.testing.assert_allclose(packed[b, lo:hi], alone[i, : hi - lo], rtol=1e-5, atol=1e-5, err_msg=f"part {i}")
    np.testing.assert_allclose(derived[b, lo:hi], alone[i, : hi - lo], rtol=1e-5, atol=1e-5, err_msg=f"part {i}")
    if lo > 0:  # a document after another one in its row: streamed, it sees the one before
      later += 1
      assert rel_err(streamed[b, lo:hi], alone[i, : hi - lo]) > 1e-3
  assert later >= 4
  real = ROWS["segment_ids"] > 0
  assert rel_err(stretched[real], packed[real]) > 1e-3


@pytest.mark.parametrize("attention", ["explicit", "xla"])
def test_captured_attention_stays_within_each_document(attention):
  """Captured probabilities (explicit scores whatever the kernel) put no mass across documents."""
  model = _model(TEACHER, attention)
  out = model(jnp.asarray(ROWS["inputs"]), capture=("attn",), segment_ids=ROWS["segment_ids"])
  seg = ROWS["segment_ids"]
  across = seg[:, None, :, None] != seg[:, None, None, :]  # [B, 1, T, S]
  for probs in out.attn:
    assert float(jnp.max(jnp.where(across, probs, 0.0))) == 0.0


def test_rope_restarts_at_each_document():
  """RoPE at the rows' positions rotates each document's part exactly as the document alone (bitwise: the same
  angles); at the row's own positions it does not."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(*ROWS["inputs"].shape, 2, 16)), jnp.float32)  # [B, T, H, K]
  packed = np.asarray(rope(x, 10_000.0, None, jnp.asarray(ROWS["positions"])))
  streamed = np.asarray(rope(x, 10_000.0))
  for b, lo, hi in _parts(ROWS):
    alone = np.asarray(rope(x[b:b + 1, lo:hi], 10_000.0))[0]
    np.testing.assert_array_equal(packed[b, lo:hi], alone)
    if lo > 0:
      assert rel_err(streamed[b, lo:hi], alone) > 0.1


def test_the_query_key_kernel_takes_each_rows_positions():
  """`_head_prep.norm_rope_heads` (the splash path's queries and keys on a TPU; interpreted here) with per-row tables
  ``[B, T, K]`` equals the XLA form at the same positions, values and gradient (float32: the same products in another
  order, 1e-5 as tests/test_head_prep.py)."""
  B, H, K = 2, 2, 128
  rng = np.random.default_rng(2)
  y = jnp.asarray(rng.normal(size=(B, T, H * K)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(B, H, T, K)), jnp.float32)
  positions = jnp.asarray(ROWS["positions"][:B])

  def xla(y):
    return rope(einops.rearrange(y, "b t (h k) -> b h t k", k=K), 10_000.0, None, positions, token_axis=2)

  def kernel(y):
    cos, sin = rope_tables(positions, K, 10_000.0)
    return norm_rope_heads(y, H, cos, sin, interpret=True)

  loss = lambda fn: lambda y: jnp.sum(fn(y) * g)  # noqa: E731
  with jax.default_matmul_precision("highest"):
    want, want_grad = xla(y), jax.grad(loss(xla))(y)
  got, got_grad = kernel(y), jax.grad(loss(kernel))(y)
  assert rel_err(got, want) < 1e-5 and rel_err(got_grad, want_grad) < 1e-5
  shared = norm_rope_heads(y, H, *rope_tables(jnp.arange(T), K, 10_000.0), interpret=True)
  assert rel_err(shared, want) > 0.1  # the rows' positions matter here


def _steps(batch, attention, shape=None, fsdp=False, remat="none"):
  """Loss and gradient norm of two SGD steps of a teacher-student pair on ``batch`` (LogitKD: the teacher's logits
  enter the loss), and the student's parameters after them."""
  mesh = None if shape is None else md.make_mesh(*shape)
  d = md.Distiller(_model(STUDENT.replace(remat=remat), attention, seed=1, mesh=mesh),
                   _model(TEACHER, attention, seed=0, mesh=mesh), optimizer=optax.sgd(1.0), mesh=mesh, fsdp=fsdp)
  state, records = d.init_state(), []
  for _ in range(2):
    state, metrics = d.step(state, batch)
    records.append((float(metrics["loss"]), float(metrics["grad_norm"]), float(metrics["tokens"])))
  return np.asarray(records), jax.device_get(d.unreplicate(state.params)["student"])


def _batch(rows):
  return {k: ROWS[k][:rows] for k in ("inputs", "targets", "mask", *SEGMENT_KEYS)}


@pytest.fixture(scope="module")
def alone_steps():
  """The reference: the documents of the packed batch's rows each in a row of its own, on one device."""
  packed = _batch(2)
  n = len(_parts(packed))
  return _steps(_one_by_one(packed, rows=n + n % 2), "xla")


@pytest.mark.parametrize("attention, shape, fsdp, remat", [
    ("xla", None, False, "none"), ("explicit", (2, 4), False, "none"), ("xla", (2, 4), True, "full")],
    ids=["one-device", "2x4", "2x4-fsdp-remat"])
def test_a_packed_batchs_steps_equal_its_documents_run_one_by_one(alone_steps, attention, shape, fsdp, remat):
  """Distillation steps (teacher and student both given the segment ids through the step) on packed rows: the loss,
  gradient norm, trained tokens and the student's parameters after two steps equal those of the same documents in
  rows of their own, on one device and on a 2x4 mesh."""
  records, params = _steps(_batch(2), attention, shape, fsdp, remat)
  want_records, want_params = alone_steps
  np.testing.assert_allclose(records, want_records, rtol=1e-5)
  leaves = lambda tree: jax.tree.leaves(tree)  # noqa: E731
  for got, want in zip(leaves(params), leaves(want_params)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  if shape is None:  # the segments matter here: the same rows streamed (documents attending to each other) differ
    streamed, _ = _steps({k: v for k, v in _batch(2).items() if k not in SEGMENT_KEYS}, attention)
    assert abs(streamed[0, 0] - want_records[0, 0]) > 1e-4 * abs(want_records[0, 0])


def test_data_packing_documents_gives_segment_ids_in_every_batch(tmp_path):
  """``data.packing: documents`` makes the training and validation batches carry the segment ids and positions;
  ``stream`` (the default) does not; anything else is refused with the setting named."""
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("\n".join('{"text": "%s"}' % ("ab" * n) for n in range(2, 14)))  # 4-26 bytes each
  cfg = DataConfig(source=str(corpus), seq_len=32, val_fraction=0.2)
  assert cfg.packing == "stream"
  plain = build_data(cfg, 4, process_index=0, process_count=1)
  assert not set(SEGMENT_KEYS) & set(next(iter(plain.train_iterator())))
  docs = build_data(cfg.replace(packing="documents"), 4, process_index=0, process_count=1)
  batch = next(iter(docs.train_iterator()))
  assert set(SEGMENT_KEYS) <= set(batch) and batch["segment_ids"].shape == batch["inputs"].shape
  assert batch["segment_ids"].max() >= 2  # rows of several documents
  assert set(SEGMENT_KEYS) <= set(docs.val_batches()[0])
  with pytest.raises(ValueError, match=r"data.packing='rows'.*stream.*documents"):
    cfg.replace(packing="rows")
  with pytest.raises(ValueError, match=r"data.packing=documents and data.teacher_tokenizer"):
    cfg.replace(packing="documents", teacher_tokenizer="byte")


def test_segment_ids_of_the_wrong_shape_are_refused_with_their_name():
  model = _model(TEACHER, "xla")
  with pytest.raises(ValueError, match=r"segment_ids must be \[batch, seq\]"):
    model(jnp.asarray(ROWS["inputs"]), segment_ids=ROWS["segment_ids"][:, :-1])
  with pytest.raises(ValueError, match=r"positions were given without segment_ids"):
    model(jnp.asarray(ROWS["inputs"]), positions=ROWS["positions"])


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
def test_the_packed_splash_path_compiles_for_a_tpu_with_the_query_key_kernel():
  """Compiled for one v5e chip (nothing runs): a qk-norm decoder on packed rows runs the splash kernel with segment ids
  and forms its queries and keys with the `_head_prep` kernel on each row's RoPE tables, forward and backward (the
  chip's own test, tests/tpu/test_tpu_kernels.py, compares the numbers)."""
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from meshdistill.models import abstract_params
  from meshdistill.planner._hardware import tpu_target

  cfg = md.ModelConfig(vocab_size=256, d_model=256, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=128,
                       mlp_hidden=512, max_len=256, qk_norm=True, attention="splash", dtype="bfloat16")
  mesh = Mesh(np.array(tpu_target("v5e:2x2").devices[:1]).reshape(1, 1), ("data", "tensor"))
  placed = NamedSharding(mesh, PartitionSpec())
  graphdef, state, _ = abstract_params(cfg)
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), state)
  tokens, ids, pos = (jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=placed) for _ in range(3))

  def loss(state, tokens, ids, pos):
    out = nnx.merge(graphdef, state)(tokens, segment_ids=ids, positions=pos)
    return jnp.sum(out.logits.astype(jnp.float32))

  with jax.set_mesh(mesh):
    hlo = jax.jit(jax.grad(loss)).lower(state, tokens, ids, pos).compile().as_text()
  assert "norm_rope_heads_bwd" in hlo and "norm_rope_heads" in hlo


def test_the_tunix_adapter_keeps_packed_documents_apart():
  """A tunix Qwen3 (the adapter, on 4x2) given the rows' segment ids: each document's logits equal the document
  alone (1e-5), and differ without them."""
  import pathlib

  from meshdistill.models.tunix_adapter import load_tunix_hf

  model = load_tunix_hf(pathlib.Path(__file__).parent / "fixtures" / "hf_qwen3", md.make_mesh(data=4, tensor=2))
  rng = np.random.default_rng(3)
  docs = [rng.integers(3, model.cfg.vocab_size, n) for n in (10, 7, 12)]
  rows = pack_documents(docs, 32, eos_id=EOS, pad_id=PAD).arrays(segments=True)
  x = jnp.asarray(rows["inputs"])
  packed = np.asarray(model(x, segment_ids=rows["segment_ids"], positions=rows["positions"]).logits)
  streamed = np.asarray(model(x).logits)
  for b, lo, hi in _parts(rows):
    alone = np.asarray(model(x[b:b + 1, lo:hi]).logits)[0]
    np.testing.assert_allclose(packed[b, lo:hi], alone, rtol=1e-5, atol=1e-5)
    if lo > 0:
      assert rel_err(streamed[b, lo:hi], alone) > 1e-3


def test_a_top_k_teacher_with_packed_documents_is_refused_naming_the_setting():
  """A teacher given by its top-k computed it on rows whose documents see each other: with segment ids in the batch
  the `Distiller` refuses it, naming data.packing; a batch with only one of the two keys is refused too."""
  from meshdistill.strategies import LogitKD
  from meshdistill.train.teacher import TopKTeacher

  live = md.Distiller(_model(STUDENT, "xla", seed=1), _model(TEACHER, "xla"), optimizer=optax.sgd(1.0))
  with pytest.raises(ValueError, match=r"both \['segment_ids', 'positions'\].*only \['segment_ids'\]"):
    live.check_batch({k: v for k, v in _batch(2).items() if k != "positions"})
  cache = TopKTeacher(cfg=TEACHER, k=4, temperature=1.0, vocab=TEACHER.vocab_size, source="teacher.cache=c")
  d = md.Distiller(_model(STUDENT, "xla", seed=1), cache, strategy=LogitKD(top_k=4, temperature=1.0),
                   optimizer=optax.sgd(1.0))
  with pytest.raises(ValueError, match=r"data.packing=documents with teacher.cache=c.*use data.packing=stream"):
    d.check_batch(_batch(2))


def test_packed_rows_with_the_student_on_rows_split_over_tensor_equal_one_by_one():
  """``mesh.student_split: batch`` (the student on rows split over data x tensor, the teacher's inputs pinned whole
  over rows): the segment ids travel with both models' rows; loss and gradient norm of two steps equal the documents
  in rows of their own on one device."""
  idx = [0, 1, 2, 0, 1, 2, 0, 1]  # a multiple of data x tensor = 8 rows
  packed = {k: ROWS[k][idx] for k in ("inputs", "targets", "mask", *SEGMENT_KEYS)}
  n = len(_parts(packed))
  alone = _one_by_one(packed, rows=-(-n // 8) * 8)

  def records(batch, mesh=None, **kw):
    d = md.Distiller(_model(STUDENT, "xla", seed=1, mesh=mesh), _model(TEACHER, "xla", mesh=mesh),
                     optimizer=optax.sgd(1.0), mesh=mesh, **kw)
    state, out = d.init_state(), []
    for _ in range(2):
      state, metrics = d.step(state, batch)
      out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return np.asarray(out)

  np.testing.assert_allclose(records(packed, md.make_mesh(2, 4), student_split="batch"), records(alone), rtol=1e-5)
