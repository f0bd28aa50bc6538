"""tunix's Llama3 / Qwen3 NNX models as meshdistill teachers or students.

`TunixLM` wraps a ``tunix.models.llama3.model.Llama3`` or ``tunix.models.qwen3.model.Qwen3``
(dense) and exposes what the distillation step needs: ``.cfg`` (`TunixConfig`),
``model(tokens_BxT, capture=("hidden", "final"), logits=True) -> ModelOutput`` and
``head_weight() -> [D, V]``. Hidden states come from running tunix's own layers one by
one (no model surgery). Attention probabilities are computed inside tunix's attention and
not returned, so ``capture=("attn",)`` raises: use `meshdistill.models.hf.load_hf` (the
built-in decoder) for attention transfer.

Weights are split over the mesh axis ``tensor`` (`tensor_sharding`: heads, MLP hidden units,
vocabulary; norms replicated), and `load_tunix_hf` reads a Hugging Face directory straight
onto the mesh, each device reading only its window.

Known difference: tunix 0.1.7's Llama3 attention calls its RoPE without the configured
``rope_theta`` (it uses 1e6) and has no Llama-3 frequency scaling, so its logits differ
from transformers' for Llama 3.x checkpoints (theta 500000); its Qwen3 matches (theta 1e6).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshdistill.parallel.mesh import param_shardings
from meshdistill.parallel.rules import DEFAULT, split_ways
from meshdistill.models import families
from meshdistill.models._visible import Segments, segment_mask
from meshdistill.models.decoder import ModelOutput
from meshdistill.models.hf import read_hf_config, read_onto_mesh

_CAPTURABLE = ("hidden", "final")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TunixConfig:
  """Sizes of a wrapped tunix model, in meshdistill's names."""

  family: str  # "llama" or "qwen3"
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_hidden: int
  max_len: int
  tie_embeddings: bool

  @property
  def hd(self) -> int:
    return self.head_dim

  def check_tensor_split(self, tensor: int) -> None:
    """Raises when a ``tensor``-split dimension is not divisible by ``tensor``."""
    dims = {"vocab_size": self.vocab_size, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
            "mlp_hidden": self.mlp_hidden}
    bad = {k: v for k, v in dims.items() if v % tensor}
    if bad:
      desc = ", ".join(f"{k}={v}" for k, v in bad.items())
      raise ValueError(f"mesh tensor={tensor} does not divide {desc} of the tunix model (heads are split whole); "
                       f"choose a tensor axis dividing them")


def tensor_sharding(module):
  """A tunix ``ShardingConfig`` for ``module`` (tunix's llama3 or qwen3 model module): its weights split as the
  default rules table splits the decoder's (`meshdistill.parallel.rules`; tunix takes mesh axis names)."""
  V, D, N, F, E = (DEFAULT.axis(n) for n in ("vocab", "embed", "heads", "mlp", "experts"))
  kw = dict(
      emb_vd=(V, D), emb_dv=(D, V), q_weight_dnh=(D, N, None),
      kv_weight_dnh=(D, N, None), o_weight_nhd=(N, None, D), ffw_weight_df=(D, F),
      ffw_weight_fd=(F, D), rms_norm_weight=(D,), act_btd=(None, None, None),
      act_btf=(None, None, None), act_btnh=(None, None, None, None),
  )
  if "exp_weight_edf" in {f.name for f in dataclasses.fields(module.ShardingConfig)}:
    kw.update(exp_weight_edf=(E, D, F), exp_weight_efd=(E, F, D))
  return module.ShardingConfig(**kw)


def _tunix_module(family: str):
  if family == "llama":
    from tunix.models.llama3 import model
  elif family == "qwen3":
    from tunix.models.qwen3 import model
  else:
    raise ValueError(f"tunix adapter supports model_type 'llama' and 'qwen3', not {family!r}")
  return model


def tunix_config(cfg: TunixConfig):
  """The tunix ``ModelConfig`` (sharded over ``tensor``) of a `TunixConfig`."""
  module = _tunix_module(cfg.family)
  common = dict(num_layers=cfg.n_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.d_model, hidden_dim=cfg.mlp_hidden,
                num_heads=cfg.n_heads, head_dim=cfg.head_dim, num_kv_heads=cfg.n_kv_heads,
                shd_config=tensor_sharding(module))
  if cfg.family == "llama":
    return module.ModelConfig(**common, rope_theta=500_000, norm_eps=1e-5, weight_tying=cfg.tie_embeddings)
  return module.ModelConfig(**common, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=cfg.tie_embeddings)


class TunixLM(nnx.Module):
  """A tunix Llama3 / Qwen3 model behind meshdistill's model interface."""

  def __init__(self, cfg: TunixConfig, inner: nnx.Module):
    self.cfg = cfg
    self.inner = inner

  def __call__(self, tokens_BxT: jax.Array, *, capture: tuple[str, ...] = (), logits: bool = True,
               segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> ModelOutput:
    """As `meshdistill.models.Decoder`: ``segment_ids`` / ``positions`` [B, T] of rows packed from several documents
    (attention within a document, RoPE restarting at each), given to tunix's layers as their positions and mask."""
    unknown = set(capture) - set(_CAPTURABLE)
    if unknown:
      raise ValueError(f"capture={capture!r}: a tunix model can give {_CAPTURABLE}, not {sorted(unknown)} "
                       "(its attention does not return probabilities); use meshdistill.models.hf.load_hf for those")
    B, T = tokens_BxT.shape
    if T > self.cfg.max_len:
      raise ValueError(f"sequence length {T} exceeds the model's max_len={self.cfg.max_len}")
    m = self.inner
    positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    causal_BxTxT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), dtype=bool)), (B, T, T))
    segments = Segments.of(tokens_BxT, segment_ids, positions)
    if segments is not None:
      positions_BxT, causal_BxTxT = segments.positions_BxT, causal_BxTxT & segment_mask(segments.ids_BxT)[:, 0]
    x = m.embedder.encode(tokens_BxT)
    hidden = [x] if "hidden" in capture else []
    for layer in m.layers:
      _, x = layer(x, positions_BxT, None, causal_BxTxT)
      if "hidden" in capture:
        hidden.append(x)
    x = m.final_norm(x)
    final = x if "final" in capture else None
    if not logits:
      return ModelOutput(None, tuple(hidden), (), final)
    logits_BxTxV = jnp.einsum("btd,dv->btv", x, self.head_weight().astype(x.dtype))
    return ModelOutput(logits_BxTxV.astype(jnp.float32), tuple(hidden), (), final)

  def head_weight(self) -> jax.Array:
    """The LM head as [D, V] (V split over ``tensor``)."""
    if self.cfg.tie_embeddings:
      return self.inner.embedder.input_embedding[...].T
    return self.inner.lm_head.w[...]


_NAMES = {
    ("attn", "q_proj", "w"): ("self_attn.q_proj.weight", "in_heads"),
    ("attn", "k_proj", "w"): ("self_attn.k_proj.weight", "in_heads"),
    ("attn", "v_proj", "w"): ("self_attn.v_proj.weight", "in_heads"),
    ("attn", "o_proj", "w"): ("self_attn.o_proj.weight", "out_heads"),
    ("attn", "q_norm", "w"): ("self_attn.q_norm.weight", "same"),
    ("attn", "k_norm", "w"): ("self_attn.k_norm.weight", "same"),
    ("mlp", "gate_proj", "kernel"): ("mlp.gate_proj.weight", "T"),
    ("mlp", "up_proj", "kernel"): ("mlp.up_proj.weight", "T"),
    ("mlp", "down_proj", "kernel"): ("mlp.down_proj.weight", "T"),
    ("input_layernorm", "w"): ("input_layernorm.weight", "same"),
    ("post_attention_layernorm", "w"): ("post_attention_layernorm.weight", "same"),
}


def _tunix_names(key: tuple) -> tuple[str, str]:
  p = tuple(str(x) for x in key)
  if p == ("embedder", "input_embedding"):
    return "model.embed_tokens.weight", "same"
  if p == ("final_norm", "w"):
    return "model.norm.weight", "same"
  if p == ("lm_head", "w"):
    return "lm_head.weight", "T"
  if p[0] == "layers" and p[2:] in _NAMES:
    name, layout = _NAMES[p[2:]]
    return f"model.layers.{p[1]}.{name}", layout
  raise ValueError(f"tunix parameter {'.'.join(p)} has no Hugging Face counterpart")


def load_tunix_hf(path: str | os.PathLike, mesh: Mesh | None = None, *, param_dtype: str = "float32",
                  max_len: int | None = None) -> TunixLM:
  """A `TunixLM` holding a Hugging Face Llama 3.x / Qwen3 checkpoint, split over ``tensor`` on ``mesh``."""
  hf = read_hf_config(path)
  family = families.family_for(hf, str(path)).name
  base = families.get(family).from_hf(hf, max_len=max_len)  # validates the fields
  cfg = TunixConfig(family=family, vocab_size=base.vocab_size, d_model=base.d_model, n_layers=base.n_layers,
                    n_heads=base.n_heads, n_kv_heads=base.n_kv_heads, head_dim=base.hd, mlp_hidden=base.mlp_hidden,
                    max_len=base.max_len, tie_embeddings=base.tie_embeddings)
  if mesh is not None:
    cfg.check_tensor_split(split_ways(mesh, "heads"))
  module = _tunix_module(family)
  tcfg = tunix_config(cfg)
  tcfg = dataclasses.replace(tcfg, rope_theta=base.rope_theta, norm_eps=base.norm_eps)
  model_cls = module.Llama3 if family == "llama" else module.Qwen3
  with nnx.use_eager_sharding(False):
    abstract_model = nnx.eval_shape(lambda: TunixLM(cfg, model_cls(tcfg, rngs=nnx.Rngs(0))))
  graphdef, abstract = nnx.split(abstract_model)
  shardings = None if mesh is None else param_shardings(nnx.get_partition_spec(abstract), mesh)

  def names(key):
    if key[0] != "inner":
      raise ValueError(f"unexpected parameter {key}")
    return _tunix_names(key[1:])

  state, _, _ = read_onto_mesh(path, abstract, shardings, names, param_dtype)
  return nnx.merge(graphdef, state)
