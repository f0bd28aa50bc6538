"""Plots of a run's ``metrics.jsonl`` (``meshdistill plot RUN_DIR``): `read_metrics`, `plot_run`.

PNGs go to ``RUN_DIR/plots`` or ``--out``; a PNG is replaced only in a plot directory meshdistill made
(`meshdistill.core.ownership`), and never through a symlink.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from meshdistill.core.fsutil import OutputExistsError, SymlinkError
from meshdistill.core.ownership import OutputKind, read_marker, write_marker

log = logging.getLogger("meshdistill.train.loop.monitor")  # the records keep the name they always had

# plot name -> curves (split, metric key, label). Validation "loss" is the model's cross-entropy.
PLOTS = {
  "loss": (("train", "loss", "train objective"), ("val", "loss", "validation cross-entropy")),
  "kl": (("train", "kl", "train KL(teacher || student) at tau"), ("val", "kl", "validation KL at tau = 1")),
  "ce": (
    ("train", "ce", "train cross-entropy"),
    ("val", "loss", "validation cross-entropy"),
    ("val", "teacher_loss", "teacher, validation"),
  ),
  "corr": (("train", "corr", "train logit correlation"), ("val", "corr", "validation logit correlation")),
}


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
  """The rows of ``run_dir/metrics.jsonl``; a torn line (a run killed mid-write) is skipped with a warning.

  Rows are kept as written: a divergence restore repeats steps on purpose (plots keep each step's
  last value); a resumed run has already dropped the rows past its checkpoint (`Monitor.rewind`).
  """
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist; is {run_dir!r} a run directory (written by meshdistill)?")
  rows: list[dict[str, Any]] = []
  with open(path, encoding="utf-8", errors="replace") as f:
    for i, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        int(row["step"])
      except (ValueError, TypeError, KeyError) as e:
        log.warning("%s line %d is not a metrics row (%s); skipped", path, i, e)
        continue
      rows.append(row)
  return rows


def _series(rows: Iterable[dict], split: str, key: str) -> tuple[list[int], list[float]]:
  by_step = {}
  for r in rows:
    if r.get("split") == split and key in r:
      by_step[int(r["step"])] = float(r[key])  # a resumed run may repeat steps: keep the latest
  steps = sorted(by_step)
  return steps, [by_step[s] for s in steps]


def plot_run(run_dir: str, out_dir: str | None = None, names: Iterable[str] = tuple(PLOTS)) -> list[str]:
  """Writes one PNG per plot in ``names`` (see `PLOTS`: loss, kl, ce, corr) and returns their paths.

  Curves a run does not have (a pretraining run has no KL) are left out, and so are plots
  with no curve at all. A PNG is replaced only in a plot directory meshdistill made (its owner marker;
  ``RUN_DIR/plots`` of an earlier version holding only plots): in any other ``out_dir`` an existing file of
  the same name is an error naming it, checked before anything is written (`_plot_dir`).
  """
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("plotting needs matplotlib: pip install matplotlib") from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  rows = read_metrics(run_dir)
  default = os.path.join(run_dir, "plots")
  names = [n for n in names if any(_series(rows, split, key)[0] for split, key, _ in PLOTS[n])]
  out_dir = _plot_dir(out_dir or default, names, earlier_ok=os.path.abspath(out_dir or default) == os.path.abspath(
    default))
  written = []
  for name in names:
    curves = [(label, *_series(rows, split, key)) for split, key, label in PLOTS[name]]
    curves = [c for c in curves if c[1]]
    if not curves:
      continue
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, xs, ys in curves:
      ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(name)
    ax.set_title(f"{os.path.basename(os.path.normpath(run_dir))}: {name}")
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(out_dir, f"{name}.png")
    fig.tight_layout()
    tmp = os.path.join(out_dir, f".tmp-{name}.png-{os.getpid()}")
    fig.savefig(tmp, dpi=100, format="png")
    os.replace(tmp, path)  # a link put there meanwhile is replaced, not written through
    plt.close(fig)
    written.append(path)
  if not written:
    raise ValueError(f"{run_dir}/metrics.jsonl has none of the metrics to plot ({sorted(PLOTS)})")
  return written


def _plot_dir(out_dir: str, names: list[str], earlier_ok: bool) -> str:
  """``out_dir`` checked for `plot_run` (created, with its owner marker, when missing); raises before anything is
  written when a ``<name>.png`` there is a link, or a file in a directory meshdistill did not make."""
  kind = OutputKind("plots", "plot directory", lambda n: n in {f"{k}.png" for k in PLOTS})
  if os.path.islink(out_dir):
    raise SymlinkError(out_dir)
  if not os.path.exists(out_dir) or (os.path.isdir(out_dir) and not os.listdir(out_dir)):
    write_marker(out_dir, kind)
  if not os.path.isdir(out_dir):
    raise OutputExistsError(f"--out {out_dir} exists and is not a directory; give a directory")
  marker = read_marker(out_dir)
  entries = [n for n in os.listdir(out_dir) if not n.startswith(".")]
  ours = (marker is not None and marker["kind"] == kind.name) or (
    marker is None and earlier_ok and all(kind.ours(n) for n in entries))
  for name in names:
    path = os.path.join(out_dir, f"{name}.png")
    if os.path.islink(path):
      raise SymlinkError(path)
    if os.path.lexists(path) and not ours:
      raise OutputExistsError(
        f"{path} exists and meshdistill did not write it (--out is not a plot directory meshdistill made); nothing was "
        "changed. Give another --out (a new directory), or move the file away"
      )
  return out_dir
