"""Whole jobs from a `Config`: pretrain a teacher, distil a student, evaluate a run.

The CLI is a thin shell over these functions; scripts and benchmarks call them directly.
Order of work in `distill` (the main job):

1. the mesh (``mesh.data`` x ``mesh.tensor``; on CPU, simulated devices -- see
   `prepare_devices`, which must run before JAX starts);
2. the data (`meshdistill.data.build_data`): tokenizer, training iterator, validation batches;
3. the teacher: ``teacher.hf`` (a Hugging Face directory) or ``pretrain.teacher`` if given, else the
   cached teacher for these settings, else one pretrained now on hard labels (`pretrain`) and cached;
4. the student, directly on the mesh: ``student.hf``, copied from the teacher's blocks
   (``student.init``), or initialised from ``train.seed`` (`meshdistill.sources.build_student`);
5. `meshdistill.trainer.fit` with a `Distiller`, checkpoints and monitoring in ``run.run_dir``;
6. the final evaluation of teacher and student on the validation batches (``summary.json``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import IO, Any

from meshdistill.checkpoint import (
  Checkpointer,
  TeacherDamagedError,
  check_teacher_target,
  load_teacher,
  read_teacher_meta,
  save_teacher,
)
from meshdistill.config import Config, ConfigError, dump_config
from meshdistill.fsutil import RunLock
from meshdistill.monitor import Monitor, ProfileWindow

log = logging.getLogger(__name__)


def prepare_devices(cfg: Config) -> None:
  """Makes the devices the mesh needs exist. Call before anything starts JAX.

  ``mesh.simulate_cpu_devices``: ``auto`` asks the CPU platform for ``data * tensor`` devices
  (it only affects the CPU platform: on a GPU/TPU machine JAX still uses the accelerators);
  ``true`` also forces the CPU platform; ``false`` leaves devices as they are. In a job of several
  processes (`meshdistill.distributed.initialize` first) each process simulates its share.
  """
  from meshdistill.distributed import local_device_share  # pylint: disable=g-import-not-at-top
  from meshdistill.mesh import simulate_cpu_devices  # pylint: disable=g-import-not-at-top

  sim = cfg.mesh.simulate_cpu_devices
  if sim is False:
    return
  if sim is True:
    os.environ["JAX_PLATFORMS"] = "cpu"
  n = cfg.mesh.devices
  if cfg.models.teacher_devices:  # the teacher's own mesh takes devices beside the student's
    n += cfg.models.teacher_devices["data"] * cfg.models.teacher_devices["tensor"]
  if n > 1 or sim is True:
    simulate_cpu_devices(local_device_share(n))


def build_mesh(cfg: Config):
  """The run's mesh (None for the ``single`` backend)."""
  from meshdistill.distributed import data_shard, process_count  # pylint: disable=g-import-not-at-top
  from meshdistill.layout import BACKENDS, layout_class  # pylint: disable=g-import-not-at-top
  from meshdistill.mesh import make_mesh  # pylint: disable=g-import-not-at-top

  layout = layout_class(cfg.mesh.backend)
  if process_count() > 1 and not layout.spans_processes:
    spanning = [name for name in BACKENDS if layout_class(name).spans_processes]
    raise ConfigError(
      f"mesh.backend={cfg.mesh.backend!r} cannot span the {process_count()} processes of this job; use "
      f"mesh.backend={spanning[0]}"
    )
  if layout.one_device:
    return None
  try:
    mesh = make_mesh(data=cfg.mesh.data, tensor=cfg.mesh.tensor)
    data_shard(mesh)  # each process's share of a batch is well defined
    return mesh
  except ValueError as e:
    raise ConfigError(
      f"{e}. Set the layout with e.g. --set mesh.data=1 --set mesh.tensor=1 (or mesh.backend=single), "
      "or run on simulated CPU devices with --set mesh.simulate_cpu_devices=true"
    ) from None


def load_data(cfg: Config, batch_size: int | None = None, mesh=None):
  """The data bundle of ``cfg`` for the distillation batch size; checks the vocabulary fits the models.

  In a job of several processes each process reads the rows of every batch its devices of ``mesh``
  hold (`meshdistill.distributed.data_shard`).
  """
  from meshdistill.data import build_data  # pylint: disable=g-import-not-at-top
  from meshdistill.distributed import data_shard  # pylint: disable=g-import-not-at-top

  index, count = data_shard(mesh)
  data = build_data(
    cfg.data, cfg.train.batch_size if batch_size is None else batch_size, process_index=index, process_count=count
  )
  vocab = data.tokenizer.vocab_size
  for who in ("teacher", "student"):
    have = getattr(cfg, who).vocab_size
    if have < vocab:
      raise ConfigError(
        f"{who}.vocab_size={have} is smaller than the tokenizer's vocabulary ({vocab} ids, "
        f"data.tokenizer={cfg.data.tokenizer!r}); set teacher.vocab_size={vocab} and student.vocab_size={vocab}"
      )
  return data


def with_batch_size(data, batch_size: int):
  """The same data bundle with another global batch size (no re-reading)."""
  return dataclasses.replace(data, global_batch_size=batch_size)


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
  d = cfg.data
  data = {
    k: getattr(d, k)
    for k in ("source", "text_key", "val_fraction", "max_chars", "max_docs", "seq_len", "seed", "num_epochs")
  }
  blob = json.dumps(
    {"model": dataclasses.asdict(cfg.teacher), "tokenizer": tokenizer.fingerprint, "data": data, "recipe": recipe},
    sort_keys=True,
    default=str,
  )
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def teacher_dir(cfg: Config, tokenizer: Any) -> str:
  """Where the cached teacher of ``cfg`` lives (``pretrain.cache_dir`` / ``default_cache_dir()``)."""
  root = os.path.expanduser(cfg.pretrain.cache_dir) if cfg.pretrain.cache_dir else default_cache_dir()
  return os.path.join(root, f"teacher-{teacher_key(cfg, tokenizer)}")


def _monitor(run_dir: str, steps: int, stream, name: str) -> Monitor:
  """The run's monitor; only process 0 writes ``metrics.jsonl`` and ``tb/`` (every process shows progress)."""
  from meshdistill.distributed import is_primary  # pylint: disable=g-import-not-at-top

  return Monitor(run_dir if is_primary() else None, steps, stream=stream, name=name)


def _run_lock(run_dir: str, what: str):
  """The run directory's `RunLock`, held by the process that writes its files (process 0)."""
  import contextlib  # pylint: disable=g-import-not-at-top

  from meshdistill.distributed import is_primary  # pylint: disable=g-import-not-at-top

  return RunLock(run_dir, what) if is_primary() else contextlib.nullcontext()


def _write_config(cfg: Config, run_dir: str) -> None:
  from meshdistill.distributed import is_primary  # pylint: disable=g-import-not-at-top

  os.makedirs(run_dir, exist_ok=True)
  if is_primary():
    dump_config(cfg, os.path.join(run_dir, "config.yaml"))


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
  replaced), and only a teacher directory is ever replaced (`meshdistill.checkpoint.save_teacher`).
  Training state is checkpointed in ``run_dir`` (default ``<run.run_dir>/teacher-<key>``, the key
  of `teacher_key`, so pretraining with other settings never resumes this one), and an interrupted
  pretraining resumes. Returns a summary with the teacher's validation metrics.
  """
  from meshdistill.evaluate import Evaluator  # pylint: disable=g-import-not-at-top
  from meshdistill.hardlabel import HardLabelTrainer  # pylint: disable=g-import-not-at-top
  from meshdistill.models import init_model, param_count  # pylint: disable=g-import-not-at-top
  from meshdistill.optimizers import make_optimizer  # pylint: disable=g-import-not-at-top
  from meshdistill.trainer import fit  # pylint: disable=g-import-not-at-top

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
  model = init_model(cfg.teacher, seed=p.seed, mesh=mesh)
  optimizer = make_optimizer(p, cfg.teacher.n_layers)
  trainer = HardLabelTrainer(model, optimizer=optimizer, mesh=mesh, backend=cfg.mesh.backend)
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
    from meshdistill.sources import load_teacher_hf  # pylint: disable=g-import-not-at-top

    report(f"teacher: {cfg.models.teacher_hf} (Hugging Face)")
    return load_teacher_hf(cfg, mesh), cfg.models.teacher_hf
  if cfg.pretrain.teacher:
    path = os.path.expanduser(cfg.pretrain.teacher)
    report(f"teacher: {path}")
    return load_teacher(path, cfg.teacher, mesh, data.tokenizer), path
  from meshdistill.distributed import agree_on  # pylint: disable=g-import-not-at-top

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


def _evaluate_pair(distiller, state, val) -> dict:
  from meshdistill.evaluate import Evaluator  # pylint: disable=g-import-not-at-top
  from meshdistill.models import param_count  # pylint: disable=g-import-not-at-top

  student = Evaluator.for_trainer(distiller)(distiller.unreplicate(state.params)["student"], val)
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


def _open_teacher_cache(cfg: Config, data, say):
  """``teacher.cache``: the cache (checked against this run's data, tokenizer, teacher config and student
  vocabulary), the data with the teacher's top-k in every training batch, and the teacher as a `TopKTeacher`."""
  from meshdistill import teacher_cache as tc  # pylint: disable=g-import-not-at-top

  if cfg.models.student_init.from_teacher:
    raise ConfigError("student.init.from_teacher copies the teacher's weights, but teacher.cache loads none; "
                      "remove student.init (or teacher.cache)")
  cache = tc.TeacherCache(cfg.models.teacher_cache)
  teacher_cfg = {k: v for k, v in dataclasses.asdict(cfg.teacher).items() if k != "remat"}
  saved_cfg = {k: v for k, v in cache.manifest["teacher"]["config"].items() if k != "remat"}
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
  from meshdistill.teacher_mesh import split_meshes  # pylint: disable=g-import-not-at-top

  td = cfg.models.teacher_devices
  from meshdistill.layout import layout_class  # pylint: disable=g-import-not-at-top

  if not layout_class(cfg.mesh.backend).spans_processes:  # a mesh split over devices of its own
    raise ConfigError(f"teacher.devices needs mesh.backend=shard_map (got {cfg.mesh.backend!r})")
  try:
    return split_meshes((td["data"], td["tensor"]), (cfg.mesh.data, cfg.mesh.tensor))
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _teacher_on_own_mesh(cfg: Config, data, teacher_mesh, mesh, stream, say):
  """``teacher.devices``: the teacher on ``teacher_mesh``, its top-k fed to the student on ``mesh``."""
  from meshdistill.distiller import resolve_shared_vocab  # pylint: disable=g-import-not-at-top
  from meshdistill.teacher_mesh import TeacherMeshData, TeacherOnMesh  # pylint: disable=g-import-not-at-top

  td = cfg.models.teacher_devices
  if cfg.distill.kind != "logit_kd" or cfg.distill.top_k is None:
    raise ConfigError("teacher.devices sends the teacher's top-k to the student: set distill.kind=logit_kd and "
                      "distill.top_k (e.g. 32); other strategies need the teacher on the student's mesh")
  if callable(cfg.distill.temperature) or isinstance(cfg.distill.temperature, dict):
    raise ConfigError("teacher.devices needs a constant distill.temperature (the top-k is taken at it)")
  teacher, tdir = obtain_teacher(cfg, data, teacher_mesh, stream=stream, report=say)
  vocab = resolve_shared_vocab(teacher.cfg.vocab_size, cfg.student.vocab_size) or teacher.cfg.vocab_size
  on_mesh = TeacherOnMesh(teacher, k=cfg.distill.top_k, temperature=float(cfg.distill.temperature), vocab=vocab,
                          teacher_mesh=teacher_mesh, student_mesh=mesh)
  say(f"teacher: on its own {td['data']}x{td['tensor']} mesh, student on {cfg.mesh.data}x{cfg.mesh.tensor}")
  return TeacherMeshData(data, on_mesh), on_mesh.spec(), tdir


def _cache_safeguards(kwargs: dict, distiller) -> dict:
  """With a top-k teacher the guard only restores: its fallback loss (logit MSE) needs the teacher's logits."""
  if distiller.topk_teacher is not None and kwargs.get("fallback") is not None:
    kwargs = {**kwargs, "fallback": distiller.strategy}
  return kwargs


def _evaluate_student(distiller, state, val) -> dict:
  from meshdistill.evaluate import Evaluator  # pylint: disable=g-import-not-at-top
  from meshdistill.models import param_count  # pylint: disable=g-import-not-at-top

  student = Evaluator.for_trainer(distiller)(distiller.unreplicate(state.params)["student"], val)
  return {
    "teacher": None,
    "student": {"loss": student["loss"], "ppl": student["ppl"], "params": param_count(distiller.student(state))},
    "val_tokens": student["tokens"],
  }


def cache_teacher(
  cfg: Config, out: str, *, k: int = 32, precision: str = "float16", rows_per_shard: int = 1024,
  stream: IO[str] | None = None, stop_after_shards: int | None = None,
) -> dict:
  """Writes the top-``k`` cache of the run's teacher over its training rows into ``out`` (resumable).

  The teacher is the one `distill` would use (``teacher.hf``, ``pretrain.teacher``, cached or pretrained
  now), run on the configured mesh; log-probabilities are taken at ``distill.temperature`` over the
  token range teacher and student share. Returns the manifest.
  """
  from meshdistill import teacher_cache as tc  # pylint: disable=g-import-not-at-top
  from meshdistill.distiller import resolve_shared_vocab  # pylint: disable=g-import-not-at-top
  from meshdistill.layout import make_layout  # pylint: disable=g-import-not-at-top

  if callable(cfg.distill.temperature) or isinstance(cfg.distill.temperature, dict):
    raise ConfigError(f"distill.temperature={cfg.distill.temperature!r}: a teacher cache holds log-probabilities "
                      "at one temperature; set a constant distill.temperature")
  from meshdistill import distributed  # pylint: disable=g-import-not-at-top

  if distributed.process_count() > 1:
    # Each process would own every n-th shard, but the teacher program spans the global mesh, so every
    # process must take part in every call: not supported yet.
    raise ConfigError(f"cache-teacher runs as one process, but this job has {distributed.process_count()}; run it "
                      "once on one host (its devices as mesh.data x mesh.tensor), then distil from the cache")
  mesh = build_mesh(cfg)
  data = load_data(cfg, mesh=mesh)
  say = stream_reporter(stream)
  teacher, _ = obtain_teacher(cfg, data, mesh, stream=stream, report=say)
  vocab = resolve_shared_vocab(teacher.cfg.vocab_size, cfg.student.vocab_size) or teacher.cfg.vocab_size
  program = tc.TeacherTopK(teacher, k=k, temperature=float(cfg.distill.temperature), vocab=vocab,
                           mesh=make_layout(cfg.mesh.backend, mesh).eval_mesh)
  identity = {"teacher": tc.teacher_identity(teacher),
              "data": tc.data_identity(data.train, data.tokenizer, cfg.data.source)}
  import jax  # pylint: disable=g-import-not-at-top

  t0 = time.perf_counter()
  manifest = tc.write_cache(program, data.train, out, identity=identity, precision=precision,
                            rows_per_shard=rows_per_shard, batch_size=data.global_batch_size,
                            process_index=jax.process_index(), process_count=jax.process_count(),
                            stop_after_shards=stop_after_shards, barrier=_barrier)
  say(f"teacher cache: {len(data.train)} rows x {data.train.seq_len} tokens -> {out} in "
      f"{time.perf_counter() - t0:.1f}s")
  return manifest


def _barrier() -> None:
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  multihost_utils.sync_global_devices("meshdistill-teacher-cache")


def loop_kwargs(settings) -> dict:
  """`meshdistill.trainer.fit` keywords a `TrainSettings` section (``train`` / ``pretrain``) decides: the
  number of steps, the evaluation and logging cadence, and the logged learning-rate schedule (None with
  progressive freezing, whose stages set the rate)."""
  from meshdistill.optimizers import lr_schedule  # pylint: disable=g-import-not-at-top

  return {
    "steps": settings.steps,
    "eval_every": settings.eval_every,
    "eval_batches": settings.eval_batches,
    "log_every": settings.log_every,
    "lr": None if settings.freeze else lr_schedule(settings),
  }


def safeguard_kwargs(cfg: Config, strategy: Any = None) -> dict:
  """`meshdistill.trainer.fit` keywords for ``cfg.safeguards``: the divergence guard and automatic remat.

  ``strategy``: the run's distillation strategy, whose fallback is built from
  ``safeguards.guard.fallback`` (None for hard-label training: the guard then only restores).
  """
  from meshdistill.guard import DivergenceGuard  # pylint: disable=g-import-not-at-top
  from meshdistill.strategies import ScaledLoss, fallback_strategy  # pylint: disable=g-import-not-at-top

  g, r = cfg.safeguards.guard, cfg.safeguards.remat
  kwargs = {"auto_remat": r.auto, "memory_budget_bytes": r.budget_bytes, "memory_headroom": r.headroom}
  if not g.enabled:
    return kwargs
  fallback = None
  if strategy is not None:
    fallback = fallback_strategy(strategy)
    if g.fallback != "mse":
      inner = fallback.strategy if isinstance(fallback, ScaledLoss) else fallback
      if "divergence" not in {f.name for f in dataclasses.fields(inner)}:
        raise ConfigError(
          f"safeguards.guard.fallback={g.fallback!r} needs a strategy with a divergence setting (LogitKD, "
          f"ChunkedLogitKD); {type(inner).__name__} falls back to logit MSE only: set safeguards.guard.fallback=mse"
        )
      inner = dataclasses.replace(inner, divergence=g.fallback)
      fallback = ScaledLoss(inner, fallback.scale) if isinstance(fallback, ScaledLoss) else inner
  guard = DivergenceGuard(window=g.window, factor=g.factor, min_history=g.min_history, max_restores=g.max_restores)
  return {**kwargs, "guard": guard, "keep_every": g.keep_every, "fallback": fallback}


def strategy_and_optimizer(cfg: Config, student_layers: int | None = None):
  """The distillation strategy and student optimizer of ``cfg`` (what `make_distiller` and ``meshdistill plan``
  use); ``student_layers`` replaces ``cfg.student.n_layers`` for a freezing schedule."""
  from meshdistill.optimizers import make_optimizer  # pylint: disable=g-import-not-at-top

  strategy, scale = cfg.distill.strategy(), cfg.safeguards.loss_scale
  if scale is not None:
    from meshdistill.strategies import ScaledLoss  # pylint: disable=g-import-not-at-top

    strategy = ScaledLoss(strategy, scale)
  layers = cfg.student.n_layers if student_layers is None else student_layers
  return strategy, make_optimizer(cfg.train, layers, loss_scale=scale)


def make_distiller(cfg: Config, teacher, mesh, tokenizer: Any = None):
  """The `Distiller` of ``cfg`` for ``teacher`` (student from `meshdistill.sources.build_student`); with
  ``distill.on_policy`` active an `OnPolicyDistiller` (completions end at ``tokenizer``'s EOS)."""
  from meshdistill.distiller import Distiller  # pylint: disable=g-import-not-at-top
  from meshdistill.sources import build_student  # pylint: disable=g-import-not-at-top

  student = build_student(cfg, teacher, mesh)
  strategy, optimizer = strategy_and_optimizer(cfg)
  extra = {}
  if cfg.distill.on_policy.active:
    from meshdistill.onpolicy import OnPolicyDistiller as Distiller  # pylint: disable=g-import-not-at-top

    eos, pad = getattr(tokenizer, "eos_id", None), getattr(tokenizer, "pad_id", None)
    extra["on_policy"] = cfg.distill.on_policy.config(eos_id=eos, pad_id=pad or 0)
  return Distiller(
    student,
    teacher,
    strategy=strategy,
    optimizer=optimizer,
    mesh=mesh,
    backend=cfg.mesh.backend,
    seed=cfg.train.seed,
    **extra,
  )


def distill(
  cfg: Config, *, stream: IO[str] | None = None, profile: str | None = None, stop_after: int | None = None
) -> dict:
  """The main job: teacher (loaded, cached or pretrained) -> distilled student -> evaluation.

  Writes ``config.yaml``, ``metrics.jsonl``, ``tb/``, ``checkpoints/`` and ``summary.json`` into
  ``run.run_dir`` and returns the summary (teacher / student validation loss and perplexity).
  Holds the run directory's lock (`meshdistill.fsutil.RunLock`) throughout; ``config.yaml`` is
  written only once the settings are known to fit the checkpoint the run resumes from.
  """
  with _run_lock(cfg.run.run_dir, "distillation run"):
    return _distill(cfg, stream=stream, profile=profile, stop_after=stop_after)


def _check_against_checkpoint(cfg: Config, expected: dict) -> None:
  """Raises when the run directory's checkpoint was written by another run (``expected``: facts of this one).

  The same check as `meshdistill.trainer.fit`'s on resume, made before ``config.yaml`` is written.
  """
  from meshdistill.distributed import agree_on  # pylint: disable=g-import-not-at-top
  from meshdistill.trainer import _check_resumable  # pylint: disable=g-import-not-at-top

  # Opening a checkpoint manager is a collective: every process takes process 0's answer.
  if not agree_on(int(os.path.isdir(cfg.checkpoint_dir)), "whether the run has a checkpoint directory"):
    return
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0, read_only=True)
  try:
    if ckpt.latest_step() is None:
      return
    _check_resumable(ckpt.read_meta(), expected, ckpt.directory, cfg.train.steps)
  finally:
    ckpt.close()


def _distill(cfg: Config, *, stream, profile, stop_after) -> dict:
  from meshdistill.evaluate import Evaluator  # pylint: disable=g-import-not-at-top
  from meshdistill.trainer import fit  # pylint: disable=g-import-not-at-top

  run_dir = cfg.run.run_dir
  teacher_mesh = None
  if cfg.models.teacher_devices:  # the teacher's own mesh, the student's on the other devices
    teacher_mesh, mesh = _split_meshes(cfg)
  else:
    mesh = build_mesh(cfg)
  data = load_data(cfg, mesh=mesh)
  # Checked before the teacher is built (kind, steps), and again with the models and teacher before config.yaml is
  # written: a rejected resume changes nothing in the run directory.
  _check_against_checkpoint(cfg, {"kind": "distill"})
  if cfg.distill.kind == "preference":  # batches of (chosen, rejected) row pairs; validation stays plain text
    from meshdistill.data import PreferencePairs  # pylint: disable=g-import-not-at-top

    pairs = cfg.preference.pairs
    data = PreferencePairs(with_batch_size(data, cfg.train.batch_size // 2),
                           source="own" if pairs == "own" else os.path.expanduser(pairs),
                           prompt_fraction=cfg.preference.prompt_fraction)
  say = stream_reporter(stream)
  say(
    f"data: {data.stats['train_tokens']:,} train / {data.stats['val_tokens']:,} validation tokens, "
    f"vocabulary {data.tokenizer.vocab_size}"
  )
  if cfg.models.teacher_cache:  # an offline top-k teacher: no teacher weights are loaded
    data, teacher, tdir = _open_teacher_cache(cfg, data, say)
  elif teacher_mesh is not None:  # a live teacher on its own devices, one batch ahead
    data, teacher, tdir = _teacher_on_own_mesh(cfg, data, teacher_mesh, mesh, stream, say)
  else:
    teacher, tdir = obtain_teacher(cfg, data, mesh, stream=stream, report=say)
  if (cfg.models.teacher_cache or teacher_mesh is not None) and (
      cfg.distill.on_policy.active or cfg.distill.on_policy.prompts_file):
    raise ConfigError("distill.on_policy trains on prompts and sampled completions, but teacher.cache / "
                      "teacher.devices feed the teacher's top-k of the corpus rows; remove one of them")
  if cfg.distill.on_policy.prompts_file:  # train on prompt/completion pairs instead of the corpus rows
    from meshdistill.prompts import PromptData, read_prompts  # pylint: disable=g-import-not-at-top

    rows = read_prompts(os.path.expanduser(cfg.distill.on_policy.prompts_file), need_completion=True)
    data = PromptData(rows, data.tokenizer, seq_len=cfg.data.seq_len, batch_size=cfg.train.batch_size,
                      val_fraction=cfg.data.val_fraction, seed=cfg.data.seed)
    say(f"prompts: {data.stats['pairs']} pairs from {cfg.distill.on_policy.prompts_file}")
  distiller = make_distiller(cfg, teacher, mesh, data.tokenizer)
  from meshdistill.trainer import _meta  # pylint: disable=g-import-not-at-top

  _check_against_checkpoint(cfg, _meta(distiller, "distill", {"teacher_dir": tdir}))
  _write_config(cfg, run_dir)
  monitor = _monitor(run_dir, cfg.train.steps, stream, "distill")
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
    monitor.close()
  distiller = result.trainer
  if distiller.topk_teacher is not None:
    summary = _evaluate_student(distiller, result.state, data.val_batches(max_batches=t.eval_batches))
  else:
    summary = _evaluate_pair(distiller, result.state, data.val_batches(max_batches=t.eval_batches))
  summary.update({"step": result.step, "teacher_dir": tdir, "run_dir": run_dir, "train_seconds": result.seconds})
  summary["safeguards"] = {
    "remat": distiller.student_cfg.remat,
    "divergences": sum(e["kind"] == "diverged" for e in result.events),
    "events": result.events,
  }
  from meshdistill.distributed import is_primary  # pylint: disable=g-import-not-at-top

  if is_primary():
    with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=2)
  return summary


def evaluate(cfg: Config, *, stream: IO[str] | None = None) -> dict:
  """Evaluates the latest checkpoint of the run in ``run.run_dir`` against its teacher."""
  say = stream_reporter(stream)
  if not os.path.isdir(cfg.checkpoint_dir):  # evaluation creates nothing
    raise FileNotFoundError(
      f"no checkpoint in {cfg.checkpoint_dir}: run `meshdistill distill` with run.run_dir={cfg.run.run_dir} first"
    )
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0, read_only=True)
  try:
    if ckpt.latest_step() is None:
      raise FileNotFoundError(
        f"no checkpoint in {cfg.checkpoint_dir}: run `meshdistill distill` with run.run_dir={cfg.run.run_dir} first"
      )
    meta = ckpt.read_meta()
    if meta.get("kind") != "distill":
      raise ValueError(f"{cfg.checkpoint_dir} holds a {meta.get('kind')!r} run, not a distillation run")
    mesh = build_mesh(cfg)
    data = load_data(cfg, mesh=mesh)
    tdir, teacher = run_teacher(cfg, meta, mesh, data.tokenizer)
    distiller = make_distiller(cfg, teacher, mesh)
    state, _, _ = ckpt.restore(distiller, distiller.init_state())
    say(f"evaluating step {meta['step']} of {cfg.run.run_dir} (teacher {tdir})")
    summary = _evaluate_pair(distiller, state, data.val_batches(max_batches=cfg.train.eval_batches))
  finally:
    ckpt.close()
  summary.update({"step": int(meta["step"]), "teacher_dir": tdir, "run_dir": cfg.run.run_dir})
  return summary


def generate(
  cfg: Config,
  prompts: list[str],
  *,
  model: str = "student",
  sampling: Any = None,
  seed: int = 0,
  stream: IO[str] | None = None,
) -> list[str]:
  """Completions of ``prompts`` by the ``model`` (``student``: the run's latest checkpoint; ``teacher``: its
  teacher) of the run in ``run.run_dir``, decoded with ``sampling`` (a `meshdistill.generate.SamplingConfig`;
  its ``eos_id`` defaults to the tokenizer's) from ``jax.random.key(seed)`` on the run's layout."""
  import jax  # pylint: disable=g-import-not-at-top

  from meshdistill.data import load_tokenizer  # pylint: disable=g-import-not-at-top
  from meshdistill.generate import SamplingConfig, generate, left_pad  # pylint: disable=g-import-not-at-top

  if model not in ("student", "teacher"):
    raise ValueError(f"model={model!r}; choose student or teacher")
  if not prompts:
    raise ValueError("no prompts: give --prompt TEXT or --prompts-file FILE")
  say = stream_reporter(stream)
  ckpt = Checkpointer(cfg.checkpoint_dir, every=0, keep=cfg.checkpoint.keep)
  try:
    step = ckpt.latest_step()
    meta = ckpt.read_meta() if step is not None else {}
    if step is not None and meta.get("kind") != "distill":
      raise ValueError(f"{cfg.checkpoint_dir} holds a {meta.get('kind')!r} run, not a distillation run")
    if step is None and model == "student":
      raise FileNotFoundError(
        f"no checkpoint in {cfg.checkpoint_dir}: run `meshdistill distill` with run.run_dir={cfg.run.run_dir} "
        "first, or generate with the teacher (--model teacher)"
      )
    tdir = meta.get("teacher_dir") or cfg.pretrain.teacher
    if not tdir and not cfg.models.teacher_hf:
      raise FileNotFoundError(f"{cfg.run.run_dir} names no teacher: set pretrain.teacher=DIR or distil first")
    # A saved teacher carries its tokenizer; otherwise (a Hugging Face teacher) the run's data settings name it.
    tokenizer = load_data(cfg).tokenizer if cfg.models.teacher_hf else load_tokenizer(os.path.join(tdir, "tokenizer"))
    mesh = build_mesh(cfg)
    _, net = run_teacher(cfg, meta, mesh, tokenizer)
    if model == "student":
      distiller = make_distiller(cfg, net, mesh)
      state, _, _ = ckpt.restore(distiller, distiller.init_state())
      net = distiller.student(state)
      mesh = distiller.layout.eval_mesh
    say(f"generating with the {model} of {cfg.run.run_dir}" + (f" (step {step})" if model == "student" else ""))
  finally:
    ckpt.close()
  sampling = sampling or SamplingConfig()
  if sampling.eos_id is None:
    sampling = dataclasses.replace(sampling, eos_id=tokenizer.eos_id)
  ids = [tokenizer.encode(p) for p in prompts]
  rows = len(ids)
  if mesh is not None and rows % mesh.shape["data"]:  # fill the batch up to a multiple of the data axis
    ids += [ids[-1]] * (mesh.shape["data"] - rows % mesh.shape["data"])
  tokens, mask = left_pad(ids, pad_id=getattr(tokenizer, "pad_id", 0) or 0)
  gen = jax.device_get(generate(net, tokens, mask, jax.random.key(seed), sampling, mesh=mesh))
  out = []
  for r in range(rows):
    row = [int(t) for t, m in zip(gen.tokens_BxN[r], gen.mask_BxN[r]) if m and t != sampling.eos_id]
    out.append(tokenizer.decode(row))
  return out


def run_teacher(cfg: Config, meta: dict, mesh, tokenizer):
  """``(teacher_dir, teacher)`` of a distillation run whose checkpoint ``meta`` is given."""
  if cfg.models.teacher_hf:
    from meshdistill.sources import load_teacher_hf  # pylint: disable=g-import-not-at-top

    return cfg.models.teacher_hf, load_teacher_hf(cfg, mesh)
  tdir = meta.get("teacher_dir") or cfg.pretrain.teacher
  read_teacher_meta(tdir)
  return tdir, load_teacher(tdir, cfg.teacher, mesh, tokenizer)


def stream_reporter(stream: IO[str] | None):
  """A function writing one line to ``stream`` (or to the log when None)."""

  def say(text: str) -> None:
    if stream is None:
      log.info("%s", text)
    else:
      stream.write(text + "\n")
      stream.flush()

  return say


def summary_table(summary: dict) -> str:
  """The final teacher / student table as text."""
  t, s = summary["teacher"], summary["student"]
  rows = [
    ("model", "params", "val loss", "val ppl"),
    ("teacher", f"{t['params']:,}", f"{t['loss']:.4f}", f"{t['ppl']:.3f}") if t else None,
    ("distilled student", f"{s['params']:,}", f"{s['loss']:.4f}", f"{s['ppl']:.3f}"),
  ]
  if t is None:  # distilled from a teacher cache: no teacher weights to evaluate
    rows = [r for r in rows if r is not None]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
    return table + "\n(teacher given by its top-k only: not evaluated)"
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
  out = [line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]]
  out.append(
    f"student/teacher params {summary['param_ratio']:.1%}; student vs teacher: KL {s['kl']:.4f}, "
    f"top-1 agreement {s['agree']:.1%}, logit correlation {s['corr']:.3f}"
  )
  return "\n".join(out)
