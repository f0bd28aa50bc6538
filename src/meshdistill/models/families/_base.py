"""The `Family` contract: what one Hugging Face model family maps onto the built-in `Decoder`.

A family is one class in its own module of this package, decorated with
`meshdistill.models.families.register`. It names the Hugging Face ``architectures`` and ``model_type``
it reads, and holds

* ``block``: the `ModelConfig` block options its checkpoints need (Qwen3: ``{"qk_norm": True}``);
* `Family.from_hf` / `Family.to_hf`: ``config.json`` <-> `ModelConfig` (the base reads and writes the
  fields every Llama-style family shares; `hf_fields` adds the family's own written fields, `check_hf`
  its own refusals);
* ``options``: the `ModelConfig` attention options (`ATTENTION_OPTIONS`: sliding window, soft-caps, ...) it
  reads (`config_fields`) and writes (`hf_fields`); a config that sets one the family does not name is refused
  by `to_hf`;
* `Family.weight_name` / `Family.param_path`: Hugging Face tensor name <-> `Decoder` parameter path
  (`BLOCK_WEIGHTS`, the Llama layout; a family with other names sets ``block_weights``);
* ``presets``: named shapes for the planner, each the shape fields of a published ``config.json``.

A family that differs from another only in config subclasses it and changes the class attributes.
Two are never inherited, so a subclass neither repeats its parent's presets nor takes its place:
``presets`` and ``default_export`` (the family a `ModelConfig` with the family's ``block`` options is
written as when no family is named; one per block).
"""

from __future__ import annotations

from typing import Any, ClassVar

from meshdistill.models._config import ModelConfig, RopeScaling

# Decoder parameter path inside a block -> (Hugging Face name inside ``model.layers.<i>.``, transposed?).
# Hugging Face stores Linear weights as [out, in], the decoder's kernels are [in, out]; embeddings and norm
# scales are stored alike. Both store q/k in rotate-half order, so no RoPE permutation is needed.
BLOCK_WEIGHTS: dict[tuple[str, ...], tuple[str, bool]] = {
    ("attn_norm", "scale"): ("input_layernorm.weight", False),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", False),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", False),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", False),
    ("attn", "o", "kernel"): ("self_attn.o_proj.weight", True),
    ("mlp", "gate", "kernel"): ("mlp.gate_proj.weight", True),
    ("mlp", "up", "kernel"): ("mlp.up_proj.weight", True),
    ("mlp", "down", "kernel"): ("mlp.down_proj.weight", True),
    **{("attn", x, "kernel"): (f"self_attn.{x}_proj.weight", True) for x in "qkv"},
    **{("attn", x, "bias"): (f"self_attn.{x}_proj.bias", False) for x in "qkv"},
}
# Decoder parameter path outside the blocks -> (Hugging Face name, transposed?).
TOP_WEIGHTS: dict[tuple[str, ...], tuple[str, bool]] = {
    ("embed", "embedding"): ("model.embed_tokens.weight", False),
    ("final_norm", "scale"): ("model.norm.weight", False),
    ("head", "kernel"): ("lm_head.weight", True),
}
# The `ModelConfig` switches that change the block's weights or its arithmetic (one value per family).
BLOCK_OPTIONS = ("qk_norm", "qkv_bias", "geglu", "norm_offset", "embed_scale", "post_norms")
# The `ModelConfig` attention options a family may read and write (None: off); see `Family.options`.
ATTENTION_OPTIONS = ("sliding_window", "layer_types", "rope_local_theta", "query_scale", "attn_softcap",
                     "final_softcap")


class Family:
  """One Hugging Face model family on the built-in decoder (see the module docstring)."""

  name: ClassVar[str]  # the registry key and the default model_type
  architectures: ClassVar[tuple[str, ...]]  # config.json "architectures" entries it reads; the first is written
  model_type: ClassVar[str | None] = None  # config.json "model_type" (default: `name`)
  block: ClassVar[dict[str, bool]] = {}  # ModelConfig block options (`BLOCK_OPTIONS`) the family sets to True
  experts: ClassVar[bool] = False  # mixture-of-experts blocks (`ModelConfig.moe` set; see families._moe)
  rope_scaling: ClassVar[bool] = False  # whether `to_hf` may write Llama-3 rope_scaling
  presets: ClassVar[dict[str, dict[str, Any]]] = {}  # planner preset name -> shape fields; not inherited
  options: ClassVar[tuple[str, ...]] = ()  # ATTENTION_OPTIONS it reads and writes
  block_weights: ClassVar[dict[tuple[str, ...], tuple[str, bool]] | None] = None  # its own BLOCK_WEIGHTS, if any
  default_export: ClassVar[bool] = False  # see the module docstring; not inherited

  def __init_subclass__(cls, **kw):
    super().__init_subclass__(**kw)
    cls.default_export = cls.__dict__.get("default_export", False)
    cls.presets = cls.__dict__.get("presets", {})
    if "model_type" not in cls.__dict__ and "name" in cls.__dict__:
      cls.model_type = cls.name

  def __repr__(self) -> str:
    return f"<family {self.name}: {', '.join(self.architectures)}>"

  # -- config.json <-> ModelConfig ------------------------------------------------------------------------------

  def check_hf(self, hf: dict[str, Any], where: str) -> None:
    """Raises a ValueError naming ``where`` for a field of ``hf`` the decoder cannot follow."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"{where}: hidden_act={act!r} is not supported; the decoder's MLP is SwiGLU (silu)")
    for flag in ("mlp_bias",) + (() if self.block.get("qkv_bias") else ("attention_bias",)):
      if hf.get(flag):
        raise ValueError(f"{where}: {flag}=true is not supported for model_type={self.model_type!r}; expected false")
    if hf.get("use_sliding_window"):
      raise ValueError(f"{where}: use_sliding_window=true is not supported; the decoder attends over the whole "
                       "sequence")

  def from_hf(self, hf: dict[str, Any], *, max_len: int | None = None, dtype: str = "auto",
              where: str = "config.json") -> ModelConfig:
    """A `ModelConfig` equal to the Hugging Face config ``hf`` (a parsed ``config.json``).

    ``max_len`` overrides ``max_position_embeddings`` (it only bounds the sequence length).
    """
    self.check_hf(hf, where)
    theta, scaling = read_rope(hf, where)
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        d_model=d,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or d // heads),
        mlp_hidden=int(hf["intermediate_size"]),
        max_len=int(max_len or hf.get("max_position_embeddings") or 2048),
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype,
        rope_scaling=scaling,
        **{k: bool(self.block.get(k, False)) for k in BLOCK_OPTIONS},
        **self.config_fields(hf, where),
    )

  def config_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
    """`ModelConfig` fields only this family reads from ``hf`` (its ``options``; added to the common ones)."""
    del hf, where
    return {}

  def writes(self, cfg: ModelConfig) -> bool:
    """Whether this family's ``config.json`` can say every attention option ``cfg`` sets (`ATTENTION_OPTIONS`)."""
    return all(getattr(cfg, o) is None or o in self.options for o in ATTENTION_OPTIONS)

  def fits(self, cfg: ModelConfig) -> bool:
    """Whether a decoder of ``cfg`` has this family's block (its weights are exactly the family's)."""
    same_block = all(getattr(cfg, k) == bool(self.block.get(k, False)) for k in BLOCK_OPTIONS)
    return same_block and (cfg.moe is not None) == self.experts

  def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    """Fields only this family writes into ``config.json`` (added to the common ones by `to_hf`)."""
    del cfg
    return {}

  def to_hf(self, cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The Hugging Face ``config.json`` contents for a decoder of config ``cfg``."""
    if not self.fits(cfg):
      raise ValueError(f"a decoder with qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias}, "
                       f"{'mixture-of-experts' if cfg.moe else 'dense'} blocks cannot be written as "
                       f"{self.name!r}; use family={default_family_name(cfg)!r}")
    unwritten = [o for o in ATTENTION_OPTIONS if getattr(cfg, o) is not None and o not in self.options]
    if unwritten:
      able = sorted(f.name for f in all_families() if f.fits(cfg) and f.writes(cfg))
      raise ValueError(f"family {self.name!r} cannot write {unwritten} (set in the decoder's config) into its "
                       f"config.json; families that can: {able or 'none'}")
    if cfg.rope_scaling is not None and not self.rope_scaling:
      raise ValueError(f"rope_scaling is not written for family {self.name!r}; families that write it: "
                       f"{_scaling_families()}")
    out: dict[str, Any] = {
        "architectures": [self.architectures[0]],
        "model_type": self.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.hd,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    out.update(self.hf_fields(cfg))
    if cfg.rope_scaling is not None:
      out["rope_scaling"] = write_rope_scaling(cfg.rope_scaling)
    return out

  # -- weight names ---------------------------------------------------------------------------------------------

  def weight_name(self, path: tuple) -> tuple[str, bool]:
    """(Hugging Face tensor name, transposed?) of a `Decoder` parameter path (see `BLOCK_WEIGHTS`)."""
    return weight_name(path, self.block_weights)

  def param_path(self, name: str) -> tuple[tuple, bool]:
    """(`Decoder` parameter path, transposed?) of a Hugging Face tensor name; the inverse of `weight_name`."""
    found = param_path(name, self.block_weights)
    if found is None:
      raise ValueError(f"Hugging Face tensor {name!r} has no counterpart in the decoder of family {self.name!r}")
    return found


def weight_name(path: tuple, block_weights: dict | None = None) -> tuple[str, bool]:
  """(Hugging Face tensor name, transposed?) of a `Decoder` parameter path in the Llama layout (or with the
  block names ``block_weights``)."""
  p = tuple(str(x) for x in path)
  block = BLOCK_WEIGHTS if block_weights is None else block_weights
  if p in TOP_WEIGHTS:
    return TOP_WEIGHTS[p]
  if len(p) > 2 and p[0] == "blocks" and p[2:] in block:
    name, transposed = block[p[2:]]
    return f"model.layers.{p[1]}.{name}", transposed
  raise ValueError(f"decoder parameter {'.'.join(p)} has no Hugging Face counterpart")


def param_path(name: str, block_weights: dict | None = None) -> tuple[tuple, bool] | None:
  """(`Decoder` parameter path, transposed?) of a Hugging Face tensor name in the Llama layout (or with the block
  names ``block_weights``), or None."""
  for path, (hf, transposed) in TOP_WEIGHTS.items():
    if name == hf:
      return path, transposed
  parts = name.split(".", 3)
  if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
    for path, (hf, transposed) in (BLOCK_WEIGHTS if block_weights is None else block_weights).items():
      if parts[3] == hf:
        return ("blocks", int(parts[2]), *path), transposed
  return None


def read_rope(hf: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
  """(rope_theta, Llama-3 scaling or None) of a config: transformers < 5 writes ``rope_theta`` + ``rope_scaling``,
  >= 5 may write ``rope_parameters``."""
  params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10_000.0)
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind == "linear":
    return theta, RopeScaling(kind="linear", factor=float(params["factor"]))
  if kind == "llama3":
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_len=int(params["original_max_position_embeddings"]),
    )
  raise ValueError(f"{where}: rope_type={kind!r} is not supported; supported: 'default', 'linear', 'llama3'")


def write_rope_scaling(s: RopeScaling) -> dict[str, Any]:
  """The ``rope_scaling`` entry of a config.json for frequency scaling ``s`` (Llama-3 or linear)."""
  if s.kind == "linear":
    return {"rope_type": "linear", "factor": s.factor}
  return {
      "rope_type": "llama3",
      "factor": s.factor,
      "low_freq_factor": s.low_freq_factor,
      "high_freq_factor": s.high_freq_factor,
      "original_max_position_embeddings": s.original_max_len,
  }


# The registry's table (filled by `meshdistill.models.families.register`); read here for the contract's own errors.
_REGISTRY: dict[str, Family] = {}


def names() -> list[str]:
  """The registered family names."""
  return sorted(_REGISTRY)


def all_families() -> list[Family]:
  return [_REGISTRY[n] for n in names()]


def default_for(cfg: ModelConfig) -> Family:
  """The family a `ModelConfig` is written as when none is named: the ``default_export`` family of its block, or
  (a config with attention options that family does not write, e.g. a sliding window) the first that writes them."""
  fitting = [fam for fam in all_families() if fam.fits(cfg)]
  for fam in sorted(fitting, key=lambda f: not f.default_export):
    if fam.writes(cfg):
      return fam
  raise ValueError(f"ModelConfig with qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias}, "
                   f"{'mixture-of-experts' if cfg.moe else 'dense'} blocks matches no supported Hugging "
                   f"Face family; families: {names()}")


def default_family_name(cfg: ModelConfig) -> str:
  return default_for(cfg).name


def _scaling_families() -> list[str]:
  return sorted(f.name for f in all_families() if f.rope_scaling)
