"""What to distil: strategies turn student and teacher outputs into loss terms.

The contract (`meshdistill.strategies._base`): a strategy is per-sequence (`SequenceStrategy`:
``per_sequence`` on one sequence's `ModelOutput`, vmapped by the step) or per-batch
(`BatchStrategy`: ``per_batch`` on all local rows plus the LM heads, ``needs_head = True``).
Both return a dict of token SUMS with a ``"loss"`` entry (every other entry is a metric);
the step divides by the global count of unmasked tokens, so every value is a token mean.
Every strategy has ``capture`` (extra model outputs: ``"hidden"``, ``"attn"``, ``"final"``),
``needs_logits`` / ``needs_head``, ``init_params(student_cfg, teacher_cfg, key)`` (extra
trainable parameters, and the check of settings against model sizes) and ``fallback()``
(its replacement after a divergence, or None); the base classes give the defaults (the contract is written once,
in `_base`), and `PerSequence` / `PerBatch` name the two kinds (`SequenceStrategy` / `BatchStrategy`).

Built in (registered name in brackets, for configs' ``distill.kind`` and `get`):

=====================================  ===========================================================
`LogitKD` (logit_kd)                   a divergence (KL, reverse KL, JSD, ...) between
                                       temperature-softened logits, mixed with hard-label CE
`ChunkedLogitKD` (chunked_logit_kd)    the same recipe without ``[B, T, V]`` logits (token chunks,
                                       vocabulary-parallel); shares `LogitRecipe` with `LogitKD`
`HardLabelCE` (hard_label_ce)          cross-entropy on the targets only
`AttentionTransfer`                    KL / MSE between attention probability maps of mapped layers
(attention_transfer)
`FeaturePooling` (feature_pooling)     cosine / MSE to the teacher's width-pooled hidden states
`FeatureProjection`                    cosine / MSE through a learned ``[D_s, D_t]`` map per mapped
(feature_projection)                   layer
`Composite`                            a weighted sum of per-sequence strategies; weights may be
                                       schedules
`PreferenceLoss` (preference)          DPO / IPO / DPO + KL on (chosen, rejected) row pairs, the
                                       teacher as the frozen reference (a mean over pairs)
`SampledTokenKD` (sampled_token)       on-policy REINFORCE on the student's sampled tokens, advantage
                                       ``log p_teacher - log p_student`` (any teacher giving one log-prob)
`ULD` / `SpanKL` (uld, span_kl)        a teacher of another tokenizer: ULD on aligned spans, span-merged
                                       KL over the matched vocabulary
`ByteKL` (byte_kl)                     a teacher of another tokenizer: KL on the student's next byte
=====================================  ===========================================================

A new strategy is one module in this package: a class deriving from `SequenceStrategy` or
`BatchStrategy`, decorated with ``@register("name")``. Every module of the package is
imported here, so the decorator runs and the class is exported under its own name.

Layer maps (`default_layer_map`) pair student with teacher layers; weights and other
scalars may be schedules, evaluated with `value_at` and checked with
`meshdistill.losses.schedules.check_scalar`.

Strategies hold losses only: the preference rows and batches a `PreferenceLoss` trains on are the data package's
(`meshdistill.data.read_preferences`, `meshdistill.data.preference_batch`); the two names stay here as aliases of
those functions.
"""

import importlib
import pkgutil

from meshdistill.losses.schedules import Scalar, value_at
from meshdistill.strategies._attention import AttentionTransfer, attention_map_loss, group_heads
from meshdistill.strategies._base import (
    BatchStrategy,
    PerBatch,
    PerSequence,
    SequenceStrategy,
    CONTRACT,
    Strategy,
    check,
    from_settings,
    get,
    names,
    register,
)
from meshdistill.strategies._chunked import CHUNKED_FROM_VOCAB, DEFAULT_CHUNK, ChunkedLogitKD, default_recipe
from meshdistill.strategies._composite import Composite, HardLabelCE
from meshdistill.strategies._features import FeaturePooling, FeatureProjection, feature_loss, pool_features
from meshdistill.strategies._layer_map import default_layer_map
from meshdistill.strategies._logit import LogitKD, LogitRecipe, logit_metrics, logit_token_metrics
from meshdistill.strategies._preference import PreferenceLoss
from meshdistill.strategies._wrappers import LogitMSE, fallback_strategy, label

__all__ = [
    "AttentionTransfer",
    "BatchStrategy",
    "CHUNKED_FROM_VOCAB",
    "ChunkedLogitKD",
    "DEFAULT_CHUNK",
    "Composite",
    "FeaturePooling",
    "FeatureProjection",
    "HardLabelCE",
    "LogitKD",
    "PreferenceLoss",
    "LogitRecipe",
    "PerBatch",
    "PerSequence",
    "Scalar",
    "SequenceStrategy",
    "Strategy",
    "CONTRACT",
    "attention_map_loss",
    "check",
    "default_layer_map",
    "feature_loss",
    "from_settings",
    "get",
    "group_heads",
    "label",
    "logit_metrics",
    "logit_token_metrics",
    "names",
    "pool_features",
    "preference_batch",
    "read_preferences",
    "register",
    "value_at",
    "default_recipe",
]


def _data():
  """The data package, imported on first use of the aliases below."""
  from meshdistill import data  # lazy: the data package loads grain, which building a Distiller must not

  return data


def read_preferences(path: str) -> list[dict[str, str]]:
  """Alias of `meshdistill.data.read_preferences` (the rows of a preference JSONL file), kept under this name."""
  return _data().read_preferences(path)


def preference_batch(rows, encode, seq_len: int, pad_id: int = 0):
  """Alias of `meshdistill.data.preference_batch` (a host batch of (chosen, rejected) row pairs), kept under this
  name."""
  return _data().preference_batch(rows, encode, seq_len, pad_id)


# Modules added to this package register their strategies on import; export those by class name.
for _module in pkgutil.iter_modules(__path__):
  importlib.import_module(f"{__name__}.{_module.name}")
for _name in names():
  _cls = get(_name)
  if _cls.__name__ not in globals():
    globals()[_cls.__name__] = _cls
    __all__.append(_cls.__name__)
