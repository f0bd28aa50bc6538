"""Where a run's metrics go besides ``metrics.jsonl`` and the progress line: ``run.loggers``.

* ``tensorboard`` (the default): event files in ``<run_dir>/tb`` (`meshdistill.train.loop.monitor`);
* ``wandb``: a Weights & Biases run (`WandbLogger`; the ``wandb`` extra: ``pip install 'meshdistill[wandb]'``). The
  run's config is its W&B config, every metrics row is logged at its step as ``train/<metric>`` / ``val/<metric>``,
  and the final summary (``summary.json``) is the W&B run's summary. The W&B run id is kept in
  ``<run_dir>/wandb_id``, so a run resumed from its checkpoints logs into the same W&B run. W&B's own settings come
  from its environment: ``WANDB_PROJECT`` (default ``meshdistill``), ``WANDB_ENTITY``, ``WANDB_MODE=offline`` (write
  under ``<run_dir>/wandb`` only; ``wandb sync`` uploads it later), ``WANDB_API_KEY``.

W&B accepts steps in increasing order only: after a resume, the steps a killed run had logged past its last
checkpoint are run again but W&B keeps its first values of them (``metrics.jsonl`` and TensorBoard hold the redone
values).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from typing import Any

from meshdistill.core.fsutil import write_text_atomic
from meshdistill.core.typed_yaml import ConfigError

log = logging.getLogger(__name__)

LOGGERS = ("tensorboard", "wandb")
WANDB_ID_FILE = "wandb_id"  # in the run directory: the W&B run id a resumed run logs into again
WANDB_DIR = "wandb"  # W&B's own files (offline runs, logs), in the run directory


def check_loggers(value, setting: str = "run.loggers") -> tuple[str, ...]:
  """``value`` as a tuple of known logger names, or a `ConfigError` naming ``setting``."""
  if isinstance(value, str) or not isinstance(value, (list, tuple)):
    raise ConfigError(f"{setting}={value!r} must be a list of loggers from {list(LOGGERS)}, e.g. [tensorboard, wandb] "
                      "([] for metrics.jsonl and the progress line only)")
  unknown = [v for v in value if v not in LOGGERS]
  if unknown:
    raise ConfigError(f"{setting}={list(value)}: {unknown[0]!r} is not a logger; choose from {list(LOGGERS)}")
  if len(set(value)) != len(value):
    raise ConfigError(f"{setting}={list(value)} names a logger twice; list each once")
  return tuple(value)


def import_wandb():
  """The ``wandb`` module, or a `ConfigError` saying how to get it."""
  try:
    import wandb  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError("run.loggers includes 'wandb', but the wandb package is not installed: pip install "
                      "'meshdistill[wandb]' (or pip install wandb), or remove wandb from run.loggers") from None
  return wandb


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
  """A nested summary as ``{"a/b": number or text}`` (lists of events and other values left out)."""
  out: dict[str, Any] = {}
  if isinstance(tree, dict):
    for k, v in tree.items():
      out |= _flat(v, f"{prefix}{k}/")
  elif isinstance(tree, bool) or tree is None:
    pass
  elif isinstance(tree, (int, float)):
    if math.isfinite(float(tree)):
      out[prefix[:-1]] = tree
  elif isinstance(tree, str):
    out[prefix[:-1]] = tree
  return out


class WandbLogger:
  """The W&B run of one run directory (see the module docstring).

  Args:
    run_dir: the run directory (holds ``wandb_id`` and W&B's ``wandb/``).
    config: the run's config as a plain dict (`meshdistill.config.Config.to_dict`), or None.
    job: what the run does (``distill``, ``pretrain``): W&B's ``job_type``.
  """

  def __init__(self, run_dir: str, *, config: dict | None = None, job: str = ""):
    wandb = import_wandb()
    id_path = os.path.join(run_dir, WANDB_ID_FILE)
    run_id = None
    if os.path.isfile(id_path):
      with open(id_path, encoding="utf-8") as f:
        run_id = f.read().strip() or None
    if run_id is None:
      run_id = secrets.token_hex(6)  # W&B ids: letters and digits
      write_text_atomic(id_path, run_id + "\n")  # before the run starts: a kill after it still resumes this id
    self.resumed = os.path.isdir(os.path.join(run_dir, WANDB_DIR))
    self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "meshdistill",
                          name=os.path.basename(os.path.normpath(os.path.abspath(run_dir))), id=run_id,
                          resume="allow", dir=run_dir, config=config, job_type=job or None, reinit="create_new")
    log.info("wandb: run %s (%s)%s", run_id, self.run.settings.mode, ", resumed" if self.resumed else "")

  @property
  def id(self) -> str:
    return self.run.id

  def log(self, step: int, split: str, metrics: dict[str, float]) -> None:
    """One metrics row, as ``<split>/<metric>`` at ``step``."""
    row = {f"{split}/{k}": float(v) for k, v in metrics.items() if math.isfinite(float(v))}
    if row:
      self.run.log(row, step=int(step))

  def summary(self, summary: dict) -> None:
    """The run's final summary (nested keys joined with ``/``) as the W&B run's summary."""
    for k, v in _flat(summary).items():
      self.run.summary[k] = v

  def close(self) -> None:
    self.run.finish()
