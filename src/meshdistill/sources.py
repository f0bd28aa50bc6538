"""Where a run's teacher and student come from: Hugging Face directories, the teacher's own blocks, or fresh.

In a config these are keys of the ``teacher`` and ``student`` sections::

  teacher: {hf: path/to/Qwen3-8B}          # config.json + *.safetensors; loaded sharded (`load_hf`)
  student: {hf: path/to/Qwen3-0.6B}        # a pretrained smaller model of the same family and tokenizer
  student: {init: {from_teacher: true, layers: [0, 9, 18, 27]}}   # or: the teacher's embeddings, LM head,
                                           # final norm and these blocks (layer-subset initialisation)
  student: {lora: {rank: 8, alpha: 16, targets: [q, k, v, o], quantize: int8}}   # with any of the above:
                                           # train low-rank adapters on a frozen base (`meshdistill.models.lora`)

With ``hf`` or ``init.from_teacher`` a section's shape is derived -- from ``config.json``, or the
teacher's shape with ``len(layers)`` blocks -- and only ``max_len``, ``dtype`` and ``remat`` may be
set beside it (a shape key typed again is an error, unless it equals the derived value). With
``teacher.hf`` the data pipeline tokenizes with the teacher's ``tokenizer.json``; a ``student.hf``
whose tokenizer differs in anything but its ``padding`` / ``truncation`` settings is an error, as is
a student of another family. Everything here is checked when the config is loaded (only JSON files
are read), before any weights are touched.

`ModelSources` is the typed form held in `meshdistill.config.Config` (field ``models``);
`split_sources` moves the keys out of the raw sections and `nest_sources` puts them back when a
config is written, so ``config.yaml`` reads as it was written. `resolve` derives the shapes;
`load_teacher_hf` and `build_student` build the models at run time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from meshdistill._typed_yaml import ConfigError, from_dict
from meshdistill.models.lora import LoraConfig

log = logging.getLogger(__name__)

FREE_KEYS = ("max_len", "dtype", "remat")  # settable beside a derived shape
_TOKENIZER_SETTINGS = ("padding", "truncation")  # tokenizer.json keys allowed to differ between teacher and student


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudentInit:
  """``student.init``: ``from_teacher: true`` copies the teacher's embeddings, LM head, final norm and
  the blocks ``layers`` (teacher block indices, in the student's order) into the student."""

  from_teacher: bool = False
  layers: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.layers is not None and not self.from_teacher:
      raise ConfigError(
          f"student.init.layers={list(self.layers)} is set but student.init.from_teacher is false; "
          "set student.init.from_teacher=true (or remove student.init.layers)"
      )
    if self.from_teacher:
      if not self.layers:
        raise ConfigError(
            "student.init.from_teacher=true needs student.init.layers, the teacher blocks to copy, e.g. [0, 2]"
        )
      if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.layers):
        raise ConfigError(f"student.init.layers={list(self.layers)} must be teacher block indices (integers >= 0)")
      if len(set(self.layers)) != len(self.layers):
        raise ConfigError(f"student.init.layers={list(self.layers)} names a block twice; list each block once")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSources:
  """``teacher.hf``, ``teacher.cache``, ``student.hf`` and ``student.init`` of a config (paths made absolute)."""

  teacher_hf: str | None = None
  student_hf: str | None = None
  student_init: StudentInit = dataclasses.field(default_factory=StudentInit)
  teacher_cache: str | None = None  # an offline top-k cache (`meshdistill.teacher_cache`): no teacher weights loaded
  teacher_devices: dict | None = None  # the teacher's own mesh {data, tensor} (`meshdistill.teacher_mesh`)
  student_lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # rank 0: no adapters

  def __post_init__(self):
    if self.teacher_cache is not None:
      object.__setattr__(self, "teacher_cache", os.path.abspath(os.path.expanduser(self.teacher_cache)))
      if self.teacher_devices:
        raise ConfigError("teacher.cache and teacher.devices exclude each other: a cached teacher runs nowhere; "
                          "remove one of them")
    for who in ("teacher", "student"):
      path = getattr(self, f"{who}_hf")
      if path is not None:
        if not isinstance(path, str) or not path:
          raise ConfigError(f"{who}.hf={path!r} must be the path of a local Hugging Face model directory")
        object.__setattr__(self, f"{who}_hf", os.path.abspath(os.path.expanduser(path)))
    if self.student_hf and self.student_init.from_teacher:
      raise ConfigError(
          "student.hf and student.init.from_teacher exclude each other: start the student from a pretrained "
          "checkpoint (student.hf) or from the teacher's blocks (student.init), not both"
      )
    if self.student_hf and not self.teacher_hf:
      raise ConfigError(
          "student.hf needs teacher.hf: a Hugging Face student is distilled from a Hugging Face teacher with the "
          "same tokenizer; set teacher.hf, or describe the student by its shape"
      )

  @property
  def any(self) -> bool:
    return bool(self.teacher_hf or self.student_hf or self.student_init.from_teacher)


def split_sources(raw: dict) -> dict:
  """Moves ``teacher.hf``, ``student.hf`` and ``student.init`` of a raw config into ``raw["models"]``.

  Raises `ConfigError` when a section with a derived shape also sets a shape key (other than
  `FREE_KEYS`): the shape is read from the checkpoint or the teacher, not typed twice.
  """
  raw = dict(raw)
  models: dict[str, Any] = {}
  student = raw.get("student")
  if isinstance(student, dict) and "lora" in student:  # not a source of the shape: taken out before the checks
    student = dict(student)
    lora = student.pop("lora")
    if lora is not None and not isinstance(lora, dict):
      raise ConfigError(f"student.lora={lora!r} must be a mapping, e.g. {{rank: 8, alpha: 16}}")
    allowed = [f.name for f in dataclasses.fields(LoraConfig)]
    for k in lora or {}:
      if k not in allowed:
        from meshdistill._typed_yaml import unknown_key  # pylint: disable=g-import-not-at-top

        raise unknown_key("student.lora.", k, allowed)
    try:
      LoraConfig(**(lora or {}))  # checked here, so errors name student.lora.*
    except (TypeError, ValueError) as e:
      raise ConfigError(str(e)) from None
    models["student_lora"] = dict(lora or {})
    raw["student"] = student
  for who, keys in (("teacher", ("hf", "cache", "devices")), ("student", ("hf", "init"))):
    section = raw.get(who)
    if not isinstance(section, dict) or not any(k in section for k in keys):
      continue
    section = dict(section)
    for k in keys:
      if k in section:
        models[f"{who}_{k}"] = _checked(f"{who}.{k}", section.pop(k))
    derived = models.get(f"{who}_hf") is not None or (
        isinstance(models.get("student_init"), dict) and models["student_init"].get("from_teacher") and who == "student"
    )
    typed = sorted(k for k in section if k not in FREE_KEYS)
    if derived and typed:
      how = f"{who}.hf" if models.get(f"{who}_hf") is not None else "student.init.from_teacher"
      origin = "config.json" if "hf" in how else "the teacher"
      raise ConfigError(
          f"{who}.{typed[0]} is set, but with {how} the {who}'s shape is derived ({origin}); "
          f"remove {[f'{who}.{k}' for k in typed]} (beside it only {[f'{who}.{k}' for k in FREE_KEYS]} may be set)"
      )
    raw[who] = section
  if "models" in raw:
    raise ConfigError(
        "unknown section 'models'; give the teacher and student sources as teacher.hf, student.hf and student.init"
    )
  if models:
    raw["models"] = models
  return raw


def _checked(key: str, value: Any) -> Any:
  """Type checks of the raw source keys, named as the user wrote them (not as ``models.*``)."""
  if key.endswith(".hf"):
    if value is not None and (not isinstance(value, str) or not value):
      raise ConfigError(f"{key}={value!r} must be the path of a local Hugging Face model directory")
    return value
  if key == "teacher.devices":
    if value is not None and (not isinstance(value, dict) or set(value) != {"data", "tensor"} or any(
        isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value.values())):
      raise ConfigError(f"{key}={value!r} must be the teacher's own mesh {{data: D, tensor: T}} (positive integers), "
                        "e.g. {data: 1, tensor: 4}; the student's mesh (mesh.data x mesh.tensor) takes other devices")
    return value
  if key == "teacher.cache":
    if value is not None and (not isinstance(value, str) or not value):
      raise ConfigError(f"{key}={value!r} must be the path of a teacher cache (written by `meshdistill cache-teacher`)")
    return value
  if value is None:
    return value
  allowed = [f.name for f in dataclasses.fields(StudentInit)]
  if not isinstance(value, dict):
    raise ConfigError(f"{key}={value!r} must be a mapping, e.g. {{from_teacher: true, layers: [0, 2]}}")
  for k in value:
    if k not in allowed:
      from meshdistill._typed_yaml import unknown_key  # pylint: disable=g-import-not-at-top

      raise unknown_key(f"{key}.", k, allowed)
  if not isinstance(value.get("from_teacher", False), bool):
    raise ConfigError(f"{key}.from_teacher={value['from_teacher']!r} must be true or false")
  layers = value.get("layers")
  if layers is not None and (
      not isinstance(layers, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
  ):
    raise ConfigError(f"{key}.layers={layers!r} must be a list of teacher block indices, e.g. [0, 2]")
  return value


def nest_sources(plain: dict, sources: ModelSources) -> dict:
  """The inverse of `split_sources` on a plain (``to_dict``) config: derived sections keep only their
  source keys and `FREE_KEYS`."""
  plain = dict(plain)
  plain.pop("models", None)
  lora = sources.student_lora
  if sources.teacher_hf:
    plain["teacher"] = {"hf": sources.teacher_hf, **{k: plain["teacher"][k] for k in FREE_KEYS}}
  if sources.student_hf:
    plain["student"] = {"hf": sources.student_hf, **{k: plain["student"][k] for k in FREE_KEYS}}
  elif sources.student_init.from_teacher:
    init = {"from_teacher": True, "layers": list(sources.student_init.layers)}
    plain["student"] = {"init": init, **{k: plain["student"][k] for k in FREE_KEYS}}
  if sources.teacher_cache:
    plain["teacher"] = {**plain["teacher"], "cache": sources.teacher_cache}
  if sources.teacher_devices:
    plain["teacher"] = {**plain["teacher"], "devices": dict(sources.teacher_devices)}
  if lora.enabled:
    plain["student"] = {**plain["student"], "lora": {**dataclasses.asdict(lora), "targets": list(lora.targets)}}
  return plain


# --------------------------------------------------------------------------- checks on files
def check_hf_dir(path: str, setting: str) -> dict:
  """The parsed ``config.json`` of a Hugging Face directory, or a `ConfigError` naming ``setting``."""
  if not os.path.isdir(path):
    raise ConfigError(f"{setting}={path!r} is not a directory; give a local Hugging Face model directory "
                      "(config.json + *.safetensors)")
  config = os.path.join(path, "config.json")
  if not os.path.isfile(config):
    raise ConfigError(f"{setting}={path!r} holds no config.json; a Hugging Face model directory holds config.json "
                      "and model.safetensors (or model-*.safetensors with model.safetensors.index.json)")
  if not any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json")):
    raise ConfigError(f"{setting}={path!r} holds no model.safetensors or model.safetensors.index.json; only "
                      "safetensors weights can be loaded (convert PyTorch .bin files with transformers first)")
  try:
    with open(config, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{setting}={path!r}: config.json is not valid JSON ({e})") from None


def _hf_model_config(path: str, setting: str, section):
  from meshdistill.models._hf_config import config_from_hf  # pylint: disable=g-import-not-at-top

  hf = check_hf_dir(path, setting)
  try:
    cfg = config_from_hf(hf, max_len=section.max_len, dtype=section.dtype, where=f"{setting}={path!r}: config.json")
  except (KeyError, TypeError, ValueError) as e:
    raise ConfigError(f"{setting}={path!r}: {e if not isinstance(e, KeyError) else f'config.json lacks {e}'}") from None
  return cfg.replace(remat=section.remat)


def _family(cfg) -> str:
  from meshdistill.models._hf_config import default_family  # pylint: disable=g-import-not-at-top

  return default_family(cfg)


def tokenizer_file(path: str) -> str | None:
  file = os.path.join(path, "tokenizer.json")
  return file if os.path.isfile(file) else None


def _tokenizer_spec(file: str) -> dict:
  with open(file, encoding="utf-8") as f:
    spec = json.load(f)
  return {k: v for k, v in spec.items() if k not in _TOKENIZER_SETTINGS} if isinstance(spec, dict) else spec


def tokenizer_difference(file_a: str, file_b: str) -> list[str]:
  """The top-level keys in which two tokenizer.json files differ (ignoring padding / truncation)."""
  a, b = _tokenizer_spec(file_a), _tokenizer_spec(file_b)
  if not isinstance(a, dict) or not isinstance(b, dict):
    return [] if a == b else ["<whole file>"]
  return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def resolve(cfg) -> dict:
  """The derived ``teacher`` / ``student`` `ModelConfig` and ``data`` settings of a `Config` with sources.

  Returns a dict of the sections to replace (possibly empty). Raises `ConfigError` naming the setting.
  """
  src: ModelSources = cfg.models
  if not src.any:
    return {}
  out: dict[str, Any] = {}
  teacher = cfg.teacher
  if src.teacher_hf:
    if cfg.pretrain.teacher:
      raise ConfigError(
          f"teacher.hf={src.teacher_hf!r} and pretrain.teacher={cfg.pretrain.teacher!r} both name the teacher; "
          "keep one of them"
      )
    teacher = _hf_model_config(src.teacher_hf, "teacher.hf", cfg.teacher)
    out["teacher"] = teacher
    out["data"] = _teacher_tokenizer(cfg, src.teacher_hf)
  if src.student_hf:
    student = _hf_model_config(src.student_hf, "student.hf", cfg.student)
    tf, sf = _family(teacher), _family(student)
    if (tf, teacher.rope_scaling is None) != (sf, student.rope_scaling is None):
      raise ConfigError(
          f"student.hf={src.student_hf!r} is a {sf!r} model but teacher.hf={src.teacher_hf!r} is a {tf!r} model; "
          "distil within one family (one tokenizer), or start the student from the teacher with "
          "student.init: {from_teacher: true, layers: [...]}"
      )
    _check_student_tokenizer(src, teacher, student)
    out["student"] = student
  elif src.student_init.from_teacher:
    layers = src.student_init.layers
    bad = [i for i in layers if i >= teacher.n_layers]
    if bad:
      raise ConfigError(
          f"student.init.layers={list(layers)}: block {bad[0]} is past the teacher's depth (the teacher has "
          f"{teacher.n_layers} blocks: indices 0..{teacher.n_layers - 1})"
      )
    s = cfg.student
    out["student"] = teacher.replace(n_layers=len(layers), max_len=s.max_len, dtype=s.dtype, remat=s.remat)
  return out


def _teacher_tokenizer(cfg, path: str):
  """``data`` with ``tokenizer`` = the teacher's tokenizer.json (or a checked equal one)."""
  file = tokenizer_file(path)
  given = cfg.data.tokenizer
  if given in ("byte", path, file):
    if file is None:
      raise ConfigError(
          f"teacher.hf={path!r} holds no tokenizer.json, which the data pipeline tokenizes with; add it to the "
          "directory, or set data.tokenizer to the path of the teacher's tokenizer.json"
      )
    return cfg.data.replace(tokenizer=path)
  if given == "bpe":
    raise ConfigError(
        f"data.tokenizer='bpe' trains a new tokenizer, but teacher.hf={path!r} has its own; remove data.tokenizer "
        "(the teacher's tokenizer.json is used)"
    )
  from meshdistill.data._tokenizer import _json_path  # pylint: disable=g-import-not-at-top

  other = _json_path(os.path.expanduser(given))
  if not os.path.isfile(other):
    raise ConfigError(f"data.tokenizer={given!r}: no tokenizer file at {other!r}")
  if file is not None:
    diff = tokenizer_difference(file, other)
    if diff:
      raise ConfigError(
          f"data.tokenizer={given!r} differs from the tokenizer of teacher.hf={path!r} (in {diff}); remove "
          "data.tokenizer: with teacher.hf the data is tokenized with the teacher's tokenizer.json"
      )
  return cfg.data


def _check_student_tokenizer(src: ModelSources, teacher, student) -> None:
  from meshdistill.distiller import PADDING_TOLERANCE  # pylint: disable=g-import-not-at-top

  t_file, s_file = tokenizer_file(src.teacher_hf), tokenizer_file(src.student_hf)
  if t_file and s_file:
    diff = tokenizer_difference(t_file, s_file)
    if diff:
      raise ConfigError(
          f"the tokenizers of teacher.hf={src.teacher_hf!r} and student.hf={src.student_hf!r} differ (tokenizer.json "
          f"keys {diff}); distillation compares distributions token by token, so both need one tokenizer (only "
          "padding / truncation settings may differ)"
      )
  elif s_file is None:
    log.info("student.hf=%s has no tokenizer.json; comparing vocabulary sizes only", src.student_hf)
  small, large = sorted((teacher.vocab_size, student.vocab_size))
  if large - small > PADDING_TOLERANCE * large:
    raise ConfigError(
        f"student.hf={src.student_hf!r} has vocab_size={student.vocab_size} but teacher.hf={src.teacher_hf!r} has "
        f"{teacher.vocab_size}: more than padding apart, so not one tokenizer; choose a student of the teacher's "
        "tokenizer"
    )


# --------------------------------------------------------------------------- building the models
def load_teacher_hf(cfg, mesh):
  """The teacher of ``teacher.hf`` on ``mesh`` (each device reading only its slices)."""
  from meshdistill.models.hf import load_hf  # pylint: disable=g-import-not-at-top

  model = load_hf(cfg.models.teacher_hf, mesh, dtype=cfg.teacher.dtype, max_len=cfg.teacher.max_len)
  return _with_config(model, cfg.teacher)


def _with_config(model, want):
  """``model`` with its `ModelConfig` set to ``want`` (equal up to the compute-only ``remat``; the padding and
  key/value replication the mesh asked for at load time (`ModelConfig.for_tensor`) are kept)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  want = want.replace(vocab_multiple=model.cfg.vocab_multiple, replicate_kv=model.cfg.replicate_kv)
  if model.cfg.replace(remat=want.remat) != want:
    raise ValueError(f"loaded model config {model.cfg} differs from the configured {want}")
  if model.cfg == want:
    return model
  from meshdistill.models import abstract_params  # pylint: disable=g-import-not-at-top

  graphdef, _, _ = abstract_params(want)
  return nnx.merge(graphdef, nnx.state(model))


def build_student(cfg, teacher, mesh):
  """The run's student on ``mesh``: loaded (``student.hf``), copied from ``teacher`` (``student.init``),
  or initialised from ``train.seed``."""
  from meshdistill.models import init_model  # pylint: disable=g-import-not-at-top

  src: ModelSources = cfg.models
  if src.student_hf:
    from meshdistill.models.hf import load_hf  # pylint: disable=g-import-not-at-top

    model = load_hf(src.student_hf, mesh, dtype=cfg.student.dtype, max_len=cfg.student.max_len)
    model = _with_config(model, cfg.student)
  elif src.student_init.from_teacher:
    model = student_from_teacher(teacher, src.student_init.layers, cfg.student, mesh)
  else:
    model = init_model(cfg.student, seed=cfg.train.seed, mesh=mesh)
  return with_lora(model, src.student_lora, seed=cfg.train.seed, mesh=mesh)


def with_lora(model, lora: LoraConfig, *, seed: int, mesh):
  """``model`` with the adapters of ``student.lora`` (unchanged when its rank is 0)."""
  if not lora.enabled:
    return model
  from meshdistill.models.lora import apply_lora  # pylint: disable=g-import-not-at-top

  return apply_lora(model, lora, seed=seed + 1, mesh=mesh)


def student_from_teacher(teacher, layers, student_cfg, mesh=None):
  """A student whose embeddings, LM head, final norm and blocks are copies of ``teacher``'s.

  Student block ``i`` is teacher block ``layers[i]``. ``student_cfg`` must be the teacher's
  configuration with ``n_layers=len(layers)`` (``max_len``, ``dtype``, ``remat`` may differ).
  The copies are new buffers on ``mesh`` with the student's shardings (never aliases of the
  teacher's weights, which the train step must not update).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from meshdistill.models import abstract_params  # pylint: disable=g-import-not-at-top

  t = teacher.cfg
  # the copies keep the teacher's layout for the mesh (vocabulary padding, key/value replication)
  student_cfg = student_cfg.replace(vocab_multiple=t.vocab_multiple, replicate_kv=t.replicate_kv)
  if student_cfg.replace(n_layers=t.n_layers, max_len=t.max_len, dtype=t.dtype, remat=t.remat) != t:
    raise ValueError("student_from_teacher: student_cfg must be the teacher's config with n_layers=len(layers)")
  if len(layers) != student_cfg.n_layers or any(not 0 <= i < t.n_layers for i in layers):
    raise ValueError(f"layers={list(layers)} must be {student_cfg.n_layers} block indices in [0, {t.n_layers})")
  graphdef, abstract, shardings = abstract_params(student_cfg, mesh)
  teacher_flat = dict(nnx.to_flat_state(nnx.state(teacher)))
  leaves = []
  for key, var in nnx.to_flat_state(abstract):
    src_key = (key[0], layers[key[1]], *key[2:]) if key[0] == "blocks" else key
    leaves.append((key, var.replace(teacher_flat[src_key].get_value())))
  state = nnx.from_flat_state(leaves)
  if mesh is None:
    state = jax.jit(lambda s: jax.tree.map(jnp.copy, s))(state)
  else:
    state = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=shardings)(state)
  return nnx.merge(graphdef, state)
