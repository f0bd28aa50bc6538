"""Hugging Face Hub ids as model sources: ``teacher.hf``, ``student.hf`` and ``student.init.pruned`` may name a Hub
repository, ``org/name`` or ``org/name@revision`` (a branch, tag or commit), instead of a local directory.

A value is a Hub id when it has that form and no such local path exists (a local directory always wins). It is
resolved through `huggingface_hub` to the snapshot directory of its local cache first (``HF_HUB_CACHE``, by default
``~/.cache/huggingface/hub``: ``models--org--name/snapshots/<commit>/``, the revision read from ``refs/<revision>``),
so a cached model needs no network and works with ``HF_HUB_OFFLINE=1``. Only when the cache lacks it and the Hub is
not offline are the files downloaded (for a model: its config, safetensors weights and tokenizer files). A run
records the id pinned to the commit it resolved (``org/name@<commit>``), so a resumed or re-read run uses the same
files.
"""

from __future__ import annotations

import logging
import os
import re

from meshdistill.core.typed_yaml import ConfigError

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_TRUE = {"1", "on", "yes", "true"}


def hub_id(value) -> tuple[str, str | None] | None:
  """``(repo, revision)`` when ``value`` is a Hub id and no local path of that name exists, else None."""
  if not isinstance(value, str) or os.path.exists(os.path.expanduser(value)):
    return None
  m = _HUB_ID.match(value)
  if m is None or m.group("repo").startswith((".", "~")) or ".." in m.group("repo"):
    return None
  return m.group("repo"), m.group("revision")


def local_or_id(value: str) -> str:
  """A local path made absolute, or a Hub id as given (resolved later by `resolve_hub`)."""
  return value if hub_id(value) else os.path.abspath(os.path.expanduser(value))


def cache_dir() -> str:
  """The Hugging Face Hub cache searched (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else huggingface_hub's default)."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top

  if os.environ.get("HF_HUB_CACHE"):
    return os.path.expanduser(os.environ["HF_HUB_CACHE"])
  if os.environ.get("HF_HOME"):
    return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
  return str(constants.HF_HUB_CACHE)


def offline() -> bool:
  """Whether downloads are refused: ``HF_HUB_OFFLINE`` (read now, and as huggingface_hub read it)."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top

  return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def resolve_hub(value: str, setting: str, patterns: tuple[str, ...] | None = MODEL_FILES) -> tuple[str, str]:
  """``(local snapshot directory, "repo@commit")`` of the Hub id ``value`` (see the module docstring).

  ``patterns``: the files a download fetches (None: all). Raises `ConfigError` naming ``setting``, the id, the
  revision and the cache searched when the model is neither cached nor (offline, or unreachable) downloadable.
  """
  parsed = hub_id(value)
  if parsed is None:
    raise ValueError(f"{setting}={value!r} is not a Hub id (org/name or org/name@revision)")
  repo, revision = parsed
  try:
    from huggingface_hub import snapshot_download  # pylint: disable=g-import-not-at-top
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError(f"{setting}={value!r} names a Hugging Face Hub model, which needs the huggingface_hub package "
                      "(pip install huggingface_hub); or give a local model directory") from None
  cache = cache_dir()
  where = (f"{setting}={value!r} (no local directory {os.path.abspath(os.path.expanduser(value))}; read as the Hub "
           f"repository {repo!r}, revision {revision or 'main'!r})")
  try:
    path = snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True)
  except (LocalEntryNotFoundError, FileNotFoundError, HfHubHTTPError, OSError, ValueError):
    path = None
  if path is None:
    if offline():
      raise ConfigError(f"{where} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set, so nothing is "
                        "downloaded; download it first (huggingface-cli download " + repo +
                        (f" --revision {revision}" if revision else "") + "), point HF_HUB_CACHE at a cache that "
                        "holds it, or give a local model directory")
    log.info("%s is not in the cache %s: downloading it", where, cache)
    try:
      path = snapshot_download(repo, revision=revision, cache_dir=cache,
                               allow_patterns=list(patterns) if patterns else None)
    except Exception as e:  # pylint: disable=broad-except  # any failure of the Hub: named, with what to do
      raise ConfigError(f"{where} is not in the Hugging Face cache {cache} and could not be downloaded "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); check the id and "
                        "revision, or give a local model directory") from None
  commit = os.path.basename(os.path.normpath(path))
  log.info("%s: %s", where, path)
  return path, f"{repo}@{commit}"
