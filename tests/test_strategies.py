"""Attention transfer, feature pooling / projection, hard-label CE and composite strategies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, make_batch

import meshdistill as md
from meshdistill import losses
from meshdistill.models import ModelOutput
from meshdistill.strategies import (
    AttentionTransfer,
    ChunkedLogitKD,
    Composite,
    FeaturePooling,
    FeatureProjection,
    HardLabelCE,
    LogitKD,
    default_layer_map,
    group_heads,
)

T = 6
MASK = jnp.array([1, 1, 1, 1, 0, 0], jnp.float32)  # last two tokens are padding
KEY = jax.random.key(0)


def causal_maps(key, n_layers: int, n_heads: int, t: int = T) -> tuple:
  """``n_layers`` random causal attention maps ``[H, T, T]`` (rows sum to 1, zero above the diagonal)."""
  out = []
  for k in jax.random.split(key, n_layers):
    scores = jax.random.normal(k, (n_heads, t, t))
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    out.append(jax.nn.softmax(scores, axis=-1))
  return tuple(out)


def features(key, n_layers: int, width: int, t: int = T) -> tuple:
  return tuple(jax.random.normal(k, (t, width)) for k in jax.random.split(key, n_layers + 1))


def output(key, n_layers=2, n_heads=4, width=8, vocab=16) -> ModelOutput:
  k1, k2, k3 = jax.random.split(key, 3)
  return ModelOutput(
      logits=jax.random.normal(k1, (T, vocab)),
      hidden=features(k2, n_layers, width),
      attn=causal_maps(k3, n_layers, n_heads),
  )


def loss_of(strategy, params, student, teacher, mask=MASK, targets=None):
  targets = jnp.zeros((T,), jnp.int32) if targets is None else targets
  return strategy.per_sequence(params, student, teacher, targets, mask, jnp.int32(0))


# ------------------------------------------------------------------ minimum at equality


@pytest.mark.parametrize("loss", ["kl", "mse"])
def test_attention_transfer_is_zero_when_maps_are_equal(loss):
  out = output(KEY)
  strategy = AttentionTransfer(loss=loss, layer_map=((0, 0), (1, 1)))
  assert float(loss_of(strategy, {}, out, out)["loss"]) == pytest.approx(0.0, abs=1e-6)
  other = output(jax.random.key(1))
  assert float(loss_of(strategy, {}, other, out)["loss"]) > 1e-3


@pytest.mark.parametrize("loss", ["cosine", "mse"])
def test_feature_pooling_is_zero_when_pooled_teacher_equals_student(loss):
  student = output(KEY, width=4)
  # every student feature repeated twice side by side: pooling pairs gives the student back
  teacher = student._replace(hidden=tuple(jnp.repeat(h, 2, axis=-1) for h in student.hidden))
  strategy = FeaturePooling(loss=loss, layer_map=((0, 0), (1, 1), (2, 2)))
  assert float(loss_of(strategy, {}, student, teacher)["loss"]) == pytest.approx(0.0, abs=1e-5)
  assert float(loss_of(strategy, {}, student, output(jax.random.key(1), width=8))["loss"]) > 1e-3


@pytest.mark.parametrize("loss", ["cosine", "mse"])
def test_feature_projection_is_zero_when_teacher_is_the_projected_student(loss):
  s_cfg, t_cfg = TEACHER_CFG.replace(d_model=4, n_layers=2), TEACHER_CFG.replace(d_model=8, n_layers=2)
  strategy = FeatureProjection(loss=loss)
  params = strategy.init_params(s_cfg, t_cfg, KEY)
  student = output(KEY, width=4)
  teacher_hidden = list(features(jax.random.key(3), 2, 8))
  for name, (s, t) in zip(sorted(params), sorted(default_layer_map(2, 2, offset=1))):
    assert name == f"s{s}_t{t}"
    teacher_hidden[t] = student.hidden[s] @ params[name]["kernel"]
  teacher = student._replace(hidden=tuple(teacher_hidden))
  assert float(loss_of(strategy, params, student, teacher)["loss"]) == pytest.approx(0.0, abs=1e-5)
  moved = jax.tree.map(lambda k: k + 0.5, params)
  assert float(loss_of(strategy, moved, student, teacher)["loss"]) > 1e-3


def test_hard_label_ce_is_the_masked_cross_entropy_sum():
  out = output(KEY)
  targets = jnp.arange(T, dtype=jnp.int32)
  got = loss_of(HardLabelCE(), {}, out, out, targets=targets)["loss"]
  want = jnp.sum(losses.cross_entropy(out.logits, targets, MASK))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  peaked = out._replace(logits=100.0 * jax.nn.one_hot(targets, 16))
  assert float(loss_of(HardLabelCE(), {}, peaked, out, targets=targets)["loss"]) == pytest.approx(0.0, abs=1e-5)


# ---------------------------------------------------------------------------- masking


@pytest.mark.parametrize("loss", ["kl", "mse"])
def test_attention_values_at_masked_queries_and_keys_change_nothing(loss):
  student, teacher = output(KEY), output(jax.random.key(1))
  # mask a middle key too, so masked keys are also attended to by unmasked queries
  mask = jnp.array([1, 1, 0, 1, 0, 0], jnp.float32)
  strategy = AttentionTransfer(loss=loss)
  base = loss_of(strategy, {}, student, teacher, mask)["loss"]

  def perturb(maps, rows, cols):
    noise = 0.3 * jnp.abs(jax.random.normal(jax.random.key(9), maps[0].shape))
    sel = jnp.zeros((T, T), bool).at[rows, :].set(True).at[:, cols].set(True)
    return tuple(jnp.where(sel, m + noise, m) for m in maps)

  masked_rows, masked_cols = jnp.array([2, 4, 5]), jnp.array([2, 4, 5])
  s2 = student._replace(attn=perturb(student.attn, masked_rows, masked_cols))
  t2 = teacher._replace(attn=perturb(teacher.attn, masked_rows, masked_cols))
  np.testing.assert_allclose(loss_of(strategy, {}, s2, t2, mask)["loss"], base, rtol=1e-6)
  # the same perturbation on an unmasked key does change the loss
  s3 = student._replace(attn=perturb(student.attn, jnp.array([], jnp.int32), jnp.array([1])))
  assert abs(float(loss_of(strategy, {}, s3, teacher, mask)["loss"]) - float(base)) > 1e-4
  # without key masking the masked middle key counts
  keep = AttentionTransfer(loss=loss, mask_keys=False)
  s4 = student._replace(attn=perturb(student.attn, jnp.array([], jnp.int32), jnp.array([2])))
  moved, unmoved = loss_of(keep, {}, s4, teacher, mask)["loss"], loss_of(keep, {}, student, teacher, mask)["loss"]
  assert abs(float(moved - unmoved)) > 1e-4


@pytest.mark.parametrize("cls", [FeaturePooling, FeatureProjection])
def test_hidden_values_at_masked_tokens_change_nothing(cls):
  s_cfg, t_cfg = TEACHER_CFG.replace(d_model=4, n_layers=2), TEACHER_CFG.replace(d_model=8, n_layers=2)
  strategy = cls()
  params = strategy.init_params(s_cfg, t_cfg, KEY)
  student, teacher = output(KEY, width=4), output(jax.random.key(1), width=8)
  base = loss_of(strategy, params, student, teacher)["loss"]
  bump = lambda hs: tuple(h.at[4:].add(7.0) for h in hs)  # noqa: E731  (positions 4, 5 are masked)
  s2, t2 = student._replace(hidden=bump(student.hidden)), teacher._replace(hidden=bump(teacher.hidden))
  np.testing.assert_allclose(loss_of(strategy, params, s2, t2)["loss"], base, rtol=1e-6)
  s3 = student._replace(hidden=tuple(h.at[1].add(7.0) for h in student.hidden))
  assert abs(float(loss_of(strategy, params, s3, teacher)["loss"]) - float(base)) > 1e-4


# ------------------------------------------------------------- heads and layer maps


def test_teacher_heads_are_averaged_in_consecutive_groups():
  # 4 teacher heads over T=2 (causal rows: [1, 0], [a, 1-a]); student has 2 heads
  a = jnp.array([0.1, 0.3, 0.6, 0.8])
  teacher_Hx2x2 = jnp.stack([jnp.array([[1.0, 0.0], [x, 1.0 - x]]) for x in a])
  grouped = group_heads(teacher_Hx2x2, 2)
  np.testing.assert_allclose(grouped[:, 1, 0], [0.2, 0.7], rtol=1e-6)  # (0.1+0.3)/2, (0.6+0.8)/2
  np.testing.assert_allclose(grouped[:, 0], [[1.0, 0.0], [1.0, 0.0]])

  student_2x2x2 = jnp.stack([jnp.array([[1.0, 0.0], [0.5, 0.5]])] * 2)
  mask = jnp.ones((2,), jnp.float32)
  out_s = ModelOutput(logits=None, attn=(student_2x2x2,))
  out_t = ModelOutput(logits=None, attn=(teacher_Hx2x2,))
  got = AttentionTransfer().per_sequence({}, out_s, out_t, jnp.zeros(2, jnp.int32), mask, 0)["loss"]
  kl = lambda p: p * np.log(p / 0.5) + (1 - p) * np.log((1 - p) / 0.5)  # noqa: E731  row 2; row 1 has KL 0
  np.testing.assert_allclose(got, (kl(0.2) + kl(0.7)) / 2, rtol=1e-5)  # averaged over the 2 student heads


def test_default_layer_map_spreads_student_layers_evenly():
  assert default_layer_map(2, 4) == ((0, 1), (1, 3))
  assert default_layer_map(1, 4) == ((0, 3),)
  assert default_layer_map(3, 6) == ((0, 1), (1, 3), (2, 5))
  assert default_layer_map(4, 4) == ((0, 0), (1, 1), (2, 2), (3, 3))
  assert default_layer_map(2, 4, offset=1) == ((1, 2), (2, 4))  # hidden states: entry 0 is the embeddings
  # the strategy uses it: student 2 layers vs teacher 4, only pairs (0,1) and (1,3) matter
  student, teacher = output(KEY, n_layers=2), output(jax.random.key(1), n_layers=4)
  explicit = AttentionTransfer(layer_map=((0, 1), (1, 3)))
  np.testing.assert_allclose(
      loss_of(AttentionTransfer(), {}, student, teacher)["loss"], loss_of(explicit, {}, student, teacher)["loss"]
  )
  other = AttentionTransfer(layer_map=((0, 0), (1, 2)))
  moved, default = loss_of(other, {}, student, teacher)["loss"], loss_of(explicit, {}, student, teacher)["loss"]
  assert abs(float(moved - default)) > 1e-4


# ----------------------------------------------------------------------- composite


def test_composite_is_the_weighted_sum_of_its_terms_and_reports_each():
  s_cfg, t_cfg = TEACHER_CFG.replace(d_model=4, n_layers=2), TEACHER_CFG.replace(d_model=8, n_layers=2)
  terms = {"kd": LogitKD(), "attn": AttentionTransfer(), "proj": FeatureProjection(), "ce": HardLabelCE()}
  weights = {"kd": 1.0, "attn": 0.5, "proj": lambda step: 0.1 * step}  # "ce" defaults to 1.0
  composite = Composite(terms=terms, weights=weights)
  assert set(composite.capture) == {"attn", "hidden"}
  params = composite.init_params(s_cfg, t_cfg, KEY)
  assert set(params) == set(terms) and params["kd"] == {} and "kernel" in params["proj"]["s1_t1"]

  student, teacher = output(KEY, width=4), output(jax.random.key(1), width=8)
  targets = jnp.arange(T, dtype=jnp.int32)
  step = jnp.int32(3)
  got = composite.per_sequence(params, student, teacher, targets, MASK, step)
  want = 0.0
  for name, term in terms.items():
    values = term.per_sequence(params[name], student, teacher, targets, MASK, step)
    for k, v in values.items():
      np.testing.assert_allclose(got[f"{name}/{k}"], v, rtol=1e-6)
    want += {"kd": 1.0, "attn": 0.5, "proj": 0.3, "ce": 1.0}[name] * values["loss"]
  np.testing.assert_allclose(got["loss"], want, rtol=1e-6)
  assert "kd/kl" in got and "attn/loss" in got


# ------------------------------------------------------------------ through the step


@pytest.fixture(scope="module")
def trained():
  """Two layouts, 2 steps of attention transfer + feature projection: metrics and states."""
  strategy = Composite(terms={"attn": AttentionTransfer(), "proj": FeatureProjection(loss="mse")})
  runs = {}
  for name, mesh in (("mesh2x4", md.make_mesh(data=2, tensor=4)), ("single", None)):
    teacher = md.init_model(TEACHER_CFG, seed=0, mesh=mesh)
    student = md.init_model(STUDENT_CFG, seed=1, mesh=mesh)
    d = md.Distiller(student, teacher, strategy=strategy, mesh=mesh)
    state = d.init_state()
    init_proj = jax.device_get(state.params["strategy"])
    metrics = []
    for i in range(2):
      state, m = d.step(state, make_batch(seed=i))
      metrics.append(jax.device_get(m))
    runs[name] = (init_proj, metrics, jax.device_get(state.params["strategy"]))
  return runs


def test_attention_transfer_and_projection_match_on_a_2x4_mesh_and_one_device(trained):
  _, mesh_metrics, mesh_proj = trained["mesh2x4"]
  _, single_metrics, single_proj = trained["single"]
  for got, want in zip(mesh_metrics, single_metrics):
    for key in ("loss", "attn/loss", "proj/loss"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
    assert np.isfinite(got["grad_norm"]) and got["attn/loss"] > 0 and got["proj/loss"] > 0
  chex_close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)  # noqa: E731
  jax.tree.map(chex_close, mesh_proj, single_proj)


def test_projection_params_train_and_do_not_depend_on_batch_or_length(trained):
  init_proj, _, final_proj = trained["mesh2x4"]
  kernel0, kernel2 = init_proj["proj"]["s1_t2"]["kernel"], final_proj["proj"]["s1_t2"]["kernel"]
  assert kernel0.shape == (STUDENT_CFG.d_model, TEACHER_CFG.d_model)
  assert np.max(np.abs(kernel2 - kernel0)) > 1e-4  # trained with the student

  strategy = FeatureProjection()
  params = strategy.init_params(STUDENT_CFG, TEACHER_CFG, KEY)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  assert n_params == STUDENT_CFG.d_model * TEACHER_CFG.d_model * len(default_layer_map(1, 2))
  # the same parameters serve any batch size and sequence length
  for batch, t in ((2, 4), (5, 12)):
    s = ModelOutput(None, hidden=tuple(jnp.ones((batch, t, STUDENT_CFG.d_model)) for _ in range(2)))
    te = ModelOutput(None, hidden=tuple(jnp.ones((batch, t, TEACHER_CFG.d_model)) for _ in range(3)))
    per_seq = jax.vmap(strategy.per_sequence, in_axes=(None, 0, 0, 0, 0, None))
    out = per_seq(params, s, te, jnp.zeros((batch, t), jnp.int32), jnp.ones((batch, t)), 0)
    assert out["loss"].shape == (batch,)


# ----------------------------------------------------------------------- bad input


@pytest.mark.parametrize("cls", [AttentionTransfer, FeaturePooling, FeatureProjection])
def test_layer_map_naming_a_missing_layer_is_rejected_with_the_valid_range(cls):
  strategy = cls(layer_map=((0, 7),))
  with pytest.raises(ValueError, match=r"layer_map.*teacher .* 7.*0\.\.") as err:
    strategy.init_params(STUDENT_CFG, TEACHER_CFG, KEY)
  assert "does not exist" in str(err.value)
  with pytest.raises(ValueError, match="layer_map"):
    cls(layer_map=((0, -1),))
  with pytest.raises(ValueError, match="layer_map"):
    cls(layer_map="0->1")


def test_distiller_init_state_rejects_a_missing_student_layer():
  teacher, student = md.init_model(TEACHER_CFG, 0), md.init_model(STUDENT_CFG, 1)
  d = md.Distiller(student, teacher, strategy=AttentionTransfer(layer_map=((3, 1),)))
  with pytest.raises(ValueError, match=r"AttentionTransfer\.layer_map.*student layer 3.*0\.\.0"):
    d.init_state()


def test_heads_that_do_not_divide_are_rejected():
  student_cfg = STUDENT_CFG.replace(n_heads=8, n_kv_heads=2)  # teacher has 4 heads
  with pytest.raises(ValueError, match="heads"):
    AttentionTransfer().init_params(student_cfg, TEACHER_CFG, KEY)
  assert AttentionTransfer(heads="mean").init_params(student_cfg, TEACHER_CFG, KEY) == {}
  with pytest.raises(ValueError, match="AttentionTransfer.heads"):
    AttentionTransfer(heads="max")


def test_widths_that_do_not_divide_are_rejected_by_pooling():
  with pytest.raises(ValueError, match="d_model"):
    FeaturePooling().init_params(STUDENT_CFG.replace(d_model=12, head_dim=4), TEACHER_CFG, KEY)


def test_bad_settings_are_rejected_naming_the_setting():
  with pytest.raises(ValueError, match=r"Composite\.weights\['attn'\]=-0\.5"):
    Composite(terms={"kd": LogitKD(), "attn": AttentionTransfer()}, weights={"attn": -0.5})
  with pytest.raises(ValueError, match=r"Composite\.weights names \['atn'\]"):
    Composite(terms={"attn": AttentionTransfer()}, weights={"atn": 1.0})
  with pytest.raises(ValueError, match="Composite.terms"):
    Composite(terms={})
  with pytest.raises(ValueError, match=r"Composite\.terms\['kd'\]=ChunkedLogitKD.*LogitKD"):
    Composite(terms={"kd": ChunkedLogitKD()})
  with pytest.raises(ValueError, match="AttentionTransfer.loss"):
    AttentionTransfer(loss="cosine")
  with pytest.raises(ValueError, match="FeatureProjection.loss"):
    FeatureProjection(loss="kl")


# ---------------------------------------------------------------- the contract and the registry
def test_every_built_in_strategy_meets_the_contract_without_optional_hooks():
  built = {name: md.strategies.get(name)() for name in md.strategies.names()}
  assert {"logit_kd", "chunked_logit_kd", "hard_label_ce", "attention_transfer", "feature_pooling"} <= set(built)
  for name, strategy in built.items():
    kind = md.strategies.check(strategy, name)
    protocol = md.strategies.PerBatch if kind == "per_batch" else md.strategies.PerSequence
    assert isinstance(strategy, protocol), name
    assert strategy.needs_head == (kind == "per_batch") and strategy.needs_logits == (kind == "per_sequence"), name
  assert md.strategies.check(Composite(terms={"kd": LogitKD()})) == "per_sequence"


def test_a_strategy_without_the_contract_is_rejected_naming_what_it_lacks():
  class Bare:
    capture = ()

    def per_sequence(self, *args):
      return {}

  with pytest.raises(ValueError, match=r"Composite.terms\['x'\]=Bare is not a strategy.*needs_logits.*SequenceStrategy"):
    Composite(terms={"x": Bare()})


def test_a_registered_strategy_is_found_by_name_with_its_settings():
  @md.strategies.register("test_scaled_ce")
  class ScaledCE(HardLabelCE):  # pylint: disable=unused-variable
    pass

  assert "test_scaled_ce" in md.strategies.names()
  assert isinstance(md.strategies.from_settings("test_scaled_ce", {"temperature": None}), ScaledCE)  # None: unset
  with pytest.raises(ValueError, match=r"ScaledCE.temperature=2.0 is not a setting of ScaledCE .*its settings: \[\]"):
    md.strategies.from_settings("test_scaled_ce", {"temperature": 2.0})  # never silently dropped
  kd = md.strategies.from_settings("logit_kd", {"temperature": 3.0, "alpha": 0.2, "top_k": None, "chunk_size": None})
  assert kd == LogitKD(temperature=3.0, alpha=0.2)
  assert md.strategies.from_settings("chunked_logit_kd", {"chunk_size": 8}) == ChunkedLogitKD(chunk_size=8)
  with pytest.raises(ValueError, match=r"LogitKD.chunk_size=8 is not a setting of LogitKD"):  # never another class
    md.strategies.from_settings("logit_kd", {"chunk_size": 8})
  with pytest.raises(ValueError, match=r"strategy 'no_such' is not registered; choose one of \[.*'logit_kd'"):
    md.strategies.from_settings("no_such", {})
  with pytest.raises(ValueError, match="name 'logit_kd' is taken by LogitKD"):
    md.strategies.register("logit_kd")(ScaledCE)


def test_composite_weights_take_spec_dicts_and_reject_non_finite_values():
  attn = AttentionTransfer()
  c = Composite(terms={"attn": attn}, weights={"attn": {"kind": "linear", "start": 0.0, "end": 1.0, "steps": 4}})
  np.testing.assert_allclose(float(c.weight("attn", jnp.int32(2))), 0.5)
  for bad in (float("inf"), float("nan"), "1", {"kind": "constant", "value": -1.0}):
    with pytest.raises(ValueError, match=r"Composite\.weights\['attn'\]"):
      Composite(terms={"attn": attn}, weights={"attn": bad})


def test_a_new_strategy_is_one_new_module(tmp_path):
  """Copy the package, add one file to strategies/, and use the strategy from the API and a config."""
  import os
  import shutil
  import subprocess
  import sys
  import textwrap

  src = os.path.dirname(os.path.dirname(os.path.abspath(md.__file__)))
  shutil.copytree(os.path.join(src, "meshdistill"), tmp_path / "meshdistill", ignore=shutil.ignore_patterns("__pycache__"))
  (tmp_path / "meshdistill" / "strategies" / "_mine.py").write_text(textwrap.dedent('''
      import dataclasses
      import jax.numpy as jnp
      from meshdistill import losses
      from meshdistill.losses.schedules import check_scalar
      from meshdistill.strategies._base import SequenceStrategy, register

      @register("mine")
      @dataclasses.dataclass(frozen=True, kw_only=True)
      class Mine(SequenceStrategy):
        temperature: float = 1.0

        def __post_init__(self):
          check_scalar("Mine.temperature", self.temperature, 0.0, low_open=True)

        def per_sequence(self, params, student, teacher, targets_T, mask_T, step):
          return {"loss": jnp.sum(losses.forward_kl(student.logits, teacher.logits, mask_T, self.temperature))}
  '''))
  probe = textwrap.dedent('''
      import meshdistill as md
      from meshdistill.config import ConfigError, load_config
      assert md.strategies.Mine is md.strategies.get("mine")
      assert load_config(None, ["distill.kind=mine"]).distill.strategy() == md.strategies.Mine(temperature=1.0)
      try:
        load_config(None, ["distill.kind=mine", "distill.temperature=0"])
      except ConfigError as e:
        print(e)
      else:
        raise SystemExit("distill.temperature=0 was accepted")
  ''')
  env = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  assert "distill.temperature=0.0 must be > 0.0" in run.stdout


def test_a_strategy_declares_that_it_reads_row_pairs_and_the_jobs_ask_it_not_its_name():
  """Capabilities are asked of the strategy (issue: `kind == "preference"` tests in the jobs and the config)."""
  import pathlib
  import re

  from meshdistill import strategies

  assert [n for n in strategies.names() if strategies.get(n).needs_pairs] == ["preference"]
  src = pathlib.Path(__file__).resolve().parents[1] / "src" / "meshdistill"
  named = [str(p.relative_to(src)) for p in src.rglob("*.py")
           if re.search(r"kind\s*==\s*[\"']preference[\"']", p.read_text(encoding="utf-8"))]
  assert named == []
