"""Chunked, vocabulary-parallel logit losses: same numbers as the naive loss, less memory, no vocab gather."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, all_gather_shapes, jaxpr_equations, make_batch, rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshdistill as md
from meshdistill.parallel.collectives import all_reduce_census
from meshdistill.losses import chunked_token_sums, cross_entropy_token_fn, divergence_token_fn
from meshdistill.strategies import LogitKD
from meshdistill.strategies import ChunkedLogitKD

N, D, E, V = 37, 16, 24, 200  # 37 tokens: prime, so most chunk sizes leave a padded tail
DIVERGENCES = sorted(md.losses.DIVERGENCES)
TOKEN_FNS = {name: divergence_token_fn(fn) for name, fn in md.losses.DIVERGENCES.items()}
TOKEN_FNS["cross_entropy"] = cross_entropy_token_fn


@pytest.fixture(scope="module")
def inputs():
  k = jax.random.split(jax.random.key(0), 6)
  return {
      "s": jax.random.normal(k[0], (N, D)),
      "w": 0.3 * jax.random.normal(k[1], (D, V)),
      "t": jax.random.normal(k[2], (N, E)),
      "wt": 0.3 * jax.random.normal(k[3], (E, V)),
      "targets": jax.random.randint(k[4], (N,), 0, V),
      "mask": (jax.random.uniform(k[5], (N,)) > 0.3).astype(jnp.float32),
  }


def loss_and_grads(token_fn, x, chunk_sizes, params=None):
  """[(loss, sums, (d student hidden, d student head))] for each chunk size, from one compiled program."""
  params = {"temperature": jnp.float32(2.0)} if params is None else params

  def loss(s, w, chunk_size):
    sums = chunked_token_sums(token_fn, params, s, w, x["t"], x["wt"], x["targets"], x["mask"], chunk_size=chunk_size)
    return sums["loss"], sums

  def all_sizes(s, w):
    return [jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(s, w, c) for c in chunk_sizes]

  return [(value, sums, grads) for (value, sums), grads in jax.jit(all_sizes)(x["s"], x["w"])]


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_chunked_kd_loss_metrics_and_grads_equal_naive_for_every_divergence(inputs, divergence):
  kd = ChunkedLogitKD(divergence=divergence, temperature=1.5, alpha=0.3)
  (ref, ref_sums, ref_grads), (value, sums, grads) = loss_and_grads(kd.token_terms, inputs, (0, 5), kd.scalars(0))
  assert float(jnp.abs(ref)) > 0 and float(jnp.max(jnp.abs(ref_grads[1]))) > 0
  assert {"loss", "kl", "ce", "teacher_ce", "corr", "agree"} <= set(sums)
  assert (divergence == "forward_kl") == (set(sums) == {"loss", "kl", "ce", "teacher_ce", "corr", "agree"})
  for k in ref_sums:
    assert rel_err(sums[k], ref_sums[k]) < 1e-5, k
  for g, ref_g in zip(grads, ref_grads):  # w.r.t. student hidden states and student head
    assert rel_err(g, ref_g) < 1e-5


@pytest.mark.parametrize("name", ["forward_kl", "cross_entropy"])
def test_any_chunk_size_gives_the_naive_loss_and_grads(inputs, name):
  # 8 pads 37 tokens to 40; 37 is one exact chunk; 64 exceeds the token count
  (ref, _, ref_grads), *chunked = loss_and_grads(TOKEN_FNS[name], inputs, (0, 8, N, 64))
  for chunk, (value, _, grads) in zip((8, N, 64), chunked):
    assert rel_err(value, ref) < 1e-5, (chunk, float(value), float(ref))
    for g, ref_g in zip(grads, ref_grads):
      assert rel_err(g, ref_g) < 1e-5, chunk


def test_a_tied_head_is_read_as_its_table_with_the_same_loss_metrics_and_grads(inputs):
  """A head that is a ``[V, D]`` table transposed (``tied_heads``: an LM head tied to the embedding) enters the chunk
  loop as the table and its gradient is accumulated ``[V, D]`` (a transposed head would enter the loop as a copy,
  once per step, and its gradient leave as another: `benchmarks/step_cycles.py`), with the numbers of the same head
  given plainly."""
  kd = ChunkedLogitKD(temperature=1.5, alpha=0.3)
  s_tab, t_tab = inputs["w"].T, inputs["wt"].T  # [V, D], [V, E]

  def loss(s, s_tab, tied):
    sums = chunked_token_sums(kd.token_terms, kd.scalars(0), s, s_tab.T, inputs["t"], t_tab.T, inputs["targets"],
                              inputs["mask"], chunk_size=8, tied_heads=tied)
    return sums["loss"], sums

  grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  (want, want_sums), want_grads = jax.jit(grad, static_argnums=2)(inputs["s"], s_tab, (False, False))
  (got, got_sums), got_grads = jax.jit(grad, static_argnums=2)(inputs["s"], s_tab, (True, True))
  assert float(jnp.abs(want)) > 0 and set(got_sums) == set(want_sums)
  for k in want_sums:
    assert rel_err(got_sums[k], want_sums[k]) < 1e-5, k
  for g, ref_g in zip(got_grads, want_grads):
    assert rel_err(g, ref_g) < 1e-5

  def loop_inputs(tied):
    jaxpr = jax.make_jaxpr(grad, static_argnums=2)(inputs["s"], s_tab, tied).jaxpr
    scans = [e for e in jaxpr_equations(jaxpr) if e.primitive.name == "scan"]
    return {tuple(v.aval.shape) for e in scans for v in e.invars} & {(V, D), (V, E), (D, V), (E, V)}

  assert loop_inputs((True, True)) == {(V, D), (V, E)}  # both tables as stored, the accumulator [V, D] too
  assert loop_inputs((False, False)) == {(D, V), (E, V)}


def test_in_bfloat16_the_logits_gradient_is_formed_once_and_feeds_both_matmuls(inputs):
  """With bfloat16 hidden states and heads (the models' compute dtype), each chunk's gradient with respect to its
  logits is formed once, in bfloat16, and read by the ``d hidden`` and ``d head`` matmuls (left in float32, XLA
  formed it again inside each matmul from both chunks' float32 logits: two more passes over them per chunk); the
  gradients agree with the naive loss's to bfloat16 precision."""
  fn = TOKEN_FNS["forward_kl"]
  x = {k: v.astype(jnp.bfloat16) if k in ("s", "w", "t", "wt") else v for k, v in inputs.items()}

  def grads(chunk):
    def loss(s, w):
      return chunked_token_sums(fn, {"temperature": 2.0}, s, w, x["t"], x["wt"], x["targets"], x["mask"],
                                chunk_size=chunk)["loss"]
    return jax.grad(loss, argnums=(0, 1))

  jaxpr = jax.make_jaxpr(grads(8))(x["s"], x["w"]).jaxpr
  barriers = [e for e in jaxpr_equations(jaxpr) if e.primitive.name == "optimization_barrier"]
  formed = [v for e in barriers for v in e.outvars if v.aval.shape == (8, V) and v.aval.dtype == jnp.bfloat16]
  assert len(formed) == 1, barriers
  readers = [e for e in jaxpr_equations(jaxpr) if e.primitive.name == "dot_general" and formed[0] in e.invars]
  assert len(readers) == 2, readers  # d hidden and d head
  ref, out = grads(0)(x["s"], x["w"]), grads(8)(x["s"], x["w"])
  for g, r in zip(out, ref):
    assert g.dtype == jnp.bfloat16
    assert rel_err(g.astype(jnp.float32), r.astype(jnp.float32)) < 2e-2


def test_masked_tokens_get_no_gradient_and_do_not_change_the_loss(inputs):
  fn = TOKEN_FNS["forward_kl"]
  changed = dict(inputs, s=jnp.where(inputs["mask"][:, None] > 0, inputs["s"], 100.0))
  [(value, _, (ds, _))] = loss_and_grads(fn, inputs, (8,))
  [(changed_value, _, _)] = loss_and_grads(fn, changed, (8,))
  masked = np.asarray(inputs["mask"]) == 0
  assert masked.any() and np.all(np.asarray(ds)[masked] == 0)
  assert np.any(np.asarray(ds)[~masked] != 0)
  assert float(changed_value) == pytest.approx(float(value), rel=1e-6)


def test_chunked_loss_holds_far_less_memory_than_naive():
  n, d, v = 4096, 64, 2048
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  args = (spec(n, d), spec(d, v), spec(n, d), spec(d, v), jax.ShapeDtypeStruct((n,), jnp.int32), spec(n))
  fn = TOKEN_FNS["forward_kl"]

  def temp_bytes(chunk):
    def loss(s, w, t, wt, targets, mask):
      return chunked_token_sums(fn, {"temperature": 2.0}, s, w, t, wt, targets, mask, chunk_size=chunk)["loss"]

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  naive, chunked = temp_bytes(0), temp_bytes(256)
  logits_bytes = n * v * 4
  assert naive >= 2 * logits_bytes  # student and teacher logits at least
  assert chunked < 0.25 * naive and chunked < logits_bytes, (naive, chunked)


def test_bad_settings_name_the_setting(inputs):
  x = inputs
  with pytest.raises(ValueError, match="chunk_size"):
    chunked_token_sums(TOKEN_FNS["forward_kl"], {"temperature": 1.0}, x["s"], x["w"], x["t"], x["wt"], x["targets"],
                       x["mask"], chunk_size=-1)
  with pytest.raises(ValueError, match="vocabulary"):
    chunked_token_sums(TOKEN_FNS["forward_kl"], {"temperature": 1.0}, x["s"], x["w"], x["t"], x["wt"][:, :10],
                       x["targets"], x["mask"], chunk_size=4)
  with pytest.raises(ValueError, match="divergence"):
    ChunkedLogitKD(divergence="no_such_divergence")
  with pytest.raises(ValueError, match="chunk_size"):
    ChunkedLogitKD(chunk_size=-3)
  with pytest.raises(ValueError, match="temperature"):
    ChunkedLogitKD(temperature=0.0)
  with pytest.raises(ValueError, match="final"):
    ChunkedLogitKD(capture=("hidden",))


# ------------------------------------------------------------------ one recipe: LogitKD and ChunkedLogitKD
BAD_RECIPES = [
    {"temperature": 0.0},
    {"temperature": -1.0},
    {"temperature": "hot"},
    {"temperature": {"kind": "linear", "start": 3.0, "end": 0.0, "steps": 10}},
    {"alpha": 1.5},
    {"alpha": True},
    {"alpha": {"kind": "cosine", "start": 0.5, "end": 1.5, "steps": 10}},
    {"beta": 1.2, "divergence": "jsd"},
    {"beta": 0.0, "divergence": "jsd"},
    {"beta": {"kind": "constant", "value": 1.0}, "divergence": "jsd"},
    {"skew": 1.0, "divergence": "skew_kl"},
    {"skew": float("nan")},
    {"divergence": "kl"},
]


@pytest.mark.parametrize("kwargs", BAD_RECIPES, ids=str)
def test_logitkd_and_chunked_reject_the_same_bad_values_with_the_same_message(kwargs):
  with pytest.raises(ValueError) as plain:
    LogitKD(**kwargs)
  with pytest.raises(ValueError) as chunked:
    ChunkedLogitKD(**kwargs)
  setting = next(iter(kwargs))
  assert f"LogitKD.{setting}" in str(plain.value)
  assert str(chunked.value) == str(plain.value).replace("LogitKD.", "ChunkedLogitKD.")


@pytest.mark.parametrize(
    "recipe",
    [
        {},
        {"divergence": "jsd", "beta": 0.3, "alpha": 0.7},
        {"divergence": "skew_reverse_kl", "temperature": {"kind": "linear", "start": 3.0, "end": 1.0, "steps": 4}},
        {"divergence": "mse", "alpha": {"kind": "step", "values": [0.2, 0.9], "boundaries": [2]}},
    ],
    ids=["forward_kl", "jsd", "skew_reverse_kl_scheduled_tau", "mse_scheduled_alpha"],
)
def test_logitkd_and_chunked_report_the_same_metrics_on_the_same_inputs(inputs, recipe):
  b, T = 4, 9  # 36 of the 37 tokens as [b, T] rows
  s_BxTxD, t_BxTxE = inputs["s"][: b * T].reshape(b, T, D), inputs["t"][: b * T].reshape(b, T, E)
  targets_BxT, mask_BxT = inputs["targets"][: b * T].reshape(b, T), inputs["mask"][: b * T].reshape(b, T)
  plain, chunked = LogitKD(**recipe), ChunkedLogitKD(chunk_size=5, **recipe)
  student = md.ModelOutput(logits=s_BxTxD @ inputs["w"])
  teacher = md.ModelOutput(logits=t_BxTxE @ inputs["wt"])
  for step in (0, 3):
    per_seq = jax.vmap(plain.per_sequence, in_axes=(None, 0, 0, 0, 0, None))
    ref = {k: jnp.sum(v) for k, v in per_seq({}, student, teacher, targets_BxT, mask_BxT, step).items()}
    got = chunked.per_batch({}, md.ModelOutput(logits=None, final=s_BxTxD), md.ModelOutput(logits=None, final=t_BxTxE),
                            (inputs["w"], inputs["wt"]), targets_BxT, mask_BxT, step)
    assert set(got) == set(ref) and {"loss", "kl", "ce", "teacher_ce", "corr", "agree"} <= set(ref)
    for k in ref:
      assert rel_err(got[k], ref[k]) < 1e-5, (step, k, float(got[k]), float(ref[k]))


def test_the_fallback_keeps_the_recipe_on_the_logit_mse():
  assert LogitKD(top_k=4, alpha=0.3).fallback() == LogitKD(divergence="mse", alpha=0.3)
  fallback = ChunkedLogitKD(chunk_size=7, temperature=3.0).fallback()
  assert fallback == ChunkedLogitKD(chunk_size=7, temperature=3.0, divergence="mse") and fallback.needs_head


# ------------------------------------------------------------------ through the train step
VOCAB = 200  # distinct from every other dimension of the models and the batch
TEACHER = TEACHER_CFG.replace(vocab_size=VOCAB, tie_embeddings=False)
STUDENT = STUDENT_CFG.replace(vocab_size=VOCAB)


def train(strategy, mesh, batches):
  teacher = md.init_model(TEACHER, seed=0, mesh=mesh)
  student = md.init_model(STUDENT, seed=1, mesh=mesh)
  d = md.Distiller(student, teacher, strategy=strategy, mesh=mesh)
  state = d.init_state()
  history = []
  for batch in batches:
    state, metrics = d.step(state, batch)
    history.append({k: float(v) for k, v in metrics.items()})
  return d, state, history


BATCHES = [make_batch(seed=s, vocab=VOCAB) for s in range(2)]  # 8 rows x 8 tokens, last 2 masked


@pytest.fixture(scope="module")
def chunked_2x4():
  # 4 rows x 8 tokens = 32 local tokens per data shard; chunks of 5 leave a padded tail
  return train(ChunkedLogitKD(temperature=2.0, alpha=0.5, chunk_size=5), md.make_mesh(2, 4), BATCHES)


def test_2x4_chunked_step_matches_single_device_naive_logit_kd(chunked_2x4):
  ref_d, ref_state, ref = train(LogitKD(temperature=2.0, alpha=0.5), None, BATCHES)
  d, state, ours = chunked_2x4
  assert ref[0].keys() == ours[0].keys()
  for r, o in zip(ref, ours):
    for k in ("loss", "kl", "ce", "teacher_ce", "agree"):
      assert rel_err(o[k], r[k]) < 1e-5, (k, o[k], r[k])
    # A correlation lives on [-1, 1]: its float32 rounding is absolute (~1e-7), and here its mean is ~-0.004,
    # so a relative bound would test rounding. 1e-6 absolute is still 1e-5 of the scale of a correlation.
    assert abs(o["corr"] - r["corr"]) < 1e-6, (o["corr"], r["corr"])
  assert ours[1]["loss"] != ours[0]["loss"]  # the first update changed the student
  # after two AdamW steps (lr 1e-3): Adam divides by sqrt(nu), so on a coordinate whose gradient is near zero the
  # rounding of the gradient moves the update by a few percent of a step; 1e-4 is a tenth of one step
  for a, b in zip(jax.tree.leaves(d.student(state)), jax.tree.leaves(ref_d.student(ref_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_2x4_chunked_step_never_gathers_the_vocabulary(chunked_2x4):
  d, state, _ = chunked_2x4
  hlo = d.lower(state, BATCHES[0]).compile().as_text()
  assert re.search(r"\ball-reduce(-start)?\(", hlo)  # vocabulary max/sum and gradient sums are reductions
  assert not [s for s in all_gather_shapes(hlo) if VOCAB in s], all_gather_shapes(hlo)
  # the parser does see a vocabulary gather when one exists
  probe = jax.jit(lambda x: x, out_shardings=NamedSharding(d.mesh, P()))
  x = jax.device_put(jnp.zeros((8, VOCAB)), NamedSharding(d.mesh, P(None, "tensor")))
  assert any(VOCAB in s for s in all_gather_shapes(probe.lower(x).compile().as_text()))


def test_the_step_tells_the_chunked_loss_which_heads_are_embedding_tables():
  """The student ties its LM head to its embedding table, the teacher here does not: the step says so to a strategy
  that `reads_tied_heads` (the chunk loop then reads the student's table as stored), in every trace of the step."""
  seen = []

  class Recording(ChunkedLogitKD):
    def per_batch(self, *args, tied_heads=(False, False), **kwargs):
      seen.append(tied_heads)
      return super().per_batch(*args, tied_heads=tied_heads, **kwargs)

  assert Recording.reads_tied_heads and not LogitKD.reads_tied_heads
  train(Recording(chunk_size=5), None, BATCHES[:1])
  assert seen and set(seen) == {(STUDENT.tie_embeddings, TEACHER.tie_embeddings)} == {(True, False)}


def loop_body_all_reduces(hlo: str) -> int:
  """All-reduces inside while-loop bodies of a compiled HLO text (the chunk loop: each runs once per chunk)."""
  bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", hlo))
  count, computation = 0, None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if m:
      computation = m.group(1)
    elif computation in bodies and re.search(r"\ball-reduce(?:-start)?\(", line):
      count += 1
  return count


def test_2x4_chunked_step_reduces_over_the_vocabulary_in_three_all_reduces_per_chunk(chunked_2x4):
  """The fused recipe (`losses.forward_kl_terms`): per chunk one max, one combined sum (loss + metrics) and the
  correlation's sums combined with the hidden-state gradient's; term by term it took 8 (5 metrics-light)."""
  d, state, _ = chunked_2x4
  full = d.lower(state, BATCHES[0]).compile().as_text()
  light = d.metrics_light().lower(state, BATCHES[0]).compile().as_text()
  assert loop_body_all_reduces(full) <= 3 and loop_body_all_reduces(light) <= 3
  assert all_reduce_census(full, d.mesh)["total"] <= 17  # 22 term by term
