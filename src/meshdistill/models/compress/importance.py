"""Minitron importance of a dense decoder's units, measured on calibration batches (`score`).

For every block and every calibration sequence the teacher runs once (on the mesh, as placed) and these
activations are read from its own modules (nothing in the model changes):

* **MLP neurons** ``[L, F]``: the gated hidden activation ``act(gate(x)) * up(x)`` of each unit;
* **attention heads** ``[L, H]``: the L2 norm over ``head_dim`` of each query head's attention output, before the
  output projection (the attention's own forward with an identity in place of ``o``); a query group's score
  ``[L, KV]`` (grouped-query attention: a key/value head and the query heads that share it) is the sum of its
  heads' scores, and groups are what width pruning removes, so key/value heads stay whole;
* **embedding channels** ``[D]``: the outputs of every RMSNorm that reads the residual stream (each block's
  attention and MLP norms, the final norm), summed over those norms;
* **layers** ``[L]``: ``loss`` -- how much the token-mean cross-entropy on the calibration batches rises when
  the block is skipped (its input passed on unchanged); ``cosine`` -- the block importance of ShortGPT / Minitron,
  ``1 - cos(input, output)`` of the block per token, averaged over tokens.

Aggregation (Minitron's best, Sec. 2.2 and Table 11 of "Compact Language Models via Pruning and Knowledge
Distillation"): the magnitude of an activation is averaged over the unmasked tokens of a sequence (``mean`` over the
sequence) and the per-sequence means are combined over all calibration sequences by their L2 norm (``l2`` over the
batch). Padding never counts. Each batch's sums are computed in one compiled program on the mesh (global arrays:
weights split over ``tensor`` and, with fsdp, over ``data``; rows over ``data``) and accumulated on the host in
float64, so any layout gives the one-device scores up to float32 reduction order.

The skipped-layer losses rerun the blocks after the skipped one: ``L (L - 1) / 2`` block evaluations per batch on
top of the forward pass (``depth="cosine"`` needs only the forward pass).
"""

from __future__ import annotations

import dataclasses
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshdistill.models.decoder import Attention, Decoder
from meshdistill.models._variants import post_norm, softcap
from meshdistill.models.quantize import is_quantized
from meshdistill.models.stacking import to_unrolled
from meshdistill.parallel.mesh import host_to_global

DEPTH = ("loss", "cosine")  # how layers are ranked (`Importance.layers`)


@dataclasses.dataclass(frozen=True)
class Importance:
  """Scores of a teacher's units on calibration data (larger: more important); arrays on the host.

  ``mlp`` [L, F], ``heads`` [L, H] (per query head), ``groups`` [L, KV] (per query group: the sum of its heads),
  ``embed`` [D], ``layer_loss`` [L] (validation-loss rise when the block is skipped; NaN when not measured),
  ``layer_cosine`` [L] (``1 - cos`` of the block's input and output), ``loss`` (the teacher's token-mean
  cross-entropy on the same batches), ``sequences`` and ``tokens`` (unmasked) seen."""

  mlp: np.ndarray
  heads: np.ndarray
  groups: np.ndarray
  embed: np.ndarray
  layer_loss: np.ndarray
  layer_cosine: np.ndarray
  loss: float
  sequences: int
  tokens: int

  def layers(self, depth: str = "loss") -> np.ndarray:
    """The layer scores ``depth`` ranks by (`DEPTH`)."""
    if depth not in DEPTH:
      raise ValueError(f"depth={depth!r}; choose one of {list(DEPTH)}")
    scores = self.layer_loss if depth == "loss" else self.layer_cosine
    if np.isnan(scores).any():
      raise ValueError("depth='loss': the skipped-layer losses were not measured; score with depth='loss'")
    return scores

  def save(self, path: str) -> str:
    """Writes the scores as ``.npz`` (one array per field)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(path, **{f.name: np.asarray(getattr(self, f.name)) for f in dataclasses.fields(self)})
    return path

  @classmethod
  def load(cls, path: str) -> Importance:
    with np.load(path) as z:
      values = {k: z[k] for k in z.files}
    return cls(**{k: (v.item() if v.ndim == 0 else v) for k, v in values.items()})


def check_prunable(model) -> Decoder:
  """``model`` with unrolled float blocks, or a ValueError saying why it cannot be scored or pruned."""
  if not isinstance(model, Decoder):
    raise ValueError(f"prune: the teacher is a {type(model).__name__}; importance and pruning need the built-in "
                     "Decoder (load it with load_hf / teacher.hf or a pretrained teacher)")
  if model.cfg.moe is not None:
    raise ValueError("prune: the teacher is a mixture-of-experts model; pruning covers dense families (Llama, "
                     "Qwen2 / 3, Mistral, Gemma 2 / 3)")
  if is_quantized(model) or jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
    raise ValueError("prune: the teacher holds quantized weights or LoRA adapters; prune the float model "
                     "(without teacher.quantize / student.lora)")
  return to_unrolled(model) if model.cfg.scan_layers else model


def _head_outputs(attn: Attention, x_BxTxD: jax.Array) -> jax.Array:
  """``[B, T, H, K]``: each query head's attention output before the output projection -- the attention's own
  forward (RoPE, window, soft-cap, kernel as configured) with an identity in place of ``o``."""
  probe = types.SimpleNamespace(**{k: getattr(attn, k) for k in ("cfg", "q", "k", "v", "q_norm", "k_norm", "window",
                                                                  "theta", "scaling")})
  probe.o = lambda y: y
  out_BxTxHK = Attention.__call__(probe, x_BxTxD, False).x  # pylint: disable=unnecessary-dunder-call
  return out_BxTxHK.reshape(*out_BxTxHK.shape[:2], attn.cfg.n_heads, attn.cfg.hd)


def _logits(model: Decoder, x_BxTxD: jax.Array) -> jax.Array:
  """float32 logits ``[B, T, V]`` of the last block's output (final norm, LM head, soft-cap)."""
  cd = model.cfg.compute_dtype
  y = model.final_norm(x_BxTxD).astype(cd)
  return softcap((y @ model.head_weight().astype(cd)).astype(jnp.float32), model.cfg.final_softcap)


def _token_ce(logits_BxTxV, targets_BxT, mask_BxT) -> jax.Array:
  """Sum over unmasked tokens of the cross-entropy."""
  logp = jax.nn.log_softmax(logits_BxTxV, axis=-1)
  nll = -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * mask_BxT)


def batch_sums(model: Decoder, batch: dict, layer_loss: bool = True) -> dict:
  """One batch's contributions: sums of squared per-sequence means (``mlp`` [L, F], ``heads`` [L, H], ``embed``
  [D]), the cross-entropy sums (``ce``, and ``ce_skip`` [L] with each block skipped), the summed ``1 - cos``
  (``cosine`` [L]) and the unmasked token count (``tokens``)."""
  cfg = model.cfg
  inputs, targets = batch["inputs"], batch["targets"]
  mask_BxT = batch["mask"].astype(jnp.float32)
  count_B = jnp.maximum(mask_BxT.sum(axis=1), 1.0)

  def l2_of_means(a_BxTxN):  # |activation| averaged over a sequence's tokens, squared, summed over sequences
    mean_BxN = jnp.einsum("btn,bt->bn", jnp.abs(a_BxTxN).astype(jnp.float32), mask_BxT) / count_B[:, None]
    return jnp.sum(mean_BxN**2, axis=0)

  out = model(inputs, capture=("hidden",))
  hidden = out.hidden
  mlp, heads, embed_BxTxD, cosine = [], [], jnp.zeros(hidden[0].shape, jnp.float32), []
  for i, block in enumerate(model.blocks):
    h = hidden[i]
    n1 = block.attn_norm(h)
    heads.append(l2_of_means(jnp.linalg.norm(_head_outputs(block.attn, n1).astype(jnp.float32), axis=-1)))
    x = h + post_norm(block.post_attn_norm, block.attn(n1, False).x)
    n2 = block.mlp_norm(x)
    mlp.append(l2_of_means(block.mlp.act(block.mlp.gate(n2)) * block.mlp.up(n2)))
    embed_BxTxD = embed_BxTxD + jnp.abs(n1).astype(jnp.float32) + jnp.abs(n2).astype(jnp.float32)
    a32, b32 = h.astype(jnp.float32), hidden[i + 1].astype(jnp.float32)
    cos = jnp.sum(a32 * b32, -1) / jnp.maximum(jnp.linalg.norm(a32, axis=-1) * jnp.linalg.norm(b32, axis=-1), 1e-12)
    cosine.append(jnp.sum((1.0 - cos) * mask_BxT))
  embed_BxTxD = embed_BxTxD + jnp.abs(model.final_norm(hidden[-1])).astype(jnp.float32)
  sums = {"mlp": jnp.stack(mlp), "heads": jnp.stack(heads), "embed": l2_of_means(embed_BxTxD),
          "cosine": jnp.stack(cosine), "ce": _token_ce(out.logits, targets, mask_BxT), "tokens": mask_BxT.sum()}
  if layer_loss:
    skipped = []
    for i in range(cfg.n_layers):
      x = hidden[i]  # block i skipped: its input goes on to block i + 1
      for block in model.blocks[i + 1:]:
        x = block(x, False).x
      skipped.append(_token_ce(_logits(model, x), targets, mask_BxT))
    sums["ce_skip"] = jnp.stack(skipped)
  return sums


def score(model, batches, *, mesh=None, depth: str = "loss") -> Importance:
  """The `Importance` of ``model``'s units on ``batches`` (host batches ``{inputs, targets, mask}`` [B, T]).

  ``model`` runs where its weights are (place it on ``mesh`` first: `meshdistill.models.shard_model`, or a
  layout's ``fit_model`` / ``place_params`` for fsdp); with ``mesh`` each batch is split over ``data``.
  ``depth="cosine"`` skips the skipped-layer losses (their scores are then NaN).
  """
  if depth not in DEPTH:
    raise ValueError(f"depth={depth!r}; choose one of {list(DEPTH)}")
  model = check_prunable(model)
  graphdef, state = nnx.split(model)
  want_loss = depth == "loss"
  program = jax.jit(lambda s, b: batch_sums(nnx.merge(graphdef, s), b, want_loss))
  total: dict[str, np.ndarray] = {}
  sequences = 0
  for batch in batches:
    host = {k: np.asarray(batch[k]) for k in ("inputs", "targets", "mask")}
    sequences += host["inputs"].shape[0]
    placed = host if mesh is None else host_to_global(host, mesh)
    for k, v in jax.device_get(program(state, placed)).items():
      total[k] = total.get(k, 0.0) + np.asarray(v, np.float64)
  if not total:
    raise ValueError("prune: no calibration batches; give at least one batch (prune.batches >= 1)")
  cfg = model.cfg
  tokens = max(float(total["tokens"]), 1.0)
  heads = np.sqrt(total["heads"])
  groups = heads.reshape(cfg.n_layers, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads).sum(-1)
  loss = float(total["ce"] / tokens)
  layer_loss = total["ce_skip"] / tokens - loss if want_loss else np.full(cfg.n_layers, np.nan)
  return Importance(mlp=np.sqrt(total["mlp"]), heads=heads, groups=groups, embed=np.sqrt(total["embed"]),
                    layer_loss=np.asarray(layer_loss), layer_cosine=total["cosine"] / tokens, loss=loss,
                    sequences=sequences, tokens=int(total["tokens"]))

