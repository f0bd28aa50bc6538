"""The main job, `distill`: teacher (its source: `meshdistill.teachers.kinds`) -> distilled student -> evaluation,
with the check against the run's checkpoint and the final teacher / student evaluation."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import IO

from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.config import Config, ConfigError
from meshdistill.config.sections import strategy_defaults
from meshdistill.core.fsutil import write_text_atomic
from meshdistill.jobs._setup import (_monitor, _run_lock, _write_config, build_mesh, describe_devices, load_data,
                                     stream_reporter)
from meshdistill.jobs._setup import checkpoint_layout, resolve_mesh, with_batch_size
from meshdistill.jobs._teacher import services, teacher_source
from meshdistill.jobs._training import _cache_safeguards, loop_kwargs, make_distiller, safeguard_kwargs
from meshdistill.train.loop.monitor import ProfileWindow
from meshdistill.data import PreferencePairs, TrainingData, read_preferences
from meshdistill.data.prompts import PromptData, read_prompts
from meshdistill.parallel.distributed import agree_on, is_primary
from meshdistill.train.loop.evaluate import Evaluator
from meshdistill.train.loop.trainer import check_resumable, fit, run_meta
from meshdistill import strategies
from meshdistill.models import param_count
from meshdistill.teachers import multi
from meshdistill.train.teacher import TeacherKind


def distill(
  cfg: Config, *, stream: IO[str] | None = None, profile: str | None = None, stop_after: int | None = None
) -> dict:
  """The main job: teacher (loaded, cached or pretrained) -> distilled student -> evaluation.

  Writes ``config.yaml``, ``metrics.jsonl``, ``tb/``, ``checkpoints/`` and ``summary.json`` into
  ``run.run_dir`` and returns the summary (teacher / student validation loss and perplexity).
  Holds the run directory's lock (`meshdistill.core.fsutil.RunLock`) throughout; ``config.yaml`` is
  written only once the settings are known to fit the checkpoint the run resumes from.
  """
  cfg = resolve_mesh(cfg)  # `mesh` auto: the devices present, recorded so in the run's config.yaml
  with _run_lock(cfg.run.run_dir, "distillation run", cfg.checkpoint_dir):
    return _distill(cfg, stream=stream, profile=profile, stop_after=stop_after)


# Settings that do not change what a run trains (how it is laid out, logged, evaluated, checkpointed; how far
# it goes): a finished or interrupted run continues under other values of these, and its config.yaml then
# records them. Any other setting differing from the run's config.yaml is an error (`_changed_settings`).
UNTRAINED_SETTINGS = (
  "run.", "checkpoint.", "mesh.", "safeguards.remat.", "data.cache_dir", "train.steps", "train.log_every",
  "train.eval_every", "train.eval_batches", "pretrain.log_every", "pretrain.eval_every", "pretrain.eval_batches",
  "teacher.remat", "student.remat", "teacher.attention", "student.attention",  # how it computes, not what
  "teacher.scan_layers", "student.scan_layers",  # how the blocks are laid out (a student resumes in its own)
  "train.micro_batch", "pretrain.micro_batch",
  # where and how a served teacher is reached (its identity, which checkpoints record, names what is trained)
  "teacher.url", "teacher.timeout", "teacher.retries", "teacher.token_env",
)


def _flat(d, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _strategy_defaults_filled(flat: dict) -> dict:
  """``flat`` with each null ``distill.<setting>`` replaced by the value the strategy trains with (its default), so a
  config.yaml that left a setting to the strategy compares equal to one that states the same value."""
  kind = flat.get("distill.kind")
  try:
    defaults = strategy_defaults(kind) if isinstance(kind, str) else None
  except (KeyError, ValueError, TypeError):  # an unknown kind: the kind itself differs or is refused elsewhere
    defaults = None
  if defaults is None:  # no kind, or an unknown one
    return flat
  out = dict(flat)
  for key, value in flat.items():
    name = key[len("distill."):] if key.startswith("distill.") else None
    if value is None and name in defaults:
      out[key] = defaults[name]
  return out


def _dtypes_resolved(flat: dict, cfg: Config) -> dict:
  """``flat`` settings with the models' ``dtype`` / ``param_dtype`` of ``auto`` as they resolve here (a frozen teacher
  stored in its compute dtype): a run written with ``float32`` before ``auto`` existed is the same run on a CPU."""
  out = dict(flat)
  for who in ("teacher", "student"):
    model = getattr(cfg, who)
    stored = model.frozen() if who == "teacher" else model  # a frozen teacher is stored in its compute dtype
    for key, value in ((f"{who}.dtype", model.compute_dtype.name), (f"{who}.param_dtype", stored.weight_dtype.name)):
      if out.get(key) == "auto":
        out[key] = value
  return out


def _changed_settings(cfg: Config) -> None:
  """Raises `ConfigError` when a setting that changes what is trained differs from the run's ``config.yaml``
  (the settings its checkpoint was trained with), naming each key with the old and the new value.

  Settings in `UNTRAINED_SETTINGS` may change (e.g. more ``train.steps`` to continue, another
  ``train.log_every``); keys only one side has (a config.yaml of an older version) are not compared.
  """
  import yaml  # pylint: disable=g-import-not-at-top

  path = os.path.join(cfg.run.run_dir, "config.yaml")
  try:
    with open(path, encoding="utf-8") as f:
      saved = yaml.safe_load(f)
  except (OSError, yaml.YAMLError):
    saved = None
  saved = _flat(saved) if isinstance(saved, dict) else {}
  now = _flat(yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False)))  # as config.yaml would hold it
  saved, now = _strategy_defaults_filled(saved), _strategy_defaults_filled(now)
  saved, now = _dtypes_resolved(saved, cfg), _dtypes_resolved(now, cfg)
  changed = [k for k in now if k in saved and saved[k] != now[k] and not k.startswith(UNTRAINED_SETTINGS)
             and k not in UNTRAINED_SETTINGS]
  if agree_on(int(bool(changed)), "whether the run's settings changed"):  # process 0 decides for the job
    shown = "; ".join(f"{k}: trained with {saved[k]!r}, now {now[k]!r}" for k in changed[:6]) or "see process 0"
    raise ConfigError(
      f"run.run_dir={cfg.run.run_dir} already holds a run trained with other settings ({shown}); nothing was "
      f"changed. A run directory keeps the settings it was trained with: give a new run.run_dir (e.g. --set "
      f"run.run_dir={cfg.run.run_dir.rstrip('/')}-2) for these settings, or use those of {path}. Only how far and "
      "how a run goes may change (train.steps, the log / eval cadence, checkpoint.*, mesh.*, run.*)"
    )


def _check_against_checkpoint(cfg: Config, expected: dict) -> None:
  """Raises when the run directory's checkpoint was written by another run (``expected``: facts of this one),
  or by this run with other settings that change what is trained (`_changed_settings`).

  The same check as `meshdistill.train.loop.trainer.fit`'s on resume, made before ``config.yaml`` is written.
  """
  # Opening a checkpoint manager is a collective: every process takes process 0's answer.
  if not agree_on(int(os.path.isdir(cfg.checkpoint_dir)), "whether the run has a checkpoint directory"):
    return
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0, read_only=True)
  try:
    if ckpt.latest_step() is None:
      return
    check_resumable(ckpt.read_meta(), expected, ckpt.directory, cfg.train.steps)
    _changed_settings(cfg)
  finally:
    ckpt.close()


def _distill(cfg: Config, *, stream, profile, stop_after) -> dict:
  """The run composed from its parts, the same steps whatever they are: the teacher source (`teacher_source`: one
  source or several, each a `meshdistill.teachers.kinds.Source`) checked and given its meshes; the files of the
  batches the student trains on read (`TrainingBatches`); the data loaded and handed to the source, which returns it
  prepared with the teacher (a `Prepared`); the `Distiller`; the student's batches made from the prepared data (a
  `meshdistill.data.TrainingData`); then training and the final evaluation."""
  run_dir = cfg.run.run_dir
  source = teacher_source(cfg)
  source.check()  # what the config alone decides (the strategy's capabilities), before any data or weights
  teacher_mesh, mesh = source.meshes(build_mesh)  # a source with devices of its own: the student's are the others
  batches = TrainingBatches.read(cfg)  # a bad preference or prompts file stops the run before any teacher work
  data = load_data(cfg, mesh=mesh)
  # Checked before the teacher is built (kind, steps), and again with the models and teacher before config.yaml is
  # written: a rejected resume changes nothing in the run directory.
  _check_against_checkpoint(cfg, {"kind": "distill"})
  settings = cfg  # config.yaml keeps the settings as given; the student resumes in its checkpoint's layout
  cfg = dataclasses.replace(cfg, student=checkpoint_layout(cfg.student, cfg.checkpoint_dir))
  say = stream_reporter(stream)
  say(describe_devices(mesh, teacher_mesh))
  say(_describe_data(data))
  prepared = source.prepare(data, mesh, teacher_mesh, services(stream, say))
  distiller = make_distiller(cfg, prepared.teacher, mesh, prepared.data.tokenizer, prepared.data.teacher_tokenizer,
                             topk_of=prepared.topk_of, cache=prepared.cache)
  data = batches.of(prepared.data, say)
  tdir = prepared.identity

  _check_against_checkpoint(cfg, run_meta(distiller, "distill", {"teacher_dir": tdir}))
  _write_config(settings, run_dir)
  monitor = _monitor(run_dir, cfg.train.steps, stream, "distill", cfg)
  try:
    summary = _train_and_evaluate(cfg, distiller, data, prepared.teachers, monitor, tdir, run_dir, profile, stop_after)
    monitor.summary(summary)  # loggers that keep one (W&B)
  finally:
    monitor.close()
  if is_primary():  # through a rename: a link put there is replaced, never written through
    write_text_atomic(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=2))
  return summary


def _describe_data(data: TrainingData) -> str:
  """One line: the data's tokens and vocabulary (and the teacher's own tokenizer's)."""
  own = data.teacher_tokenizer
  return (f"data: {data.stats['train_tokens']:,} train / {data.stats['val_tokens']:,} validation tokens, "
          f"vocabulary {data.tokenizer.vocab_size}"
          + ("" if own is None else f" (the teacher's own tokenizer: {own.vocab_size})"))


@dataclasses.dataclass(frozen=True)
class TrainingBatches:
  """What the student trains on, made from the prepared data (`of`): (chosen, rejected) row pairs for a strategy that
  reads them (its ``needs_pairs``: `meshdistill.data.PreferencePairs`, from the run's text or the rows of the
  ``preference.pairs`` file; validation stays plain text), then, with ``distill.on_policy.prompts_file``, that file's
  prompt / completion pairs instead of the corpus rows (`meshdistill.data.prompts.PromptData`); else the data itself.
  The files are read first (`read`), before any teacher work."""

  cfg: Config
  preference_rows: list | None = None  # the rows of preference.pairs (a file); None: the run's own text, or no pairs
  prompt_rows: list | None = None  # the pairs of distill.on_policy.prompts_file

  @classmethod
  def read(cls, cfg: Config) -> TrainingBatches:
    pairs, prompts_file = cfg.preference.pairs, cfg.distill.on_policy.prompts_file
    reads_pairs = strategies.get(cfg.distill.kind).needs_pairs
    return cls(cfg,
               read_preferences(os.path.expanduser(pairs)) if reads_pairs and pairs != "own" else None,
               read_prompts(os.path.expanduser(prompts_file), need_completion=True) if prompts_file else None)

  def of(self, data: TrainingData, report) -> TrainingData:
    """The student's batches made from ``data``; a line through ``report`` says what prompt pairs it trains on."""
    cfg = self.cfg
    if strategies.get(cfg.distill.kind).needs_pairs:
      pairs = cfg.preference.pairs
      data = PreferencePairs(with_batch_size(data, cfg.train.batch_size // 2),
                             source="own" if pairs == "own" else os.path.expanduser(pairs),
                             prompt_fraction=cfg.preference.prompt_fraction, rows=self.preference_rows)
    if self.prompt_rows is not None:
      data = PromptData(self.prompt_rows, data.tokenizer, seq_len=cfg.data.seq_len, batch_size=cfg.train.batch_size,
                        val_fraction=cfg.data.val_fraction, seed=cfg.data.seed)
      report(f"prompts: {data.stats['pairs']} pairs from {cfg.distill.on_policy.prompts_file}")
    return data


def _train_and_evaluate(cfg, distiller, data, teachers_data, monitor, tdir, run_dir, profile, stop_after) -> dict:
  """`fit` the distiller, then the run's summary: the student (and teachers) on the validation batches."""
  ckpt = Checkpointer(cfg.checkpoint_dir, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep)
  t = cfg.train
  try:
    result = fit(
      distiller,
      data,
      kind="distill",
      checkpointer=ckpt,
      monitor=monitor,
      evaluator=Evaluator.for_trainer(distiller),
      profile=ProfileWindow.parse(profile, os.path.join(run_dir, "profile")),
      stop_after=stop_after,
      **loop_kwargs(t),
      meta={"teacher_dir": tdir},
      **_cache_safeguards(safeguard_kwargs(cfg, distiller.strategy), distiller),
    )
  finally:
    ckpt.close()
  distiller = result.trainer
  if distiller.teacher_output.kind is not TeacherKind.MODEL:  # top-k only, or no teacher: no weights to evaluate
    val = data.val_batches(max_batches=t.eval_batches)
    summary = _evaluate_student(distiller, result.state, val)
    if teachers_data is not None and val:  # several teachers: each one's loss and the student against each
      summary["teachers"] = multi.evaluate_teachers(
          distiller, distiller.unreplicate(result.state.params)["student"], teachers_data, val,
          cfg.teachers.members(), combine_name=cfg.teachers.combine,
          temperature=float(cfg.distill.value("temperature")))
  else:
    summary = _evaluate_pair(distiller, result.state, data.val_batches(max_batches=t.eval_batches))
  summary.update({"step": result.step, "teacher_dir": tdir, "run_dir": run_dir, "train_seconds": result.seconds})
  summary["safeguards"] = {
    "remat": distiller.student_cfg.remat,
    "divergences": sum(e["kind"] == "diverged" for e in result.events),
    "events": result.events,
  }
  return summary


def _evaluate_pair(distiller, state, val) -> dict:
  student = Evaluator.for_trainer(distiller)(distiller.unreplicate(state.params)["student"], val)
  if distiller.cross_tokenizer:
    return _evaluate_cross(distiller, state, student)
  teacher_eval = Evaluator(distiller.teacher_def, mesh=distiller.layout.eval_mesh)
  teacher = teacher_eval(distiller.unreplicate(distiller.teacher_params), val)
  from flax import nnx  # pylint: disable=g-import-not-at-top

  n_student = param_count(distiller.student(state))
  n_teacher = param_count(nnx.merge(distiller.teacher_def, distiller.unreplicate(distiller.teacher_params)))
  return {
    "teacher": {"loss": teacher["loss"], "ppl": teacher["ppl"], "params": n_teacher},
    "student": {
      "loss": student["loss"],
      "ppl": student["ppl"],
      "params": n_student,
      "kl": student["kl"],
      "agree": student["agree"],
      "corr": student["corr"],
    },
    "param_ratio": n_student / n_teacher,
    "val_tokens": student["tokens"],
  }


def _evaluate_student(distiller, state, val) -> dict:
  student = Evaluator.for_trainer(distiller)(distiller.unreplicate(state.params)["student"], val)
  out = {"loss": student["loss"], "ppl": student["ppl"], "params": param_count(distiller.student(state))}
  if "bpb" in student:  # batches of two tokenizations (a cross-tokenizer cache): bits per byte too
    out["bpb"] = student["bpb"]
  return {"teacher": None, "student": out, "val_tokens": student["tokens"]}


def _evaluate_cross(distiller, state, student: dict) -> dict:
  """A teacher of another tokenizer: both models in bits per byte on the same bytes (losses per token differ)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  n_student = param_count(distiller.student(state))
  n_teacher = param_count(nnx.merge(distiller.teacher_def, distiller.unreplicate(distiller.teacher_params)))
  return {
    "teacher": {"bpb": student["teacher_bpb"], "params": n_teacher},
    "student": {"loss": student["loss"], "ppl": student["ppl"], "bpb": student["bpb"], "params": n_student},
    "param_ratio": n_student / n_teacher,
    "val_tokens": student["tokens"],
  }
