"""On-policy distillation (GKD): the student writes the completions it is graded on.

Per train step, with probability ``lmbda`` the student samples completions of the batch's prompts
(on-policy); otherwise the batch's own completions are used (off-policy). ``seq_kd`` lets the
teacher sample instead (sequence-level KD). The teacher then scores the sequences inside the
ordinary distillation step (`meshdistill.train.step.per_device_step`, unchanged), whose loss mask covers
the completion tokens only, so the divergence (``distill.divergence``: forward/reverse KL,
generalized JSD with ``beta``, ...) at the loss temperature ``distill.temperature`` is taken on
exactly the sampled tokens. The sampling temperature is a separate setting.

The generation is its own jitted program (`meshdistill.models.generate.generate`), run just before the
step on the same layout and reading the train state's student parameters in place (no copy).
Its PRNG key is ``fold_in(key(seed), step)`` and the coin flip ``uniform(fold_in(key(seed + 1),
step)) < lmbda``: a run is reproducible, resumes identically, and every layout samples the same text.

Batches: a prompt/completion batch (`meshdistill.data.prompts`: with ``prompt_len``) keeps its prompts;
a packed batch of documents is cut, the first ``seq_len + 1 - max_new_tokens`` tokens of each row
becoming its prompt and the rest its completion. Generated batches have the same ``[B, seq_len]``
shape, so the step compiles once for both kinds.

With ``alpha < 1`` the hard-label CE term of `LogitKD` is taken on the sampled tokens too; GKD
recipes use ``distill.alpha=1`` (divergence only).

Two forms, by strategy: GKD (a distribution divergence, `LogitKD`, on the sampled sequences) and the
sampled-token form (`meshdistill.strategies.SampledTokenKD`, ``distill.kind=sampled_token``: REINFORCE with
the advantage ``log p_teacher(y_t) - log p_student(y_t)`` on the student's own tokens, usually ``lambda=1``).

Off-policy batches from an offline cache (``cache``, a `meshdistill.teachers.cache.TeacherCache` written over
the training rows): the batches whose coin says "data" read the teacher's top-k from the cache by their
``row_ids`` (the data iterator yields them) and the step runs no teacher; the generated batches, which no cache
can hold, run the teacher live. The strategy must then train from a top-k teacher (`LogitKD` with
``top_k <= k``, the same top-k loss the live teacher's share computes from its logits, or `SampledTokenKD`).

Several teachers (``teachers:``, `meshdistill.teachers.multi`): the distiller's teacher is their combined top-k
(a `meshdistill.teachers.cache.TopKTeacher` with names), which the data's batches carry; a batch without it (a
generated one, or a prompt/completion pair) is given it by ``topk_of`` (the teachers' programs run on its rows:
each row's own teacher by its ``domain`` under ``combine: route``, their mixture under ``mix``), so the step is the
same for both kinds. A generated row keeps its prompt's ``domain``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from meshdistill.train.distiller import Distiller
from meshdistill.train.teacher import TeacherKind, TeacherOutput, decide
from meshdistill.parallel.distributed import process_count
from meshdistill.models.generate import SamplingConfig, generate
from meshdistill.strategies import Strategy
from meshdistill.data import DOMAIN_KEY
from meshdistill.data.prompts import completion_batch, cut_prompts, prompts_of
from meshdistill.core.batch import TOPK_KEYS

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnPolicyConfig(SamplingConfig):
  """GKD settings: ``lmbda`` = probability that a batch is generated; ``seq_kd``: the teacher generates.

  Defaults: ``lmbda=0.5`` (TRL's GKD default) and sampling at ``temperature=1`` (the GKD paper's; TRL's default is
  0.9). GKD's loss is ``LogitKD(divergence="jsd", beta=0.5, temperature=1.0, alpha=1.0)`` (``beta`` in TRL's
  convention, 0.5 its default; ``alpha=1``: the divergence alone). Every arm's loss is the token mean over the
  completion tokens of the global batch (sampled ones, EOS included, for a generated batch; the data's for the
  others); prompt and padding positions never count.

  The sampler's settings (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``eos_id`` ending a
  completion, ``pad_id`` filling rows) are those of `SamplingConfig`, checked there.
  """

  lmbda: float = 0.5
  seq_kd: bool = False

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.lmbda, bool) or not isinstance(self.lmbda, (int, float)) or not 0 <= self.lmbda <= 1:
      raise ValueError(f"OnPolicyConfig.lmbda={self.lmbda!r} must be a number in [0, 1] (0 = dataset completions "
                       "only, 1 = always sample)")

  def sampling(self) -> SamplingConfig:
    return SamplingConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingConfig)})


class OnPolicyDistiller(Distiller):
  """A `Distiller` whose batches are, with probability ``on_policy.lmbda``, completed by the student.

  Takes the `Distiller` arguments plus ``on_policy`` (an `OnPolicyConfig`) and ``cache`` (a
  `meshdistill.teachers.cache.TeacherCache` over the training rows, or None: the off-policy batches' teacher; see
  the module docstring) or ``topk_of`` (with a top-k teacher of several, ``teacher`` a `TopKTeacher`: a batch
  without the teachers' top-k -> the batch with it, e.g. `meshdistill.teachers.multi.MultiTeacherData.score`).
  ``step`` returns the step's
  metrics (``tokens``: the completion tokens trained on, a host number) plus ``on_policy`` (1 for a
  generated batch, else 0) and, for generated batches,
  ``sample_len`` (mean completion length) and ``sample_nll`` (the teacher's per-token NLL of the
  generated completions: the step's ``teacher_ce`` on them).
  """

  def __init__(self, student, teacher, *, on_policy: OnPolicyConfig, cache=None, topk_of=None, **kwargs):
    if process_count() > 1:  # the sampled batch is built on the host from the whole batch's completions
      raise ValueError(
          f"on-policy distillation (distill.on_policy.lambda={on_policy.lmbda}, seq_kd={on_policy.seq_kd}) runs as "
          f"one process, but this job has {process_count()}; run it on one host (its devices as mesh.data x "
          "mesh.tensor), or set distill.on_policy.lambda=0 and seq_kd=false for off-policy KD across processes"
      )
    self.cache = cache  # read by `_decide_teacher` while the Distiller is built
    super().__init__(student, teacher, **kwargs)
    self.on_policy = on_policy
    self.topk_of = topk_of
    if self.teacher_output.kind is TeacherKind.TOPK:
      topk = self.topk_teacher
      assert topk is not None  # `decide`: a TOPK teacher carries its TopKTeacher
      if cache is not None or topk_of is None:
        raise ValueError(f"{topk.source} gives the teacher's top-k of the data's rows; the generated rows "
                         "need their own: pass topk_of (the teachers' programs on a batch's rows), or a teacher model")
      if on_policy.seq_kd:
        raise ValueError(f"distill.on_policy.seq_kd: the teacher samples, but {topk.source} has no one "
                         "teacher model to sample from; set seq_kd=false (the student samples) or use one teacher")
    elif topk_of is not None:
      raise ValueError("topk_of scores generated rows for a top-k teacher (several teachers); this distiller runs its "
                       "teacher model in the step: leave topk_of out")
    if cache is not None:
      if self.teacher_output.kind is not TeacherKind.MODEL:
        raise ValueError(f"an off-policy cache ({cache.path}) serves the data's batches; the generated ones need a "
                         "live teacher, but this distiller has none: pass the teacher model")
      cache.spec().check_strategy(self.strategy)
      cache_vocab = cache.manifest["vocab"]
      if cache_vocab > self.student_cfg.vocab_size:
        raise ValueError(f"teacher cache {cache.path} has token ids up to {cache_vocab} but the student's vocab_size "
                         f"is {self.student_cfg.vocab_size}; use the cache of this teacher and tokenizer")

  def _decide_teacher(self, teacher: Any, strategy: Strategy | None) -> TeacherOutput:
    """A teacher model whose off-policy batches bring its top-k from ``cache`` (`decide`'s ``cache_rows``)."""
    return decide(teacher, strategy, cache_rows=self.cache is not None)

  def prompt_width(self, seq_len: int) -> int:
    """Room for a prompt in a row of ``seq_len`` positions when ``max_new_tokens`` are generated."""
    width = seq_len + 1 - self.on_policy.max_new_tokens
    if width < 1:
      raise ValueError(
          f"on_policy.max_new_tokens={self.on_policy.max_new_tokens} leaves no room for a prompt in rows of "
          f"seq_len={seq_len} tokens; use max_new_tokens <= {seq_len}"
      )
    return width

  def as_prompt_batch(self, batch: dict) -> dict:
    """``batch`` with ``prompt_len`` (a packed batch is cut into prompt + completion)."""
    if "prompt_len" in batch:
      return dict(batch)
    return cut_prompts(batch, self.prompt_width(np.shape(batch["inputs"])[1]))

  def wants_sample(self, step: int) -> bool:
    """The step's coin: whether its batch is generated (reproducible from the seed and step)."""
    if self.on_policy.lmbda == 0:
      return False
    u = jax.random.uniform(jax.random.fold_in(jax.random.key(self.seed + 1), step))
    return bool(float(u) < self.on_policy.lmbda)

  def sample_batch(self, state, batch: dict, step: int) -> dict:
    """The prompts of ``batch`` completed by the student (the teacher with ``seq_kd``) at ``step``."""
    seq_len = np.shape(batch["inputs"])[1]
    prompts, prompt_mask = prompts_of(batch, self.prompt_width(seq_len), self.on_policy.pad_id)
    if self.on_policy.seq_kd:
      model = (self.teacher_def, self.unreplicate(self.teacher_params))
    else:
      model = (self.student_def, self.unreplicate(state.params)["student"])
    mesh = self.layout.eval_mesh
    key = jax.random.fold_in(jax.random.key(self.seed), step)
    gen = jax.device_get(generate(model, prompts, prompt_mask, key, self.on_policy.sampling(), mesh=mesh))
    out = completion_batch(prompts, prompt_mask, gen.tokens_BxN, gen.mask_BxN, seq_len, self.on_policy.pad_id)
    if DOMAIN_KEY in batch:  # a row's corpus is its prompt's (several teachers route by it)
      out[DOMAIN_KEY] = np.asarray(batch[DOMAIN_KEY])
    return out

  def step(self, state, batch: dict):
    step = int(np.asarray(jax.device_get(self.unreplicate(state).step)))
    batch = self.as_prompt_batch(batch)
    sampled = self.wants_sample(step)
    row_ids = batch.pop("row_ids", None)
    if sampled:
      batch = self.sample_batch(state, batch, step)
    elif self.cache is not None:  # the data's completions: the teacher's top-k from the cache
      if row_ids is None:
        raise ValueError(f"with the off-policy cache {self.cache.path} every batch carries row_ids (its rows in the "
                         "cache); read the data with train_iterator(row_ids=True)")
      batch = {**batch, **self.cache.rows(row_ids)}
    if self.topk_of is not None and TOPK_KEYS[0] not in batch:  # generated rows (or prompt pairs): scored now
      batch = self.topk_of(batch)
    new_state, metrics = super().step(state, batch)
    metrics = dict(metrics)
    # The tokens trained on (completion targets; sampled ones for a generated batch), counted on the host:
    # `fit` reports tokens/s from this rather than from the mask of the batch it handed over.
    metrics["tokens"] = np.float32(np.sum(batch["mask"]))
    metrics["on_policy"] = np.float32(sampled)
    if sampled:
      metrics["sample_len"] = np.float32(np.mean(np.sum(batch["mask"], axis=1)))
      if "teacher_ce" in metrics:
        metrics["sample_nll"] = metrics["teacher_ce"]
    return new_state, metrics
