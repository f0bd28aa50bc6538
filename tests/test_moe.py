"""Mixture-of-experts blocks: routing, the grouped matmul, capacity, the router's loss terms against a plain formula,
the Hugging Face MoE fixtures on one device and with experts split over an ``expert`` axis, and MoE teacher / MoE
student steps on 2x4 and on expert-split layouts (with fsdp) against one device, with the HLO audit of the token
exchange."""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import STUDENT_CFG, TEACHER_CFG, assert_trees_close, make_batch

import meshdistill as md
from meshdistill.models.hf import load_hf
from meshdistill.models.lora import LoraConfig, apply_lora
from meshdistill.models.moe import MoeConfig, capacity_keep, dense_experts, grouped_experts, route
from meshdistill.models.stacking import to_scanned
from meshdistill.train.router_losses import router_terms

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MOE_TEACHER = TEACHER_CFG.replace(moe=MoeConfig(n_experts=4, top_k=2, expert_hidden=16))
# a student with a dense layer, a capacity that drops assignments and both router terms weighted
MOE_STUDENT = STUDENT_CFG.replace(n_layers=2, moe=MoeConfig(
    n_experts=4, top_k=2, expert_hidden=12, capacity_factor=1.0, dense_layers=(1,), aux_loss_weight=0.1,
    z_loss_weight=0.01))


def _forward(cfg, seed, tokens):
  """The output of a fresh model of ``cfg`` on ``tokens`` with its routing (one compiled call: eager MoE ops are
  slow to dispatch)."""
  model = md.init_model(cfg, seed)
  return jax.jit(lambda t: model(t, capture=("router",)))(jnp.asarray(tokens))


def _experts(seed, E=4, D=8, F=6):
  keys = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(k, s) / s[1] ** 0.5 for k, s in zip(keys, [(E, D, F), (E, D, F), (E, F, D)])]


def test_routing_picks_top_k_breaks_ties_by_index_and_renormalises():
  logits = jnp.array([[0.0, 2.0, 2.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
  w, e = route(logits, MoeConfig(n_experts=4, top_k=2, norm_topk_prob=False))
  np.testing.assert_array_equal(e, [[1, 2], [0, 1]])  # equal scores: the lower expert first
  p = np.asarray(jax.nn.softmax(logits, -1))
  np.testing.assert_allclose(w, [[p[0, 1], p[0, 2]], [p[1, 0], p[1, 1]]], rtol=1e-6)
  w, _ = route(logits, MoeConfig(n_experts=4, top_k=2, norm_topk_prob=True))
  np.testing.assert_allclose(np.sum(w, -1), 1.0, rtol=1e-6)
  w, e = route(logits, MoeConfig(n_experts=4, top_k=1, score="sigmoid", norm_topk_prob=False))
  np.testing.assert_allclose(w[:, 0], jax.nn.sigmoid(jnp.array([2.0, 3.0])), rtol=1e-6)


@pytest.mark.parametrize("drop", [False, True])
def test_grouped_matmul_equals_a_loop_over_experts(drop):
  x = jax.random.normal(jax.random.key(0), (20, 8))
  w, e = route(jax.random.normal(jax.random.key(1), (20, 4)), MoeConfig(n_experts=4, top_k=2))
  keep = (jnp.arange(40).reshape(20, 2) % 3 != 0) if drop else None
  got, want = jax.jit(lambda *a: (grouped_experts(*a), dense_experts(*a)))(x, e, w, *_experts(2), keep)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  if drop:  # a dropped assignment adds nothing
    alone, _ = jax.jit(lambda *a: (grouped_experts(*a), 0))(x, e, jnp.where(keep, w, 0.0), *_experts(2))
    np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-6)


def test_capacity_keeps_first_choices_then_earlier_tokens_and_counts_the_rest():
  # one sequence, 3 tokens, top-2: every token's first choice is expert 0, second choice expert 1 / 0 / 1
  experts = jnp.array([[[0, 1], [0, 2], [0, 1]]])
  keep = capacity_keep(experts, n_experts=3, capacity=2)
  np.testing.assert_array_equal(keep[0], [[True, True], [True, True], [False, True]])
  assert MoeConfig(n_experts=4, top_k=2, capacity_factor=1.0).capacity(8) == 4
  assert MoeConfig(n_experts=4, top_k=2).capacity(8) is None
  (routing,) = _forward(MOE_STUDENT, 1, make_batch()["inputs"]).router  # layer 1 is dense
  assert routing.logits_BxTxE.shape == (8, 8, 4) and float(jnp.sum(routing.dropped_BxT)) > 0


def test_padding_takes_no_expert_capacity_and_a_sequence_s_capacity_counts_its_real_tokens():
  """`capacity_keep` with ``valid_BxT``: a padding token's assignments are never kept and displace none (the tokens
  after it keep what they keep without it), with one capacity per sequence; `MoE` reads that capacity from the
  sequence's real tokens, and its `Routing.dropped_BxT` counts no dropped assignment for padding. Packed documents
  tell the block their padding (ids 0): a row with padding in front of its document routes the document's tokens as
  the document alone (every capacity-bound layer), and the outputs are those of the document alone."""
  experts = jnp.array([[[0, 1], [0, 2], [0, 1]], [[0, 1], [0, 2], [0, 1]]])  # two sequences of the test above
  valid = jnp.array([[False, True, True], [True, True, True]])
  keep = capacity_keep(experts, n_experts=3, capacity=jnp.array([2, 1]), valid_BxT=valid)
  np.testing.assert_array_equal(keep[0], [[False, False], [True, True], [True, True]])  # as tokens 2, 3 alone
  np.testing.assert_array_equal(keep[1], [[True, True], [False, True], [False, False]])  # capacity 1: firsts first
  cfg = MOE_STUDENT.replace(moe=dataclasses.replace(MOE_STUDENT.moe, dense_layers=()))
  model = md.init_model(cfg, seed=3)
  doc = np.random.default_rng(4).integers(1, cfg.vocab_size, (1, 5)).astype(np.int32)
  padded = np.concatenate([np.zeros((1, 3), np.int32), doc], axis=1)
  run = jax.jit(lambda m, t, ids: m(t, capture=("router",), segment_ids=ids))
  alone = run(model, jnp.asarray(doc), jnp.ones((1, 5), jnp.int32))
  got = run(model, jnp.asarray(padded), jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1]], jnp.int32))
  assert cfg.moe.capacity(5) < cfg.moe.capacity(8)  # the padded row's length would give the document more room
  assert float(sum(jnp.sum(r.dropped_BxT) for r in alone.router)) > 0, "no assignment dropped: the test shows nothing"
  for a, g in zip(alone.router, got.router):
    np.testing.assert_array_equal(g.dropped_BxT[:, 3:], a.dropped_BxT)
    assert not np.asarray(g.dropped_BxT[:, :3]).any()
  np.testing.assert_allclose(got.logits[:, 3:], alone.logits, rtol=1e-5, atol=1e-5)


def test_scanned_moe_blocks_equal_unrolled_with_their_routing():
  cfg = MOE_STUDENT.replace(moe=MOE_STUDENT.moe.__class__(**{**MOE_STUDENT.moe.__dict__, "dense_layers": ()}))
  model = md.init_model(cfg, 1)
  scanned = to_scanned(model)
  tokens = jnp.asarray(make_batch()["inputs"])
  a, b = nnx.jit(lambda m, s, t: (m(t, capture=("router",)), s(t, capture=("router",))))(model, scanned, tokens)
  np.testing.assert_allclose(b.logits, a.logits, atol=1e-5)
  assert len(a.router) == len(b.router) == 2
  for ra, rb in zip(a.router, b.router):
    np.testing.assert_allclose(rb.logits_BxTxE, ra.logits_BxTxE, atol=1e-5)
    np.testing.assert_array_equal(rb.dropped_BxT, ra.dropped_BxT)
  with pytest.raises(ValueError, match=r"scan_layers=true stacks identical blocks, but moe.dense_layers=\[1\]"):
    MOE_STUDENT.replace(scan_layers=True)


def reference_router_terms(logits_LxNxE, mask_N, top_k):
  """transformers' load_balancing_loss_func (with an attention mask) and the z-loss, in plain numpy."""
  L, N, E = logits_LxNxE.shape
  p = np.exp(logits_LxNxE - logits_LxNxE.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  chosen = np.zeros_like(p)
  for l in range(L):
    for n in range(N):
      chosen[l, n, np.argsort(-p[l, n], kind="stable")[:top_k]] = 1.0
  rows = L * mask_N.sum()
  tokens_per_expert = (chosen * mask_N[None, :, None]).sum((0, 1)) / rows
  prob_per_expert = (p * mask_N[None, :, None]).sum((0, 1)) / rows
  lse = np.log(np.exp(logits_LxNxE).sum(-1))
  return E * np.sum(tokens_per_expert * prob_per_expert), np.sum(lse**2 * mask_N[None]) / rows


def test_router_terms_equal_the_plain_formula_and_ignore_masked_tokens():
  batch = make_batch()
  out = _forward(MOE_TEACHER, 0, batch["inputs"])
  terms, usage = jax.jit(router_terms, static_argnums=(2, 3))(out.router, jnp.asarray(batch["mask"]), MOE_TEACHER.moe,
                                                              None)
  logits = np.stack([np.asarray(r.logits_BxTxE).reshape(-1, 4) for r in out.router]).astype(np.float64)
  aux, z = reference_router_terms(logits, batch["mask"].reshape(-1), 2)
  np.testing.assert_allclose(float(terms["moe_aux"]), aux, rtol=1e-5)
  np.testing.assert_allclose(float(terms["moe_z"]), z, rtol=1e-5)
  assert float(usage["moe_load_max"]) >= 1.0 >= float(usage["moe_load_min"]) and float(usage["moe_dropped"]) == 0.0
  # masked tokens never count: changing their router logits changes nothing
  noisy = tuple(r._replace(logits_BxTxE=r.logits_BxTxE.at[:, 6:].add(50.0)) for r in out.router)
  again, _ = jax.jit(router_terms, static_argnums=(2, 3))(noisy, jnp.asarray(batch["mask"]), MOE_TEACHER.moe, None)
  np.testing.assert_allclose(float(again["moe_aux"]), aux, rtol=1e-5)


@pytest.mark.parametrize("name", ["hf_qwen3_moe", "hf_mixtral"])
def test_one_device_loaded_moe_logits_and_load_balancing_loss_equal_transformers(name):
  ref = np.load(FIXTURES / name / "reference.npz")
  model = load_hf(FIXTURES / name)
  assert model.cfg.moe is not None
  out = jax.jit(lambda t: model(t, capture=("router",)))(jnp.asarray(ref["tokens"]))
  np.testing.assert_allclose(np.asarray(out.logits), ref["logits"], atol=1e-4, rtol=0)
  # transformers' aux_loss (output_router_logits=True, rows padded by attention_mask) from our routing
  terms, _ = router_terms(out.router, jnp.asarray(ref["aux_mask"], jnp.float32), model.cfg.moe, None)
  np.testing.assert_allclose(float(terms["moe_aux"]), float(ref["aux_loss"]), rtol=1e-5)


@pytest.mark.parametrize("name, layout", [("hf_qwen3_moe", (1, 4, 2)), ("hf_mixtral", (2, 2, 2))])
def test_expert_split_loaded_moe_logits_equal_transformers(name, layout):
  """Qwen3-MoE's 8 experts over expert=4 x tensor=2, Mixtral's 4 over data 2 x expert 2 x tensor 2: each device
  loads only its experts' shards, and the logits equal transformers' (the rows exchanged by all-to-all)."""
  ref = np.load(FIXTURES / name / "reference.npz")
  data, expert, tensor = layout
  mesh = md.make_mesh(data, tensor, axes={"expert": expert})
  model = load_hf(FIXTURES / name, mesh)
  gate = model.blocks[0].mlp.gate.get_value()
  assert tuple(gate.sharding.spec) == ("expert", None, "tensor")
  assert gate.addressable_shards[0].data.shape[0] == model.cfg.moe.n_experts // expert
  logits = jax.jit(lambda t: model(t).logits)(jnp.asarray(ref["tokens"]))
  np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=1e-4, rtol=0)


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
  model = md.init_model(MOE_TEACHER, 0)  # 4 experts
  with jax.set_mesh(md.make_mesh(1, 1, devices=jax.devices()[:3], axes={"expert": 3})):
    with pytest.raises(ValueError, match=r"mesh.axes.expert=3 does not divide the 4 experts .* choose expert in "
                                         r"\[1, 2, 4\]"):
      jax.eval_shape(lambda t: model(t).logits, jnp.zeros((2, 4), jnp.int32))


def test_lora_on_expert_weights_is_refused_naming_what_works():
  with pytest.raises(ValueError, match=r"mixtures of experts .* target the attention projections only"):
    apply_lora(md.init_model(MOE_STUDENT, 1), LoraConfig(rank=2))


SETUPS = {"moe_teacher": (MOE_TEACHER, STUDENT_CFG), "moe_student": (TEACHER_CFG, MOE_STUDENT)}
# (data, expert, tensor, fsdp) of each layout; "ep4": the teacher's 4 experts one per device of expert=4, the dense
# student replicated over expert; "ep2_fsdp": the MoE student's experts over expert=2, its weights over data too
LAYOUTS = {"2x4": (2, 1, 4, False), "ep4": (1, 4, 2, False), "ep2_fsdp": (2, 2, 2, True)}
RUN_LAYOUTS = {"moe_teacher": ("single", "ep4"), "moe_student": ("single", "2x4", "ep2_fsdp")}


def _mesh(layout):
  data, expert, tensor, _ = LAYOUTS[layout]
  return md.make_mesh(data, tensor, axes={"expert": expert} if expert > 1 else None)


@pytest.fixture(scope="module")
def runs():
  """Two steps of each setup on one device and on the layouts of `RUN_LAYOUTS`, from the same weights and batches."""
  batches = [make_batch(seed=s) for s in range(2)]
  out = {}
  for setup, (t_cfg, s_cfg) in SETUPS.items():
    for layout in RUN_LAYOUTS[setup]:
      mesh = None if layout == "single" else _mesh(layout)
      fsdp = layout != "single" and LAYOUTS[layout][3]
      d = md.Distiller(md.init_model(s_cfg, seed=1, mesh=mesh), md.init_model(t_cfg, seed=0, mesh=mesh), mesh=mesh,
                       optimizer=optax.adam(1e-2), fsdp=fsdp)
      state, metrics = d.init_state(), []
      for b in batches:
        state, m = d.step(state, b)
        metrics.append({k: float(v) for k, v in m.items()})
      out[setup, layout] = (d, state, metrics)
  return out


@pytest.mark.parametrize("setup, layout", [(s, l) for s, ls in RUN_LAYOUTS.items() for l in ls if l != "single"])
def test_moe_steps_on_tensor_and_expert_split_layouts_equal_one_device(runs, setup, layout):
  """2x4 (experts' hidden units over tensor), the MoE teacher's experts over expert=4 beside a dense student, and the
  MoE student's experts over expert=2 with fsdp: the same metrics and parameters as one device after 2 steps."""
  _, want_state, want = runs[setup, "single"]
  d, state, got = runs[setup, layout]
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for k in w:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert_trees_close(jax.device_get(d.unreplicate(state.params)), jax.device_get(want_state.params))
  if LAYOUTS[layout][1] > 1:  # the MoE model's experts really are split over expert (and data under fsdp)
    moe_params = d.teacher_params if setup == "moe_teacher" else state.params["student"]
    gate = moe_params["blocks"][0]["mlp"]["gate"].get_value()
    assert tuple(gate.sharding.spec) == ("expert", "data" if LAYOUTS[layout][3] else None, "tensor")


@pytest.mark.parametrize("setup, layout", [("moe_teacher", "ep4"), ("moe_student", "ep2_fsdp")])
def test_expert_split_step_exchanges_tokens_over_expert_and_gathers_no_expert_weight(runs, setup, layout):
  """The compiled step (CPU HLO, labelled by the planner's census): three all-to-alls over ``expert`` per MoE layer
  forward (counts, tokens, results) and two more backward for a student, and no all-gather of an expert weight:
  without fsdp none, with fsdp only the ZeRO-3 gather over ``data``, whose copy keeps E split over expert
  (``[E / 2, D, F / 2]``). Activations are gathered over ``expert``: the MoE block's output rows (the rest of the
  step is replicated over ``expert``) and what the compiler chose to split over it (router logits before top-k).
  ``MOE_STUDENT``'s sizes keep its expert weights' shapes apart from its activations' ([4, 8, 16] rows)."""
  from meshdistill.planner._compile import collectives

  d, state, _ = runs[setup, layout]
  mesh = d.layout.mesh
  ep, tp, fsdp = mesh.shape["expert"], mesh.shape["tensor"], LAYOUTS[layout][3]
  cfg = MOE_TEACHER if setup == "moe_teacher" else MOE_STUDENT
  moe_layers = sum(cfg.moe.sparse(i) for i in range(cfg.n_layers))
  hlo = d.lower(state, make_batch(seed=0)).compile().as_text()
  census = collectives(hlo, mesh.shape)
  a2a = sum(c["count"] for c in census if c["kind"] == "all-to-all" and c["axis"] == "expert")
  assert a2a == moe_layers * (3 if setup == "moe_teacher" else 5), census
  E, D, F = cfg.moe.n_experts, cfg.d_model, cfg.moe.expert_hidden
  weights = {s for e in (E, E // ep) for f in (F, F // tp) for s in ((e, D, f), (e, f, D))}
  gathered = [(shape, axis) for shape, axis in _gathers(hlo, mesh.shape) if shape in weights]
  zero3 = [((E // ep, D, F // tp), "data")] * 2 + [((E // ep, F // tp, D), "data")]  # gate, up, down
  assert sorted(gathered) == (sorted(zero3 * moe_layers) if fsdp else []), gathered


def _gathers(hlo, mesh_shape):
  """(result shape, mesh axes) of every all-gather of a compiled program."""
  from meshdistill.planner._compile import _axis, _groups
  out = []
  for line in hlo.splitlines():
    m = re.search(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", line)
    if m:
      out.append((tuple(int(v) for v in m.group(1).split(",") if v), _axis(_groups(line), mesh_shape)))
  return out


def test_moe_student_step_reports_router_terms_of_the_plain_formula(runs):
  _, _, metrics = runs["moe_student", "2x4"]
  first = metrics[0]
  assert {"moe_aux", "moe_z", "moe_load_max", "moe_load_min", "moe_dropped"} <= set(first)
  assert 0.0 < first["moe_dropped"] < 1.0  # capacity_factor=1.0 drops some of the uneven assignments
  assert "moe_aux" not in runs["moe_teacher", "ep4"][2][0]  # a dense student has no router terms
  batch = make_batch(seed=0)
  out = _forward(MOE_STUDENT, 1, batch["inputs"])
  logits = np.stack([np.asarray(r.logits_BxTxE).reshape(-1, 4) for r in out.router]).astype(np.float64)
  aux, z = reference_router_terms(logits, batch["mask"].reshape(-1), 2)
  np.testing.assert_allclose(first["moe_aux"], aux, rtol=1e-5)
  np.testing.assert_allclose(first["moe_z"], z, rtol=1e-5)


def _count(c: md.ModelConfig) -> int:
  """Parameters of a decoder of ``c``, by formula: attention, norms, a dense MLP or a router and experts per layer."""
  attn = c.d_model * c.hd * (2 * c.n_heads + 2 * c.n_kv_heads) + (2 * c.hd if c.qk_norm else 0) + 2 * c.d_model
  moe = c.moe
  mlp = [3 * c.d_model * c.mlp_hidden if moe is None or not moe.sparse(i) else
         c.d_model * moe.n_experts + 3 * moe.n_experts * c.d_model * moe.expert_hidden for i in range(c.n_layers)]
  return c.n_layers * attn + sum(mlp) + c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2) + c.d_model


def test_moe_presets_have_their_published_total_and_active_sizes():
  """Total and active parameters of the presets against the model cards (Qwen3-30B-A3B: 30.5B / 3.3B, Qwen3-235B-A22B:
  235B / 22B, Mixtral-8x7B: 46.7B / 12.9B); the planner's analytic FLOPs count the active ones."""
  from meshdistill.models import abstract_params
  from meshdistill.models.moe import inactive_params
  from meshdistill.planner import resolve_model
  from meshdistill.planner._plan import _matmul_params

  assert _count(MOE_STUDENT) == sum(v.get_value().size for _, v in nnx.to_flat_state(abstract_params(MOE_STUDENT)[1]))
  sizes = {"qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9), "mixtral-8x7b": (46.7e9, 12.9e9)}
  for name, (total, active) in sizes.items():
    cfg, _ = resolve_model(name, who="teacher")
    n = _count(cfg)
    assert abs(n / total - 1) < 0.02, (name, n)
    assert abs((n - inactive_params(cfg)) / active - 1) < 0.03, (name, n - inactive_params(cfg))
    assert _matmul_params(cfg, n) == n - inactive_params(cfg) - cfg.vocab_size * cfg.d_model  # untied embedding


def test_cached_decoding_of_an_moe_model_equals_its_forward_pass():
  """Prefill 5 tokens, then decode the other 3 one by one: the logits equal the full forward pass (dropless)."""
  model = md.init_model(MOE_TEACHER, 0)
  tokens = jnp.asarray(make_batch(batch=2)["inputs"])

  @nnx.jit
  def run(model, tokens):
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    valid = jnp.ones((B, T), bool)
    first, kv = model.decode_step(tokens[:, :5], model.empty_cache(B, T), valid, jnp.int32(0), positions[:, :5])
    steps = [first]
    for t in range(5, T):
      logits, kv = model.decode_step(tokens[:, t:t + 1], kv, valid, jnp.int32(t), positions[:, t:t + 1])
      steps.append(logits)
    return jnp.concatenate(steps, axis=1), model(tokens).logits

  cached, full = run(model, tokens)
  np.testing.assert_allclose(cached, full, atol=1e-5)


@pytest.mark.skipif(not __import__("meshdistill.planner", fromlist=["x"]).libtpu_available(),
                    reason="needs libtpu: pip install 'meshdistill[tpu]' (in the test extra)")
def test_tpu_compiled_moe_step_keeps_experts_split_over_tensor_and_gathers_nothing():
  """An MoE teacher and an MoE student compiled for v5e:2x2 (mesh 1x4) by the planner: ragged_dot is the TPU's own
  op and the step holds no all-gather (a dense pair has none either). Left to the compiler, the experts' sort and
  ragged_dot with F split over tensor gathered the activations around every projection (measured: 60 all-gathers);
  `models.moe.experts_on_mesh` runs them in a shard_map over tensor instead."""
  import os
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from meshdistill import planner
  from meshdistill.planner._compile import compile_step
  from helpers import all_gather_shapes

  moe = MoeConfig(n_experts=8, top_k=2, expert_hidden=256, aux_loss_weight=0.01)
  teacher = md.ModelConfig(vocab_size=1024, d_model=256, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=64,
                           mlp_hidden=512, max_len=128, dtype="bfloat16", moe=moe)
  pl = planner.make_planner(teacher, teacher, topology="v5e:2x2", seq=128)
  hlo = compile_step(pl._distiller(planner.Knobs(1, 4, "none", None, 4)), 4, 128).hlo
  assert "ragged-dot" in hlo
  assert all_gather_shapes(hlo) == []
