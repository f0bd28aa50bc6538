"""The final evaluation of a several-teacher run (``teachers:``): each teacher and the combined target against the
student on the validation rows, and the run's summary table of them (`summary_table`).

Each validation batch gets every teacher's top-k as a training batch does: a teacher that runs a model (`Live`)
runs its program on the rows, a served one (a bundle with ``fetch``) is asked for them; a cache holds the top-k of
the training rows only and is reported as not evaluated. Under ``combine: route`` a teacher is compared on the rows
it serves (its corpora), under ``mix`` on every row. Per teacher: its validation loss and perplexity (the
cross-entropy of its model on those rows; a model teacher only), the student's KL from the teacher's top-k and their
top-1 agreement (`meshdistill.train.loop.evaluate.Evaluator.against_topk`: the step's ``kl/<name>`` /
``agreement/<name>`` on validation rows, at ``distill.temperature``); and the same against the combined target
(routed or mixed: what the student trained on) when every teacher gave its top-k.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from meshdistill import losses
from meshdistill.core.batch import MULTI_KEYS, TOPK_KEYS
from meshdistill.data import DOMAIN_KEY
from meshdistill.models.decoder import param_count
from meshdistill.teachers.multi._data import Live, MultiTeacherData, combine
from meshdistill.train.loop.evaluate import Evaluator

CACHE_NOTE = "a cache holds the top-k of the training rows only"


def _topk_of(producer, host: dict) -> losses.TopK | None:
  """``producer``'s top-k of the rows of ``host`` (host arrays), or None when it cannot give new rows (a cache)."""
  if isinstance(producer, Live):
    return losses.TopK(*(np.asarray(x) for x in producer(host)))
  if hasattr(producer.bundle, "fetch"):
    got = producer.bundle.fetch(host)
    return losses.TopK(*(np.asarray(got[k]) for k in TOPK_KEYS))
  return None


def with_topk(data: MultiTeacherData, host: dict) -> tuple[dict, list[bool]] | None:
  """``host`` with its teachers' top-k (`MULTI_KEYS`: those that gave one, in order; `TOPK_KEYS`: the combined
  target, when all did) and which teachers gave one; None when the rows cannot be routed (no ``domain``)."""
  if data.route is not None and DOMAIN_KEY not in host:
    return None
  topks = [_topk_of(p, host) for p in data.producers]
  given = [t is not None for t in topks]
  B = np.asarray(host["inputs"]).shape[0]
  teacher_B = None if data.route is None else data.route[np.asarray(host[DOMAIN_KEY])]
  if all(given):
    out = combine(topks, teacher_B, k=data.k, weights=None if teacher_B is not None else data.weights)
  elif any(given):
    kept = [t for t in topks if t is not None]
    out = {k: v for k, v in combine(kept, None, k=data.k, weights=(1.0,) * len(kept)).items() if k in MULTI_KEYS}
    n = len(topks)
    rows = np.ones((B, n), np.float32) if teacher_B is None else np.eye(n, dtype=np.float32)[teacher_B]
    out["teachers_rows"] = rows[:, np.asarray(given)]
  else:
    return {**host}, given
  return {**host, **{k: np.asarray(v) for k, v in out.items()}}, given


def evaluate_teachers(distiller, student_params, data: MultiTeacherData, val: list[dict], members, *,
                      combine_name: str, temperature: float) -> dict:
  """The summary's ``teachers`` entry (see the module docstring): ``{"combine", "temperature", "members": [{"name",
  "source", "params", "loss", "ppl", "kl", "agreement", "tokens", "note"}], "target": {"kl", "agreement", "tokens"}
  or None}``; ``members``: the ``teachers.sources`` (``name``, ``source``) in the data's order."""
  mesh = distiller.layout.eval_mesh
  placed = [with_topk(data, b) for b in val]
  rows_known = bool(val) and all(p is not None for p in placed)
  entries = [{"name": m.name, "source": m.source, "params": None, "loss": None, "ppl": None, "kl": None,
              "agreement": None, "tokens": 0.0, "note": None} for m in members]
  target = None
  if not rows_known:
    for e in entries:
      e["note"] = "the validation rows carry no corpus to route them by"
    return {"combine": combine_name, "temperature": temperature, "members": entries, "target": None}
  given = placed[0][1]
  batches = [b for b, _ in placed]
  if any(given):
    got = Evaluator(distiller.student_def, mesh=mesh).against_topk(student_params, batches, temperature)
    for e, metrics in zip([e for e, g in zip(entries, given) if g], got["teachers"]):
      e.update(metrics)
    target = got["target"]
  for n, (entry, producer, ok) in enumerate(zip(entries, data.producers, given)):
    if not ok:
      entry["note"] = CACHE_NOTE
      continue
    if not isinstance(producer, Live):
      entry["note"] = "served: its model is not here"
      continue
    program = producer.program
    entry["params"] = param_count(nnx.merge(program.graphdef, program.params))
    own = [dict(b, mask=np.asarray(b["mask"]) * _rows(b, given, n)[:, None]) for b in batches]
    if not sum(float(np.sum(b["mask"])) for b in own):
      entry["note"] = "serves no validation row"
      continue
    mine = Evaluator(program.graphdef, mesh=mesh)(program.params, own)
    entry["loss"], entry["ppl"] = mine["loss"], mine["ppl"]
  return {"combine": combine_name, "temperature": temperature, "members": entries, "target": target}


def _rows(batch: dict, given: list[bool], n: int) -> np.ndarray:
  """``[B]`` float: the rows teacher ``n`` serves (of the teachers that gave a top-k, its column)."""
  return np.asarray(batch["teachers_rows"])[:, sum(given[:n])].astype(np.float32)


def summary_table(summary: dict) -> str:
  """The final table of a several-teacher run: each teacher's loss, the student's, and the student against each
  teacher's top-k and the combined target."""
  teachers, s = summary["teachers"], summary["student"]
  where = "the rows it serves" if teachers["combine"] == "route" else "every row"
  rows = [("model", "params", "val loss", "val ppl")]
  for e in teachers["members"]:
    if e["loss"] is not None:
      rows.append((f"teacher {e['name']} ({e['source']})", f"{e['params']:,}", f"{e['loss']:.4f}", f"{e['ppl']:.3f}"))
    else:
      rows.append((f"teacher {e['name']} ({e['source']})", f"{e['params']:,}" if e["params"] else "-", "-", "-"))
  rows.append(("distilled student", f"{s['params']:,}", f"{s['loss']:.4f}", f"{s['ppl']:.3f}"))
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  def line(r):
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

  out = [line(rows[0]), "  ".join("-" * w for w in widths), *map(line, rows[1:])]
  out.append(f"student vs each teacher's top-k (forward KL on its k+1 bins at temperature "
             f"{teachers['temperature']:g}; teacher losses on {where}):")
  for e in teachers["members"]:
    if e["kl"] is None:
      out.append(f"  {e['name']}: not evaluated ({e['note']})")
    else:
      extra = f"; loss not evaluated ({e['note']})" if e["loss"] is None and e["note"] else ""
      out.append(f"  {e['name']} ({int(e['tokens']):,} tokens): KL {e['kl']:.4f}, top-1 agreement "
                 f"{e['agreement']:.1%}{extra}")
  t = teachers["target"]
  name = "routed" if teachers["combine"] == "route" else "mixed"
  if t is None:
    out.append(f"  {name} target: not evaluated (it needs every teacher's top-k)")
  else:
    out.append(f"  {name} target ({int(t['tokens']):,} tokens): KL {t['kl']:.4f}, top-1 agreement "
               f"{t['agreement']:.1%}")
  return "\n".join(out)
