"""Where a run's teacher and student come from: Hugging Face directories, the teacher's own blocks, or fresh.

In a config these are keys of the ``teacher`` and ``student`` sections (the teacher's keys belong to the source
``teacher.source`` chooses, which checks them: `meshdistill.teachers.kinds`)::

  teacher: {hf: path/to/Qwen3-8B}          # config.json + *.safetensors; loaded sharded (`load_hf`)
  student: {hf: path/to/Qwen3-0.6B}        # a pretrained smaller model of the same family and tokenizer
  student: {init: {from_teacher: true, layers: [0, 9, 18, 27]}}   # or: the teacher's embeddings, LM head,
                                           # final norm and these blocks (layer-subset initialisation)
  student: {lora: {rank: 8, alpha: 16, targets: [q, k, v, o], quantize: int8}}   # with any of the above:
                                           # train low-rank adapters on a frozen base (`meshdistill.models.lora`)
  teacher: {quantize: int8}                # with any teacher source: its projections stored int8 / int4 / nf4
                                           # for inference (`meshdistill.models.quantize`)

``hf`` and ``init.pruned`` also take a Hugging Face Hub id, ``org/name[@revision]`` (`_hub`: the local cache first,
downloading only where allowed; the run's config names the id pinned to its commit).

With ``hf`` or ``init.from_teacher`` a section's shape is derived -- from ``config.json``, or the
teacher's shape with ``len(layers)`` blocks -- and only `FREE_KEYS` (``max_len``, ``dtype``, ``param_dtype``,
``remat``, ``scan_layers``, ``attention``) may be set beside it (a shape key typed again is an error, unless it
equals the derived value). A shape read from a ``config.json`` (``hf``, and ``init.from_teacher`` with
``teacher.hf``) is bounded by its ``max_position_embeddings`` (the sequence bound ``max_len``; no weight depends on
it) unless the section names ``max_len``, which then wins, larger or smaller; the built-in shapes (no ``hf``) keep
their own ``max_len`` (128 by default). With ``teacher.hf`` the data pipeline tokenizes with the teacher's
``tokenizer.json``; a ``student.hf`` whose tokenizer differs in anything but its ``padding`` /
``truncation`` settings is an error, as is a student of another family. Everything here is checked
when the config is loaded (only JSON files are read), before any weights are touched.

`ModelSources` is the typed form held in `meshdistill.config.Config` (field ``models``);
`split_sources` moves the keys out of the raw sections and `nest_sources` puts them back when a
config is written, so ``config.yaml`` reads as it was written. `resolve` derives the shapes;
`load_teacher_hf` (from `meshdistill.teachers.kinds.hf`) and `build_student` build the models at run time.

Modules: `_settings` (`ModelSources`, `StudentInit`, `split_sources`, `nest_sources`: the config
keys), `_hub` (Hub ids to local snapshot directories), `_resolve` (`resolve`: shapes from ``config.json`` or the
teacher, and the checks on the Hugging Face directories and tokenizers), `_build` (`load_teacher_hf`, `build_student`,
`student_from_teacher`, `with_lora`, `quantized_teacher`: the models at run time).
"""

from meshdistill.teachers.sources._build import (
  build_student,
  load_teacher_hf,
  quantized_teacher,
  student_from_teacher,
  with_lora,
)
from meshdistill.teachers.sources._resolve import check_hf_dir, resolve, tokenizer_difference, tokenizer_file
from meshdistill.teachers.sources._settings import FREE_KEYS, ModelSources, StudentInit, nest_sources, split_sources

__all__ = [
    "FREE_KEYS",
    "ModelSources",
    "StudentInit",
    "build_student",
    "check_hf_dir",
    "load_teacher_hf",
    "nest_sources",
    "resolve",
    "split_sources",
    "student_from_teacher",
    "tokenizer_difference",
    "tokenizer_file",
    "quantized_teacher",
    "with_lora",
]
