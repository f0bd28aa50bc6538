"""What `meshdistill.train.loop.trainer.fit` is given from a `Config`: the loop and safeguard keywords, the
distillation strategy and optimizer, and the `Distiller` itself."""

from __future__ import annotations

from typing import Any

from meshdistill.config import Config, ConfigError
from meshdistill.train.loop.guard import DivergenceGuard
from meshdistill.models import Decoder
from meshdistill.strategies import Strategy, default_recipe, fallback_strategy, label
from meshdistill.teachers.sources import build_student, quantized_teacher
from meshdistill.data.alignment import TokenizerPair
from meshdistill.train.distiller import Distiller
from meshdistill.train.onpolicy import OnPolicyDistiller
from meshdistill.train.optimizers import lr_schedule, make_optimizer
from meshdistill.train.teacher import TeacherKind


def loop_kwargs(settings) -> dict:
  """`meshdistill.train.loop.trainer.fit` keywords a `TrainSettings` section (``train`` / ``pretrain``) decides: the
  number of steps, the evaluation and logging cadence, and the logged learning-rate schedule (None with
  progressive freezing, whose stages set the rate)."""
  return {
    "steps": settings.steps,
    "eval_every": settings.eval_every,
    "eval_batches": settings.eval_batches,
    "log_every": settings.log_every,
    "lr": None if settings.freeze else lr_schedule(settings),
  }


def safeguard_kwargs(cfg: Config, strategy: Strategy | None = None) -> dict:
  """`meshdistill.train.loop.trainer.fit` keywords for ``cfg.safeguards``: the divergence guard and automatic remat.

  ``strategy``: the run's distillation strategy, whose fallback is built from
  ``safeguards.guard.fallback`` (None for hard-label training: the guard then only restores).
  """
  g, r = cfg.safeguards.guard, cfg.safeguards.remat
  kwargs = {"auto_remat": r.auto, "memory_budget_bytes": r.budget_bytes, "memory_headroom": r.headroom}
  if not g.enabled:
    return kwargs
  fallback = None
  if strategy is not None:
    fallback = fallback_strategy(strategy)
    if g.fallback != "mse":
      if "divergence" not in fallback.settings():
        raise ConfigError(
          f"safeguards.guard.fallback={g.fallback!r} needs a strategy with a divergence setting (LogitKD, "
          f"ChunkedLogitKD); {label(fallback)} falls back to logit MSE only: set safeguards.guard.fallback=mse"
        )
      fallback = fallback.replace(divergence=g.fallback)
  guard = DivergenceGuard(window=g.window, factor=g.factor, min_history=g.min_history, max_restores=g.max_restores)
  return {**kwargs, "guard": guard, "keep_every": g.keep_every, "keep_in": g.keep_in, "fallback": fallback}


def _cache_safeguards(kwargs: dict, distiller) -> dict:
  """With a top-k teacher, or none, the guard only restores: its fallback loss (logit MSE) needs the teacher's
  logits."""
  if distiller.teacher_output.kind is not TeacherKind.MODEL and kwargs.get("fallback") is not None:
    kwargs = {**kwargs, "fallback": distiller.strategy}
  return kwargs


def strategy_and_optimizer(cfg: Config, student_layers: int | None = None):
  """The distillation strategy and student optimizer of ``cfg`` (what `make_distiller` and ``meshdistill plan``
  use); ``student_layers`` replaces ``cfg.student.n_layers`` for a freezing schedule. With
  ``safeguards.loss_scale`` the optimizer unscales the gradients; the step scales them (the Distiller's
  ``loss_scale``), and the strategy is the one configured."""
  layers = cfg.student.n_layers if student_layers is None else student_layers
  return cfg.distill.strategy(), make_optimizer(cfg.train, layers, loss_scale=cfg.safeguards.loss_scale)


def make_distiller(cfg: Config, teacher, mesh, tokenizer: Any = None, teacher_tokenizer: Any = None, topk_of=None,
                   cache=None):
  """The `Distiller` of ``cfg`` for ``teacher`` (student from `meshdistill.teachers.sources.build_student`); with
  ``distill.on_policy`` active an `OnPolicyDistiller` (completions end at ``tokenizer``'s EOS). With a teacher of
  its own ``teacher_tokenizer``, a strategy that compares matched tokens (``span_kl``) gets the matched vocabulary
  and one that compares next bytes (``byte_kl``) the vocabularies' byte tables. ``topk_of``: with several teachers
  on the on-policy path, what gives a generated batch their top-k (`OnPolicyDistiller`). ``cache``: on the on-policy
  path, the offline cache that serves the batches of the data's completions (the teacher runs live on the others)."""
  student = build_student(cfg, teacher, mesh)
  teacher = quantized_teacher(cfg, teacher, mesh)  # teacher.quantize: after the student copied any float blocks
  strategy, optimizer = strategy_and_optimizer(cfg)
  # a full-vocabulary LogitKD (no loss form named) runs its chunked form on a large vocabulary (the same numbers)
  named = strategy
  strategy = default_recipe(strategy, student.cfg.vocab_size, isinstance(teacher, Decoder))
  chunk = "auto" if strategy is not named else None  # the chunked form the config did not name: its chunk is tuned
  if teacher_tokenizer is not None:  # what the strategy needs of the two tokenizers (the contract's with_tokenizers)
    strategy = strategy.with_tokenizers(TokenizerPair(teacher_tokenizer, tokenizer))
  extra, cls = {}, Distiller
  if cfg.distill.on_policy.active:
    cls = OnPolicyDistiller
    eos, pad = getattr(tokenizer, "eos_id", None), getattr(tokenizer, "pad_id", None)
    extra["on_policy"] = cfg.distill.on_policy.config(eos_id=eos, pad_id=pad or 0)
    if topk_of is not None:
      extra["topk_of"] = topk_of
    if cache is not None:
      extra["cache"] = cache
  return cls(
    student,
    teacher,
    strategy=strategy,
    optimizer=optimizer,
    mesh=mesh,
    backend=cfg.mesh.backend,
    fsdp=cfg.mesh.fsdp,
    student_split=cfg.mesh.student_split,
    loss_scale=cfg.safeguards.loss_scale,
    seed=cfg.train.seed,
    micro_batch=cfg.train.micro_batch,
    chunk_size=chunk,
    **extra,
  )
