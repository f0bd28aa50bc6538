"""What every layer shares, below all of them: this package imports nothing else of meshdistill.

`batch` (the batch schema: `BATCH_KEYS`, `TOPK_KEYS`, `MULTI_KEYS`, `CROSS_KEYS`, `TARGET_LOGPROB_KEY`,
`SEGMENT_KEYS`), `state` (`TrainState`, `split_trainable` / `join_trainable`, `SplitStep`: a step a layout may run
in two halves), `vocab` (the vocabulary-padding rule: `resolve_shared_vocab`, `PADDING_TOLERANCE`), `typed_yaml`
(typed dataclasses from YAML and `ConfigError`, the error of every setting check), `fsutil` and `ownership` (the rules
every output directory follows). Import the module you need (``from meshdistill.core.batch import TOPK_KEYS``): this
file imports none of them, so reading the batch keys or the config loads no JAX.
"""
