"""The sizes and options of a `meshdistill.models.decoder.Decoder`: `ModelConfig` with its validation and
its fitting to a ``tensor`` axis (vocabulary padding, key/value replication), `RopeScaling`, and the names
of the attention kernels (`ATTENTION`) and per-block rematerialisation policies (`REMAT_POLICIES`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from meshdistill.models.moe import MoeConfig
from meshdistill.parallel.mesh import compiler_tensor_size, platform_of, target_platform
from meshdistill.parallel.rules import split_ways

# Per-block rematerialisation (`jax.checkpoint`) policies, by `ModelConfig.remat` name ("auto", the default: the
# `Distiller` compiles its first step with the policies in the order of `train.memory.REMAT_ORDER` and keeps the best
# whose memory fits the device, with the micro-batch, `train.tuning.auto_tune`; a model run outside one computes as
# "none"):
# "none" keeps every activation for the backward pass; "full" keeps only each block's
# input and recomputes the block; "dots" keeps matmul outputs; "dots_no_batch" keeps
# only matmuls without batch dimensions (the weight projections, not attention scores). Both "dots" policies also
# keep what the splash kernel's backward pass reads of its forward (its output and log-sum-exp, named
# `ATTENTION_RESIDUALS`): without them the backward pass runs the forward kernel again for them (a Pallas call is no
# matmul to a policy), for [B, H, T] float32 and the [B, H, T, K] output the output projection reads anyway.
ATTENTION_RESIDUALS = "attention_residuals"
_KEEP_ATTENTION = jax.checkpoint_policies.save_only_these_names(ATTENTION_RESIDUALS)
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.checkpoint_dots, _KEEP_ATTENTION),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _KEEP_ATTENTION),
}

# Attention kernels, by `ModelConfig.attention` name. Every one is causal grouped-query attention
# without copying key/value heads; capturing attention probabilities always uses "explicit".
ATTENTION = {
    "auto": "splash where it applies (a TPU target, sequence a multiple of 128, the tensor axis dividing n_heads, "
            "not decoding), else xla; explicit scores when probabilities are captured (`ModelConfig.kernel`)",
    "explicit": "grouped einsums materialising [B, H, T, S] float32 scores and probabilities",
    "xla": "jax.nn.dot_product_attention(implementation='xla')",
    "cudnn": "jax.nn.dot_product_attention(implementation='cudnn'): cuDNN flash attention, GPU with bf16/fp16 only",
    "splash": "the Pallas TPU splash-attention kernel, per device on its heads of a tensor-split mesh (interpreted "
              "when the target is not a TPU; sequence length a multiple of 128)",
}


# `ModelConfig.dtype` / `param_dtype` values. ``auto``: compute in bfloat16 on a TPU, float32 elsewhere; store
# weights in float32, except a frozen teacher's, stored in its compute dtype (`ModelConfig.frozen`).
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _auto_compute(platform: str) -> str:
  """``dtype="auto"`` on ``platform``: bfloat16 on a TPU (its matrix units' native input), float32 elsewhere."""
  return "bfloat16" if platform == "tpu" else "float32"


# `ModelConfig.layer_types` values (Hugging Face's names): what a layer's attention sees.
LAYER_TYPES = {
    "full_attention": "every earlier token (global)",
    "sliding_attention": "the last sliding_window tokens, itself included (local)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama-3 rotary frequency scaling (Hugging Face ``rope_scaling`` with ``rope_type="llama3"``).

  Wavelengths longer than ``original_max_len / low_freq_factor`` are stretched by ``factor``,
  those shorter than ``original_max_len / high_freq_factor`` kept, the band between blended.
  """

  factor: float = 8.0
  kind: str = "llama3"  # "llama3", or "linear": every frequency divided by ``factor`` (Gemma 3's global layers)
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192

  def __post_init__(self):
    if self.kind not in ("llama3", "linear"):
      raise ValueError(f"RopeScaling.kind={self.kind!r}; choose 'llama3' or 'linear'")
    if self.kind == "linear" and self.factor <= 0:
      raise ValueError(f"RopeScaling(kind='linear', factor={self.factor}) needs factor > 0")
    bad = not self.high_freq_factor > self.low_freq_factor > 0 or self.factor <= 0 or self.original_max_len < 1
    if self.kind == "llama3" and bad:
      raise ValueError(
          f"RopeScaling{dataclasses.astuple(self)} needs factor > 0, high_freq_factor > low_freq_factor > 0 "
          "and original_max_len >= 1 (e.g. Llama 3.1: factor=8, low_freq_factor=1, high_freq_factor=4, "
          "original_max_len=8192)"
      )

  def apply(self, inv_freq: jax.Array) -> jax.Array:
    """Scaled inverse frequencies ``[K/2]`` from the plain ones."""
    if self.kind == "linear":
      return inv_freq / self.factor
    wavelen = 2 * jnp.pi / inv_freq
    low_wavelen = self.original_max_len / self.low_freq_factor
    high_wavelen = self.original_max_len / self.high_freq_factor
    smooth = (self.original_max_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
    blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
    out = jnp.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
    return jnp.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), blended, out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Sizes of a decoder. Head dimension is ``d_model // n_heads`` unless given.

  ``scan_layers``: the blocks' weights are stacked along a leading layer axis (``blocks/attn/q/kernel``
  is ``[L, D, H*Hd]``, the layer axis never split) and the forward pass runs them under ``nnx.scan``,
  so the compiled program holds ONE block body however deep the model is (compile time stops growing
  with ``n_layers``); ``remat`` applies per scanned block. Layers that attend differently (``layer_types``: Gemma 2
  / 3's local and global layers) keep the same stacked weights and are scanned in groups of `scan_period`
  consecutive layers, one body of that many blocks, the ``n_layers % scan_period`` last layers after the loop.
  Values, gradients and captures equal the unrolled model's for the same weights; `meshdistill.models.stacking`
  converts between the two layouts (``to_scanned`` / ``to_unrolled``, ``stack_layers`` / ``unstack_layers``).
  ``auto`` (the default) is decided where a model is built (`scanned_on`, `with_scan`): stacked on an accelerator
  (a TPU or GPU step compiles one block instead of every layer: 20 s against 81 s for the headline pair's step on a
  v5e, at the same tokens/s) whose mesh does not split the weights over ``tensor``, per layer on a CPU, and per layer
  wherever stacking does not apply (MoE blocks mixing dense and expert layers). A built `Decoder`'s own config always
  says ``true`` or ``false``.
  """

  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int | None = None
  mlp_hidden: int = 512
  max_len: int = 512
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  dtype: str = "auto"  # compute dtype of activations (weights are cast to it where used); auto: see DTYPES
  param_dtype: str = "auto"  # dtype the weights are stored in: bfloat16 / float16 halve a frozen teacher's memory
  remat: str = "auto"  # per-block rematerialisation policy, a key of REMAT_POLICIES; auto: chosen by memory (below)
  qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3)
  qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
  rope_scaling: RopeScaling | None = None  # Llama-3 frequency scaling (a dict of its fields also works)
  attention: str = "auto"  # attention kernel, a key of ATTENTION (explicit scores whenever probabilities are captured)
  scan_layers: bool | str = "auto"  # blocks stacked [L, ...] under nnx.scan (one compiled block); auto: on accelerators
  # Block options of the Mistral and Gemma families (`meshdistill.models._variants`), all off for Llama:
  sliding_window: int | None = None  # a sliding layer's query sees itself and the sliding_window - 1 tokens before
  layer_types: tuple[str, ...] | None = None  # per layer, a key of LAYER_TYPES; None: all sliding if sliding_window
  rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3; they then take no rope_scaling)
  geglu: bool = False  # MLP gate through tanh-approximated GELU instead of SiLU (Gemma)
  norm_offset: bool = False  # RMSNorm scales stored as w, applied as 1 + w in float32 (Gemma)
  embed_scale: bool = False  # embeddings times sqrt(d_model), rounded to the compute dtype (Gemma)
  post_norms: bool = False  # RMSNorm on the attention and MLP outputs before each residual add (Gemma 2 / 3)
  query_scale: float | None = None  # score scale (Gemma: query_pre_attn_scalar ** -0.5); default head_dim ** -0.5
  attn_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
  final_softcap: float | None = None  # logits -> cap * tanh(logits / cap), elementwise, per vocabulary shard (Gemma 2)
  moe: MoeConfig | None = None  # mixture-of-experts blocks (`meshdistill.models.moe`; a dict of its fields also works)
  # Set by `for_tensor` (init_model / load_hf / shard_model on a mesh), rarely by hand:
  vocab_multiple: int = 1  # embedding / head rows padded to a multiple of this; logits still cover vocab_size
  replicate_kv: bool = False  # k/v projections replicated over `tensor` (fewer key/value heads than `tensor`)

  def __post_init__(self):
    if isinstance(self.layer_types, list):
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    if isinstance(self.moe, dict):
      object.__setattr__(self, "moe", MoeConfig(**self.moe))
    sizes = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden", "max_len", "vocab_multiple")
    for name in sizes:
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"ModelConfig.{name}={v!r} must be a positive integer")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
          "(grouped-query attention shares each key/value head among n_heads/n_kv_heads query heads)"
      )
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
          f"ModelConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
          "set head_dim explicitly or choose d_model as a multiple of n_heads"
      )
    if self.head_dim is not None and self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (rotary embedding)")
    if self.dtype not in DTYPES:
      raise ValueError(f"ModelConfig.dtype={self.dtype!r}; choose one of {DTYPES}")
    if self.param_dtype not in DTYPES:
      raise ValueError(f"ModelConfig.param_dtype={self.param_dtype!r}; choose one of {DTYPES} (the dtype the "
                       "weights are stored in; bfloat16 halves a frozen teacher's memory)")
    if self.attention not in ATTENTION:
      raise ValueError(f"ModelConfig.attention={self.attention!r}; choose one of {tuple(ATTENTION)}")
    if not isinstance(self.scan_layers, bool) and self.scan_layers != "auto":
      raise ValueError(f"ModelConfig.scan_layers={self.scan_layers!r} must be true, false or auto (stacked on an "
                       "accelerator, per layer on a CPU)")
    if self.remat not in REMAT_POLICIES and self.remat != "auto":
      raise ValueError(f"ModelConfig.remat={self.remat!r}; choose auto or one of {tuple(REMAT_POLICIES)}")
    if self.scan_layers is True and not self._stackable():
      raise ValueError(
          f"ModelConfig.scan_layers=true stacks identical blocks, but moe.dense_layers={list(self.moe.dense_layers)} "
          f"mixes dense and expert layers among n_layers={self.n_layers}; set scan_layers=false for this model"
      )
    self._check_layer_options()

  def _stackable(self) -> bool:
    """Whether the blocks can be stacked: all alike (an MoE model mixing dense and expert layers is not)."""
    return self.moe is None or len({self.moe.sparse(i) for i in range(self.n_layers)}) == 1

  def scanned_on(self, platform: str, tensor: int = 1) -> bool:
    """Whether a model of this config built for ``platform``, its weights split ``tensor`` ways, stacks its blocks:
    ``scan_layers``, where ``auto`` is true on an accelerator (``tpu``, ``gpu``) with no ``tensor`` split, when the
    blocks can be stacked; false on a CPU (whose tests and main job compile small models unrolled) and where
    ``tensor`` splits the weights: compiled for v5e at mesh 1x4, a scanned pair's step all-gathers its activations in
    every layer (a 4-layer pair: 135 all-gathers, 2.5 times the collective bytes of the unrolled step, which has none;
    `tests/test_moe.py` counts none in the default MoE pair's step)."""
    if isinstance(self.scan_layers, bool):
      return self.scan_layers
    return platform != "cpu" and tensor == 1 and self._stackable()

  @property
  def scanned(self) -> bool:
    """`scanned_on` the target platform and ``tensor`` axis in context (`meshdistill.parallel.mesh.target_platform`,
    `compiler_tensor_size`)."""
    return self.scanned_on(target_platform(), compiler_tensor_size())

  def with_scan(self, platform: str | None = None, tensor: int | None = None) -> "ModelConfig":
    """This config with ``scan_layers="auto"`` decided for ``platform`` and a ``tensor`` split (defaults: those in
    context), as a model built there lays out its blocks (`scanned_on`)."""
    if isinstance(self.scan_layers, bool):
      return self
    platform = target_platform() if platform is None else platform
    return self.replace(scan_layers=self.scanned_on(platform, compiler_tensor_size() if tensor is None else tensor))

  def with_scan_on(self, mesh) -> "ModelConfig":
    """`with_scan` for the devices of ``mesh`` (None: one device of the default backend): their platform and the
    ``tensor`` split of its weights."""
    return self.with_scan(platform_of(mesh), split_ways(mesh, "heads"))

  def _check_layer_options(self) -> None:
    w = self.sliding_window
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
      raise ValueError(f"ModelConfig.sliding_window={w!r} must be a positive integer or None (no window)")
    for name in ("query_scale", "attn_softcap", "final_softcap", "rope_local_theta"):
      v = getattr(self, name)
      if v is not None and not (isinstance(v, (int, float)) and v > 0):
        raise ValueError(f"ModelConfig.{name}={v!r} must be a positive number or None (off)")
    types = self.layer_types
    if types is None:
      return
    if len(types) != self.n_layers or any(t not in LAYER_TYPES for t in types):
      raise ValueError(f"ModelConfig.layer_types={list(types)!r} must name one of {list(LAYER_TYPES)} for each of the "
                       f"n_layers={self.n_layers} layers")
    if "sliding_attention" in types and w is None:
      raise ValueError("ModelConfig.layer_types has sliding_attention layers but sliding_window=None; set the window")

  def layer_attention(self, layer: int) -> tuple[int | None, float, RopeScaling | None]:
    """``(window or None, RoPE base, RoPE scaling or None)`` of block ``layer``."""
    types = self.layer_types
    sliding = self.sliding_window is not None and (types is None or types[layer] == "sliding_attention")
    if not sliding:
      return None, self.rope_theta, self.rope_scaling
    if self.rope_local_theta is not None:
      return self.sliding_window, self.rope_local_theta, None
    return self.sliding_window, self.rope_theta, self.rope_scaling

  @property
  def scan_period(self) -> int:
    """Layers per scanned group: the least ``p`` such that every layer attends as layer ``i % p`` does (its window,
    RoPE base and scaling; `layer_attention`). 1 for a model whose layers all attend alike (Llama); 2 for Gemma 2's
    alternating local / global layers; 6 for Gemma 3's five local then one global."""
    kinds = [self.layer_attention(i) for i in range(self.n_layers)]
    return next(p for p in range(1, self.n_layers + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))

  def with_layers(self, layers) -> "ModelConfig":
    """This config for a model of the blocks ``layers`` (indices into this one's), their layer types kept."""
    types = None if self.layer_types is None else tuple(self.layer_types[i] for i in layers)
    return self.replace(n_layers=len(layers), layer_types=types)

  @property
  def hd(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def compute_dtype(self):
    """The dtype activations are computed in: ``dtype``, where ``auto`` is bfloat16 when the target is a TPU
    (`meshdistill.parallel.mesh.target_platform`: the mesh in context, else the default backend) and float32
    elsewhere."""
    return jnp.dtype(_auto_compute(target_platform()) if self.dtype == "auto" else self.dtype)

  @property
  def weight_dtype(self):
    """The dtype the weights are stored in: ``param_dtype``, where ``auto`` is float32 (the weights of a model that
    trains; a frozen teacher's ``auto`` is its compute dtype: `frozen`)."""
    return jnp.dtype("float32" if self.param_dtype == "auto" else self.param_dtype)

  def frozen(self, platform: str | None = None) -> "ModelConfig":
    """This config for a frozen model (a teacher): ``param_dtype="auto"`` becomes the compute dtype on ``platform``
    (default: `target_platform`), so a teacher computing in bfloat16 is stored in bfloat16 (it gains nothing
    from float32 storage: its weights are cast to bfloat16 where they are used). A ``param_dtype`` given stays."""
    if self.param_dtype != "auto":
      return self
    platform = target_platform() if platform is None else platform
    return self.replace(param_dtype=_auto_compute(platform) if self.dtype == "auto" else self.dtype)

  def for_platform(self, platform: str) -> "ModelConfig":
    """This config with ``dtype="auto"`` made concrete for ``platform`` (what `compute_dtype` gives there): for a
    program compiled for another platform than this process's (the planner). ``scan_layers="auto"`` stays: it is
    decided where the model is built on a mesh (`with_scan`: the platform and the ``tensor`` split)."""
    return self.replace(dtype=_auto_compute(platform)) if self.dtype == "auto" else self

  def kernel(self, T: int, *, probs: bool = False, decoding: bool = False, platform: str | None = None,
             tensor: int | None = None) -> str:
    """The attention kernel a layer runs on ``T`` query tokens: ``explicit`` when probabilities are captured;
    ``auto`` is ``splash`` where the kernel applies (``platform`` -- default `target_platform` -- is a TPU,
    ``T`` a multiple of 128, the compiler-managed ``tensor`` axis -- default the mesh in context's -- divides
    ``n_heads``, not ``decoding``), else ``xla``; ``splash`` decoding a few queries against a cache is ``xla``
    (nothing for a flash kernel to save); ``xla`` / ``cudnn`` with a soft-capped score (Gemma 2) is ``explicit``
    (`jax.nn.dot_product_attention` has no soft-cap)."""
    if probs:
      return "explicit"
    kind = self.attention
    if kind == "auto":
      platform = target_platform() if platform is None else platform
      tensor = compiler_tensor_size() if tensor is None else tensor
      fits = platform == "tpu" and T % 128 == 0 and self.n_heads % tensor == 0
      kind = "splash" if fits and not decoding else "xla"
    if kind == "splash" and decoding:
      kind = "xla"
    if self.attn_softcap is not None and kind in ("xla", "cudnn"):
      kind = "explicit"
    return kind

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @property
  def padded_vocab(self) -> int:
    """Rows of the embedding (and columns of an untied head): ``vocab_size`` rounded up to ``vocab_multiple``."""
    return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

  def for_tensor(self, tensor: int) -> "ModelConfig":
    """This config adjusted to a mesh whose ``tensor`` axis has ``tensor`` devices.

    Uneven splits are handled where that is exact:

    * a vocabulary that ``tensor`` does not divide (GPT-2's 50257) is padded to a multiple of
      ``tensor`` (``vocab_multiple``); the padded rows start at zero and the decoder cuts them
      off its logits and ``head_weight()``, so no loss, metric or sampler ever sees them, and
      `export_hf` drops them;
    * fewer (or a non-dividing count of) key/value heads than ``tensor``: the k/v projections are
      replicated over ``tensor`` (``replicate_kv``), as serving stacks replicate key/value heads;
    * a query head count that ``tensor`` does not divide works when ``n_heads * head_dim`` is
      divisible: the split then falls inside heads and the compiler adds the communication
      (correct, slower; prefer ``tensor`` dividing ``n_heads``). Otherwise, and for ``mlp_hidden``,
      a ValueError names the setting.
    """
    if not isinstance(tensor, int) or tensor < 1:
      raise ValueError(f"mesh tensor={tensor!r} must be a positive integer")
    self.check_tensor_split(tensor)
    cfg = self
    if cfg.padded_vocab % tensor:
      cfg = cfg.replace(vocab_multiple=math.lcm(cfg.vocab_multiple, tensor))
    if cfg.n_kv_heads % tensor and not cfg.replicate_kv:
      cfg = cfg.replace(replicate_kv=True)
    return cfg

  def check_tensor_split(self, tensor: int) -> None:
    """Raises when a ``tensor``-split dimension that cannot be padded or replicated is not divisible (with
    ``attention='splash'`` the query heads too: each device runs the kernel on its own heads)."""
    dims = {"n_heads * head_dim": self.n_heads * self.hd, "mlp_hidden": self.mlp_hidden}
    if self.moe is not None:
      dims["moe.expert_hidden"] = self.moe.expert_hidden
    bad = {k: v for k, v in dims.items() if v % tensor}
    if bad:
      desc = ", ".join(f"{k}={v}" for k, v in bad.items())
      raise ValueError(
          f"mesh tensor={tensor} does not divide {desc} (n_heads={self.n_heads}, head_dim={self.hd}); these weight "
          f"dimensions are split over the tensor axis: choose sizes that are multiples of {tensor} or a smaller "
          "tensor axis (vocabularies are padded and key/value heads replicated automatically)"
      )
    if self.attention == "splash" and self.n_heads % tensor:
      raise ValueError(
          f"attention='splash' runs each device's query heads on their own (the Pallas kernel is not split by "
          f"the compiler), but mesh tensor={tensor} does not divide n_heads={self.n_heads}; use a tensor axis "
          f"dividing {self.n_heads} or attention='xla'"
      )
