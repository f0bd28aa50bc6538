"""Gradient accumulation (``train.micro_batch``): a device's rows run as micro-batches give the whole batch's step --
the same new parameters and metrics on one device and on the 2x4 mesh, with masked tokens spread unevenly over the
micro-batches -- and a size that does not cut the rows evenly, or a student whose loss cannot be cut, is a named
error."""

import jax
import numpy as np
import optax
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, assert_sgd_steps_agree, make_batch

import meshdistill as md
from meshdistill.config import ConfigError
from meshdistill.config.sections import TrainSettings
from meshdistill.models.moe import MoeConfig

ROWS = 16


def uneven_batch(seed: int) -> dict:
  """16 rows of 8 tokens whose unmasked tokens are spread unevenly: the first rows nearly all masked, the last
  whole, so micro-batches of contiguous rows hold very different token counts (a mean per micro-batch would weigh
  a micro-batch of few tokens like a full one)."""
  batch = make_batch(seed=seed, batch=ROWS, pad_from=None)
  mask = np.ones_like(batch["mask"])
  for row in range(ROWS):
    mask[row, 1 + row // 2:] = 0.0  # row r keeps 1 + r // 2 tokens: 1 token in the first rows, all 8 in the last
  batch["mask"] = mask
  return batch


BATCHES = [uneven_batch(s) for s in range(2)]
KEYS = ("loss", "kl", "ce", "teacher_ce", "agree")


def distiller(shape=None, split="tensor", fsdp=False, scan=False, **kw):
  mesh = None if shape is None else md.make_mesh(*shape)
  teacher = md.init_model(TEACHER_CFG.replace(scan_layers=scan), seed=0, mesh=mesh)
  student = md.init_model(STUDENT_CFG.replace(scan_layers=scan), seed=1, mesh=mesh)
  return md.Distiller(student, teacher, mesh=mesh, optimizer=optax.sgd(1.0), student_split=split, fsdp=fsdp,
                      **kw)


@pytest.fixture(scope="module")
def whole():
  return distiller()


def test_uneven_masks_make_a_mean_per_micro_batch_differ_from_the_step_loss(whole):
  """The batches test what they should: the loss of the whole batch is not the mean of its halves' losses."""
  batch = BATCHES[0]
  halves = [{k: v[i * ROWS // 2:(i + 1) * ROWS // 2] for k, v in batch.items()} for i in range(2)]
  _, metrics = whole.step(whole.init_state(), batch)
  per_half = [float(whole.step(whole.init_state(), h)[1]["loss"]) for h in halves]
  tokens = [h["mask"].sum() for h in halves]
  assert tokens[0] < tokens[1] / 2
  assert abs(np.mean(per_half) - float(metrics["loss"])) > 1e-3 * abs(float(metrics["loss"]))


@pytest.mark.parametrize("shape, split, fsdp, scan, micro_batch", [
    (None, "tensor", False, False, 8),  # one device: 16 rows as 2 micro-batches
    (None, "tensor", False, False, 4),  # ... as 4
    (None, "tensor", False, True, 8),  # both models' layers scanned (`nnx.scan` inside the loop over micro-batches)
    ((2, 4), "tensor", False, False, 4),  # 2x4: 8 rows per data shard as 2 micro-batches
    ((2, 4), "tensor", False, False, 2),  # ... as 4
    ((2, 4), "batch", False, False, 4),  # the student on rows split over tensor too: 2 micro-batches of 4 rows
    ((2, 4), "tensor", True, False, 4),  # weights split over data too: gathered, gradients scattered per micro-batch
], ids=["1-device-k2", "1-device-k4", "1-device-scanned-k2", "2x4-k2", "2x4-k4", "2x4-student-split-k2",
        "2x4-fsdp-k2"])
def test_an_accumulated_step_gives_the_whole_batch_step(whole, shape, split, fsdp, scan, micro_batch):
  """The same new parameters and metrics as one device running the whole batch at once, within float32 summation
  bounds (`assert_sgd_steps_agree`: the sums over the same tokens in another order)."""
  accumulated = distiller(shape, split, fsdp, scan, micro_batch=micro_batch)
  assert_sgd_steps_agree(distiller(scan=True) if scan else whole, accumulated, BATCHES, KEYS)


def test_the_metrics_light_step_accumulates_the_same_loss(whole):
  light = distiller(micro_batch=4).metrics_light()
  _, full = whole.step(whole.init_state(), BATCHES[0])
  _, got = light.step(light.init_state(), BATCHES[0])
  assert set(got) == {"loss", "grad_norm", "tokens"}
  # one step's loss: a token mean over the batch's positions, summed in another order (`summation_atol`'s bound)
  atol = 2 * BATCHES[0]["mask"].size * float(np.finfo(np.float32).eps) * abs(float(full["loss"]))
  np.testing.assert_allclose(float(got["loss"]), float(full["loss"]), rtol=0, atol=atol)
  assert float(got["tokens"]) == float(full["tokens"]) == BATCHES[0]["mask"].sum()


def test_a_micro_batch_that_does_not_cut_the_rows_evenly_names_the_setting_and_the_sizes_that_work():
  d = distiller(micro_batch=3)
  with pytest.raises(ValueError, match=r"train\.micro_batch=3 must divide the 16 rows .*use one of \[16, 8, 4, 2, 1\]"):
    d.step(d.init_state(), BATCHES[0])
  on_mesh = distiller((2, 4), "batch", micro_batch=2)  # rows split over tensor=4 as well: multiples of 4
  with pytest.raises(ValueError, match=r"micro_batch=2 must divide the 8 rows .*multiple of 4.*use one of \[8, 4\]"):
    on_mesh.step(on_mesh.init_state(), BATCHES[0])
  with pytest.raises(ConfigError, match=r"train\.micro_batch=3 must divide train\.batch_size=16.*\[16, 8, 4, 2, 1\]"):
    TrainSettings(batch_size=16, micro_batch=3)
  with pytest.raises(ConfigError, match=r"train\.micro_batch=0 must be a positive integer"):
    TrainSettings(micro_batch=0)
  with pytest.raises(ValueError, match=r"train\.micro_batch='half' must be a positive number of rows"):
    distiller(micro_batch="half")


def test_a_mixture_of_experts_student_refuses_micro_batches_by_name():
  moe = STUDENT_CFG.replace(moe=MoeConfig(n_experts=2, top_k=1, expert_hidden=8))
  d = md.Distiller(md.init_model(moe, seed=1), md.init_model(TEACHER_CFG, seed=0), micro_batch=8)
  with pytest.raises(ValueError, match=r"train\.micro_batch: a mixture-of-experts student's load-balancing loss"):
    d.step(d.init_state(), BATCHES[0])
  whole_rows = md.Distiller(md.init_model(moe, seed=1), md.init_model(TEACHER_CFG, seed=0), micro_batch=ROWS)
  _, metrics = whole_rows.step(whole_rows.init_state(), BATCHES[0])  # one micro-batch of all rows: the plain step
  assert np.isfinite(float(jax.device_get(metrics["moe_aux"])))
