"""Qwen3-MoE (``Qwen3MoeForCausalLM``): the Qwen3 block (``qk_norm``) with routed experts
(`meshdistill.models.moe`): softmax router, ``num_experts_per_tok`` of ``num_experts`` experts of
``moe_intermediate_size`` hidden units, optional renormalisation (``norm_topk_prob``); the layers in
``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP of ``intermediate_size``.
The planner's Qwen3-30B-A3B and Qwen3-235B-A22B presets."""

from __future__ import annotations

from typing import Any

from meshdistill.models._config import ModelConfig
from meshdistill.models.families import register
from meshdistill.models.families._moe import ExpertFamily
from meshdistill.models.families.qwen3 import qwen_fields
from meshdistill.models.moe import MoeConfig


def _qwen3_moe(d, layers, heads, kv, experts, moe_hidden) -> dict[str, Any]:
  """The shape fields of a published Qwen3-MoE config.json."""
  return {
      "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": d,
      "intermediate_size": 6144 if d == 2048 else 12288, "moe_intermediate_size": moe_hidden,
      "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128,
      "num_experts": experts, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
      "mlp_only_layers": [], "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
      "rope_theta": 1000000.0, "tie_word_embeddings": False,
  }


@register
class Qwen3Moe(ExpertFamily):
  name = "qwen3_moe"
  architectures = ("Qwen3MoeForCausalLM",)
  block = {"qk_norm": True}
  default_export = True
  # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json on the Hugging Face hub
  presets = {
      "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 4, 128, 768),
      "qwen3-235b-a22b": _qwen3_moe(4096, 94, 64, 4, 128, 1536),
  }

  def moe_from_hf(self, hf: dict[str, Any], n_layers: int) -> MoeConfig:
    experts = int(hf.get("num_experts") or hf["num_local_experts"])  # transformers 5 writes num_local_experts
    step, dense_only = int(hf.get("decoder_sparse_step", 1)), {int(i) for i in hf.get("mlp_only_layers") or ()}
    return MoeConfig(
        n_experts=experts, top_k=int(hf["num_experts_per_tok"]), expert_hidden=int(hf["moe_intermediate_size"]),
        score="softmax", norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(n_layers) if i in dense_only or (i + 1) % step),
    )

  def moe_fields(self, cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    if moe.score != "softmax" or moe.capacity_factor is not None:
      raise ValueError(f"qwen3_moe routes by softmax without a capacity; this model has score={moe.score!r}, "
                       f"capacity_factor={moe.capacity_factor}: set score='softmax', capacity_factor=null to export it")
    return {
        **qwen_fields(cfg), "num_experts": moe.n_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_hidden, "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
        "mlp_only_layers": list(moe.dense_layers),
    }
