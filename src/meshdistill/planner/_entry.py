"""`plan`, `search` and `make_planner`: the planner's entry points (a `Planner` for the arguments, then compile).

Part of `meshdistill.planner`; import the names from there.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from meshdistill.config import Config, DistillSettings, load_config
from meshdistill.models.decoder import ModelConfig
from meshdistill.parallel.mesh import mesh_shape
from meshdistill.planner._hardware import parse_target
from meshdistill.planner._placement import placements
from meshdistill.planner._plan import _UNSET, GIB, Knobs, Planner
from meshdistill.planner._presets import resolve_model
from meshdistill.planner._report import Plan
from meshdistill.train.memory import REMAT_ORDER
from meshdistill.core.vocab import resolve_shared_vocab

log = logging.getLogger("meshdistill.planner._plan")  # the name its records always had


# --------------------------------------------------------------------------- entry points
def _config(config: Config | str | None, overrides: Sequence[str]) -> Config:
  if isinstance(config, Config):
    if overrides:
      raise ValueError("overrides apply to a config file or name; pass a Config already carrying them")
    return config
  return load_config(config, overrides)


def _mesh_arg(mesh: Any) -> dict[str, int] | None:
  """``--mesh``: None for ``auto``, else ``{axis: size}`` (`meshdistill.parallel.mesh.mesh_shape`: ``2x8``,
  ``data=2,expert=2,tensor=2``, ``(data, tensor)`` or a mapping)."""
  if mesh is None or mesh == "auto":
    return None
  try:
    return mesh_shape(mesh)
  except ValueError as e:
    raise ValueError(f"{e}, or 'auto'") from None


def make_planner(teacher=None, student=None, *, topology=None, devices=None, seq=None, config=None, overrides=(),
                 dtype=None, remat=None, hbm_gib=None, scan_layers=None, attention=None,
                 fast_compile: bool = False) -> Planner:
  """A `Planner` for a pair and target (see `plan` for the arguments)."""
  cfg = _config(config, overrides)
  default_dtype = "bfloat16" if dtype is None else dtype
  named = teacher is not None and not isinstance(teacher, ModelConfig)
  t_cfg, t_label = resolve_model(cfg.teacher if teacher is None else teacher, who="teacher", scan_layers=scan_layers,
                                 attention=attention, param_dtype=cfg.teacher.param_dtype if named else None,
                                 dtype=dtype if teacher is None or isinstance(teacher, ModelConfig) else default_dtype)
  s_cfg, s_label = resolve_model(cfg.student if student is None else student, who="student", remat=remat,
                                 scan_layers=scan_layers, attention=attention,
                                 dtype=dtype if student is None or isinstance(student, ModelConfig) else default_dtype)
  flags = {"dtype": dtype, "remat": remat, "scan_layers": scan_layers, "attention": attention}
  if teacher is None:
    t_label = "config teacher"
  else:
    t_cfg, t_label = _with_set(t_cfg, t_label, cfg, overrides, "teacher", flags)
  if student is None:
    s_label = "config student"
  else:
    s_cfg, s_label = _with_set(s_cfg, s_label, cfg, overrides, "student", flags)

  resolve_shared_vocab(t_cfg.vocab_size, s_cfg.vocab_size)  # different tokenizers raise here
  if hbm_gib is not None and not hbm_gib > 0:
    raise ValueError(f"hbm_gib={hbm_gib!r} must be a positive number of GiB per device")
  budget = None if hbm_gib is None else int(hbm_gib * GIB)
  if budget is None and devices is not None and cfg.safeguards.remat.budget_bytes is not None:
    budget = cfg.safeguards.remat.budget_bytes
  target = parse_target(topology, devices, budget)
  seq = cfg.data.seq_len if seq is None else seq
  if not isinstance(seq, int) or seq < 1:
    raise ValueError(f"seq={seq!r} must be a positive integer")
  # The defaults (`auto`) made concrete for the target as `distill` makes them on its devices: the compute dtype, a
  # frozen teacher stored in it, the attention kernel (`ModelConfig.kernel`).
  platform = target.platform
  t_cfg = _concrete(t_cfg, platform, seq).frozen(platform)
  s_cfg = _concrete(s_cfg, platform, seq)
  for who, m in (("teacher", t_cfg), ("student", s_cfg)):
    if seq > m.max_len:
      raise ValueError(f"seq={seq} exceeds the {who}'s max_len={m.max_len}; use seq <= {m.max_len}")
    if m.attention == "splash" and seq % 128:
      raise ValueError(f"the {who}'s attention='splash' needs seq a multiple of 128 (the kernel's block width), got "
                       f"{seq}; use seq={max(128, seq // 128 * 128)} or attention='xla'")
  return Planner(cfg, t_cfg, s_cfg, (t_label, s_label), target, seq, fast_compile=fast_compile)


def _concrete(model: ModelConfig, platform: str, seq: int) -> ModelConfig:
  """``model`` with ``dtype="auto"`` and ``attention="auto"`` as they resolve on ``platform`` at ``seq`` tokens."""
  model = model.for_platform(platform)
  if model.attention == "auto":
    model = model.replace(attention=model.kernel(seq, platform=platform, tensor=1))
  return model


def _with_set(model: ModelConfig, label: str, cfg: Config, overrides: Sequence[str], who: str,
              flags: dict) -> tuple[ModelConfig, str]:
  """``model`` (a preset or config.json named by ``--teacher`` / ``--student``) with the shape settings that
  ``--set who.<field>=...`` gave (their values as the config read them), and its label saying so; a field a flag
  (``--dtype``, ``--remat``, ...) also sets keeps the flag's value. Without this a preset silently ignored them."""
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  changes = {}
  for o in overrides:
    key = str(o).split("=", 1)[0].strip()
    if key.startswith(f"{who}."):
      field = key[len(who) + 1:].split(".", 1)[0]
      if field in fields and flags.get(field) is None:
        changes[field] = getattr(getattr(cfg, who), field)
  if not changes:
    return model, label
  try:
    model = model.replace(**changes)
  except ValueError as e:
    given = ", ".join(f"{who}.{k}={v}" for k, v in changes.items())
    raise ValueError(f"{who} {label} with --set {given}: {e}") from None
  return model, f"{label} with {', '.join(f'{k}={v}' for k, v in changes.items())}"


def _default_knobs(pl: Planner, mesh, batch: int, chunk_size) -> Knobs:
  chunk = pl.cfg.distill.chunk_size if chunk_size is _UNSET else chunk_size
  if chunk is not None:
    DistillSettings(chunk_size=chunk)  # validates
  given = _mesh_arg(mesh)
  if given is not None:
    k = Knobs.on(given, pl.student.remat, chunk, batch)
    pl.check_mesh(k.data, k.tensor, batch, dict(k.axes))
    return k
  layouts = pl.layouts(batch)
  if not layouts:
    n = len(pl.target.devices)
    raise ValueError(f"no (data x tensor) layout of {n} devices splits both models with batch {batch}: "
                     f"{pl.split_error(n) or ''} (batch must be a multiple of data)")
  m = pl.cfg.mesh.resolved(None) if pl.cfg.mesh.auto else pl.cfg.mesh  # auto: the CPU's reference layout
  cfg_mesh = Knobs.on(mesh_shape({"data": m.data, **(m.axes or {}), "tensor": m.tensor}), pl.student.remat, chunk,
                      batch)
  knobs = [Knobs.on(s, pl.student.remat, chunk, batch) for s in layouts]
  if pl.target.budget_bytes is None:
    return cfg_mesh if cfg_mesh in knobs else knobs[0]
  limit = pl.headroom * pl.target.budget_bytes
  if pl.target.platform == "cpu" and cfg_mesh in knobs and pl.static_bytes(cfg_mesh) <= 0.5 * limit:
    return cfg_mesh  # CPU devices: the mesh the configured job runs on them, where it fits the budget
  # auto: the least tensor parallelism whose weights and optimizer state take at most half the limit
  for k in knobs:
    if pl.static_bytes(k) <= 0.5 * limit:
      return k
  return knobs[-1]


def plan(teacher: Any = None, student: Any = None, *, topology: str | None = None, devices: str | None = None,
         mesh: Any = "auto", batch: int | None = None, seq: int | None = None, config: Config | str | None = None,
         overrides: Sequence[str] = (), dtype: str | None = None, remat: str | None = None, chunk_size: Any = _UNSET,
         hbm_gib: float | None = None, suggest: int = 1, max_compiles: int = 4,
         scan_layers: bool | None = None, attention: str | None = None, placement: int | None = None,
         fast_compile: bool = False) -> Plan:
  """Compiles the distillation step ``meshdistill distill`` would run, for a target, without allocating it.

  Args:
    teacher, student: a preset name (`PRESETS`), a Hugging Face ``config.json`` path (or its directory) or a
      `ModelConfig`; default: the config's models. Presets and config files compute in ``bfloat16`` unless ``dtype``
      says otherwise; weights are stored as the config's ``teacher.param_dtype`` / ``student.param_dtype`` say.
    topology: a TPU topology (``v5e:4x4``, ``v5p:4x4x4``, ...; needs ``pip install 'meshdistill[tpu]'``),
      or ``devices="cpu:N"``: N CPU devices of this process (at most what this machine can simulate,
      `meshdistill.planner._hardware.max_cpu_devices`).
    mesh: ``(data, tensor)``, ``"DATAxTENSOR"``, every axis the layout declares by name (``"data=2,expert=2,tensor=2"``
      or a mapping) or ``"auto"`` (on CPU devices the config's mesh, where its weights and optimizer state take at
      most half the memory limit or no budget is given; else the least ``tensor`` that does).
    batch, seq: global batch and sequence length (default: ``train.batch_size``, ``data.seq_len``).
    config, overrides: the distillation config as for ``distill`` (a `Config`, or a YAML file / packaged name
      plus ``key=value`` overrides): strategy, chunk size, optimizer, freezing, loss scale, remat headroom.
    dtype, remat, chunk_size: replace the models' compute dtype, the student's remat policy, the loss's chunk size.
    hbm_gib: per-device memory budget; replaces the chip's HBM (CPU devices have none).
    scan_layers: replace both models' ``ModelConfig.scan_layers`` (blocks under ``nnx.scan``: one compiled body).
    attention: replace both models' ``ModelConfig.attention`` (a config's ``teacher.attention`` /
      ``student.attention`` set its own models only, not presets).
    suggest, max_compiles: when the plan does not fit, how many fitting configurations to find, compiling at most
      ``max_compiles`` more programs.
    placement: top-k kept per token: also compare where the teacher lives (in the step, a sub-mesh, an offline
      cache, a remote server; `meshdistill.planner._placement`) into ``Plan.placement``.
    fast_compile: compile with XLA's least execution-time effort (`meshdistill.planner._compile.FAST_COMPILE`):
      2-3x less compile time, but memory and bytes accessed are another program's (within about -13% / +3% and
      -41% on the pairs measured); FLOPs and collectives agree within 0.5%.
  """
  pl = make_planner(teacher, student, topology=topology, devices=devices, seq=seq, config=config,
                    overrides=overrides, dtype=dtype, remat=remat, hbm_gib=hbm_gib, scan_layers=scan_layers,
                    attention=attention, fast_compile=fast_compile)
  batch = pl.cfg.train.batch_size if batch is None else batch
  if not isinstance(batch, int) or batch < 1:
    raise ValueError(f"batch={batch!r} must be a positive integer")
  k = _default_knobs(pl, mesh, batch, chunk_size)
  pl.announce(1, more=max_compiles if suggest > 0 else 0)
  # as `distill` decides it without a step-time estimate (`train.tuning.auto_tune`): the first policy that fits the
  # whole batch (the plan is of the whole batch at once; `distill` may run micro-batches where none fits)
  if k.remat == "auto":
    first, p, tried = dataclasses.replace(k, remat=REMAT_ORDER[0]), None, {}
    if pl.fits_statically(first):  # weights and optimizer state alone over the limit: no policy can help
      for remat in REMAT_ORDER:
        tried[remat] = pl.plan(dataclasses.replace(k, remat=remat))
        if tried[remat].fits is not False:
          k, p = dataclasses.replace(k, remat=remat), tried[remat]
          p.notes.append(f"remat auto: {remat}, the first of {', '.join(REMAT_ORDER)} whose step fits (as distill "
                         "chooses it on the device)")
          break
    if p is None:  # none fits: the cheapest policy's plan, its suggestions the nearest that fit
      k = first
      p = tried.get(first.remat) or pl.plan(k)
  else:
    p = pl.plan(k)
  if p.fits is False and suggest > 0:
    p.suggestions = pl.nearest(k, suggest, max_compiles)
  if placement is not None:
    chip = pl.target.chip
    p.placement = placements(p, vocab=pl.teacher.vocab_size, k=placement,
                             ici_bytes_per_s=None if chip is None else chip.ici_bandwidth)
  return p


def search(teacher: Any = None, student: Any = None, *, topology: str | None = None, devices: str | None = None,
           batch: int | None = None, seq: int | None = None, config: Config | str | None = None,
           overrides: Sequence[str] = (), dtype: str | None = None, meshes=None, remats=None, chunk_sizes=None,
           batches=None, hbm_gib: float | None = None, max_compiles: int = 12,
           scan_layers: bool | None = None, attention: str | None = None, fast_compile: bool = False) -> list[Plan]:
  """Compiles configurations over meshes, remat policies, chunk sizes and batch sizes; returns them ranked.

  Configurations whose weights and optimizer state alone exceed the limit are skipped without compiling.
  Ranking: those that fit first, by estimated step time per token (on CPU, by memory), then the rest by memory.
  Defaults: every layout the models split over, the student's remat and ``full``, the config's loss and
  chunk size 1024, the given batch. At most ``max_compiles`` programs are compiled. ``fast_compile``: as in `plan`.
  """
  pl = make_planner(teacher, student, topology=topology, devices=devices, seq=seq, config=config,
                    overrides=overrides, dtype=dtype, hbm_gib=hbm_gib, scan_layers=scan_layers, attention=attention,
                    fast_compile=fast_compile)
  batch = pl.cfg.train.batch_size if batch is None else batch
  plans, candidates = [], pl.candidates(batch, meshes, remats, chunk_sizes, batches)
  pl.announce(min(len(candidates), max_compiles))
  for k in candidates:
    if len(plans) >= max_compiles:
      log.info("search stopped after %d compilations (max_compiles)", max_compiles)
      break
    if not pl.fits_statically(k):
      log.info("skipped %s: weights and optimizer state alone take %.2f GiB per device", k, pl.static_bytes(k) / GIB)
      continue
    plans.append(pl.plan(k))

  def rank(p: Plan):
    per_token = None if p.estimate_seconds is None else p.estimate_seconds / (p.batch * p.seq)
    total = p.need_bytes if p.need_bytes is not None else float("inf")
    return (p.fits is False, per_token if per_token is not None else total, total)

  return sorted(plans, key=rank)


__all__ = ["make_planner", "plan", "search"]
