"""Context parallelism (``mesh.axes: {context: n}``): each device holds a slice of every row's tokens, attention
gathers the whole row's keys and values over ``context``, and the step sums gradients and token sums over ``data``
and ``context``. A step on ``data=2 x context=2 x tensor=2`` equals the same step on one device, for rows of one
stream and for rows packed from several documents (documents crossing the slices' boundary), with the ``xla`` (whole and
in query blocks), ``explicit`` and ``splash`` (interpreted) kernels, the chunked loss and weights split over ``data``
(fsdp).

Tolerances: `helpers.assert_sgd_steps_agree` (float32 models, plain SGD at rate 1: the parameters after the steps
compare the gradients), each bound derived from the number of summands and the magnitudes compared.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, all_gather_shapes, assert_sgd_steps_agree, make_batch
from jax.sharding import PartitionSpec as P

import meshdistill as md
from meshdistill import cli
from meshdistill.config import load_config
from meshdistill.core.batch import SEGMENT_KEYS
from meshdistill.data import pack_documents
from meshdistill.jobs import build_mesh
from meshdistill.models import _context
from meshdistill.models._visible import Segments, segment_positions
from meshdistill.models.moe import MoeConfig
from meshdistill.parallel.backends import make_layout
from meshdistill.planner._compile import collectives
from meshdistill.strategies import ChunkedLogitKD, LogitKD

T = 16  # two slices of 8 tokens on context=2
F32 = {"max_len": T, "dtype": "float32", "param_dtype": "float32", "remat": "none"}
TEACHER = TEACHER_CFG.replace(**F32)
STUDENT = STUDENT_CFG.replace(n_layers=2, **F32)
SHAPE = {"data": 2, "context": 2, "tensor": 2}


def _mesh():
  return md.make_mesh(data=2, tensor=2, axes={"context": 2})


def _distiller(mesh, attention="xla", strategy=None, fsdp=False, window=None, **kw):
  """A float32 pair on ``mesh``; ``window``: the teacher's sliding window (its logits enter the loss)."""
  return md.Distiller(md.init_model(STUDENT.replace(attention=attention), seed=1),
                      md.init_model(TEACHER.replace(attention=attention, sliding_window=window), seed=0),
                      strategy=strategy, optimizer=optax.sgd(1.0), mesh=mesh, fsdp=fsdp, **kw)


def _plain_batches():
  return [make_batch(seed=s, batch=4, seq=T, pad_from=13) for s in range(2)]


def _packed_batches():
  """Rows of ``T`` packed from documents of 3-13 tokens: documents cross the two slices' boundary (token 8) and the
  rows' ends, padding at the end of the last row; their segment ids and positions."""
  rng = np.random.default_rng(0)
  docs = [rng.integers(3, TEACHER.vocab_size, n) for n in (11, 6, 13, 4, 9, 12, 3, 10, 7, 13, 5, 8, 12, 6, 9)]
  rows = pack_documents(docs, T, eos_id=2, pad_id=0).arrays(segments=True)
  keys = ("inputs", "targets", "mask", *SEGMENT_KEYS)
  assert len(rows["inputs"]) >= 8
  seg = rows["segment_ids"]
  assert np.sum((seg[:, 7] == seg[:, 8]) & (seg[:, 8] > 0)) >= 4  # documents continuing on the second slice
  return [{k: rows[k][4 * i: 4 * i + 4] for k in keys} for i in range(2)]


@pytest.mark.parametrize("rows, attention, strategy, fsdp, block, window", [
    ("plain", "xla", LogitKD(), False, None, None),
    ("packed", "explicit", LogitKD(), False, None, 6),
    ("plain", "xla", ChunkedLogitKD(chunk_size=4), True, 4, 6),
    ("packed", "xla", ChunkedLogitKD(chunk_size=4), True, 4, None),
], ids=["plain-xla", "packed-explicit-window", "plain-xla-query-blocks-window-chunked-fsdp",
        "packed-xla-query-blocks-chunked-fsdp"])
def test_a_step_on_data_context_tensor_equals_one_device(rows, attention, strategy, fsdp, block, window, monkeypatch):
  """Two SGD steps on data=2 x context=2 x tensor=2: loss, KL, CE, gradient norm and the parameters after them equal
  one device's. The positions and masks are the row's: a slice that used its own (local RoPE positions, a causal
  mask from its first token, documents cut at the boundary) would differ from the first step. ``block``: the xla
  kernel's queries in blocks of 4 (two per slice of 8, `ContextShard.attend`), each block's mask from its own
  global rows; ``window``: the teacher's sliding window of 6, which reaches across the slices' boundary."""
  if block is not None:
    monkeypatch.setattr(_context, "QUERY_BLOCK", block)
  batches = _plain_batches() if rows == "plain" else _packed_batches()
  metrics = assert_sgd_steps_agree(_distiller(None, attention, strategy, window=window),
                                   _distiller(_mesh(), attention, strategy, fsdp, window=window),
                                   batches, ("loss", "kl", "ce"))
  assert metrics[0]["tokens"] == sum(b["mask"].sum() for b in batches[:1])


def test_the_step_gathers_only_keys_and_values_over_context_each_on_its_tensor_block():
  """The compiled step's only gathers are the keys' and values' over ``context``: one per layer of each model and
  each of k and v, ``[rows, T, G / tensor, head_dim]`` from slices of ``T / 2`` tokens, each device gathering its
  own key/value heads (no gather over ``tensor`` first); the backward pass reduce-scatters the student's key and value
  gradients over ``context``; gradients and token sums are summed over ``data`` and ``context`` together. No logits
  and no hidden states cross ``context``."""
  mesh = _mesh()
  d = _distiller(mesh)
  hlo = d.lower(d.init_state(), _plain_batches()[0]).compile().as_text()
  found = {(c["kind"], c["axis"]): c["count"] for c in collectives(hlo, dict(mesh.shape))}
  layers = TEACHER.n_layers + STUDENT.n_layers
  assert found[("all-gather", "context")] == 2 * layers, found
  assert found[("reduce-scatter", "context")] == 2 * STUDENT.n_layers, found
  assert found[("all-reduce", "data+context")] >= 1, found
  assert not {k for k in found if k[0] in ("all-gather", "all-to-all") and k[1] != "context"}, found
  kv = {(2, T, cfg.n_kv_heads // 2, cfg.hd) for cfg in (TEACHER, STUDENT)}
  assert set(all_gather_shapes(hlo)) == kv


def test_a_packed_slice_counts_positions_from_its_documents_start_on_another_device():
  """Segment ids without positions on a slice of the row: each token's position within its document counts from
  where the document starts, on whichever device that is (the whole row's ids are gathered)."""
  mesh = md.make_mesh(data=1, tensor=1, axes={"context": 8})
  ids = np.repeat(np.array([[1, 2, 3, 4]]), [5, 20, 2, 5], axis=1).astype(np.int32)  # [1, 32]: slices of 4 tokens

  def local(ids_BxT):
    return Segments.of(ids_BxT, ids_BxT).positions_BxT

  got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(None, "context"), out_specs=P(None, "context"),
                              axis_names={"context"}, check_vma=False))(ids)
  np.testing.assert_array_equal(got, segment_positions(jnp.asarray(ids)))
  assert int(got[0, 12]) == 7  # the second document began 7 tokens earlier, on the second slice


def test_splash_under_context_parallelism_equals_one_device():
  """The splash kernel (interpreted on CPU) on data=2 x context=2 x tensor=2, rows of 256 tokens packed from documents
  that cross the slices' boundary at 128: each device runs the kernel whose causal mask starts at its offset, with the
  row's segment ids for the keys (the teacher's with a sliding window of 100, reaching across the boundary: the
  kernel's local mask shifted likewise); two steps equal one device's (the ``xla`` kernel on whole rows)."""
  long = {"max_len": 256}
  rng = np.random.default_rng(1)
  docs = [rng.integers(3, TEACHER.vocab_size, n) for n in (90, 70, 120, 40, 100, 60, 150, 80, 110, 50, 95, 130)]
  rows = pack_documents(docs, 256, eos_id=2, pad_id=0).arrays(segments=True)
  seg = rows["segment_ids"][:4]
  assert np.sum((seg[:, 127] == seg[:, 128]) & (seg[:, 128] > 0)) >= 2  # documents on both slices
  batches = [{k: rows[k][:4] for k in ("inputs", "targets", "mask", *SEGMENT_KEYS)}]

  def distiller(mesh, attention):
    return md.Distiller(md.init_model(STUDENT.replace(attention=attention, **long), seed=1),
                        md.init_model(TEACHER.replace(attention=attention, sliding_window=100, **long), seed=0),
                        optimizer=optax.sgd(1.0), mesh=mesh)

  assert_sgd_steps_agree(distiller(None, "xla"), distiller(_mesh(), "splash"), batches, ("loss", "kl", "ce"))


def test_bad_context_settings_name_the_setting():
  d = _distiller(_mesh())
  with pytest.raises(ValueError, match=r"sequence length 15 \(data.seq_len\) is not divisible by "
                                       r"mesh.axes.context=2"):
    d.step(d.init_state(), make_batch(batch=4, seq=15))
  with pytest.raises(ValueError, match=r"mesh.student_split='batch' with mesh.axes.context=2"):
    make_layout("shard_map", _mesh(), student_split="batch")
  d = _distiller(_mesh(), strategy=_RowMean())
  with pytest.raises(ValueError, match=r"strategy _RowMean is a mean over whole rows .* mesh.axes.context=2"):
    d.step(d.init_state(), _plain_batches()[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RowMean(LogitKD):
  """A strategy whose loss is a mean over rows (`count`, as the preference losses'): a row's slice is not a row."""

  def count(self, mask_BxT):
    return jnp.sum(mask_BxT[:, 0])


def test_a_dropless_moe_student_on_data_context_tensor_equals_one_device():
  """A mixture-of-experts student (dropless, with a dense layer and both router terms weighted) on data=2 x context=2
  x tensor=2: its routing is per token and its router terms global means, so two steps equal one device's. A
  per-sequence capacity is refused: a device holds a slice of each sequence, not the group the capacity is of."""
  moe = STUDENT.replace(moe=MoeConfig(n_experts=4, top_k=2, expert_hidden=12, dense_layers=(1,),
                                       aux_loss_weight=0.1, z_loss_weight=0.01))

  def distiller(mesh, capacity=None):
    student = moe.replace(moe=dataclasses.replace(moe.moe, capacity_factor=capacity))
    return md.Distiller(md.init_model(student, seed=1), md.init_model(TEACHER, seed=0), optimizer=optax.sgd(1.0),
                        mesh=mesh)

  assert_sgd_steps_agree(distiller(None), distiller(_mesh()), _plain_batches(), ("loss", "kl", "ce"))
  d = distiller(_mesh(), capacity=1.0)
  with pytest.raises(ValueError, match=r"MoeConfig.capacity_factor=1.0 caps each expert per sequence, but the "
                                       r"sequence is split over mesh.axes.context=2"):
    d.step(d.init_state(), _plain_batches()[0])


def test_mesh_axes_context_in_a_config_builds_the_mesh():
  cfg = load_config("tiny", ["mesh.data=2", "mesh.tensor=2", "mesh.axes={context: 2}"])
  assert build_mesh(cfg).shape == SHAPE


def test_the_planner_compiles_a_context_parallel_mesh(capsys):
  """``meshdistill plan --mesh data=2,context=2,tensor=2`` compiles the step (8 CPU devices) and attributes its
  key/value gathers to the context axis."""
  rc = cli.main(["plan", "--devices", "cpu:8", "--config", "tiny", "--json", "--mesh", "data=2,context=2,tensor=2",
                 "--set", "train.batch_size=4", "--attention", "xla"])
  assert rc == 0
  out = json.loads(capsys.readouterr().out)
  assert out["mesh"] == SHAPE and out["memory"]["total"] > 0
  assert any(c["kind"] == "all-gather" and c["axis"] == "context" for c in out["collectives"]), out["collectives"]
