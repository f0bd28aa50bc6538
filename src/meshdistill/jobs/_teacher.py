"""The teacher jobs: the teacher cache's key and directory, `pretrain` (a teacher from scratch on hard
labels), `obtain_teacher` (given, cached or pretrained now), the offline top-k cache (`cache_teacher`, and
opening one for a run) and the teacher on its own sub-mesh (``teacher.devices``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import IO, Any

from meshdistill.storage.checkpoint import (
  Checkpointer,
  TeacherDamagedError,
  check_teacher_target,
  load_teacher,
  save_teacher,
)
from meshdistill.config import Config, ConfigError
from meshdistill.jobs._setup import _monitor, _run_lock, _write_config, build_mesh, load_data, stream_reporter
from meshdistill.jobs._setup import with_batch_size
from meshdistill.jobs._training import loop_kwargs, safeguard_kwargs
from meshdistill.loop.monitor import ProfileWindow
from meshdistill.storage.ownership import OutputKind, check_owned, read_marker, write_marker
from meshdistill import distributed
from meshdistill.distributed import agree_on
from meshdistill.loop.evaluate import Evaluator
from meshdistill.loop.trainer import fit
from meshdistill.models import init_model, param_count
from meshdistill.parallel.backends import layout_class, make_layout
from meshdistill.storage.fsutil import read_json
from meshdistill.teachers import cache as tc
from meshdistill.teachers.mesh import TeacherMeshData, TeacherOnMesh, split_meshes
from meshdistill.teachers.sources import load_teacher_hf, quantized_teacher
from meshdistill.train.distiller import resolve_shared_vocab
from meshdistill.train.hardlabel import HardLabelTrainer
from meshdistill.train.optimizers import make_optimizer

log = logging.getLogger("meshdistill.jobs")  # the package's logger: records keep the name they always had


def default_cache_dir() -> str:
  """``$MESHDISTILL_CACHE`` or ``$XDG_CACHE_HOME/meshdistill`` (default ``~/.cache/meshdistill``) + ``/teachers``."""
  root = os.environ.get("MESHDISTILL_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshdistill"
  )
  return os.path.join(root, "teachers")


def teacher_key(cfg: Config, tokenizer: Any) -> str:
  """A digest of everything that determines a pretrained teacher (sizes, tokenizer, data, recipe, mesh-free)."""
  p = cfg.pretrain
  recipe = {
    k: getattr(p, k)
    for k in ("steps", "batch_size", "lr", "warmup", "final_lr_fraction", "weight_decay", "clip", "seed")
  }
  if p.freeze:  # a freezing schedule changes the teacher; absent, the key stays what it was before the setting counted
    recipe["freeze"] = p.freeze
  d = cfg.data
  data = {
    k: getattr(d, k)
    for k in ("source", "text_key", "val_fraction", "max_chars", "max_docs", "seq_len", "seed", "num_epochs")
  }
  # the teacher is pretrained and cached in float32 whatever teacher.param_dtype (the stored dtype, cast on load)
  model = {k: v for k, v in dataclasses.asdict(cfg.teacher).items() if k != "param_dtype"}
  blob = json.dumps(
    {"model": model, "tokenizer": tokenizer.fingerprint, "data": data, "recipe": recipe},
    sort_keys=True,
    default=str,
  )
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def teacher_dir(cfg: Config, tokenizer: Any) -> str:
  """Where the cached teacher of ``cfg`` lives (``pretrain.cache_dir`` / ``default_cache_dir()``)."""
  root = os.path.expanduser(cfg.pretrain.cache_dir) if cfg.pretrain.cache_dir else default_cache_dir()
  return os.path.join(root, f"teacher-{teacher_key(cfg, tokenizer)}")


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
  replaced), and only a teacher directory is ever replaced (`meshdistill.storage.checkpoint.save_teacher`).
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
  model = init_model(cfg.teacher.replace(param_dtype="float32"), seed=p.seed, mesh=mesh)
  optimizer = make_optimizer(p, cfg.teacher.n_layers)
  trainer = HardLabelTrainer(model, optimizer=optimizer, mesh=mesh, backend=cfg.mesh.backend, fsdp=cfg.mesh.fsdp)
  with _run_lock(run_dir, "pretraining"):  # one run per run directory
    _write_config(cfg, run_dir)
    monitor = _monitor(run_dir, p.steps, stream, "pretrain")
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


def obtain_teacher(cfg: Config, data, mesh, *, stream: IO[str] | None = None, report=None):
  """The teacher `Decoder` on ``mesh``: from ``pretrain.teacher``, the cache, or pretrained now.

  ``report(text)`` receives one line saying where the teacher came from.
  """
  report = report or log.info
  if cfg.models.teacher_hf:
    report(f"teacher: {cfg.models.teacher_hf} (Hugging Face)")
    return load_teacher_hf(cfg, mesh), cfg.models.teacher_hf
  if cfg.pretrain.teacher:
    path = os.path.expanduser(cfg.pretrain.teacher)
    report(f"teacher: {path}")
    return load_teacher(path, cfg.teacher, mesh, data.tokenizer), path

  path = teacher_dir(cfg, data.tokenizer)
  # Every process of a job takes process 0's answer: pretraining is a collective.
  if agree_on(int(os.path.isfile(os.path.join(path, "teacher.json"))), "whether the teacher is cached"):
    report(f"teacher: cached {path}")
    try:
      return load_teacher(path, cfg.teacher, mesh, data.tokenizer), path
    except Exception as e:  # noqa: BLE001 -- any unreadable cache entry is rebuilt, the reason reported
      # The cache key covers the architecture and the tokenizer: a cached teacher that does not load is damaged.
      why = str(e) if isinstance(e, TeacherDamagedError) else f"{type(e).__name__}: {str(e)[:300]}"
      log.warning("cached teacher %s cannot be used (%s); rebuilding it", path, why)
      report(f"teacher: the cached teacher is damaged ({why}); pretraining it again ({cfg.pretrain.steps} steps)")
  else:
    report(f"teacher: none cached for these settings; pretraining one ({cfg.pretrain.steps} steps) -> {path}")
  pretrain(cfg, data=data, mesh=mesh, out=path, stream=stream, overwrite=True)  # the cache is ours to replace
  return load_teacher(path, cfg.teacher, mesh, data.tokenizer), path


def _open_teacher_cache(cfg: Config, data, say):
  """``teacher.cache``: the cache (checked against this run's data, tokenizer, teacher config and student
  vocabulary), the data with the teacher's top-k in every training batch, and the teacher as a `TopKTeacher`."""
  if cfg.models.student_init.from_teacher:
    raise ConfigError("student.init.from_teacher copies the teacher's weights, but teacher.cache loads none; "
                      "remove student.init (or teacher.cache)")
  cache = tc.TeacherCache(cfg.models.teacher_cache)
  # how the teacher computes or is placed, not what: remat, stacked blocks, and the vocabulary padding and
  # key/value replication `ModelConfig.for_tensor` adds for the writer's mesh (the manifest holds the fitted config)
  layout = ("remat", "scan_layers", "vocab_multiple", "replicate_kv")
  teacher_cfg = {k: v for k, v in dataclasses.asdict(cfg.teacher).items() if k not in layout}
  # a cache written before param_dtype was a setting: float32 weights
  saved_cfg = {"param_dtype": "float32", **{k: v for k, v in cache.manifest["teacher"]["config"].items()
                                             if k not in layout}}
  if saved_cfg != teacher_cfg:
    diff = sorted(k for k in set(saved_cfg) | set(teacher_cfg) if saved_cfg.get(k) != teacher_cfg.get(k))
    raise ConfigError(
      f"teacher.cache={cache.path} was made by another teacher (teacher.{diff[0]}: cache "
      f"{saved_cfg.get(diff[0])!r}, this config {teacher_cfg.get(diff[0])!r}); use the config that wrote the cache"
    )
  cache.check(data=tc.data_identity(data.train, data.tokenizer), vocab=cfg.student.vocab_size)
  say(f"teacher: top-{cache.k} cache {cache.path} ({cache.manifest['precision']}, "
      f"{cache.bytes_per_token():.1f} bytes/token); no teacher weights loaded")
  return tc.CachedTeacherData(data, cache), cache.spec(), cache.path


def _split_meshes(cfg: Config):
  """``teacher.devices``: the teacher's mesh and the student's (``mesh.data`` x ``mesh.tensor``), disjoint."""
  td = cfg.models.teacher_devices

  # Checked first (before data or teacher): the teacher on its own mesh sends the student its top-k only.
  if cfg.distill.kind != "logit_kd" or cfg.distill.top_k is None:
    what = f"distill.kind={cfg.distill.kind}" + (" without distill.top_k" if cfg.distill.kind == "logit_kd" else "")
    raise ConfigError(
      f"teacher.devices sends the student the teacher's top-k only (not its logits, hidden states or attention "
      f"maps), but {what} needs more: set distill.kind=logit_kd and distill.top_k (e.g. 32), or remove "
      "teacher.devices to run the teacher on the student's mesh (the full-vocabulary and chunked losses, "
      "attention and feature transfer)"
    )
  tau = cfg.distill.value("temperature")  # the section's, or the strategy's default
  if callable(tau) or isinstance(tau, dict):
    raise ConfigError("teacher.devices needs a constant distill.temperature (the top-k is taken at it)")

  if not layout_class(cfg.mesh.backend).spans_processes:  # a mesh split over devices of its own
    raise ConfigError(f"teacher.devices needs mesh.backend=shard_map (got {cfg.mesh.backend!r})")
  try:
    return split_meshes((td["data"], td["tensor"]), (cfg.mesh.data, cfg.mesh.tensor))
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _teacher_on_own_mesh(cfg: Config, data, teacher_mesh, mesh, stream, say):
  """``teacher.devices``: the teacher on ``teacher_mesh``, its top-k fed to the student on ``mesh``."""
  td = cfg.models.teacher_devices
  teacher, tdir = obtain_teacher(cfg, data, teacher_mesh, stream=stream, report=say)

  teacher = quantized_teacher(cfg, teacher, teacher_mesh)  # teacher.quantize
  vocab = resolve_shared_vocab(teacher.cfg.vocab_size, cfg.student.vocab_size) or teacher.cfg.vocab_size
  tau = float(cfg.distill.value("temperature"))  # constant: checked by teacher_devices_mesh
  on_mesh = TeacherOnMesh(teacher, k=cfg.distill.top_k, temperature=tau, vocab=vocab,
                          teacher_mesh=teacher_mesh, student_mesh=mesh)
  say(f"teacher: on its own {td['data']}x{td['tensor']} mesh, student on {cfg.mesh.data}x{cfg.mesh.tensor}")
  return TeacherMeshData(data, on_mesh), on_mesh.spec(), tdir


def cache_teacher(
  cfg: Config, out: str, *, k: int = 32, precision: str = "float16", rows_per_shard: int = 1024,
  stream: IO[str] | None = None, stop_after_shards: int | None = None,
) -> dict:
  """Writes the top-``k`` cache of the run's teacher over its training rows into ``out`` (resumable).

  The teacher is the one `distill` would use (``teacher.hf``, ``pretrain.teacher``, cached or pretrained
  now), run on the configured mesh; log-probabilities are taken at ``distill.temperature`` over the
  token range teacher and student share. In a job of several processes each process is one writer:
  the teacher runs on its rows of the mesh alone (`teacher_cache.process_mesh`) and writes every n-th
  shard; every process returns the manifest process 0 writes once all shards are there. ``out`` is checked
  first (`CACHE_KIND`): new, empty, or a cache meshdistill started there (its owner marker; without one, an
  earlier version's cache files only); a directory of other files is refused before any work.
  """
  tau = cfg.distill.value("temperature")  # the section's, or the strategy's default
  if callable(tau) or isinstance(tau, dict):
    raise ConfigError(f"distill.temperature={tau!r}: a teacher cache holds log-probabilities "
                      "at one temperature; set a constant distill.temperature")

  if distributed.is_primary():  # before any teacher is loaded or pretrained: a refused --out costs nothing
    if not check_owned(out, CACHE_KIND, overwrite=None) or read_marker(out) is None:
      write_marker(out, CACHE_KIND)  # a new cache (or one an earlier version started): ours from now on
  mesh = build_mesh(cfg)
  data = load_data(cfg, mesh=mesh)
  say = stream_reporter(stream)
  teacher, _ = obtain_teacher(cfg, data, mesh, stream=stream, report=say)

  teacher = quantized_teacher(cfg, teacher, mesh)  # teacher.quantize
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
  identity = {"teacher": tc.teacher_identity(teacher),
              "data": tc.data_identity(data.train, data.tokenizer, cfg.data.source)}
  t0 = time.perf_counter()
  manifest = tc.write_cache(program, data.train, out, identity=identity, precision=precision,
                            rows_per_shard=rows_per_shard, batch_size=batch_size,
                            process_index=distributed.process_index(), process_count=distributed.process_count(),
                            stop_after_shards=stop_after_shards, barrier=_barrier)
  say(f"teacher cache: {len(data.train)} rows x {data.train.seq_len} tokens -> {out} in "
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
