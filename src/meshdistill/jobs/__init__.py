"""Whole jobs from a `Config`: pretrain a teacher, distil a student, evaluate a run.

The CLI is a thin shell over these functions; scripts and benchmarks call them directly.
Order of work in `distill` (the main job):

1. the mesh (``mesh.data`` x ``mesh.tensor``; on CPU, simulated devices -- see
   `prepare_devices`, which must run before JAX starts);
2. the data (`meshdistill.data.build_data`): tokenizer, training iterator, validation batches;
3. the teacher, from the source ``teacher.source`` chooses (`meshdistill.teachers.kinds`): by default
   ``pretrain.teacher`` if given, else the cached teacher for these settings, else one pretrained now on hard
   labels (`pretrain`) and cached; or a Hugging Face directory, an offline top-k cache, a teacher on its own
   devices, or none;
4. the student, directly on the mesh: ``student.hf``, copied from the teacher's blocks
   (``student.init``), or initialised from ``train.seed`` (`meshdistill.teachers.sources.build_student`);
5. `meshdistill.train.loop.trainer.fit` with a `Distiller`, checkpoints and monitoring in ``run.run_dir``;
6. the final evaluation of teacher and student on the validation batches (``summary.json``).

The jobs live in private modules by concept; import them from here (``meshdistill.jobs.<name>``):

- ``_setup``: `prepare_devices`, `build_mesh`, `load_data`, `with_batch_size`, the run directory's lock, monitor
  and ``config.yaml``, `stream_reporter`, `checkpoint_layout` (the blocks layout a resumed model keeps);
- ``_training``: `loop_kwargs`, `safeguard_kwargs`, `strategy_and_optimizer`, `make_distiller`;
- ``_teacher``: `pretrain`, `cache_teacher`, and the chosen teacher source run for a job (`prepare_teacher`,
  `obtain_teacher`; the sources are `meshdistill.teachers.kinds`, which also hold the pretrained teacher's cache:
  `default_cache_dir`, `teacher_key`, `teacher_dir`);
- ``_distill_job``: `distill` and its final evaluation;
- ``_prune_job``: `prune` (``meshdistill prune``: the teacher scored and cut to a smaller student, `meshdistill.models.compress`);
- ``_serve``: `serve_teacher` (``meshdistill serve-teacher``: the teacher behind an HTTP server), `build_server`;
- ``_inspect``: `evaluate`, `evaluate_task` (accuracy by generation on a task), `generate`, `generate_records` (its
  completions as training records: conversations or prompt/completion pairs), `load_run` (a run's student in Python),
  `stored_student_config`, `run_teacher`, `summary_table`.
"""

from meshdistill.jobs._setup import build_mesh, load_data, prepare_devices, resolve_mesh, stream_reporter, with_batch_size
from meshdistill.jobs._training import loop_kwargs, make_distiller, safeguard_kwargs, strategy_and_optimizer
from meshdistill.jobs._teacher import cache_teacher, default_cache_dir, obtain_teacher, pretrain, teacher_dir
from meshdistill.jobs._teacher import prepare_teacher, teacher_key
from meshdistill.jobs._distill_job import distill
from meshdistill.jobs._prune_job import PruneTargets, check_prune_target, prune
from meshdistill.jobs._serve import ServeSettings, build_server, serve_teacher
from meshdistill.jobs._inspect import (
    LoadedRun,
    evaluate,
    evaluate_task,
    generate,
    generate_records,
    load_run,
    run_teacher,
    stored_student_config,
)
from meshdistill.jobs._inspect import summary_table

__all__ = [
  "build_mesh",
  "build_server",
  "cache_teacher",
  "check_prune_target",
  "default_cache_dir",
  "distill",
  "evaluate",
  "evaluate_task",
  "generate",
  "generate_records",
  "load_data",
  "load_run",
  "LoadedRun",
  "loop_kwargs",
  "make_distiller",
  "obtain_teacher",
  "prepare_devices",
  "prepare_teacher",
  "pretrain",
  "resolve_mesh",
  "prune",
  "PruneTargets",
  "run_teacher",
  "safeguard_kwargs",
  "serve_teacher",
  "ServeSettings",
  "stored_student_config",
  "strategy_and_optimizer",
  "stream_reporter",
  "summary_table",
  "teacher_dir",
  "teacher_key",
  "with_batch_size",
]
