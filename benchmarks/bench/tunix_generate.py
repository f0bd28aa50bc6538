"""tunix's own sampler (`tunix.generate.sampler.Sampler`, tunix 0.1.7) on tunix's Qwen3 at the shape of a meshdistill
student: tokens/s of cached sampling, the peer of ``tpu_step.py --systems generate``.

What runs is tunix's code as a user calls it: ``Qwen3(config, rngs=...)`` with random weights (made in one
``nnx.jit``), ``Sampler(model, tokenizer, CacheConfig(...))`` and ``sampler(prompts, max_generation_steps=new,
max_prompt_length=prompt, temperature=1.0, top_p=1.0, ...)``. Ours is only the usage around it:

* the shape: `qwen3_config` copies the student's sizes (layers, vocabulary, width, heads, key-value heads, head
  width, MLP width, tied embeddings); it refuses a student tunix's Qwen3 cannot express (no q/k norm, biases, sliding
  windows, experts, Gemma's options). tunix's Qwen3 applies RoPE with base 1e6 whatever its ``rope_theta`` says,
  which changes no cost.
* the dtype policy of meshdistill's generate row: weights stored in ``param_dtype`` (float32, the student as it
  trains), computing in ``dtype`` (bfloat16): tunix's ``Einsum`` casts each weight to ``dtype`` where it is used and
  its KV cache is ``dtype`` (bfloat16, as meshdistill's).
* the sampling: temperature 1 over the whole vocabulary (``top_p=1.0``, no top-k: tunix's ``top_p`` mode then draws
  ``jax.random.categorical`` of the scaled logits), as the meshdistill row (temperature 1, no filters).
* the tokenizer: tunix's sampler takes strings; `IdTokenizer` reads a prompt written as token ids (``"17 4 301"``)
  and writes ids back, with pad id 0 (the prompts draw from ``1..V-1``) and no end-of-sequence token (``-1``: every
  row decodes all ``new`` tokens, as meshdistill's rows do with ``eos_id=None``). Its host work is part of the
  timed call, as tunix's own tokenizing and decoding are.

What each sampler does per call (the same tokens out, different work): meshdistill's prefill computes the logits of
the last prompt position only and then feeds ``new - 1`` tokens; tunix's prefill (``echo=False``; its Qwen3 takes no
``decode_only_last_token``) computes float32 logits of every prompt position (``[B, prompt, V]``) and its decode loop
runs ``new`` steps (the last step's token falls outside its buffer), each attending over the whole cache of
``prompt + new`` slots.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshdistill.models.tunix_adapter import _tunix_module  # tunix's model module of a family

PAD_ID, NO_EOS = 0, -1
# the fields of a row that ran (`sample_rows`; the script adds ``pair``, ``system`` and ``tag``)
FIELDS = ("prompt", "new", "dtype", "param_dtype", "sampling", "batch", "weight_bytes", "build_s", "first_call_s",
          "times", "seconds", "tokens_per_s", "tokens_out")


class IdTokenizer:
  """A tokenizer over token ids written as text (``"17 4 301"``), with the methods tunix's ``TokenizerAdapter``
  asks of a plain tokenizer: no BOS, pad id 0, no end-of-sequence token (-1 matches no sampled token)."""

  def encode(self, text: str, **kwargs) -> list[int]:
    del kwargs
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs) -> str:
    del kwargs
    return " ".join(str(int(t)) for t in ids)

  def bos_id(self):
    return None

  def eos_id(self) -> int:
    return NO_EOS

  def pad_id(self) -> int:
    return PAD_ID


def qwen3_config(cfg, *, dtype: str = "bfloat16", param_dtype: str = "float32"):
  """tunix's Qwen3 ``ModelConfig`` with the sizes of meshdistill's ``cfg`` (a `meshdistill.models.ModelConfig`),
  computing in ``dtype`` with weights stored in ``param_dtype``.

  Raises:
    ValueError: ``cfg`` has a part tunix's Qwen3 lacks (it needs ``qk_norm=True`` and none of the others named).
  """
  unlike = {k: getattr(cfg, k) for k, plain in (("qk_norm", True), ("qkv_bias", False), ("sliding_window", None),
                                                 ("moe", None), ("geglu", False), ("norm_offset", False),
                                                 ("embed_scale", False), ("post_norms", False),
                                                 ("query_scale", None), ("attn_softcap", None),
                                                 ("final_softcap", None))
            if getattr(cfg, k, plain) != plain}
  if unlike:
    desc = ", ".join(f"{k}={v!r}" for k, v in unlike.items())
    raise ValueError(f"tunix's Qwen3 cannot take a student with {desc}; the tunix sampler runs Qwen3-shaped "
                     "students only (the qwen3 and tiny pairs)")
  qwen3 = _tunix_module("qwen3")
  return qwen3.ModelConfig(num_layers=cfg.n_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.d_model,
                           hidden_dim=cfg.mlp_hidden, num_heads=cfg.n_heads, head_dim=cfg.hd,
                           num_kv_heads=cfg.n_kv_heads, rope_theta=int(cfg.rope_theta), norm_eps=cfg.norm_eps,
                           use_tied_embedding=cfg.tie_embeddings, dtype=jnp.dtype(dtype),
                           param_dtype=jnp.dtype(param_dtype))


def random_model(tcfg, seed: int):
  """tunix's ``Qwen3(tcfg)`` with its own random initialisation, made in one compiled program (op by op, a 0.6 B
  model takes minutes on a chip's host)."""
  qwen3 = _tunix_module("qwen3")
  return nnx.jit(lambda: qwen3.Qwen3(tcfg, rngs=nnx.Rngs(params=seed)))()


def prompts_text(batch: int, prompt: int, vocab: int, seed: int) -> list[str]:
  """``batch`` prompts of ``prompt`` random token ids in ``1..vocab-1`` (0 is the pad id), as `IdTokenizer` text."""
  ids = np.random.default_rng(seed).integers(1, vocab, (batch, prompt))
  return [" ".join(map(str, row)) for row in ids]


def sample_rows(cfg, batches, prompt: int, new: int, *, calls: int = 3, dtype: str = "bfloat16",
                param_dtype: str = "float32", seed: int = 1) -> list[dict[str, Any]]:
  """One row per batch size: tunix's sampler on tunix's Qwen3 at ``cfg``'s shape, ``prompt`` prompt tokens and
  ``new`` sampled ones per row. Each row: ``first_call_s`` (the first call: compiles its prefill and decode
  programs), ``times`` (``calls`` calls after it, same shapes, other seeds), ``seconds`` (their median),
  ``tokens_per_s = batch * new / seconds``, ``weight_bytes`` (the model's weights as stored), ``tokens_out`` (the
  fewest tokens a row got back: ``new``) and the dtypes; ``{"error": ...}`` in place of the timings where tunix could
  not run the batch (the other batches still run). A model tunix cannot build gives one error row per batch."""
  base = {"prompt": prompt, "new": new, "dtype": dtype, "param_dtype": param_dtype,
          "sampling": "temperature 1, top_p 1 (full vocabulary)"}
  try:
    from tunix.generate import sampler as sampler_lib  # pylint: disable=g-import-not-at-top

    tcfg = qwen3_config(cfg, dtype=dtype, param_dtype=param_dtype)
    t0 = time.perf_counter()
    model = random_model(tcfg, seed)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    jax.block_until_ready(nnx.state(model))
    build_s = time.perf_counter() - t0
    cache = sampler_lib.CacheConfig(cache_size=prompt + new, num_layers=tcfg.num_layers,
                                    num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim)
    sampler = sampler_lib.Sampler(model, IdTokenizer(), cache)
  except Exception as e:  # noqa: BLE001 -- a result: the row says why tunix did not run
    return [{**base, "batch": b, "error": f"{type(e).__name__}: {str(e)[:400]}"} for b in batches]
  rows = []
  for b in batches:
    row = {**base, "batch": b, "weight_bytes": int(weights), "build_s": build_s}
    text = prompts_text(b, prompt, tcfg.vocab_size, seed=b)

    def call(call_seed: int):
      return sampler(text, max_generation_steps=new, max_prompt_length=prompt, echo=False, temperature=1.0,
                     top_p=1.0, seed=call_seed)

    try:
      t0 = time.perf_counter()
      call(0)
      row["first_call_s"] = time.perf_counter() - t0
      times = []
      for i in range(calls):
        t0 = time.perf_counter()
        out = call(i + 1)  # returns host tokens (tunix's `device_get`): the time covers the whole call
        times.append(time.perf_counter() - t0)
      row["times"], row["seconds"] = times, float(np.median(times))
      row["tokens_per_s"] = b * new / row["seconds"]
      row["tokens_out"] = min(len(t) for t in out.tokens)
    except Exception as e:  # noqa: BLE001 -- out of memory, a cache too small: a result for this batch
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    rows.append(row)
  del sampler, model
  return rows

