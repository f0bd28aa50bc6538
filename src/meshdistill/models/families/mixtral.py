"""Mixtral (``MixtralForCausalLM``): the plain Llama block with routed experts in every layer
(`meshdistill.models.moe`): softmax router, ``num_experts_per_tok`` of ``num_local_experts`` experts of
``intermediate_size`` hidden units, top-k weights always renormalised; the checkpoint names the block
``block_sparse_moe`` and the expert projections ``w1`` (gate), ``w3`` (up), ``w2`` (down). The router's
training-time ``router_jitter_noise`` is not applied. The planner's Mixtral-8x7B preset."""

from __future__ import annotations

from typing import Any

from meshdistill.models._config import ModelConfig
from meshdistill.models.families import register
from meshdistill.models.families._moe import ExpertFamily
from meshdistill.models.moe import MoeConfig


@register
class Mixtral(ExpertFamily):
  name = "mixtral"
  architectures = ("MixtralForCausalLM",)
  default_export = True
  moe_module = "block_sparse_moe"
  projections = {"gate": "w1", "up": "w3", "down": "w2"}
  # mistralai/Mixtral-8x7B-v0.1 config.json on the Hugging Face hub
  presets = {
      "mixtral-8x7b": {
          "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
          "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False, "sliding_window": None,
      },
  }

  def moe_from_hf(self, hf: dict[str, Any], n_layers: int) -> MoeConfig:
    del n_layers
    return MoeConfig(n_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
                     expert_hidden=int(hf["intermediate_size"]), score="softmax", norm_topk_prob=True)

  def moe_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    if (moe.score, moe.norm_topk_prob, moe.capacity_factor, moe.dense_layers) != ("softmax", True, None, ()):
      raise ValueError(
          f"mixtral routes by softmax with renormalised top-k weights, no capacity and experts in every layer; this "
          f"model has score={moe.score!r}, norm_topk_prob={moe.norm_topk_prob}, capacity_factor={moe.capacity_factor}"
          f", dense_layers={list(moe.dense_layers)}: export it as family='qwen3_moe' or change those settings")
    if moe.expert_hidden != cfg.mlp_hidden:
      raise ValueError(f"mixtral's experts have intermediate_size hidden units, but moe.expert_hidden="
                       f"{moe.expert_hidden} differs from mlp_hidden={cfg.mlp_hidden}; set them equal")
    return {"num_local_experts": moe.n_experts, "num_experts_per_tok": moe.top_k, "sliding_window": None,
            "router_jitter_noise": 0.0}
