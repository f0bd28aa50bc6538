"""Config files: packaged names, reading YAML with overrides, and the generated ``default.yaml``.

The dataclass defaults of `meshdistill.config.Config` are the one source of the main job's
settings. The packaged ``configs/default.yaml`` is generated from them by `default_yaml`
(``python scripts/write_default_config.py``), with the comments below, and a test keeps the
file equal to the generated text. Other packaged configs (``tiny``) hold only the keys they
change. In the repository's ``configs/``, ``default.yaml`` and ``tiny.yaml`` are links to the
packaged files, not copies; it also holds recipes that only make sense in a checkout (``hf_example``).
"""

from __future__ import annotations

import importlib.resources
import os
from collections.abc import Sequence
import yaml

from meshdistill.core.typed_yaml import ConfigError, YamlRefused, load_yaml, parse_override, set_path

CONFIG_SUFFIXES = (".yaml", ".yml")

HEADER = """\
# The main job: `meshdistill distill` with no arguments runs exactly this.
# Generated from the defaults of meshdistill.config.Config by scripts/write_default_config.py; do not edit.
# Override any key from the command line: meshdistill distill --set train.steps=200 --set distill.alpha=0.7
"""

# dotted key -> the comment written after it in default.yaml
COMMENTS = {
    "preference.pairs": "distill.kind preference: own (the run's text vs another place's) or a JSONL file",
    "mesh.data": "batch split over data devices; auto: the devices present (no accelerator: 2; one chip: 1)",
    "mesh.tensor": "weights (heads, MLP units, vocabulary) split over tensor devices; auto: no accelerator: 4",
    "mesh.axes": "more mesh axes between data and tensor, e.g. {expert: 2}: MoE experts split over 2; null: none",
    "mesh.backend": "shard_map | single | pmap",
    "mesh.fsdp": "true: weights and optimizer moments split over data too (ZeRO-3; shard_map only)",
    "mesh.student_split": "tensor | batch: a replicated student on rows split over data x tensor",
    "mesh.simulate_cpu_devices": "without an accelerator: 8 simulated CPU devices",
    "teacher": "~1.05 M parameters",
    "teacher.vocab_size": "the byte tokenizer's vocabulary",
    "teacher.max_len": "longest row; with teacher.hf: config.json's max_position_embeddings unless set",
    "teacher.dtype": "compute dtype; auto: bfloat16 on a TPU, float32 elsewhere",
    "teacher.param_dtype": "stored weights; auto: the compute dtype (a frozen teacher)",
    "teacher.attention": "auto: the splash kernel on a TPU (seq a multiple of 128), else xla",
    "teacher.scan_layers": "auto: stacked under nnx.scan on a TPU / GPU (one compiled block), per layer on a CPU",
    "student.max_len": "longest row; student.hf, or init.from_teacher of teacher.hf: config.json's unless set",
    "student.dtype": "compute dtype; auto: bfloat16 on a TPU, float32 elsewhere",
    "student.param_dtype": "stored weights; auto: float32 (the student trains)",
    "student.remat": "auto: with train.micro_batch, the cheapest that fits the device (none on a CPU)",
    "student.attention": "auto: the splash kernel on a TPU (seq a multiple of 128), else xla",
    "student.scan_layers": "auto: stacked under nnx.scan on a TPU / GPU (one compiled block), per layer on a CPU",
    "student": "~0.28 M parameters (27% of the teacher)",
    "data.source": "the Python standard library's source code",
    "data.format": "auto | text | prompt_completion | messages: conversations in the teacher's chat template",
    "data.chat_template": "a .jinja file in place of the tokenizer's chat template; null: the tokenizer's own",
    "data.val_fraction": "held-out documents",
    "data.max_chars": "a deterministic 3 M-character sample",
    "data.packing": "stream: a row's documents attend to each other; documents: each to itself (segment ids)",
    "distill.kind": "a registered strategy: meshdistill.strategies.names(); null settings: its defaults",
    "distill.temperature": "a number or a schedule, e.g. {kind: linear, start: 3.0, end: 1.0, steps: 300}",
    "distill.alpha": "weight of the KL term; 1 - alpha on the hard labels",
    "distill.divergence": "forward_kl | reverse_kl | jsd | skew_kl | skew_reverse_kl | tvd | mse",
    "distill.top_k": "e.g. 32: the teacher's top-32 tokens and a tail bin (null: the full vocabulary)",
    "distill.chunk_size": "e.g. 1024: the loss from hidden states, 1024 tokens at a time (no [B, T, V] logits)",
    "distill.options": "further settings of the strategy by name, e.g. {beta: 0.3} for divergence jsd",
    "distill.on_policy": "GKD: the student completes the prompts it is graded on (lambda > 0 turns it on)",
    "distill.on_policy.lambda": "probability a batch is sampled by the student; else the data's completions",
    "distill.on_policy.max_new_tokens": "completion length; prompts: the first seq_len + 1 - max_new_tokens tokens",
    "distill.on_policy.temperature": "the sampler's (distill.temperature is the loss's); 0 = greedy",
    "distill.on_policy.top_k": "0 = no top-k filter",
    "distill.on_policy.top_p": "1 = no nucleus filter",
    "distill.on_policy.seq_kd": "the teacher samples instead (sequence-level KD)",
    "distill.on_policy.prompts_file": "JSONL {prompt, completion} pairs instead of the corpus rows",
    "train": "the student",
    "train.micro_batch": "rows per device per forward/backward (gradient accumulation); auto: fit the device",
    "train.mu_dtype": "AdamW's first moment: float32, or bfloat16 (half its memory)",
    "train.freeze": "progressive freezing, e.g. [{start_step: 0, freeze: 0.5, lr: 3.0e-3}, {start_step: 150, lr: 1.0e-3}]",
    "pretrain": "the teacher: loaded from `teacher`, else pretrained once and cached",
    "pretrain.cache_dir": "default: ~/.cache/meshdistill/teachers",
    "safeguards": "besides train.clip and the always-on skip of non-finite updates",
    "safeguards.guard": "divergence: restore the last good state, fall back to another loss",
    "safeguards.guard.window": "losses in the running median",
    "safeguards.guard.factor": "a loss above 4x that median (or non-finite) is a divergence",
    "safeguards.guard.min_history": "losses needed before the median test applies",
    "safeguards.guard.max_restores": "then stop with an error (the last checkpoint stays)",
    "safeguards.guard.keep_every": "steps between copies of the good state (auto: 10 on the devices, 100 in host memory)",
    "safeguards.guard.keep_in": "auto: copies in host memory on an accelerator, on the devices on a CPU",
    "safeguards.guard.fallback": "the distillation term after a divergence, for the rest of the stage",
    "safeguards.remat.auto": "before step 1: turn remat on if the step would not fit in memory",
    "safeguards.remat.budget_mib": "per-device budget; null = the device's memory (CPU: none, no check)",
    "safeguards.loss_scale": "static loss scaling for low-precision gradients, e.g. 1024.0",
    "checkpoint.dir": "default: <run_dir>/checkpoints",
}
_COMMENT_COLUMN = 31


def _lines(tree: dict, path: str, indent: int) -> list[str]:
  out = []
  for key, value in tree.items():
    dotted = f"{path}{key}"
    if isinstance(value, dict) and value:
      line = f"{' ' * indent}{key}:"
    else:
      flow = yaml.safe_dump({key: value}, default_flow_style=True, sort_keys=False, width=1_000)
      line = f"{' ' * indent}{flow.strip()[1:-1]}"  # "{key: value}" -> "key: value"
    if dotted in COMMENTS:
      line = f"{line.ljust(_COMMENT_COLUMN - 1)} # {COMMENTS[dotted]}"
    out.append(line)
    if isinstance(value, dict) and value:
      out.extend(_lines(value, f"{dotted}.", indent + 2))
  return out


def default_yaml(settings: dict) -> str:
  """The text of ``default.yaml`` for the plain settings dict ``Config().to_dict()``."""
  sections = ["\n".join(_lines({name: section}, "", 0)) for name, section in settings.items()]
  return HEADER + "\n" + "\n\n".join(sections) + "\n"


def packaged_dir():
  """The folder of the packaged configs (``meshdistill/config/presets``)."""
  return importlib.resources.files("meshdistill.config") / "presets"


def config_path(name_or_path: str) -> str:
  """A config file: an existing path, or the name of a packaged config (``default``, ``tiny``)."""
  if os.path.exists(name_or_path):
    return name_or_path
  packaged = packaged_dir()
  for suffix in ("",) + CONFIG_SUFFIXES:
    candidate = packaged / f"{name_or_path}{suffix}"
    if candidate.is_file():
      return str(candidate)
  names = sorted(p.name.rsplit(".", 1)[0] for p in packaged.iterdir() if p.name.endswith(CONFIG_SUFFIXES))
  raise FileNotFoundError(f"config {name_or_path!r} is neither a file nor a packaged config; packaged configs: {names}")


def load_raw(name_or_path: str | None) -> dict:
  """The YAML mapping of a config file (``{}`` for None)."""
  if name_or_path is None:
    return {}
  path = config_path(name_or_path)
  if os.path.isdir(path):
    raise ConfigError(f"config {path} is a directory; give a YAML file (e.g. configs/tiny.yaml) or a packaged "
                      "config name (default, tiny)")
  try:
    with open(path, encoding="utf-8") as f:
      raw = load_yaml(f)  # YAML 1.2 floats (3e-4, 1e9) too; duplicated keys and alias bombs refused
  except YamlRefused as e:
    raise ConfigError(f"config {path}: {e}") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"{path}: not valid YAML ({e})") from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"config {path} is not UTF-8 text (byte {e.start}: {e.reason}), so not a YAML config; give "
                      "a YAML file or a packaged config name (default, tiny)") from None
  except OSError as e:
    raise ConfigError(f"config {path} cannot be read ({e.strerror or e}); give a readable YAML file") from None
  if raw is None:
    return {}
  if not isinstance(raw, dict):
    raise ConfigError(f"{path}: the top level must be a mapping of sections (mesh, teacher, student, ...)")
  return raw


def read(name_or_path: str | None, overrides: Sequence[str]) -> dict:
  """The raw mapping of a config file (or None: ``{}``) with ``key.path=value`` overrides applied."""
  raw = load_raw(name_or_path)
  for item in overrides:
    path, value = parse_override(item)
    set_path(raw, path, value, item)
  return raw
