"""The roofline held against published pod measurements: a step-time model with two fitted parameters.

The roofline (`Planner._roofline`) takes the step as ``max(compute, hbm) + collectives`` at the chip's peak matmul
rate and full link bandwidth. Measured steps are slower. `PUBLISHED` holds MaxText's published pretraining
measurements on TPU pods (model, slice, sequence, global batch and remat as its recipes state them); the planner
compiles the same plain training step (the teacher-less `Distiller` with `NextTokenCE`, weights and moments split
over every chip as MaxText's FSDP does) and takes its roofline terms. The calibrated step is

    step = max(compute / a, hbm) + k * collectives

``a``: the fraction of peak the step's matmuls reach; ``k``: the collectives' cost per second of ideal ring traffic
(``(1 - overlap) / link efficiency``: 0 when fully hidden behind compute). Both are fitted by least squares on the
log of the measured / estimated step time (`fit`), checked by leaving each row out (`leave_one_out`); with only
two rows ``k`` is held at 1 (no overlap) and ``a`` alone fitted, so a row can still be left out. `CALIBRATION`
holds the fit over every row, with its leave-one-out errors as the band the planner prints beside the estimate;
``benchmarks/plan_calibration.py`` recomputes the rows and the fit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from scipy.optimize import least_squares

MAXTEXT = "https://github.com/AI-Hypercomputer/maxtext/blob"
RECIPES = "https://github.com/AI-Hypercomputer/tpu-recipes/blob"
TIERING = f"{MAXTEXT}/66266787a6ca847790a3b36f90d8e5338af656f5/docs/reference/models/tiering.md"

# Llama-2-70b-hf's config.json (the shape fields); MaxText's llama2-70b model_type is this shape
LLAMA2_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}

# MaxText's synthetic 16B model (MaxText/configs/v5e/16b.sh: global_parameter_scale=16 over base.yml's base_emb_dim
# 2048, base_num_query_heads = base_num_kv_heads = 16, base_mlp_dim 7168, base_num_decoder_layers 16, head_dim 128:
# embedding x2, heads and MLP x4, layers x2), vocabulary 32,000, untied, as a config.json
MAXTEXT_16B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
               "intermediate_size": 28672, "num_hidden_layers": 32, "num_attention_heads": 64,
               "num_key_value_heads": 64, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 2048,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
# global_parameter_scale 32: embedding, heads and MLP x4, layers x2; 64: the same, layers x4
MAXTEXT_32B = {**MAXTEXT_16B, "hidden_size": 8192}
MAXTEXT_64B = {**MAXTEXT_32B, "num_hidden_layers": 64}
MODELS = {"llama2-70b": LLAMA2_70B, "maxtext-16b": MAXTEXT_16B, "maxtext-32b": MAXTEXT_32B,
          "maxtext-64b": MAXTEXT_64B}  # models of the rows that are not planner presets
V5E_README = f"{MAXTEXT}/0ed7bd529b9d690570473c3525d1efeda6b6c944/MaxText/configs/v5e/README.md"


@dataclasses.dataclass(frozen=True)
class Published:
  """One published measurement: plain pretraining of ``model`` on ``topology`` (all chips FSDP), as stated."""

  name: str
  model: str  # a planner preset, or "llama2-70b" (`LLAMA2_70B`)
  topology: str  # libtpu's name of the slice
  chips: int
  seq: int
  batch: int  # global: per_device_batch_size x chips
  remat: str  # MaxText's remat_policy in the recipe
  tokens_per_chip: float  # tokens / s / chip
  mfu: float  # as published (MaxText's FLOPs count)
  source: str  # the page the numbers are from and the file the configuration is from (commit pinned)

  @property
  def step_seconds(self) -> float:
    return self.batch * self.seq / (self.tokens_per_chip * self.chips)


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
    Published("MaxText 16B", "maxtext-16b", "v5e:16x16", 256, 2048, 6 * 256, "full", 1186.67, 0.611,
              f"{V5E_README} (1x v5e-256: 120 "
              "TFLOP/s/chip, 61.10% MFU; tokens/s/chip = 0.611 x 197 TFLOP/s over MaxText's training FLOPs per "
              "token, 6 N + 12 L H hd T with N = 15,831,666,688 (its non-causal attention count; the causal one "
              f"gives 3.3% more)); {MAXTEXT}/07775101f8aa8329d71765c5633d980bf6b3afac/MaxText/configs/v5e/16b.sh "
              "(per_device_batch_size 6, remat_policy full, max_target_length 2048, attention flash); "
              f"{MAXTEXT}/315ebb593a8ef40f4dfff2534238c0beb9402f9d/MaxText/configs/base.yml (the base shape)"),
    Published("MaxText 32B", "maxtext-32b", "v5e:16x16", 256, 2048, 4 * 256, "full", 670.57, 0.6686,
              f"{V5E_README} (1x v5e-256: 132 TFLOP/s/chip, 66.86% MFU; tokens/s/chip as the 16B row's, N = "
              f"31,663,333,376; causal: 1.7% more); {MAXTEXT}/07775101f8aa8329d71765c5633d980bf6b3afac/MaxText/"
              "configs/v5e/32b.sh (global_parameter_scale 32, per_device_batch_size 4, remat_policy full)"),
    Published("MaxText 64B", "maxtext-64b", "v5e:16x16", 256, 2048, 2 * 256, "full", 302.81, 0.599,
              f"{V5E_README} (1x v5e-256: 118 TFLOP/s/chip, 59.90% MFU; tokens/s/chip as the 16B row's, N = "
              f"62,802,370,560; causal: 1.7% more); {MAXTEXT}/0ea0637a218e5c77ec7adc5c90725df35d227b1c/MaxText/"
              "configs/v5e/64b.sh (global_parameter_scale 64, per_device_batch_size 2, remat_policy full)"),
)


@dataclasses.dataclass(frozen=True)
class Calibration:
  """``step = max(compute / a, hbm) + k * collectives`` and the relative error band of its estimates."""

  a: float  # achieved fraction of peak matmul rate
  k: float  # seconds per second of ideal collective time (not hidden behind compute)
  band: float  # leave-one-out: the largest relative error of a row's step time predicted without that row
  rows: int  # published rows fitted

  def step_seconds(self, compute_s: float, hbm_s: float, comm_s: float | None) -> float:
    return max(compute_s / self.a, hbm_s) + self.k * (comm_s or 0.0)

  def of(self, time: dict) -> dict | None:
    """The calibrated figures of a plan's roofline ``time`` (None when it has no step time)."""
    if time.get("step_s") is None:
      return None
    step = self.step_seconds(time["compute_s"], time["hbm_s"], time["comm_s"])
    scale = time["step_s"] / step
    band = None if math.isnan(self.band) else self.band  # no leave-one-out with fewer than 3 rows
    return {"step_s": step, "low_s": None if band is None else step * (1 - band),
            "high_s": None if band is None else step * (1 + band),
            "mfu": time["mfu"] * scale, "tokens_per_s": time["tokens_per_s"] * scale, "band": band}


def _predict(params: np.ndarray, terms: np.ndarray) -> np.ndarray:
  a, k = params
  return np.maximum(terms[:, 0] / a, terms[:, 1]) + k * terms[:, 2]


def fit(terms: Sequence[Sequence[float]], measured: Sequence[float], k: float | None = None) -> tuple[float, float]:
  """Least squares of ``log(predicted / measured)`` over rows of roofline ``(compute_s, hbm_s, comm_s)``:
  ``(a, k)`` with ``0.05 <= a <= 1`` and ``0 <= k <= 10``; a given ``k`` is held and ``a`` alone fitted."""
  terms, measured = np.asarray(terms, float), np.asarray(measured, float)
  need = 1 if k is not None else 2
  if len(terms) < need:
    raise ValueError(f"fit needs at least {need} measured row(s) for its {need} parameter(s), got {len(terms)}")
  if k is not None:
    res = least_squares(lambda p: np.log(_predict(np.array([p[0], k]), terms) / measured), x0=[0.6],
                        bounds=([0.05], [1.0]))
    return float(res.x[0]), float(k)
  res = least_squares(lambda p: np.log(_predict(p, terms) / measured), x0=[0.6, 0.5],
                      bounds=([0.05, 0.0], [1.0, 10.0]))
  return float(res.x[0]), float(res.x[1])


def predict(params: tuple[float, float], terms: Sequence[Sequence[float]]) -> np.ndarray:
  return _predict(np.asarray(params, float), np.asarray(terms, float))


def leave_one_out(terms: Sequence[Sequence[float]], measured: Sequence[float], k: float | None = None) -> list[float]:
  """Each row's step time predicted by the fit over the other rows (``k`` as in `fit`)."""
  terms, measured = np.asarray(terms, float), np.asarray(measured, float)
  out = []
  for i in range(len(terms)):
    keep = np.arange(len(terms)) != i
    out.append(float(predict(fit(terms[keep], measured[keep], k), terms[i:i + 1])[0]))
  return out


# with fewer rows than 3 (two parameters and one left out) ``k`` is held at 1: collectives not hidden at all
HELD_K = 1.0


def calibrate(terms: Sequence[Sequence[float]], measured: Sequence[float]) -> Calibration:
  """The fit over every row, its band the largest leave-one-out relative error; with 2 rows ``a`` alone is fitted
  (``k = HELD_K``) so that one row can still be left out."""
  k = None if len(terms) >= 3 else HELD_K
  a, k = fit(terms, measured, k)
  loo = leave_one_out(terms, measured, None if len(terms) >= 3 else HELD_K) if len(terms) >= 2 else []
  band = max((abs(p / m - 1) for p, m in zip(loo, measured)), default=math.nan)
  return Calibration(a=a, k=k, band=band, rows=len(terms))


# the fit over every `PUBLISHED` row (benchmarks/results/plan_calibration.md; tests/test_plan_cost.py refits it)
CALIBRATION: Calibration | None = Calibration(a=0.658556, k=0.000000, band=0.463442, rows=5)


__all__ = ["CALIBRATION", "Calibration", "LLAMA2_70B", "MAXTEXT_16B", "MAXTEXT_32B", "MAXTEXT_64B",
           "MODELS", "PUBLISHED", "Published", "calibrate", "fit",
           "HELD_K", "leave_one_out", "predict"]
