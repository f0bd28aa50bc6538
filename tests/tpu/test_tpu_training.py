"""On the chip against the CPU, in the same process: one distillation step, LoRA / QLoRA students, the int8 teacher.

Run on a TPU machine, in one process (see tests/tpu/conftest.py; skipped with the reason elsewhere):

  python -m pytest -o addopts= -m tpu tests/tpu -q -ra
  MESHDISTILL_TPU_TESTS_ON=cpu python -m pytest -n 0 tests/tpu -q   # the same tests on the CPU (CPU devices 0 and 1)

With ``JAX_PLATFORMS`` left to JAX both backends are open: each half builds a ``Distiller`` on a 1x1 mesh of its own
device (the ``chip`` and ``host`` fixtures) from the same weights (made on the CPU and copied, so both start from
the same bits) and takes the same batches. The optimizer is SGD with learning rate ``LR``: its update is
``-LR * gradient``, so comparing the updates compares the gradients. (AdamW's first update is ``lr * g / |g|``, a
sign per coordinate: on coordinates whose gradient is at rounding level either sign is right, and a comparison of
updated weights would test rounding.) Two steps: the second step's loss and metrics also check that the first
update was applied.

Tolerances (`helpers.rel_err`: a Frobenius-norm ratio per array, per weight for gradients):

=====================================  ===========  =========================================================
comparison                             bound        why
=====================================  ===========  =========================================================
float32 step (splash, chunked loss,    1e-4 loss,   'highest' matmul precision on both (the TPU's default runs
scanned, remat), LoRA, QLoRA with an   metrics;     a float32 product as one bfloat16 pass, ~3 digits); what
int8 teacher: chip vs CPU              1e-3 per-    differs is summation order and the TPU's exp / log / tanh
                                       weight       (4-5 digits); a small weight's gradient (a norm scale, a
                                       gradient     LoRA B) is a sum with cancellation, 10x looser. A real
                                                    fault (a mask, a term, a kernel's block) moves them O(1)
bfloat16 step (the production mix:    4x the       both sides round activations to bfloat16 (8 bits) in
bfloat16 compute and teacher weights,  bfloat16-vs- different places (the MXU accumulates in float32; the CPU
float32 student, splash, chunked       float32 gap  may upcast element-wise ops the TPU keeps in bfloat16), so
loss): chip vs CPU                     measured in  chip and CPU differ by about as much as either differs
                                       the test     from float32: if the chip's own gap is twice the CPU's,
                                       (5e-4 loss   about sqrt(2^2 + 1) = 2.2x the CPU's gap; 4x leaves margin.
                                       and metrics, On the CPU, splash and xla attention in bfloat16 differ
                                       1.7e-2 the   by 0.3-1.2x that gap
                                       gradient)
counted metrics (tokens, top-1         tokens       the same tokens; a token whose top two logits are within
agreement)                             equal,       rounding may change its top-1 choice
                                       agreement
                                       +-2 tokens
int8 teacher's logits vs its bfloat16  5e-2 (chip   per-channel int8 (steps of a channel's largest weight /
weights, float32 compute at 'highest'  vs CPU: the  127) through 2 blocks: 2.0e-2 seen on the CPU. The same
                                       float32      teacher in bfloat16 compute: 4x its bfloat16-vs-float32
                                       bound)       gap, as the bfloat16 step (2.7e-2 on the CPU)
=====================================  ===========  =========================================================
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import make_batch, rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshdistill as md
from meshdistill.models.lora import LoraConfig, apply_lora
from meshdistill.models.quantize import is_quantized, quantize_model
from meshdistill.strategies import ChunkedLogitKD

pytestmark = pytest.mark.tpu

HIGHEST = "highest"
LOSS_TOL, GRAD_TOL = 1e-4, 1e-3  # float32 at 'highest': see the table above
LR = 0.1
COUNTS = {"tokens", "agree"}  # metrics that count tokens: compared as counts, not to a rounding bound
VOCAB = 1024
# chip shapes: head_dim 128, sequences of 256 (one splash block per row), vocabulary and hidden sizes multiples of 128;
# a batch is 4 x 256 = 1024 tokens, in chunks of 384 for the chunked loss (the last one padded)
TEACHER = md.ModelConfig(vocab_size=VOCAB, d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=128,
                         mlp_hidden=512, max_len=256, attention="splash", tie_embeddings=False, dtype="float32",
                         param_dtype="float32", scan_layers=False)  # named: on a TPU the defaults differ
STUDENT = TEACHER.replace(n_layers=2, mlp_hidden=384, scan_layers=True, remat="full")
BATCHES = [make_batch(seed=s, batch=4, seq=256, vocab=VOCAB, pad_from=200) for s in range(2)]


def _mesh(device):
  return md.make_mesh(1, 1, devices=[device])


def _to_mesh(model, mesh):
  """``model`` with every array copied to ``mesh`` under the same partition spec: the same bits on another device."""
  graphdef, state = nnx.split(model)
  move = lambda a: jax.device_put(a, NamedSharding(mesh, getattr(a.sharding, "spec", P())))  # noqa: E731
  return nnx.merge(graphdef, jax.tree.map(move, state))


def _steps(student, teacher, device, strategy=None):
  """Two SGD steps of a Distiller on a 1x1 mesh of ``device`` (the models copied there): the metrics of each step
  (floats) and the first update over ``-LR`` (the gradient), per weight, on the host."""
  mesh = _mesh(device)
  with jax.default_device(device):
    d = md.Distiller(_to_mesh(student, mesh), _to_mesh(teacher, mesh), strategy=strategy, optimizer=optax.sgd(LR),
                     mesh=mesh)
    state = d.init_state()
    before, metrics = jax.device_get(d.unreplicate(state.params)), []
    for i, batch in enumerate(BATCHES):
      state, m = d.step(state, batch)
      metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
      if i == 0:
        grads = jax.tree.map(lambda a, b: (a - b) / LR, before, jax.device_get(d.unreplicate(state.params)))
  flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(grads)}
  return metrics, flat


def _metric_errors(got, want) -> dict:
  """Per step and metric: the relative error (a correlation near 0: the absolute one). The counts are checked apart
  (`_check_counts`)."""
  out = {}
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.keys() == w.keys()
    for k in set(w) - COUNTS:
      err = abs(g[k] - w[k])
      out[i, k] = err if k == "corr" else err / max(abs(w[k]), 1e-30)
  return out


def _check_counts(got, want):
  """The same tokens counted; top-1 agreement (a fraction of them) differs by at most 2 tokens whose top two logits
  are within rounding of each other."""
  for g, w in zip(got, want):
    assert g["tokens"] == w["tokens"] > 0
    assert abs(g["agree"] - w["agree"]) * w["tokens"] <= 2 + 1e-3, (g["agree"], w["agree"])


def _grad_errors(got, want) -> dict:
  assert got.keys() == want.keys()
  return {k: rel_err(got[k], want[k]) for k in want if np.any(want[k])}  # a weight with no gradient: checked below


def _models(student_cfg, teacher_cfg, host):
  with jax.default_device(host):
    mesh = _mesh(host)
    return md.init_model(student_cfg, seed=1, mesh=mesh), md.init_model(teacher_cfg, seed=0, mesh=mesh)


def test_float32_distillation_step_on_the_chip_equals_the_step_on_the_cpu(chip, host):
  """Splash attention, the chunked loss, a scanned student under remat full: two steps on the chip and on the CPU."""
  student, teacher = _models(STUDENT, TEACHER, host)
  kd = ChunkedLogitKD(chunk_size=384, temperature=2.0, alpha=0.5)
  with jax.default_matmul_precision(HIGHEST):
    got, got_grads = _steps(student, teacher, chip, kd)
    want, want_grads = _steps(student, teacher, host, kd)
  assert {"loss", "kl", "ce", "grad_norm", "tokens"} <= set(want[0]) and want[1]["loss"] != want[0]["loss"]
  _check_counts(got, want)
  errors = _metric_errors(got, want)
  assert max(errors.values()) < LOSS_TOL, {k: e for k, e in errors.items() if e >= LOSS_TOL}
  errors = _grad_errors(got_grads, want_grads)
  assert len(errors) > 10 and max(errors.values()) < GRAD_TOL, {k: e for k, e in errors.items() if e >= GRAD_TOL}
  for k, g in want_grads.items():  # what has no gradient on the CPU has none on the chip
    assert np.any(g) or not np.any(got_grads[k]), k


def test_bfloat16_distillation_step_on_the_chip_equals_the_cpu_within_bfloat16_rounding(chip, host):
  """The production mix: bfloat16 compute, a teacher stored in bfloat16, a float32 student, default precision. The
  bound is 4x the gap between the bfloat16 and the float32 step on the CPU, measured here: for the metrics the
  largest gap of any (one metric's own gap is itself a sample of rounding: it can be 10x smaller than another's),
  for the gradient one norm over every weight (a single small weight's gradient is mostly rounding in bfloat16)."""
  kd = ChunkedLogitKD(chunk_size=384, temperature=2.0, alpha=0.5)
  bf16_student, bf16_teacher = _models(STUDENT.replace(dtype="bfloat16"),
                                       TEACHER.replace(dtype="bfloat16", param_dtype="bfloat16"), host)
  f32_student, f32_teacher = _models(STUDENT, TEACHER.replace(param_dtype="bfloat16"), host)  # same weights
  got, got_grads = _steps(bf16_student, bf16_teacher, chip, kd)
  want, want_grads = _steps(bf16_student, bf16_teacher, host, kd)
  with jax.default_matmul_precision(HIGHEST):
    exact, exact_grads = _steps(f32_student, f32_teacher, host, kd)

  def whole(grads):
    return np.concatenate([g.ravel() for _, g in sorted(grads.items())])

  gap = max(_metric_errors(want, exact).values())  # 5e-4 on the CPU (grad_norm of step 2; the loss: 5e-5 to 1e-4)
  grad_gap = rel_err(whole(want_grads), whole(exact_grads))  # 1.7e-2 on the CPU
  assert 0 < gap < 1e-2 and 0 < grad_gap < 0.1, (gap, grad_gap)  # bfloat16 is really used; the gaps are rounding
  _check_counts(got, want)
  errors = _metric_errors(got, want)
  assert max(errors.values()) <= 4 * gap, ({k: e for k, e in errors.items() if e > 4 * gap}, gap)
  assert rel_err(whole(got_grads), whole(want_grads)) <= 4 * grad_gap, grad_gap


@pytest.mark.parametrize("quantize", [None, "nf4"], ids=["lora", "qlora-nf4-int8-teacher"])
def test_lora_student_step_on_the_chip_equals_the_step_on_the_cpu(chip, host, quantize):
  """Adapters of rank 8 on every projection of a float (LoRA) or an nf4-quantized base (QLoRA, which distils from an
  int8 teacher, as the QLoRA recipe does): two steps, float32 at 'highest'. Only the adapters move, on both. XLA's
  attention: the subject here is the adapters and the quantized weights (the splash kernel is the float32 step's)."""
  base_student, teacher = _models(STUDENT.replace(scan_layers=False, attention="xla"), TEACHER.replace(attention="xla"),
                                  host)
  with jax.default_device(host):
    mesh = _mesh(host)
    student = apply_lora(base_student, LoraConfig(rank=8, quantize=quantize), seed=2, mesh=mesh)
    if quantize:
      teacher = quantize_model(teacher, "int8", mesh=mesh)
      assert is_quantized(student) and is_quantized(teacher)
  with jax.default_matmul_precision(HIGHEST):
    got, got_grads = _steps(student, teacher, chip)
    want, want_grads = _steps(student, teacher, host)
  _check_counts(got, want)
  errors = _metric_errors(got, want)
  assert max(errors.values()) < LOSS_TOL, {k: e for k, e in errors.items() if e >= LOSS_TOL}
  moved = {k for k, g in want_grads.items() if np.any(g)}
  assert moved and all("lora" in k for k in moved), sorted(moved)[:5]
  errors = _grad_errors(got_grads, want_grads)
  assert max(errors.values()) < GRAD_TOL, {k: e for k, e in errors.items() if e >= GRAD_TOL}
  assert not any(np.any(got_grads[k]) for k in set(got_grads) - moved)  # the frozen base stays put on the chip


def _logits(model, tokens, device):
  graphdef, state = nnx.split(_to_mesh(model, _mesh(device)))
  with jax.default_device(device):
    return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x).logits)(state, jnp.asarray(tokens)), np.float32)


def test_int8_teacher_is_within_quantization_error_of_its_bfloat16_weights_and_the_same_on_chip_and_cpu(chip, host):
  """A teacher stored in bfloat16 (the production teacher) and its int8 copy (`quantize_model`), in float32 at
  'highest': the int8 logits are within int8's error of the bfloat16-weight ones, and the chip's logits (so the
  quantization error too) equal the CPU's. Computing in bfloat16 (the production mix), chip and CPU differ by at most
  4x the gap between bfloat16 and float32 compute of the int8 teacher on the CPU, measured here."""
  cfg = TEACHER.replace(param_dtype="bfloat16", attention="xla")
  with jax.default_device(host):
    mesh = _mesh(host)
    teachers = {dtype: md.init_model(cfg.replace(dtype=dtype), seed=0, mesh=mesh) for dtype in ("float32", "bfloat16")}
    int8 = {dtype: quantize_model(m, "int8", mesh=mesh) for dtype, m in teachers.items()}
  tokens = BATCHES[0]["inputs"]
  with jax.default_matmul_precision(HIGHEST):
    (bf16_chip, int8_chip), (bf16_cpu, int8_cpu) = (
        [_logits(m["float32"], tokens, d) for m in (teachers, int8)] for d in (chip, host))
  quantization = rel_err(int8_chip, bf16_chip)
  assert 0 < quantization < 0.05, quantization  # 2.0e-2 on the CPU: per-channel steps of max|w| / 127, 2 blocks
  assert rel_err(bf16_chip, bf16_cpu) < LOSS_TOL and rel_err(int8_chip, int8_cpu) < LOSS_TOL
  assert abs(quantization - rel_err(int8_cpu, bf16_cpu)) < LOSS_TOL
  bf16_compute_chip, bf16_compute_cpu = (_logits(int8["bfloat16"], tokens, d) for d in (chip, host))
  gap = rel_err(bf16_compute_cpu, int8_cpu)  # 2.7e-2 on the CPU
  assert 0 < gap < 0.1 and rel_err(bf16_compute_chip, bf16_compute_cpu) <= 4 * gap
