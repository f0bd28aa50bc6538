"""Several teachers in one run (``teachers:``): named sources combined into one top-k target per token.

Any teacher source can be one of them (`meshdistill.teachers.kinds`): one that gives `TOPK` (an offline cache, a
served teacher) is prepared exactly as for one teacher and read side by side with the others; one that gives a
`MODEL` (pretrained, hf, quantized) is obtained as for one teacher and run as its top-k program on the student's
mesh at its own ``temperature``. So a new top-k source is one more possible member with no change here.

They combine (`_data.combine`) by

* ``route``: every row goes to the teacher that ``takes`` its ``domain`` (the corpus of ``data.corpora`` it came
  from) and is distilled from that teacher's top-k alone;
* ``mix``: every token's target is the ``weight``-ed mixture of the teachers' top-k distributions over the union of
  their ids, with the tail bin (`meshdistill.losses.mix_topk`).

The student trains from the combined target as from any top-k teacher (``distill.kind: logit_kd`` with
``distill.top_k``), compared at ``distill.temperature``; the step also reports ``kl/<name>``,
``agreement/<name>`` and ``tokens/<name>`` per teacher over the rows it serves. Caches: one per teacher (each
written by ``meshdistill cache-teacher --teacher NAME``, `one_teacher`): the combination is made when batches are
read, so the same caches serve any routing or weights, and a cache stays the record of one teacher.

On-policy (``distill.on_policy``): every teacher runs a model or is served (not a cache), and
`MultiTeacherData.score` gives the rows the student generates their target
(`meshdistill.train.onpolicy.OnPolicyDistiller`'s ``topk_of``, the `Prepared`'s).

`Teachers` is the several teachers as the run's one teacher source (the `meshdistill.teachers.kinds.Source` the
distill job asks: ``check``, ``meshes``, ``prepare``).

After training, `evaluate_teachers` reports each teacher's validation loss and the student's KL / agreement against
each teacher's top-k and against the combined target, and `summary_table` prints them as the run's final table.

Modules: `_settings` (the ``teachers`` section, a member's own config, the checks across sections), `_data` (the
producers, `combine`, `MultiTeacherData`), `_evaluate` (the final evaluation and its table).
"""

from __future__ import annotations

import contextlib

from meshdistill.core.typed_yaml import ConfigError
from meshdistill.parallel.backends import make_layout
from meshdistill.teachers import kinds
from meshdistill.teachers.cache import TeacherTopK, TopKTeacher
from meshdistill.teachers.kinds._quantize import quantized_teacher
from meshdistill.teachers.multi._data import FromBatches, Live, MultiTeacherData, combine
from meshdistill.teachers.multi._evaluate import evaluate_teachers, summary_table
from meshdistill.teachers.multi._settings import Member, TeachersSettings, check_teachers, member_config, one_teacher
from meshdistill.core.vocab import resolve_shared_vocab

__all__ = ["FromBatches", "Live", "Member", "MultiTeacherData", "Teachers", "TeachersSettings", "check_teachers",
           "combine", "evaluate_teachers", "member_config", "one_teacher", "prepare", "summary_table"]


class Teachers:
  """The teachers of ``cfg.teachers`` as the run's one teacher source (`meshdistill.teachers.kinds.Source`): checked
  across the config's sections (`check_teachers`), on the student's mesh, prepared by `prepare`."""

  def __init__(self, cfg):
    self.cfg = cfg

  def check(self) -> None:
    check_teachers(self.cfg)

  def meshes(self, build_mesh):
    return None, build_mesh(self.cfg)

  def prepare(self, data, mesh, teacher_mesh, services: kinds.Services) -> kinds.Prepared:
    del teacher_mesh  # every teacher runs on the student's mesh, or elsewhere by its own source's settings
    return prepare(self.cfg, data, mesh, services)


def prepare(cfg, data, mesh, services: kinds.Services) -> kinds.Prepared:
  """The teachers of ``cfg.teachers`` ready for the run on ``mesh``: ``Prepared(data with the combined top-k, the
  teachers as one `TopKTeacher` (with their names), their identities)``, the `MultiTeacherData` its ``teachers``. On
  the on-policy path (``distill.on_policy``) the teachers score each batch in its step's turn instead (the
  `Prepared`'s ``topk_of``) and the data is the plain ``data``: a generated batch replaces its rows, so nothing is run
  ahead on rows that would not be trained on."""
  k, tau = int(cfg.distill.value("top_k")), float(cfg.distill.value("temperature"))
  program_mesh = make_layout(cfg.mesh.backend, mesh).eval_mesh
  producers, identities, first_cfg, vocab = [], [], None, cfg.student.vocab_size
  for m in cfg.teachers.members():
    sub = member_config(cfg, m)
    source = kinds.get(m.source)(sub)
    if source.gives == kinds.MODEL:
      with _naming(m):
        teacher, identity = source.model(data, mesh, services)
        teacher = quantized_teacher(sub, teacher, mesh)
      shared = _shared_vocab(m, teacher.cfg.vocab_size, cfg.student.vocab_size)
      producers.append(Live(TeacherTopK(teacher, k=k, temperature=m.temperature or tau, vocab=shared,
                                        mesh=program_mesh)))
      model_cfg = teacher.cfg
    else:
      with _naming(m):
        got = source.prepare(data, mesh, None, services)
      spec, identity = got.teacher, got.identity
      shared = _shared_vocab(m, spec.vocab, cfg.student.vocab_size)
      if spec.k < k:
        raise ConfigError(f"teachers: {m.name} ({spec.source}) holds the top-{spec.k} per token, fewer than "
                          f"distill.top_k={k}; lower distill.top_k to {spec.k} or rewrite it with more")
      if float(spec.temperature) != float(m.temperature or spec.temperature):
        raise ConfigError(f"teachers: {m.name} ({spec.source}) holds log-probabilities at temperature "
                          f"{spec.temperature}, but its temperature is {m.temperature}; set it to "
                          f"{spec.temperature} (or leave it out)")
      producers.append(FromBatches(got.data))
      model_cfg = spec.cfg
    first_cfg, vocab = first_cfg or model_cfg, min(vocab, shared)
    identities.append(f"{m.name}={identity}")
    where = ", live on the student mesh" if isinstance(producers[-1], Live) else ""
    services.report(f"teachers: {m.name} ({m.source}{where}, temperature {m.temperature or tau})")
  members = cfg.teachers.members()
  route = None
  if cfg.teachers.combine == "route":
    owner = {v: i for i, m in enumerate(members) for v in m.takes}
    route = [owner[name] for name in data.domains]
  bundle = MultiTeacherData(data, producers, k=k, route=route, weights=[m.weight for m in members])
  spec = TopKTeacher(cfg=first_cfg, k=k, temperature=tau, vocab=vocab, names=tuple(m.name for m in members),
                     source=f"teachers ({cfg.teachers.combine} of {', '.join(m.name for m in members)})")
  if cfg.distill.on_policy.active:
    return kinds.Prepared(data, spec, "; ".join(identities), topk_of=bundle.score, teachers=bundle)
  return kinds.Prepared(bundle, spec, "; ".join(identities), teachers=bundle)


@contextlib.contextmanager
def _naming(member: Member):
  """Errors of obtaining ``member`` (a refused setting, a teacher directory of another shape, a missing file) name it:
  ``teachers: <name> (source: <source>): <error>``."""
  prefix = f"teachers: {member.name} (source: {member.source}): "
  try:
    yield
  except ConfigError as e:
    raise ConfigError(prefix + str(e)) from None
  except FileNotFoundError as e:
    raise FileNotFoundError(prefix + str(e)) from None
  except ValueError as e:  # a damaged teacher directory, a checkpoint of another shape
    raise ConfigError(prefix + str(e)) from None


def _shared_vocab(member: Member, teacher_vocab: int, student_vocab: int) -> int:
  """The token range ``member`` and the student share, or a `ConfigError` naming the teacher."""
  try:
    return resolve_shared_vocab(teacher_vocab, student_vocab) or teacher_vocab
  except ValueError as e:
    raise ConfigError(f"teachers: {member.name} has another vocabulary than the student: {e}") from None
