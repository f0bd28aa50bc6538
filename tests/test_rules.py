"""Logical axis names and the rules table: the tables give today's shardings (the FSDP table the old "largest free
dimension" rule's, spec by spec), a mesh with a third axis runs the step like one device, an unmapped axis of size
1 costs nothing, the mesh config's errors, and model code that names logical dimensions only."""

import ast
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import STUDENT_CFG, TEACHER_CFG, assert_trees_close, make_batch

import meshdistill as md
from meshdistill.config import ConfigError, load_config
from meshdistill.jobs import build_mesh
from meshdistill.models import abstract_params
from meshdistill.parallel import rules
from meshdistill.parallel.backends import make_layout

SRC = pathlib.Path(md.__file__).parent

# Shapes of published checkpoints (two layers: the rules do not depend on depth).
LLAMA_8B = md.ModelConfig(vocab_size=128256, d_model=4096, n_layers=2, n_heads=32, n_kv_heads=8, mlp_hidden=14336,
                          max_len=64, tie_embeddings=False)
QWEN3_LIKE = TEACHER_CFG.replace(qk_norm=True, qkv_bias=True, tie_embeddings=False)
CONFIGS = {
    "tiny teacher": TEACHER_CFG,
    "tiny student, scanned, untied": STUDENT_CFG.replace(scan_layers=True, tie_embeddings=False),
    "tiny, qk-norm and biases": QWEN3_LIKE,
    "llama-8b shapes": LLAMA_8B,
    "llama-8b shapes, scanned": LLAMA_8B.replace(scan_layers=True),
}
MESHES = {"2x4": (2, 4), "4x2": (4, 2), "8x1": (8, 1), "1x8": (1, 8)}


def old_fsdp_names(names: tuple, shape: tuple, data: int, stacked: bool) -> tuple:
  """The rule `meshdistill.parallel.fsdp.assign` applied before the rules table (kept here as the reference): ``data``
  on the largest dimension that no axis splits and ``data`` divides (the first of equals; never a stacked layer
  axis), or nowhere."""
  first = 1 if stacked else 0
  free = [i for i, (a, n) in enumerate(zip(names, shape)) if i >= first and a is None and n % data == 0]
  if data == 1 or not free:
    return names
  dim = max(free, key=lambda i: (shape[i], -i))
  return tuple("data" if i == dim else a for i, a in enumerate(names))


def specs(state, table, mesh) -> dict:
  """``{path: mesh axis per dimension}`` of an abstract state with ``table`` applied on ``mesh``."""
  state = rules.apply(state, table, mesh)
  return {k: rules.mesh_names(v) for k, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fsdp_table_gives_the_old_largest_free_dimension_rule_spec_by_spec(config, mesh):
  data, tensor = MESHES[mesh]
  mesh = md.make_mesh(data, tensor)
  cfg = CONFIGS[config].for_tensor(tensor)
  _, state, _ = abstract_params(cfg)
  # The metadata the old rule read: the decoder's tensor names as created (`tensor` even at tensor=1).
  created = {k: rules.mesh_names(v) for k, v in nnx.to_flat_state(state)}
  fsdp_specs = specs(state, rules.FSDP, mesh)
  shapes = {k: tuple(v.get_value().shape) for k, v in nnx.to_flat_state(state)}
  # The tables leave a size-1 axis out (the same sharding; the old metadata named `tensor` at tensor=1).
  size_one = lambda names: tuple(None if a is None or mesh.shape[a] == 1 else a for a in names)  # noqa: E731
  want = {k: size_one(old_fsdp_names(created[k], shapes[k], data, cfg.scanned and k[0] == "blocks"))
          for k in shapes}
  assert fsdp_specs == want
  split = [k for k, v in fsdp_specs.items() if "data" in v]
  # with data > 1 every weight but a bias split over tensor has a dimension split over data
  assert {k for k in shapes if k not in split} == ({k for k in shapes if k[-1] == "bias" and "tensor" in created[k]}
                                                   if data > 1 else set(shapes))


def test_tensor_table_gives_the_megatron_split_the_decoder_had():
  """What decoder.py named with the mesh axis before the logical names (k/v: 2 key/value heads on tensor=4 are
  replicated, `ModelConfig.replicate_kv`)."""
  T = "tensor"
  _, state, _ = abstract_params(QWEN3_LIKE.for_tensor(4))
  flat = specs(state, rules.TENSOR_PARALLEL, md.make_mesh(2, 4))
  block = {".".join(map(str, k[2:])): v for k, v in flat.items() if k[:2] == ("blocks", 0)}
  want = {
      "attn.q.kernel": (None, T), "attn.q.bias": (T,), "attn.k.kernel": (None, None), "attn.k.bias": (None,),
      "attn.o.kernel": (T, None), "attn.q_norm.scale": (None,), "mlp.gate.kernel": (None, T),
      "mlp.up.kernel": (None, T), "mlp.down.kernel": (T, None), "attn_norm.scale": (None,),
  }
  assert {k: block[k] for k in want} == want
  assert flat[("embed", "embedding")] == (T, None) and flat[("head", "kernel")] == (None, T)
  assert flat[("final_norm", "scale")] == (None,)


def test_a_rule_for_the_expert_axis_is_one_line_and_a_mesh_without_it_ignores_it():
  expert_parallel = rules.TENSOR_PARALLEL.replace("expert", experts="expert")
  with nnx.use_eager_sharding(False):
    w = nnx.Param(np.zeros((4, 8, 16), np.float32), out_sharding=("experts", "embed", "mlp"),
                  sharding_rules=rules.DEFAULT)
  three = md.make_mesh(2, 2, axes={"expert": 2})
  assert rules.mesh_names(rules.apply(nnx.State({"w": w}), expert_parallel, three)["w"]) == ("expert", None, "tensor")
  two = md.make_mesh(2, 4)
  assert rules.mesh_names(rules.apply(nnx.State({"w": w}), expert_parallel, two)["w"]) == (None, None, "tensor")


def test_tables_name_every_logical_dimension():
  with pytest.raises(ValueError, match=r"rules 'bad': every logical name needs a rule; missing \['batch'"):
    rules.Rules("bad", dict.fromkeys(rules.LOGICAL))
  with pytest.raises(ValueError, match=r"logical axis names \['hidden'\]: not in"):
    rules.annotate(nnx.initializers.zeros, "embed", "hidden")


def distill(mesh, fsdp=False):
  # models built off the mesh: the layout pads and places them (no initialiser compiled per mesh)
  d = md.Distiller(md.init_model(STUDENT_CFG, seed=1), md.init_model(TEACHER_CFG, seed=0), mesh=mesh, fsdp=fsdp)
  state, losses = d.init_state(), []
  for s in range(2):
    state, metrics = d.step(state, make_batch(seed=s))
    losses.append(float(metrics["loss"]))
  return d, state, losses


def test_a_three_axis_mesh_whose_expert_axis_a_dense_model_does_not_use_equals_one_device():
  """data 2 x expert 2 x tensor 2 with fsdp: weights split over data and tensor by the rules, replicated over
  expert (a dense model has no experts dimension); the same losses and weights as one device."""
  _, want_state, want = distill(None)
  mesh = md.make_mesh(2, 2, axes={"expert": 2})
  assert mesh.axis_names == ("data", "expert", "tensor")
  _, state, got = distill(mesh, fsdp=True)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert_trees_close(jax.device_get(state.params), jax.device_get(want_state.params))
  q = state.params["student"]["blocks"][0]["attn"]["q"]["kernel"].get_value()
  assert tuple(q.sharding.spec) == ("data", "tensor") and len(q.addressable_shards) == 8


def test_an_unmapped_axis_of_size_one_costs_nothing():
  """The same step on 8x1 and on 8 x expert 1 x 1 (fsdp): every state leaf split the same way, the same
  collectives in the lowered program."""
  def lowered(mesh):
    d = md.Distiller(md.init_model(STUDENT_CFG, seed=1), md.init_model(TEACHER_CFG, seed=0), mesh=mesh, fsdp=True)
    state = d.init_state()
    return state, d.lower(state, make_batch())

  (s1, plain), (s2, extra) = lowered(md.make_mesh(8, 1)), lowered(md.make_mesh(8, 1, axes={"expert": 1}))
  split = lambda s: [x.sharding.shard_shape(x.shape) for x in jax.tree.leaves(s)]  # noqa: E731
  assert split(s1) == split(s2)
  ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
  count = lambda low: {op: low.as_text().count(f"stablehlo.{op}") for op in ops}  # noqa: E731
  assert count(plain) == count(extra) and count(plain)["all_gather"] > 0


@pytest.mark.parametrize("overrides, match", [
    (["mesh.axes={pipeline: 2}"], r"mesh.axes: unknown mesh axis 'pipeline'; choose from \['expert', 'context'\]"),
    (["mesh.axes={tensor: 2}"], r"mesh.axes names 'tensor'; set its size with mesh.tensor"),
    (["mesh.axes={expert: 0}"], r"mesh.axes.expert=0 must be a positive integer"),
    (["mesh.backend=single", "mesh.data=1", "mesh.tensor=1", "mesh.axes={expert: 2}"],
     r"mesh.backend='single' runs on one device but mesh.data=1 x mesh.tensor=1 x mesh.axes.expert=2"),
    (["mesh.backend=pmap", "mesh.data=4", "mesh.tensor=1", "mesh.axes={expert: 2}"],
     r"mesh.backend='pmap' is data-parallel only: mesh.axes.expert=2 must be 1"),
])
def test_bad_mesh_axes_settings_name_the_setting(overrides, match):
  with pytest.raises(ConfigError, match=match):
    load_config("tiny", overrides)


def test_mesh_axes_whose_product_is_not_the_device_count_are_refused():
  cfg = load_config("tiny", ["mesh.data=2", "mesh.tensor=2", "mesh.axes={expert: 4}", "mesh.simulate_cpu_devices=false"])
  assert cfg.mesh.devices == 16
  with pytest.raises(ConfigError, match=r"mesh data=2 x expert=4 x tensor=2 needs 16 devices but 8 are available"):
    build_mesh(cfg)
  cfg = load_config("tiny", ["mesh.data=2", "mesh.tensor=2", "mesh.axes={expert: 2}"])
  assert build_mesh(cfg).shape == {"data": 2, "expert": 2, "tensor": 2}


def test_model_code_names_no_mesh_axis_outside_its_collectives():
  """``models/`` imports no mesh axis name except where code runs per device over them: the splash kernel's module
  and the experts' nested shard_map (`meshdistill.models.moe.experts_on_mesh`), and the context shard's gathers
  (`meshdistill.models._context`)."""
  allowed = {"_attention.py", "_context.py", "moe.py"}
  for path in (SRC / "models").rglob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module == "meshdistill.parallel.mesh":
        named = {a.name for a in node.names} & {"DATA", "TENSOR", "EXPERT", "CONTEXT", "AXES"}
        assert not named or path.name in allowed, (path, named)


def test_the_planner_enumerates_the_axes_a_layout_declares():
  from meshdistill.planner._plan import mesh_shapes
  assert make_layout("shard_map", md.make_mesh(2, 4)).axes == ("data", "tensor")
  assert [(s["data"], s["tensor"]) for s in mesh_shapes(8, ("data", "tensor"))] == [(8, 1), (4, 2), (2, 4), (1, 8)]
  assert len(mesh_shapes(8, ("data", "expert", "tensor"))) == 10
