"""The sections of a run's `meshdistill.config.Config`: frozen, keyword-only dataclasses, each checking its
own values (`ConfigError` naming the dotted key)::

  mesh        MeshSettings (its own module, `mesh_settings`): data x tensor layout, step backend, simulated CPU devices
  distill     DistillSettings (with OnPolicySettings): the strategy and its recipe
  preference  PreferenceSettings: where a preference run gets its (chosen, rejected) pairs
  train       TrainSettings: steps, batch size, optimizer, evaluation and logging cadence
  pretrain    PretrainSettings: how the teacher is obtained
  safeguards  SafeguardSettings (with GuardSettings, RematSettings): divergence guard, automatic remat, loss scaling
  checkpoint  CheckpointSettings: where / how often train states are saved
  run         RunSettings: the run directory

Checks that span sections live in `Config.__post_init__`.
"""

from __future__ import annotations

import dataclasses
import os

from meshdistill import strategies
from meshdistill.core.typed_yaml import ConfigError, api_to_config, in_range, nonneg_int, positive_int, unknown_key
from meshdistill.train.freezing import Stage
from meshdistill.config.mesh_settings import CPU_MESH, MeshSettings  # noqa: F401  (a section of the config)
from meshdistill.losses import DIVERGENCES
from meshdistill.train.loop import guard as guard_lib
from meshdistill.train.loop import state_copy
from meshdistill.train.loop.loggers import check_loggers
from meshdistill.train.onpolicy import OnPolicyConfig
from meshdistill.train.optimizers import MAX_LOSS_SCALE


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnPolicySettings:
  """On-policy distillation (GKD, `meshdistill.train.onpolicy`): with probability ``lambda`` a batch's completions are
  sampled from the student (``seq_kd``: from the teacher), otherwise the data's are used; the loss then covers
  completion tokens only. Off (plain distillation on whole rows) while ``lambda=0``, ``seq_kd=false`` and no
  ``prompts_file``. Prompts are the first ``data.seq_len + 1 - max_new_tokens`` tokens of each training row, or
  those of ``prompts_file`` (JSONL ``prompt`` / ``completion`` pairs; ``data.val_fraction`` of them held out).
  ``temperature``, ``top_k``, ``top_p`` are the sampler's (``distill.temperature`` stays the loss's)."""

  YAML_NAMES = {"lmbda": "lambda"}  # `lambda` is a Python keyword

  lmbda: float = 0.0
  max_new_tokens: int = 32
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seq_kd: bool = False
  prompts_file: str | None = None  # JSONL prompt/completion pairs to train on instead of the corpus rows

  def __post_init__(self):
    try:  # the rules live with the sampler's settings (`OnPolicyConfig`, `meshdistill.models.generate.SamplingConfig`)
      self.config()
    except (TypeError, ValueError) as e:
      key = lambda name: f"distill.on_policy.{self.YAML_NAMES.get(name, name)}"  # noqa: E731
      raise ConfigError(api_to_config(str(e), ["OnPolicyConfig", "SamplingConfig"], key)) from None

  @property
  def active(self) -> bool:
    return self.lmbda > 0 or self.seq_kd or self.prompts_file is not None

  def config(self, eos_id: int | None = None, pad_id: int = 0):
    """The `meshdistill.train.onpolicy.OnPolicyConfig` of these settings."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "prompts_file"}
    return OnPolicyConfig(**fields, eos_id=eos_id, pad_id=pad_id)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillSettings:
  """The strategy: ``kind`` names a registered one (`meshdistill.strategies.names()`); its settings are the flat
  keys below and ``options`` (any other setting of it, e.g. ``{beta: 0.3}``), passed to
  `meshdistill.strategies.from_settings`. A setting left null takes the strategy's own default (its dataclass
  default, the same as the Python API's: `LogitKD` temperature 2.0, alpha 0.5); a setting the chosen strategy
  does not have is an error naming it and the settings it has.

  A config that names ``distill.kind`` starts from that strategy's defaults; one that does not continues the
  main job's ``distill`` section (`meshdistill.config.Config`: ``logit_kd`` at temperature 1.0, alpha 1.0).

  For ``logit_kd``: ``temperature`` and ``alpha`` are numbers or schedule specs
  (`meshdistill.losses.schedules.from_spec`), e.g. ``{kind: linear, start: 3.0, end: 1.0, steps: 300}``;
  ``chunk_size`` selects `ChunkedLogitKD` (the loss from final hidden states and LM heads,
  ``chunk_size`` tokens at a time, without ``[batch, seq, vocab]`` logits; ``0`` = all at once)."""

  FLAT = ("temperature", "alpha", "divergence", "top_k", "chunk_size")  # strategy settings with their own key

  kind: str = "logit_kd"
  temperature: float | dict | None = None
  alpha: float | dict | None = None
  divergence: str | None = None
  top_k: int | None = None
  chunk_size: int | None = None
  on_policy: OnPolicySettings = dataclasses.field(default_factory=OnPolicySettings)
  options: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    self.strategy()  # checks every setting

  @classmethod
  def section_base(cls, raw: dict, base: DistillSettings) -> DistillSettings:
    """What a config's ``distill`` mapping ``raw`` overlays (`meshdistill.core.typed_yaml.from_dict`): ``base``, or,
    when ``raw`` names a ``kind``, ``base`` without strategy settings (they belong to ``base``'s strategy)."""
    if "kind" not in raw:
      return base
    return dataclasses.replace(base, **{k: None for k in cls.FLAT}, options={})

  def settings(self) -> dict:
    """``{setting: value}`` the strategy is built from: the flat keys that are not null, then ``options``."""
    given = {k: getattr(self, k) for k in self.FLAT if getattr(self, k) is not None}
    both = sorted(set(given) & set(self.options))
    if both:
      raise ConfigError(f"distill.{both[0]} and distill.options.{both[0]} are both set; keep one")
    return {**given, **self.options}

  def key(self, setting: str) -> str:
    """The config key of a strategy setting (``distill.<name>`` or ``distill.options.<name>``)."""
    flat = setting in self.FLAT and setting not in self.options
    return f"distill.{setting}" if flat else f"distill.options.{setting}"

  def chosen_kind(self) -> str:
    """The strategy these settings build: ``kind``, except that ``logit_kd`` with ``chunk_size`` set is
    ``chunked_logit_kd`` (the same recipe from final hidden states and LM heads): the config's choice, made here and
    said in ``distill.chunk_size``'s description; the strategies themselves never turn into one another. Which
    strategy has a chunked form, and its name, the strategy declares (``chunked_form``)."""
    chunked = strategies.get(self.kind).chunked_form
    if chunked is not None and self.settings().get("chunk_size") is not None:
      top_k = self.settings().get("top_k")
      if top_k is not None:
        raise ConfigError(
            f"{self.key('chunk_size')}={self.settings()['chunk_size']} and {self.key('top_k')}={top_k} exclude each "
            f"other: the chunked loss has no top-k form; set {self.key('chunk_size')}=null for a top-k teacher, or "
            f"{self.key('top_k')}=null")
      return chunked
    return self.kind

  def strategy(self):
    """The strategy these settings describe (raises `ConfigError` naming the ``distill.`` key)."""
    if self.kind not in strategies.names():
      raise ConfigError(f"distill.kind={self.kind!r} is not a registered strategy; choose one of {strategies.names()}")
    kind = self.chosen_kind()
    try:
      return strategies.from_settings(kind, self.settings())
    except (TypeError, ValueError) as e:  # the strategies name <Class>.<setting>
      owners = [strategies.get(name).__name__ for name in strategies.names()]
      raise ConfigError(api_to_config(str(e), owners, self.key)) from None

  def value(self, setting: str):
    """The value the strategy gets for ``setting``: this section's, else the strategy's own default."""
    given = self.settings().get(setting)
    if given is not None:
      return given
    return strategy_defaults(self.kind).get(setting)


def strategy_defaults(kind: str) -> dict:
  """The settings of strategy ``kind`` that have a plain default, with it (what a null ``distill.<setting>`` trains
  with)."""
  return {f.name: f.default for f in dataclasses.fields(strategies.get(kind)) if f.default is not dataclasses.MISSING}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferenceSettings:
  """``preference``: where a ``distill.kind: preference`` run (`meshdistill.strategies.PreferenceLoss`,
  the teacher as the frozen reference; ``distill.options: {beta, loss, kl_weight}``) gets its pairs.
  ``pairs``: ``own`` (built from the run's text: its continuation against another place's, split at
  ``prompt_fraction``) or the path of a JSONL file of ``{prompt, chosen, rejected}`` rows.
  ``train.batch_size`` counts rows: half as many pairs."""

  pairs: str = "own"
  prompt_fraction: float = 0.5

  def __post_init__(self):
    in_range("preference.prompt_fraction", self.prompt_fraction, 0.0, 1.0, lo_open=True, example=" (e.g. 0.5)")
    if self.pairs != "own" and not os.path.isfile(os.path.expanduser(self.pairs)):
      raise ConfigError(f"preference.pairs={self.pairs!r} is neither 'own' nor an existing JSONL file")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSettings:
  """Optimizer (AdamW with linear warm-up then cosine decay to ``lr * final_lr_fraction``, global-norm
  clipping), batch size, the evaluation / logging cadence (in steps), and an optional progressive
  freezing schedule (``freeze``, see `stages`).

  ``micro_batch``: rows each device runs through one forward and backward pass (gradient accumulation,
  `meshdistill.train.accumulate`: the same loss, gradients and metrics as the whole batch at once); it must divide
  the rows each device holds per step (``batch_size`` over the mesh's data devices). ``auto`` (the default): decided
  at start-up with the student's remat (`meshdistill.train.tuning`): the whole batch where it fits the device's
  memory and where no memory limit is known (a CPU), else micro-batches that fit."""

  SECTION = "train"  # the config section, for messages
  steps: int = 300
  batch_size: int = 16
  micro_batch: int | str = "auto"
  lr: float = 3e-3
  warmup: int = 30
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.01
  clip: float = 1.0
  mu_dtype: str = "float32"  # AdamW's first moment: float32, or bfloat16 (half its memory)
  seed: int = 1
  eval_every: int = 100
  eval_batches: int = 8
  log_every: int = 10
  freeze: list | None = None

  def __post_init__(self):
    prefix = type(self).SECTION
    self.stages()  # checks the freezing schedule
    positive_int(f"{prefix}.steps", self.steps)
    positive_int(f"{prefix}.batch_size", self.batch_size)
    if self.micro_batch != "auto":
      positive_int(f"{prefix}.micro_batch", self.micro_batch)
      if self.batch_size % self.micro_batch:
        raise ConfigError(f"{prefix}.micro_batch={self.micro_batch} must divide {prefix}.batch_size={self.batch_size} "
                          f"(rows per device per forward and backward pass; it must also divide the rows each device "
                          f"holds); use one of {[m for m in range(self.batch_size, 0, -1) if self.batch_size % m == 0]}"
                          ", or auto")
    in_range(f"{prefix}.lr", self.lr, 0.0, 1.0, lo_open=True, example=" (e.g. 3e-3)")
    nonneg_int(f"{prefix}.warmup", self.warmup)
    in_range(f"{prefix}.final_lr_fraction", self.final_lr_fraction, 0.0, 1.0)
    in_range(f"{prefix}.weight_decay", self.weight_decay, 0.0, 1.0)
    in_range(f"{prefix}.clip", self.clip, 0.0, float("inf"), lo_open=True, example=" (e.g. 1.0)")
    if self.mu_dtype not in ("float32", "bfloat16"):
      raise ConfigError(f"{prefix}.mu_dtype={self.mu_dtype!r}: AdamW's first moment is float32 (the default) or "
                        "bfloat16 (half its memory)")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ConfigError(f"{prefix}.seed={self.seed!r} must be an integer")
    nonneg_int(f"{prefix}.eval_every", self.eval_every)
    positive_int(f"{prefix}.eval_batches", self.eval_batches)
    positive_int(f"{prefix}.log_every", self.log_every)
    if self.warmup >= self.steps:
      raise ConfigError(f"{prefix}.warmup={self.warmup} must be smaller than {prefix}.steps={self.steps}")

  def stages(self) -> list | None:
    """The progressive-freezing schedule (`meshdistill.train.freezing.Stage` list), or None.

    ``freeze`` is a list of stages ``{start_step, freeze, lr, freeze_embeddings}``: ``freeze`` a
    fraction of the bottom blocks or a list of block indices, ``lr`` the stage's learning rate
    (it replaces ``lr``/``warmup``). E.g. ``[{start_step: 0, freeze: 0.5, lr: 3e-3},
    {start_step: 100, freeze: 0.0, lr: 1e-3}]``.
    """
    if self.freeze is None:
      return None
    where = f"{type(self).SECTION}.freeze"
    if not isinstance(self.freeze, (list, tuple)) or not self.freeze:
      raise ConfigError(
        f"{where}={self.freeze!r} must be null or a non-empty list of stages {{start_step, freeze, lr}}"
      )
    allowed = [f.name for f in dataclasses.fields(Stage)]
    stages = []
    for i, spec in enumerate(self.freeze):
      if not isinstance(spec, dict):
        raise ConfigError(f"{where}[{i}]={spec!r} must be a mapping with keys {allowed}")
      for key in spec:
        if key not in allowed:
          raise unknown_key(f"{where}[{i}].", key, allowed)
      try:
        stages.append(Stage(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}))
      except (TypeError, ValueError) as e:
        raise ConfigError(api_to_config(str(e), ["Stage"], lambda key, i=i: f"{where}[{i}].{key}")) from None
    return stages


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainSettings(TrainSettings):
  """How the teacher is obtained. ``teacher``: a teacher directory (written by ``meshdistill
  pretrain``) to load; when null, a teacher is pretrained from scratch on hard labels with these
  settings and cached in ``cache_dir`` (default ``$XDG_CACHE_HOME/meshdistill/teachers``), keyed by
  the teacher's sizes, the tokenizer, the data and these settings, so later runs load it."""

  SECTION = "pretrain"
  teacher: str | None = None
  cache_dir: str | None = None
  steps: int = 400
  lr: float = 3e-3
  warmup: int = 50
  seed: int = 0
  eval_every: int = 200


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardSettings:
  """The divergence guard (`meshdistill.train.loop.safeguards.DivergenceGuard`) of the training loop.

  A step diverges when its loss is non-finite or above ``factor`` times the median of the last
  ``window`` good losses (once ``min_history`` are known). The loop then restores the last good
  train state (a copy taken every ``keep_every`` steps, ``auto``: 10 where the copies stay on the devices, 100 where
  they go to host memory, whose link is slow; and at every checkpoint step: the loop holds up to two, each the
  memory of one train state, where ``keep_in`` says: ``device``, ``host`` memory, or ``auto``: host memory on an
  accelerator, whose memory the step needs, the devices on a CPU) and, for distillation, switches the distillation
  term to the ``fallback`` divergence (``mse``: logit MSE) for the rest of the freezing stage (the whole
  run without a freezing schedule). After ``max_restores`` divergences the run stops with an
  error. Every restore is written to ``metrics.jsonl`` as an ``event`` row. ``enabled: false``
  turns the guard off (and the per-step read of the loss it needs)."""

  enabled: bool = True
  window: int = guard_lib.WINDOW  # the defaults are `DivergenceGuard`'s
  factor: float = guard_lib.FACTOR
  min_history: int = guard_lib.MIN_HISTORY
  max_restores: int = guard_lib.MAX_RESTORES
  keep_every: int | str = "auto"
  keep_in: str = "auto"
  fallback: str = "mse"

  def __post_init__(self):
    positive_int("safeguards.guard.window", self.window)
    in_range("safeguards.guard.factor", self.factor, 1.0, float("inf"), lo_open=True, example=" (e.g. 4.0)")
    positive_int("safeguards.guard.min_history", self.min_history)
    if self.min_history > self.window:
      raise ConfigError(
        f"safeguards.guard.min_history={self.min_history} must be <= safeguards.guard.window={self.window}"
      )
    positive_int("safeguards.guard.max_restores", self.max_restores)
    try:  # the loop's own checks (`train.loop.state_copy`), as config errors
      state_copy.check_keep_every(self.keep_every)
      state_copy.check_keep_in(self.keep_in)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    if self.fallback not in DIVERGENCES:
      raise ConfigError(f"safeguards.guard.fallback={self.fallback!r}; choose one of {sorted(DIVERGENCES)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RematSettings:
  """Choosing rematerialisation by memory before the first step (`meshdistill.train.memory.fit_remat`).

  With ``auto`` the trainer compiles the first step, compares its per-device memory with
  ``headroom`` times the device's memory (``budget_mib`` MiB when set; a CPU device has no known
  limit, so there the check runs only with ``budget_mib``) and, if it would not fit, turns on the
  first of the student's leaner remat policies that fits (logged, and written to
  ``metrics.jsonl`` as an ``event`` row). Measuring compiles the step once more. Settings left at ``auto``
  (``student.remat``, ``train.micro_batch``, the chunk of a chunked loss the config did not name) are decided there
  together, against the same budget (`meshdistill.train.tuning`: one line, an ``auto`` event row)."""

  auto: bool = True
  budget_mib: float | None = None
  headroom: float = 0.9

  def __post_init__(self):
    if self.budget_mib is not None:
      in_range("safeguards.remat.budget_mib", self.budget_mib, 0.0, float("inf"), lo_open=True, example=" (e.g. 16000)")
    in_range("safeguards.remat.headroom", self.headroom, 0.0, 1.0, lo_open=True, example=" (e.g. 0.9)")

  @property
  def budget_bytes(self) -> int | None:
    return None if self.budget_mib is None else int(self.budget_mib * 2**20)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SafeguardSettings:
  """Run safeguards besides ``train.clip`` and the always-on skip of non-finite updates: the divergence
  guard, automatic remat (both for pretraining and distillation), and static loss scaling of the
  distillation loss (``loss_scale``: the loss gradient is multiplied by it and the gradients divided by
  it before the update; for bf16 backward passes; null = off)."""

  guard: GuardSettings = dataclasses.field(default_factory=GuardSettings)
  remat: RematSettings = dataclasses.field(default_factory=RematSettings)
  loss_scale: float | None = None

  def __post_init__(self):
    if self.loss_scale is not None:
      in_range("safeguards.loss_scale", self.loss_scale, 0.0, float("inf"), lo_open=True, example=" (e.g. 1024.0)")
      if self.loss_scale > MAX_LOSS_SCALE:
        raise ConfigError(f"safeguards.loss_scale={self.loss_scale!r} overflows float32 gradients; use at most 2**32 "
                          "(e.g. 1024.0), or null for no scaling")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
  """Train-state checkpoints (orbax): every ``every`` steps and at the end, the newest ``keep`` kept.
  ``dir`` defaults to ``<run_dir>/checkpoints``; ``every: 0`` saves only at the end."""

  dir: str | None = None
  every: int = 100
  keep: int = 2

  def __post_init__(self):
    nonneg_int("checkpoint.every", self.every)
    positive_int("checkpoint.keep", self.keep)
    if isinstance(self.dir, str):
      object.__setattr__(self, "dir", os.path.expanduser(self.dir))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings:
  """``run_dir`` receives metrics.jsonl, TensorBoard events, checkpoints, plots and the config; ``loggers``: where
  metrics go besides metrics.jsonl and the progress line (``tensorboard``, ``wandb``:
  `meshdistill.train.loop.loggers`)."""

  run_dir: str = "runs/default"
  loggers: tuple[str, ...] = ("tensorboard",)

  def __post_init__(self):
    if not isinstance(self.run_dir, str) or not self.run_dir:
      raise ConfigError(f"run.run_dir={self.run_dir!r} must be a non-empty path")
    object.__setattr__(self, "loggers", check_loggers(self.loggers))
    object.__setattr__(self, "run_dir", os.path.expanduser(self.run_dir))  # run.run_dir=~/x: the home directory
