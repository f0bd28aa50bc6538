"""Shared test configs and helpers: tiny models, host batches, steps run and compared across layouts, an HLO
all-gather parser, a small corpus, a module of the benchmarks' package.

Imported by the tests as ``from helpers import ...``; `conftest.py` sets up the simulated
devices before any test module (and so this one) is imported.
"""

import importlib
import pathlib
import re
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

import meshdistill as md

VOCAB = 64

TEACHER_CFG = md.ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_len=16)
STUDENT_CFG = TEACHER_CFG.replace(n_layers=1, d_model=16, mlp_hidden=32)


def make_batch(seed: int = 0, batch: int = 8, seq: int = 8, vocab: int = VOCAB, pad_from: int | None = 6):
  """A host batch {inputs, targets, mask}: random tokens, positions >= pad_from masked."""
  rng = np.random.default_rng(seed)
  x = rng.integers(0, vocab, (batch, seq + 1))
  mask = np.ones((batch, seq), np.float32)
  if pad_from is not None:
    mask[:, pad_from:] = 0.0
  return {"inputs": x[:, :-1].astype(np.int32), "targets": x[:, 1:].astype(np.int32), "mask": mask}


def kd_logits(rows: int, vocab: int, seed: int, scale: float = 3.0, offset: float = 0.0):
  """Student and teacher logits ``[rows, vocab]`` (float32) with the cases a fused loss must count exactly: row 0 a
  shared arg-max, row 1 a student tied on two tokens; target ids and a float mask (rows 2, 5, 11 masked)."""
  rng = np.random.default_rng(seed)
  s = rng.normal(size=(rows, vocab)) * scale + offset
  t = 0.7 * s + rng.normal(size=(rows, vocab)) * scale + offset
  s[0, 5] = t[0, 5] = s.max() + 1.0
  s[1, 7] = s[1, 9] = s[1].max() + 1.0
  t[1, 9] = t[1].max() + 1.0
  y = rng.integers(0, vocab, rows)
  m = np.ones(rows, np.float32)
  m[[2, 5, 11]] = 0.0
  return jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32), jnp.asarray(y), jnp.asarray(m)


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
  """Leaf-by-leaf allclose of two pytrees keyed by path, ignoring Variable metadata (a layout may
  partition a weight differently, e.g. key/value projections replicated when `tensor` > n_kv_heads)."""
  flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}  # noqa: E731
  g, w = flat(jax.device_get(got)), flat(jax.device_get(want))
  assert g.keys() == w.keys(), sorted(set(g) ^ set(w))
  for k in w:
    np.testing.assert_allclose(g[k], w[k], rtol=rtol, atol=atol, err_msg=k)


def rel_err(a, b) -> float:
  """``|a - b| / |b|`` in the Frobenius norm, in float64: one number for a whole array (rounding spread over many
  elements stays small where elementwise bounds would test the smallest ones)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def all_gather_shapes(hlo: str) -> list[tuple[int, ...]]:
  """Output shapes (dims) of every all-gather in an HLO module text."""
  shapes = []
  for line in hlo.splitlines():
    m = re.search(r"=\s*\(?\s*\w+\[([\d,]*)\][^=]*?\ball-gather(?:-start)?\(", line)
    if m:
      shapes.append(tuple(int(v) for v in m.group(1).split(",") if v))
  return shapes


def write_corpus(root, n_docs=24):
  """A small corpus of text files; enough documents that some land in validation."""
  root.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  words = ["def", "return", "class", "self", "import", "for", "in", "if", "else", "x", "y", "(", ")", ":", "\n"]
  for i in range(n_docs):
    text = " ".join(rng.choice(words, size=150 + 10 * i))
    (root / f"doc{i:02d}.txt").write_text(text)
  return str(root)


def bench_module(name: str):
  """``bench.<name>``, a module of the benchmarks' package (``benchmarks/bench/``), imported as the scripts
  import it (their folder on the path)."""
  folder = str(pathlib.Path(__file__).parents[1] / "benchmarks")
  if folder not in sys.path:
    sys.path.append(folder)
  return importlib.import_module(f"bench.{name}")


def run_steps(trainer, batches):
  """``(params on the host, [metrics of each step])`` of ``trainer``'s steps on ``batches`` from a fresh state."""
  state, out = trainer.init_state(), []
  for b in batches:
    state, m = trainer.step(state, b)
    out.append(jax.device_get(m))
  return jax.device_get(trainer.unreplicate(state.params)), out


def _assert_plain_sgd(optimizer):
  """``optimizer`` moves parameters by exactly minus the gradient (``optax.sgd(1.0)``)."""
  params, grads = {"w": jnp.ones(3)}, {"w": jnp.asarray([1.0, -2.0, 0.5])}
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  np.testing.assert_array_equal(updates["w"], -grads["w"], err_msg="build both trainers with optax.sgd(1.0)")


F32_EPS = float(np.finfo(np.float32).eps)  # 2**-23


def summation_atol(n_summands: int, magnitude) -> float:
  """How far apart two float32 sums of the same ``n_summands`` terms may land when only their order differs.

  A sum of n float32 terms in any order is within ``(n - 1) * eps * sum|x_i|`` of the exact sum (the classic forward
  error bound of recursive summation, Higham, *Accuracy and Stability of Numerical Algorithms*, section 4.2); two
  orders, at most twice that apart. ``magnitude`` stands in for ``sum|x_i|`` divided by the count a mean divides by:
  the largest value of the quantity compared (a leaf's largest update, a metric's largest value over the steps).
  Which order a layout's sums take depends on the mesh (a ``psum`` over ``data`` adds two halves) and on the CPU
  (XLA's reductions follow its vector width: AVX2 and AVX-512 machines differ in the last bits), so a tolerance
  from this bound holds on any x86-64 CPU, where a fixed ``atol=1e-6`` failed on one (an AMD EPYC: one element of a
  ``v`` kernel 1.5e-6 apart after an SGD step).
  """
  return 2.0 * n_summands * F32_EPS * float(np.max(np.abs(magnitude)))


def assert_updates_agree(got_params, params, start, n_summands: int):
  """The parameter changes ``got_params - start`` and ``params - start`` agree leaf by leaf within
  `summation_atol` of ``n_summands`` terms and each leaf's largest change on the reference (``params``)."""
  flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(v, np.float64)  # noqa: E731
                       for p, v in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}
  g, w, s = flat(got_params), flat(params), flat(start)
  assert g.keys() == w.keys() == s.keys(), sorted(set(g) ^ set(w))
  for k in w:
    atol = summation_atol(n_summands, w[k] - s[k])
    np.testing.assert_allclose(g[k] - s[k], w[k] - s[k], rtol=0, atol=atol, err_msg=f"{k} (atol {atol:.3g})")


def assert_sgd_steps_agree(one, other, batches, keys, moved=1e-3):
  """``other`` (a mesh) steps like ``one`` (one device) from a fresh state over ``batches``; returns ``one``'s metrics.

  What the layout invariant is about: the loss and metrics of each step, and the gradients. Both trainers are built
  with plain SGD at rate 1 (``optax.sgd(1.0)``, checked here), so each step moves the parameters by exactly minus the
  gradient and the parameters after the steps compare the layouts' gradients (and the samples a later step draws
  depend on them). Under Adam an element whose gradient is tiny is divided by a tiny second moment, and a last-bit
  difference of the summation order becomes a relative difference of ~1e-5 in the update: the optimizer's
  conditioning, not a layout's numbers.

  Tolerances are derived, not fixed (`summation_atol`), so the comparison does not depend on the CPU model: the
  metrics named in ``keys`` and ``grad_norm`` at every step are token means over a step's ``B * T`` positions, each
  compared within the bound for that many summands at the metric's largest value over the steps; the parameter
  changes after the steps are sums of every step's gradient (``B * T`` positions each), compared leaf by leaf at
  the bound for all the steps' positions and the leaf's largest change (`assert_updates_agree`). The parameters must
  have moved by more than ``moved`` somewhere (the comparison is of real updates).
  """
  for trainer in (one, other):
    _assert_plain_sgd(trainer.optimizer)
  start = jax.device_get(one.init_state().params)
  params, metrics = run_steps(one, batches)
  got_params, got = run_steps(other, batches)
  positions = [int(np.prod(b["targets"].shape)) for b in batches]
  for key in (*keys, "grad_norm"):
    atol = summation_atol(max(positions), [m[key] for m in metrics])
    for step, (m, g) in enumerate(zip(metrics, got)):
      np.testing.assert_allclose(g[key], m[key], rtol=0, atol=atol, err_msg=f"{key} at step {step} (atol {atol:.3g})")
  change = jax.tree.map(lambda a, b: np.max(np.abs(np.asarray(a) - np.asarray(b))), params["student"], start["student"])
  assert max(jax.tree.leaves(change)) > moved
  assert_updates_agree(got_params, params, start, sum(positions))
  return metrics


def jaxpr_equations(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs its equations hold (scan bodies, custom rules, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from jaxpr_equations(sub)


def token_major(attention):
  """A head-major attention kernel (``q [B, H, T, K]``, ``k, v [B, G, T, K]``, as `splash_attention`) called on
  token-major ``[B, T, H, K]`` arrays, as `_explicit_attention` takes them, its output token-major too."""
  swap = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731
  return lambda q, k, v, **options: swap(attention(swap(q), swap(k), swap(v), **options))
