"""Width and depth pruning of a dense decoder by importance (Minitron): `prune` (``md.prune``).

`PruneTargets` says what the student keeps: ``mlp`` hidden units per block, ``heads`` query heads per block
(whole query groups: ``heads`` must be a multiple of ``n_heads / n_kv_heads``, and ``head_dim`` is kept),
``embed`` embedding channels (the model dimension) and ``layers`` blocks. `select` turns an
`meshdistill.models.compress.importance.Importance` into the `Kept` units (the most important, in their original order);
`prune_weights` cuts them out of the teacher's weights into a smaller `Decoder` whose config is a valid config of
the teacher's family (a Hugging Face export of it loads in transformers).

The pruned student computes exactly what the teacher computes with the pruned units zeroed (their weights set to 0,
pruned blocks made identities). Two corrections make that exact where the model dimension shrinks from ``D`` to
``D'``: every RMSNorm over the residual stream now averages over ``D'`` channels instead of ``D`` (of which the
pruned ones were 0), so its scale is multiplied by ``sqrt(D / D')``; and with Gemma's embedding scale
(``sqrt(d_model)``) the embedding is multiplied by ``sqrt(D / D')`` (a tied LM head then reads the same factor,
taken back out of the final norm). Only the norms' ``eps`` term differs (1e-6 against mean squares near 1).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import numpy as np
from flax import nnx

from meshdistill.models.compress.importance import DEPTH, Importance, check_prunable, score
from meshdistill.models._build import abstract_params, shard_model
from meshdistill.models.decoder import Decoder, ModelConfig, param_count

log = logging.getLogger(__name__)

NORMS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm")  # block norms over the residual stream


@dataclasses.dataclass(frozen=True, kw_only=True)
class PruneTargets:
  """What the pruned student keeps (None: that dimension is not pruned).

  Args:
    mlp: MLP hidden units kept in every block (``--mlp``; the teacher's ``mlp_hidden`` at most).
    heads: query heads kept in every block (``--heads``): whole query groups, so a multiple of
      ``n_heads / n_kv_heads``; key/value heads kept are ``heads / (n_heads / n_kv_heads)``.
    embed: embedding channels kept (``--embed``; the model dimension ``d_model``).
    layers: blocks kept (``--layers``).
    depth: how blocks are ranked: ``loss`` (the loss rise when skipped) or ``cosine`` (``1 - cos`` of the block's
      input and output).
  """

  mlp: int | None = None
  heads: int | None = None
  embed: int | None = None
  layers: int | None = None
  depth: str = "loss"

  def __post_init__(self):
    for name in ("mlp", "heads", "embed", "layers"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"--{name}={v!r} must be a positive integer (units kept), or unset to keep them all")
    if self.depth not in DEPTH:
      raise ValueError(f"--depth={self.depth!r}; choose one of {list(DEPTH)}")

  @property
  def any(self) -> bool:
    return any(getattr(self, n) is not None for n in ("mlp", "heads", "embed", "layers"))

  def check(self, cfg: ModelConfig) -> None:
    """Raises a ValueError naming the flag when a target does not fit the teacher ``cfg``."""
    group = cfg.n_heads // cfg.n_kv_heads
    limits = {"mlp": ("mlp_hidden", cfg.mlp_hidden), "heads": ("n_heads", cfg.n_heads),
              "embed": ("d_model", cfg.d_model), "layers": ("n_layers", cfg.n_layers)}
    for name, (field, most) in limits.items():
      v = getattr(self, name)
      if v is not None and v > most:
        raise ValueError(f"--{name}={v} keeps more than the teacher has ({field}={most}); choose at most {most}")
    if self.heads is not None and self.heads % group:
      choices = list(range(group, cfg.n_heads + 1, group))
      raise ValueError(f"--heads={self.heads}: query heads are pruned in whole groups of n_heads / n_kv_heads = "
                       f"{group} (each shares one key/value head); choose one of {choices}")

  def student_config(self, cfg: ModelConfig, layers=None) -> ModelConfig:
    """The pruned student's config: ``cfg`` with the kept sizes (``head_dim`` written out, blocks unrolled, one
    device), its blocks attending as the teacher's ``layers`` (default: the first ``self.layers``) do."""
    self.check(cfg)
    group = cfg.n_heads // cfg.n_kv_heads
    heads = cfg.n_heads if self.heads is None else self.heads
    layers = range(cfg.n_layers if self.layers is None else self.layers) if layers is None else layers
    out = cfg.replace(scan_layers=False, vocab_multiple=1, replicate_kv=False, head_dim=cfg.hd).with_layers(layers)
    return out.replace(mlp_hidden=self.mlp or cfg.mlp_hidden, n_heads=heads, n_kv_heads=heads // group,
                       d_model=self.embed or cfg.d_model)


@dataclasses.dataclass(frozen=True)
class Kept:
  """The units a pruned student keeps, each list ascending: ``layers`` (teacher block indices), per kept block its
  ``mlp`` units and query ``groups``, and the ``embed`` channels."""

  layers: tuple[int, ...]
  mlp: tuple[tuple[int, ...], ...]
  groups: tuple[tuple[int, ...], ...]
  embed: tuple[int, ...]

  def to_dict(self) -> dict:
    return {"layers": list(self.layers), "mlp": [list(m) for m in self.mlp], "groups": [list(g) for g in self.groups],
            "embed": list(self.embed)}

  @classmethod
  def from_dict(cls, d: dict) -> Kept:
    return cls(tuple(d["layers"]), tuple(map(tuple, d["mlp"])), tuple(map(tuple, d["groups"])), tuple(d["embed"]))

  def removed(self, cfg: ModelConfig) -> dict:
    """What goes, per kind: the pruned block indices, embedding channels, and per kept block the pruned MLP units
    and query groups."""
    gone = lambda keep, n: sorted(set(range(n)) - set(keep))  # noqa: E731
    return {"layers": gone(self.layers, cfg.n_layers), "embed": gone(self.embed, cfg.d_model),
            "mlp": {int(l): gone(m, cfg.mlp_hidden) for l, m in zip(self.layers, self.mlp)},
            "groups": {int(l): gone(g, cfg.n_kv_heads) for l, g in zip(self.layers, self.groups)}}


def _top(scores: np.ndarray, k: int) -> tuple[int, ...]:
  """The ``k`` highest-scoring indices, ascending (ties: the lower index wins)."""
  order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
  return tuple(sorted(int(i) for i in order[:k]))


def select(importance: Importance, cfg: ModelConfig, targets: PruneTargets) -> Kept:
  """The `Kept` units of a teacher of ``cfg``: the most important ones for ``targets``."""
  targets.check(cfg)
  layers = _top(importance.layers(targets.depth), targets.layers) if targets.layers else tuple(range(cfg.n_layers))
  group = cfg.n_heads // cfg.n_kv_heads
  n_groups = cfg.n_kv_heads if targets.heads is None else targets.heads // group
  return Kept(
      layers=layers,
      mlp=tuple(_top(importance.mlp[l], targets.mlp or cfg.mlp_hidden) for l in layers),
      groups=tuple(_top(importance.groups[l], n_groups) for l in layers),
      embed=_top(importance.embed, targets.embed or cfg.d_model),
  )


def _columns(units, width: int) -> np.ndarray:
  """The columns of ``units`` in a weight whose units are ``width`` consecutive columns each."""
  return np.concatenate([np.arange(u * width, (u + 1) * width) for u in units]) if len(units) else np.zeros(0, int)


def _norm_scale(w: np.ndarray, factor: float, offset: bool) -> np.ndarray:
  """An RMSNorm scale whose effective value (``1 + w`` with Gemma's offset, else ``w``) is multiplied by ``factor``."""
  return (1.0 + w) * factor - 1.0 if offset else w * factor


def prune_weights(model: Decoder, kept: Kept) -> Decoder:
  """A new one-device `Decoder` holding ``model``'s ``kept`` units (see the module docstring for the exactness)."""
  model = check_prunable(model)
  cfg = model.cfg
  group, K = cfg.n_heads // cfg.n_kv_heads, cfg.hd
  student_cfg = PruneTargets(mlp=len(kept.mlp[0]), heads=len(kept.groups[0]) * group, embed=len(kept.embed),
                             layers=len(kept.layers)).student_config(cfg, kept.layers)
  D, D2, V = cfg.d_model, len(kept.embed), cfg.vocab_size
  c = math.sqrt(D / D2)  # RMS over D' channels instead of D (the pruned ones being 0)
  c_embed = c if cfg.embed_scale else 1.0  # sqrt(D') instead of sqrt(D) multiplies the embeddings
  c_final = c / (c_embed if cfg.tie_embeddings else 1.0)  # a tied head reads the scaled embedding
  e = np.asarray(kept.embed)
  src = {k: np.asarray(jax.device_get(v.get_value()), np.float32) for k, v in nnx.to_flat_state(nnx.state(model))}

  def block_weight(i: int, path: tuple) -> np.ndarray:
    w = src[("blocks", kept.layers[i], *path)]
    qcols = _columns([g * group + r for g in kept.groups[i] for r in range(group)], K)
    kvcols, f = _columns(kept.groups[i], K), np.asarray(kept.mlp[i])
    name = path[:-1]
    if name[0] in NORMS:
      return _norm_scale(w[e], c, cfg.norm_offset)
    if name in (("attn", "q_norm"), ("attn", "k_norm")):
      return w
    if name == ("attn", "q"):
      return w[qcols] if path[-1] == "bias" else w[e][:, qcols]
    if name in (("attn", "k"), ("attn", "v")):
      return w[kvcols] if path[-1] == "bias" else w[e][:, kvcols]
    if name == ("attn", "o"):
      return w[qcols][:, e]
    if name in (("mlp", "gate"), ("mlp", "up")):
      return w[e][:, f]
    if name == ("mlp", "down"):
      return w[f][:, e]
    raise ValueError(f"prune: no rule for the weight {'/'.join(map(str, path))}")

  graphdef, abstract, _ = abstract_params(student_cfg)
  leaves = []
  for key, var in nnx.to_flat_state(abstract):
    if key[0] == "blocks":
      value = block_weight(key[1], key[2:])
    elif key == ("embed", "embedding"):
      value = src[key][:V][:, e] * c_embed
    elif key == ("head", "kernel"):
      value = src[key][e][:, :V]
    elif key == ("final_norm", "scale"):
      value = _norm_scale(src[key][e], c_final, cfg.norm_offset)
    else:
      raise ValueError(f"prune: no rule for the weight {'/'.join(map(str, key))}")
    want = tuple(var.get_value().shape)
    if value.shape != want:
      raise AssertionError(f"prune: {'/'.join(map(str, key))} has shape {value.shape}, expected {want}")
    leaves.append((key, var.replace(jax.numpy.asarray(value, var.get_value().dtype))))
  return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def zeroed(model: Decoder, kept: Kept) -> Decoder:
  """``model`` (a one-device copy) with every unit ``kept`` does not hold set to zero: the pruned MLP units' gate, up
  and down weights, the pruned query groups' output-projection rows, the pruned embedding channels (embedding
  columns and every projection writing the residual stream), and the pruned blocks' output projections (the block
  adds nothing: an identity). `prune_weights` of ``kept`` computes what this model computes."""
  model = check_prunable(model)
  cfg = model.cfg
  group, K = cfg.n_heads // cfg.n_kv_heads, cfg.hd
  gone_d = np.setdiff1d(np.arange(cfg.d_model), kept.embed)
  where = {l: i for i, l in enumerate(kept.layers)}
  leaves = []
  for key, var in nnx.to_flat_state(nnx.state(model)):
    w = np.array(jax.device_get(var.get_value()), np.float32)
    name = key[2:-1] if key[0] == "blocks" else key[:-1]
    if key == ("embed", "embedding"):
      w[:, gone_d] = 0
    if key[0] == "blocks" and key[-1] == "kernel":
      i = where.get(key[1])
      if name in (("attn", "o"), ("mlp", "down")):
        w[:, gone_d] = 0
        if i is None:
          w[:] = 0
        elif name == ("attn", "o"):
          w[np.setdiff1d(np.arange(cfg.n_heads * K), _columns(
              [g * group + r for g in kept.groups[i] for r in range(group)], K))] = 0
        else:
          w[np.setdiff1d(np.arange(cfg.mlp_hidden), kept.mlp[i])] = 0
    leaves.append((key, var.replace(jax.numpy.asarray(w, var.get_value().dtype))))
  graphdef = nnx.graphdef(model)
  return nnx.merge(graphdef, nnx.from_flat_state(leaves))


@dataclasses.dataclass(frozen=True)
class Pruned:
  """What `prune` returns: the ``student`` (placed like the teacher when a mesh was given), the teacher's
  ``importance``, the ``kept`` units and a JSON-able ``report`` (targets, sizes, parameter counts, what goes)."""

  student: Decoder
  importance: Importance
  kept: Kept
  report: dict


def prune(teacher, batches, targets: PruneTargets | None = None, *, mesh=None, importance: Importance | None = None,
          **sizes) -> Pruned:
  """Scores ``teacher``'s units on the calibration ``batches`` and cuts it to ``targets`` (or ``mlp=``, ``heads=``,
  ``embed=``, ``layers=``, ``depth=`` keywords).

  ``teacher`` runs where it is (on ``mesh`` when given: the batches are split over ``data``); the student is built on
  the host and, with ``mesh``, placed on it split as `meshdistill.models.shard_model` splits a model.
  ``importance``: scores measured before (no batch is run).
  """
  if targets is not None and sizes:
    raise ValueError(f"prune: give the targets either as PruneTargets or as keywords ({sorted(sizes)}), not both")
  targets = targets or PruneTargets(**sizes)
  teacher = check_prunable(teacher)
  cfg = teacher.cfg.replace(vocab_multiple=1, replicate_kv=False)
  targets.check(cfg)
  if importance is None:
    importance = score(teacher, batches, mesh=mesh, depth=targets.depth)
  kept = select(importance, cfg, targets)
  student = prune_weights(teacher, kept)
  if mesh is not None:
    student = shard_model(student, mesh)
  before, after = param_count(teacher), param_count(student)
  report = {
      "targets": dataclasses.asdict(targets),
      "teacher": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                  "n_kv_heads": cfg.n_kv_heads, "mlp_hidden": cfg.mlp_hidden, "params": before},
      "student": {"d_model": student.cfg.d_model, "n_layers": student.cfg.n_layers, "n_heads": student.cfg.n_heads,
                  "n_kv_heads": student.cfg.n_kv_heads, "mlp_hidden": student.cfg.mlp_hidden, "params": after},
      "fraction_kept": after / before,
      "aggregation": "per unit: |activation| mean over a sequence's unmasked tokens, L2 norm over sequences; heads: "
                     "L2 norm over head_dim first, query groups summed; embed: summed over every residual-stream "
                     f"RMSNorm's output; layers: {targets.depth}",
      "calibration": {"sequences": importance.sequences, "tokens": importance.tokens, "loss": importance.loss},
      "kept": kept.to_dict(),
      "removed": kept.removed(cfg),
  }
  log.info("pruned %d -> %d parameters (%.1f%%)", before, after, 100 * after / before)
  return Pruned(student, importance, kept, report)
