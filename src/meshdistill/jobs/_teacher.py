"""The teacher jobs: `pretrain` (a teacher from scratch on hard labels), `cache_teacher` (the offline top-k cache), and
the chosen teacher source run for a job (`prepare_teacher`, `obtain_teacher`: the sources themselves are
`meshdistill.teachers.kinds`; the jobs lend them `pretrain` through `services`). The pretrained teacher's cache key
and directory (`teacher_key`, `teacher_dir`, `default_cache_dir`) live with their source and are re-exported."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import IO

from meshdistill.storage.checkpoint import Checkpointer
from meshdistill.teachers.checkpoint import check_teacher_target, save_teacher
from meshdistill.config import Config, ConfigError
from meshdistill.jobs._setup import (_monitor, _run_lock, _write_config, build_mesh, checkpoint_layout, load_data,
                                     stream_reporter)
from meshdistill.jobs._setup import with_batch_size
from meshdistill.jobs._training import loop_kwargs, safeguard_kwargs
from meshdistill.train.loop.monitor import ProfileWindow
from meshdistill.core.ownership import OutputKind, check_owned, read_marker, write_marker
from meshdistill.parallel import distributed
from meshdistill.train.loop.evaluate import Evaluator
from meshdistill.train.loop.trainer import fit
from meshdistill.models import init_model, param_count
from meshdistill.parallel.backends import make_layout
from meshdistill.core.fsutil import read_json
from meshdistill.teachers import cache as tc
from meshdistill.teachers import kinds, multi
from meshdistill.teachers.kinds.pretrained import default_cache_dir, teacher_dir, teacher_key  # noqa: F401 (re-export)
from meshdistill.teachers.sources import quantized_teacher
from meshdistill.core.vocab import resolve_shared_vocab
from meshdistill.train.hardlabel import HardLabelTrainer
from meshdistill.train.optimizers import make_optimizer

log = logging.getLogger("meshdistill.jobs")  # the package's logger: records keep the name they always had


def pretrain(
  cfg: Config,
  *,
  data=None,
  mesh=None,
  out: str | None = None,
  run_dir: str | None = None,
  stream: IO[str] | None = None,
  profile: str | None = None,
  overwrite: bool = False,
) -> dict:
  """Pretrains the teacher of ``cfg`` from scratch on hard labels and saves it to ``out``.

  ``out`` defaults to the teacher cache (`teacher_dir`), where `distill` looks for it. An existing
  non-empty ``out`` is refused before any training unless ``overwrite`` (the cache always may be
  replaced), and only a teacher directory is ever replaced (`meshdistill.teachers.checkpoint.save_teacher`).
  Training state is checkpointed in ``run_dir`` (default ``<run.run_dir>/teacher-<key>``, the key
  of `teacher_key`, so pretraining with other settings never resumes this one), and an interrupted
  pretraining resumes. Returns a summary with the teacher's validation metrics.
  """
  if cfg.models.teacher_hf:
    raise ConfigError(
      f"teacher.hf={cfg.models.teacher_hf!r} is a pretrained teacher; `meshdistill pretrain` builds a teacher from "
      "scratch: remove teacher.hf (and give the teacher's shape) to pretrain one"
    )
  mesh = mesh if mesh is not None else build_mesh(cfg)
  data = with_batch_size(data if data is not None else load_data(cfg, mesh=mesh), cfg.pretrain.batch_size)
  if out is None:
    out, overwrite = teacher_dir(cfg, data.tokenizer), True  # the cache is ours to replace
  check_teacher_target(out, overwrite=overwrite)  # before any training
  run_dir = run_dir or os.path.join(cfg.run.run_dir, f"teacher-{teacher_key(cfg, data.tokenizer)}")
  p = cfg.pretrain
  # trained (and saved) with float32 weights; `load_teacher` stores them in teacher.param_dtype
  shape = checkpoint_layout(cfg.teacher, os.path.join(run_dir, "checkpoints"))  # a resumed run: its blocks layout
  model = init_model(shape.replace(param_dtype="float32"), seed=p.seed, mesh=mesh)
  optimizer = make_optimizer(p, cfg.teacher.n_layers)
  trainer = HardLabelTrainer(model, optimizer=optimizer, mesh=mesh, backend=cfg.mesh.backend, fsdp=cfg.mesh.fsdp,
                             micro_batch=cfg.pretrain.micro_batch)
  with _run_lock(run_dir, "pretraining"):  # one run per run directory
    _write_config(cfg, run_dir)
    monitor = _monitor(run_dir, p.steps, stream, "pretrain", cfg)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), every=cfg.checkpoint.every, keep=cfg.checkpoint.keep)
    try:
      result = fit(
        trainer,
        data,
        kind="pretrain",
        checkpointer=ckpt,
        monitor=monitor,
        evaluator=Evaluator.for_trainer(trainer, with_teacher=False),
        profile=ProfileWindow.parse(profile, os.path.join(run_dir, "profile")),
        **loop_kwargs(p),
        **safeguard_kwargs(cfg),
      )
    finally:
      ckpt.close()
      monitor.close()
  teacher = trainer.student(result.state)  # the configured model (a remat turned on for pretraining is not saved)
  info = {
    "pretrain": dataclasses.asdict(p),
    "data": cfg.to_dict()["data"],
    "eval": result.eval,
    "steps": result.step,
    "seconds": result.seconds,
    "mesh": cfg.to_dict()["mesh"],
  }
  save_teacher(out, teacher, data.tokenizer, info, overwrite=overwrite)
  return {"teacher_dir": out, "eval": result.eval, "params": param_count(teacher), "seconds": result.seconds}


def services(stream: IO[str] | None = None, report=None) -> kinds.Services:
  """What the jobs lend a teacher source: `pretrain` (looked up when called) and ``report``."""
  def pretrain_into(cfg, *, data, mesh, out):
    return pretrain(cfg, data=data, mesh=mesh, out=out, stream=stream, overwrite=True)  # the cache is ours to replace

  return kinds.Services(pretrain=pretrain_into, report=report or log.info)


def obtain_teacher(cfg: Config, data, mesh, *, stream: IO[str] | None = None, report=None):
  """``(teacher model on mesh, its identity)``: the model of the run's teacher source (`TeacherSource.runs`: the
  source itself when it runs a model -- ``teacher.hf``, the pretrained one, or any other `ModelSource` -- else the
  model whose top-k it gives). ``report(text)`` receives one line saying where the teacher came from."""
  return kinds.for_config(cfg).runs().model(data, mesh, services(stream, report))


def teacher_source(cfg: Config) -> kinds.Source:
  """The run's teacher as the distill job composes it (a `meshdistill.teachers.kinds.Source`): the several of
  ``teachers`` as one (`meshdistill.teachers.multi.Teachers`), else the source ``teacher.source`` chose
  (`meshdistill.teachers.kinds.for_config`)."""
  return multi.Teachers(cfg) if cfg.teachers.active else kinds.for_config(cfg)


def prepare_teacher(cfg: Config, data, mesh, teacher_mesh, *, stream: IO[str] | None = None, report=None):
  """The run's teacher source (`teacher_source`: the chosen one, or the several of ``teachers``) prepared for the
  run: a `Prepared`."""
  return teacher_source(cfg).prepare(data, mesh, teacher_mesh, services(stream, report))


def cache_teacher(
  cfg: Config, out: str, *, k: int = 32, precision: str = "float16", rows_per_shard: int = 1024,
  stream: IO[str] | None = None, stop_after_shards: int | None = None, teacher: str | None = None,
) -> dict:
  """Writes the top-``k`` cache of the run's teacher over its training rows into ``out`` (resumable).

  The teacher is the one `distill` would use (``teacher.hf``, ``pretrain.teacher``, cached or pretrained
  now), run on the configured mesh; log-probabilities are taken at ``distill.temperature`` over the
  token range teacher and student share. In a job of several processes each process is one writer:
  the teacher runs on its rows of the mesh alone (`teacher_cache.process_mesh`) and writes every n-th
  shard; every process returns the manifest process 0 writes once all shards are there. ``out`` is checked
  first (`CACHE_KIND`): new, empty, or a cache meshdistill started there (its owner marker; without one, an
  earlier version's cache files only); a directory of other files is refused before any work.

  With several teachers (``teachers:``) ``teacher`` names the one to cache (a member that runs a model), at its own
  ``temperature``: the cache is then that member's, for a run that lists it as ``source: cache``.
  """
  cfg = multi.one_teacher(cfg, teacher)
  if kinds.for_config(cfg).gives == kinds.NOTHING:  # obtain_teacher would pretrain a teacher to cache
    raise ConfigError(f"cache-teacher writes the top-k of the run's teacher, but teacher.source="
                      f"{cfg.models.teacher_kind} gives no teacher; set teacher.hf (a Hugging Face teacher) or "
                      "teacher.source=pretrained (pretrain.teacher=DIR, or one pretrained for these settings)")
  reason = kinds.temperature_refusal(cfg.distill, "a teacher cache holds the teacher's log-probabilities")
  if reason:
    raise ConfigError(reason)
  tau = cfg.distill.value("temperature")  # the section's, or the strategy's default

  if distributed.is_primary():  # before any teacher is loaded or pretrained: a refused --out costs nothing
    if not check_owned(out, CACHE_KIND, overwrite=None) or read_marker(out) is None:
      write_marker(out, CACHE_KIND)  # a new cache (or one an earlier version started): ours from now on
  mesh = build_mesh(cfg)
  data = load_data(cfg, mesh=mesh)
  say = stream_reporter(stream)
  cross = data.teacher_tokenizer is not None  # a teacher of its own tokenizer: rows of its tokens
  teacher, _ = obtain_teacher(cfg, data.teacher_side(), mesh, stream=stream, report=say)

  teacher = quantized_teacher(cfg, teacher, mesh)  # teacher.quantize
  if cross:  # the teacher's whole vocabulary: any student tokenizer reads the cache
    vocab = teacher.cfg.vocab_size
  else:
    vocab = resolve_shared_vocab(teacher.cfg.vocab_size, cfg.student.vocab_size) or teacher.cfg.vocab_size
  program_mesh, batch_size = make_layout(cfg.mesh.backend, mesh).eval_mesh, data.global_batch_size
  if distributed.process_count() > 1:
    # One writer per process: each runs the teacher alone on its own rows of the mesh (the same per-device
    # program and rows per device as one process on the whole mesh) and writes every n-th shard.
    try:
      program_mesh = tc.process_mesh(mesh)
      teacher = _on_mesh(teacher, program_mesh)
    except ValueError as e:
      raise ConfigError(f"cache-teacher as {distributed.process_count()} processes: {e}") from None
    batch_size = batch_size * program_mesh.shape["data"] // mesh.shape["data"]
  program = tc.TeacherTopK(teacher, k=k, temperature=float(tau), vocab=vocab, mesh=program_mesh)
  rows = data.train
  if cross:  # rows cut on the teacher's tokens alone (data.teacher_seq_len of them): no student in the cache
    rows = tc.teacher_rows_of(data, cfg.data.teacher_seq_len or cfg.data.seq_len)
    identity = {"teacher": tc.teacher_identity(teacher), "cross": True,
                "teacher_tokenizer": tc.tokenizer_identity(data.teacher_tokenizer, cfg.data.teacher_tokenizer),
                "data": tc.teacher_rows_identity(rows, data.teacher_tokenizer, cfg.data.source)}
  else:
    identity = {"teacher": tc.teacher_identity(teacher), "cross": False,
                "teacher_tokenizer": tc.tokenizer_identity(data.tokenizer, cfg.data.tokenizer),
                "data": tc.data_identity(data.train, data.tokenizer, cfg.data.source)}
  t0 = time.perf_counter()
  manifest = tc.write_cache(program, rows, out, identity=identity, precision=precision,
                            rows_per_shard=rows_per_shard, batch_size=batch_size,
                            process_index=distributed.process_index(), process_count=distributed.process_count(),
                            stop_after_shards=stop_after_shards, barrier=_barrier)
  say(f"teacher cache: {len(rows)} rows x {rows.seq_len} {'teacher ' if cross else ''}tokens -> {out} in "
      f"{time.perf_counter() - t0:.1f}s" + (f" ({distributed.process_count()} writers)"
                                             if distributed.process_count() > 1 else ""))
  return manifest


def _cache_entry(name: str) -> bool:
  return name in ("manifest.json",) or (name.startswith("shard-") and name.endswith(".safetensors")) or (
    name.startswith("progress-") and name.endswith(".json")) or name.startswith(".tmp-")


def _earlier_cache(path: str) -> str | None:
  """None when a marker-less ``path`` holds a teacher cache an earlier version wrote (a manifest or progress
  records of its shards, each naming the settings it was written with); else why not."""
  records = [n for n in sorted(os.listdir(path)) if n == "manifest.json" or n.startswith("progress-")]
  if not records:
    return "no manifest.json or progress record"
  for n in records:
    try:
      record = read_json(os.path.join(path, n), "teacher cache record")
    except (OSError, ValueError) as e:
      return str(e)
    if not isinstance(record.get("shards"), (list, dict)) or (n != "manifest.json" and "settings" not in record):
      return f"{n} is not a teacher cache record (no settings / shards)"
  return None


CACHE_KIND = OutputKind("teacher-cache", "teacher cache directory (--out)", _cache_entry, _earlier_cache)


def _on_mesh(teacher, mesh):
  """``teacher`` with its parameters on ``mesh``, this process's part of the job's mesh (no copy)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  graphdef, params = nnx.split(teacher)
  return nnx.merge(graphdef, tc.on_process_mesh(params, mesh))


def _barrier(name: str) -> None:
  """Waits for every process; a writer with more shards may finish a shard's time later than the others."""
  distributed.barrier(name, timeout_s=24 * 3600)  # a process that dies stops the others (missed heartbeats)
