"""Published pretraining measurements on TPU pods: the rows the planner's step-time model is fitted on.

Each `Published` row is one MaxText measurement as its page states it: the model (a planner preset or a config.json
here), the slice, sequence length, global batch (per-device batch x chips), MaxText's remat policy and tensor
parallelism, the published tokens/s per chip and MFU, and the page and configuration file it comes from (commit
pinned). `meshdistill.planner._calibrate` holds the model fitted on them; ``benchmarks/plan_calibration.py`` compiles
the plain training step of each row and fits.

MaxText's synthetic models (``MaxText/configs/v5e/*.sh``, ``v5p/*.sh``: ``global_parameter_scale`` over base.yml's
default model) are given in the base shape of December 2023, when both READMEs' tables were written (commit
76bd53b0f, "Refactor MaxText/configs/ and documentation"; the tables never changed after): base embedding 2560, 8
heads of 256, an ungated ReLU MLP of 8192, 16 layers, vocabulary 32,768, the head tied to the embedding. base.yml
changed to a Llama-like shape (2048, 16 x 128, SwiGLU 7168, vocabulary 32,000) only in February 2024 (3b2ac8113,
"Modify default config for good convergence"). The READMEs publish TFLOP/s per chip and MFU, not tokens/s: the
tokens/s per chip here are ``MFU x peak / (6 N + 6 L H hd T)``, MaxText's training FLOPs per token of that time
(``train.py``'s ``calculate_training_tflops``: 6 x all parameters + causal attention), `maxtext_2023_flops_per_token`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshdistill.core.chips import TPU_CHIPS

MAXTEXT = "https://github.com/AI-Hypercomputer/maxtext/blob"
RECIPES = "https://github.com/AI-Hypercomputer/tpu-recipes/blob"
TIERING = f"{MAXTEXT}/66266787a6ca847790a3b36f90d8e5338af656f5/docs/reference/models/tiering.md"
# the commit that wrote both READMEs' tables, and the configurations and base shape of that commit
CONFIGS = f"{MAXTEXT}/76bd53b0f44caf989c88189afadeb1062f9254f0/MaxText/configs"
BASE_YML = f"{CONFIGS}/base.yml"

# peak bf16 FLOP/s per chip of the generations measured here: the chip table's (`meshdistill.core.chips.TPU_CHIPS`)
PEAK_FLOPS = {g: TPU_CHIPS[g].peak_bf16_flops for g in ("v5e", "v5p", "v6e")}

# Llama-2-70b-hf's config.json (the shape fields); MaxText's llama2-70b model_type is this shape
LLAMA2_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}

# MaxText's mistral-7b (MaxText/configs/models/mistral-7b.yml at tpu-recipes-v0.1.2: Mistral 7B's shape, vocabulary
# 32,000, no sliding window, rope 1e6)
MISTRAL_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "tie_word_embeddings": False}


def maxtext_2023_shape(scale: int) -> dict[str, int]:
  """MaxText's default model at ``global_parameter_scale`` ``scale`` (December 2023): pyconfig's
  ``get_individual_scales`` doubles heads and MLP, then embedding, then layers, in turn (log2 scale = 3 b + r: heads
  and MLP x 2^(b + (r > 0)), embedding x 2^(b + (r > 1)), layers x 2^b) over base 2560 / 8 heads / 8192 / 16."""
  if scale < 1 or scale & (scale - 1):
    raise ValueError(f"global_parameter_scale={scale}: MaxText takes a power of 2")
  b, r = divmod(scale.bit_length() - 1, 3)
  return {"emb": 2560 * 2 ** (b + (r > 1)), "heads": 8 * 2 ** (b + (r > 0)), "head_dim": 256,
          "mlp": 8192 * 2 ** (b + (r > 0)), "layers": 16 * 2 ** b, "vocab": 32768}


def maxtext_2023_params(scale: int) -> int:
  """All parameters of `maxtext_2023_shape` (MaxText's ``calculate_num_params_from_pytree``): q, k, v, out (heads x
  256 each), the ungated MLP's two matrices, two norms per layer, the tied embedding and the final norm."""
  s = maxtext_2023_shape(scale)
  qkvo = 4 * s["emb"] * s["heads"] * s["head_dim"]
  layer = qkvo + 2 * s["emb"] * s["mlp"] + 2 * s["emb"]
  return s["layers"] * layer + s["vocab"] * s["emb"] + s["emb"]


def maxtext_2023_flops_per_token(scale: int, seq: int) -> float:
  """MaxText's training FLOPs per token then: ``6 N + 6 L H hd T`` (its 12 L H hd T non-causal attention halved)."""
  s = maxtext_2023_shape(scale)
  return 6.0 * maxtext_2023_params(scale) + 6.0 * s["layers"] * s["heads"] * s["head_dim"] * seq


def maxtext_2023_config(scale: int) -> dict[str, Any]:
  """`maxtext_2023_shape` as a config.json the planner builds. The decoder's MLP is SwiGLU: the ungated ReLU MLP of
  hidden m is given as SwiGLU of hidden 2m/3 rounded to a multiple of 128 (three matrices of 2m/3 hold the two of m's
  parameters and matmul FLOPs, within 0.2%); the head tied to the embedding, as ``logits_via_embedding: True``."""
  s = maxtext_2023_shape(scale)
  mlp = round(2 * s["mlp"] / 3 / 128) * 128
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": s["vocab"],
          "hidden_size": s["emb"], "intermediate_size": mlp, "num_hidden_layers": s["layers"],
          "num_attention_heads": s["heads"], "num_key_value_heads": s["heads"], "head_dim": s["head_dim"],
          "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": True}


MODELS: dict[str, dict[str, Any]] = {
    "llama2-70b": LLAMA2_70B, "maxtext-mistral-7b": MISTRAL_7B,
    **{f"maxtext-{s}b": maxtext_2023_config(s) for s in (16, 32, 64, 128)},
}  # models of the rows that are not planner presets, as config.json


@dataclasses.dataclass(frozen=True)
class Published:
  """One published measurement: plain pretraining of ``model`` on ``topology``, weights split over every chip
  (FSDP) and, where ``tensor`` > 1, MaxText's tensor parallelism over ``tensor`` chips, as stated."""

  name: str
  model: str  # a planner preset, or a key of `MODELS`
  topology: str  # libtpu's name of the slice
  chips: int
  seq: int
  batch: int  # global: per_device_batch_size x chips
  remat: str  # MaxText's remat_policy in the recipe
  tokens_per_chip: float  # tokens / s / chip
  mfu: float  # as published (MaxText's FLOPs count)
  source: str  # the page the numbers are from and the file the configuration is from (commit pinned)
  tensor: int = 1  # MaxText's ici_tensor_parallelism

  def __post_init__(self):
    if self.generation not in PEAK_FLOPS:
      raise ValueError(f"Published {self.name!r}: topology={self.topology!r} is not one of "
                       f"{sorted(PEAK_FLOPS)} (generation:shape)")
    if self.batch % self.chips or self.chips % self.tensor:
      raise ValueError(f"Published {self.name!r}: batch={self.batch}, chips={self.chips}, tensor={self.tensor}: "
                       "the batch must split evenly over the chips and the chips over tensor")

  @property
  def generation(self) -> str:
    """The TPU generation, e.g. ``v5e``: the step-time model's fraction of peak is fitted per generation."""
    return self.topology.split(":")[0]

  @property
  def step_seconds(self) -> float:
    return self.batch * self.seq / (self.tokens_per_chip * self.chips)


def _synthetic(scale: int, generation: str, mfu: float, seq: int = 2048) -> float:
  """Tokens/s/chip of a README row of MaxText's synthetic model: MFU x peak over MaxText's FLOPs per token."""
  return mfu * PEAK_FLOPS[generation] / maxtext_2023_flops_per_token(scale, seq)



def _readme_row(scale: int, generation: str, table: str, mfu: str, config: str) -> str:
  return (f"{CONFIGS}/{generation}/README.md ({table}: {mfu} MFU; tokens/s/chip = MFU x peak / (6 N + 6 L H hd T), N = "
          f"{maxtext_2023_params(scale):,}, `maxtext_2023_flops_per_token`); {CONFIGS}/{generation}/{config} "
          f"(global_parameter_scale {scale}); {BASE_YML} (the base shape)")


_LLAMA31_8B_V6E = ("llama3_1_8b_8192_no_collective_matmul: per_device_batch_size 3, max_target_length 8192, remat "
                   "custom with decoder input and q/k/v/out projections offloaded")

PUBLISHED: tuple[Published, ...] = (
    Published("Llama 3.1 8B", "llama3.1-8b", "v6e:16x16", 256, 8192, 4 * 256, "custom (decoder input, q/k/v/out "
              "projections offloaded to host)", 7207.336, 0.4546,
              f"{TIERING} (Trillium gold); {RECIPES}/a9e09290174425595a0ef6ec5f765d5f04360423/training/trillium/"
              "Llama3.1-8B-MaxText/v6e-256/README.md (llama3_1_8b_8192: per_device_batch_size 4, log line "
              "4.546 s/step)"),
    Published("Llama 3.1 70B", "llama3.1-70b", "v6e:16x16", 256, 8192, 5 * 256, "custom (decoder input, q/k/v "
              "projections offloaded to host)", 960.0, 0.5033,
              f"{TIERING} (Trillium gold); {MAXTEXT}/92e59fdf547421f647590087f50fea5729da42d8/benchmarks/"
              "maxtext_trillium_model_configs.py#L959 (llama3_1-70b-8192: per_device_batch_size 5)"),
    Published("Llama 2 70B", "llama2-70b", "v6e:16x16", 256, 4096, 3 * 256, "qkv_proj_offloaded", 905.021, 0.438,
              f"{TIERING} (Trillium gold, 900 tokens/s); {RECIPES}/9e458c71883a862cb3ba0cd466a223b8a9cba426/"
              "training/trillium/Llama2-70B-MaxText/README.md (llama2_70b_4096_sc: per_device_batch_size 3, log "
              "line 9.052 s/step, 905.021 tokens/s/device; its total_weights 2,097,152 = 512 x 4096 says the "
              "logged run had 2 rows per chip: the stated 3 are planned, compared at the published tokens/s/chip)"),
    Published("Llama 2 70B", "llama2-70b", "v5p:8x8x8", 512, 4096, 4 * 512, "save_dot_except_mlpwi", 692.0, 0.654,
              f"{TIERING} (v5p gold, 512 chips); {MAXTEXT}/92e59fdf547421f647590087f50fea5729da42d8/benchmarks/"
              "maxtext_v5p_model_configs.py#L156 (llama2_70b_v5p_128: per_device_batch_size 4)"),
    Published("MaxText 16B (2023)", "maxtext-16b", "v5e:16x16", 256, 2048, 6 * 256, "full",
              _synthetic(16, "v5e", 0.6110), 0.6110,
              _readme_row(16, "v5e", "1x v5e-256: 120 TFLOP/s/chip", "61.10%", "16b.sh")
              + " (per_device_batch_size 6, remat_policy full, max_target_length 2048)"),
    Published("MaxText 32B (2023)", "maxtext-32b", "v5e:16x16", 256, 2048, 4 * 256, "full",
              _synthetic(32, "v5e", 0.6686), 0.6686,
              _readme_row(32, "v5e", "1x v5e-256: 132 TFLOP/s/chip", "66.86%", "32b.sh")
              + " (per_device_batch_size 4, remat_policy full)"),
    Published("MaxText 64B (2023)", "maxtext-64b", "v5e:16x16", 256, 2048, 2 * 256, "full",
              _synthetic(64, "v5e", 0.5990), 0.5990,
              _readme_row(64, "v5e", "1x v5e-256: 118 TFLOP/s/chip", "59.90%", "64b.sh")
              + " (per_device_batch_size 2, remat_policy full)"),
    Published("MaxText 128B (2023)", "maxtext-128b", "v5e:16x16", 256, 2048, 1 * 256, "full",
              _synthetic(128, "v5e", 0.5606), 0.5606,
              _readme_row(128, "v5e", "1x v5e-256: 110 TFLOP/s/chip", "56.06%", "128b.sh")
              + " (per_device_batch_size 1, remat_policy full, ici_fsdp_parallelism 16, ici_tensor_parallelism 16)",
              tensor=16),
    Published("MaxText 32B (2023)", "maxtext-32b", "v5p:4x4x4", 64, 2048, 8 * 64, "minimal",
              _synthetic(32, "v5p", 0.7147), 0.7147,
              _readme_row(32, "v5p", "1x v5p-128 (64 chips): 328 TFLOP/s/chip", "71.47%", "32b.sh")
              + " (per_device_batch_size 8, remat_policy minimal, ici_tensor_parallelism 4)", tensor=4),
    Published("MaxText 64B (2023)", "maxtext-64b", "v5p:4x4x4", 64, 2048, 4 * 64, "minimal",
              _synthetic(64, "v5p", 0.7031), 0.7031,
              _readme_row(64, "v5p", "1x v5p-128 (64 chips): 323 TFLOP/s/chip", "70.31%", "64b.sh")
              + " (per_device_batch_size 4, remat_policy minimal, ici_tensor_parallelism 4)", tensor=4),
    Published("MaxText 128B (2023)", "maxtext-128b", "v5p:4x4x8", 128, 2048, 2 * 128, "minimal",
              _synthetic(128, "v5p", 0.6868), 0.6868,
              _readme_row(128, "v5p", "1x v5p-256 (128 chips): 315 TFLOP/s/chip", "68.68%", "128b.sh")
              + " (per_device_batch_size 2, remat_policy minimal, ici_tensor_parallelism 8)", tensor=8),
    Published("Llama 3.1 8B", "llama3.1-8b", "v6e:2x4", 8, 8192, 3 * 8, "custom (decoder input, q/k/v/out "
              "projections offloaded to host)", 7138.890, 413.433e12 / PEAK_FLOPS["v6e"],
              f"{RECIPES}/10ca5b92b479825ce36305c06e05aefdcb90541f/training/trillium/Llama3.1-8B-MaxText/v6e-8/"
              f"README.md ({_LLAMA31_8B_V6E}; log line 3.443 s/step, 413.433 TFLOP/s/device, 7,138.890 "
              "tokens/s/device, total_weights 196,608 = 8 x 3 x 8192)"),
    Published("Llama 3.1 8B", "llama3.1-8b", "v6e:4x4", 16, 8192, 3 * 16, "custom (decoder input, q/k/v/out "
              "projections offloaded to host)", 7243.378, 419.485e12 / PEAK_FLOPS["v6e"],
              f"{RECIPES}/43e52ff572cdb3c71be1c4bae4494aa64f12f5b7/training/trillium/Llama3.1-8B-MaxText/v6e-16/"
              f"README.md ({_LLAMA31_8B_V6E}; log line 3.393 s/step, 419.485 TFLOP/s/device, 7,243.378 "
              "tokens/s/device, total_weights 393,216 = 16 x 3 x 8192)"),
    Published("Mistral 7B", "maxtext-mistral-7b", "v6e:2x4", 8, 8192, 6 * 8, "custom (decoder input, q/k/v/out "
              "projections offloaded to host)", 7776.813, 431.981e12 / PEAK_FLOPS["v6e"],
              f"{RECIPES}/7f2f5e62e140401c1c2acf56dbc21cecf80512bd/training/trillium/Mistral-7B-MaxText/README.md "
              "(mistral_7b at MaxText tpu-recipes-v0.1.2: per_device_batch_size 6, max_target_length 8192, remat "
              "custom with decoder input and q/k/v/out projections offloaded; log line 6.320 s/step, 431.981 "
              "TFLOP/s/device, 7,776.813 tokens/s/device, total_weights 393,216 = 8 x 6 x 8192); "
              f"{MAXTEXT}/14b5876ea857c09cc3d8645385f984689376a331/MaxText/configs/models/mistral-7b.yml (the shape)"),
)


__all__ = ["LLAMA2_70B", "MISTRAL_7B", "MODELS", "PEAK_FLOPS", "PUBLISHED", "Published", "maxtext_2023_config",
           "maxtext_2023_flops_per_token", "maxtext_2023_params", "maxtext_2023_shape"]
