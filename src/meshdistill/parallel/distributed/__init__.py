"""Several processes, one job: JAX's multi-controller start-up, the local launcher, process-0 duties.

On a TPU pod slice or a GPU cluster every host runs the same ``meshdistill`` command as its own
Python process. Each process drives its local devices; together they see every device of the
job (``jax.devices()``), build the same mesh and run the same compiled programs, whose
collectives cross the processes. This module

* starts that runtime (`initialize`) before anything touches a backend, from the
  ``--coordinator`` / ``--num-processes`` / ``--process-id`` flags, the ``MESHDISTILL_*``
  environment variables (`ENV`), or the variables cluster launchers set (JAX's own
  auto-detection: Cloud TPU pod slices, SLURM, Open MPI, Kubernetes jobs);
* launches N local CPU processes as one job for development and tests (`launch`, the
  ``meshdistill launch`` command): gloo collectives, ``[pN]``-prefixed output, and when one
  process fails the rest are stopped and the launcher exits with its code (128 + N for a process
  ended by signal N); SIGTERM / SIGINT to the launcher are forwarded to every process;
* answers the questions the rest of the code asks: `process_count` / `is_primary` without
  starting a backend, `barrier`, `data_shard` (which rows of each batch this process reads).

The runtime (settings, `initialize`, process queries, `agree_on`, `data_shard`) is in
``parallel/distributed/_runtime.py``, the local launcher in ``parallel/distributed/_launch.py``; every name is imported
from here (``meshdistill.parallel.distributed.X``).

What each process does in a run (see also README.md, "Several hosts"):

* data: every process builds the same `DataBundle` and reads only its own contiguous slice of
  every global batch (`meshdistill.data.process_slice`); `meshdistill.host_to_global` assembles
  the slices with ``jax.make_array_from_process_local_data``. A global batch depends only on the
  data, the seed and the GLOBAL batch size, so the global batch at every step is the
  single-process one, and the saved data position (a global batch index) resumes on any
  process count;
* checkpoints: orbax writes every process's shards and commits once (the primary process
  finalises the step directory after a barrier); restoring reads each shard straight onto the
  new layout, on any process count;
* host files: ``config.yaml``, ``metrics.jsonl``, ``tb/``, ``summary.json``, plots and the
  teacher cache's ``teacher.json``/tokenizer are written by process 0 only (`is_primary`);
  every process prints its own progress line (a launcher shows them with a ``[pN]`` prefix).

Host decisions are identical on every process. Every value the loop reads from a device to
decide something -- the divergence guard's loss, the skipped-update count, the learning rate,
evaluation sums -- is a REPLICATED output of one SPMD program: the train step returns the loss
with ``out_specs=P()`` after a ``psum`` over ``data``, so every device of every process holds
the result of the same all-reduce, and every process reads its own copy of the same bits. The
rest of what the loop branches on (step counters, checkpoint cadence, the guard's history) is
a function of those values and of the configuration, which every process loads identically.
The one decision read from the file system, the step to resume from, is process 0's on every
process (`agree_on`); orbax's list of saved steps then changes only through saves, which every
process makes together. So no process can take a branch (restore, switch to the fallback loss,
save, stop) that another does not take, which would leave the others waiting in a collective.
`tests/test_multiprocess.py` checks it: both processes of a 2-process run print the same loss
(as displayed, 4 decimals) at every step, and process 0's logged losses equal a 1-process run's.

Failure: when a process dies, the others stop with an error instead of waiting forever. Its
peers' next collective fails (gloo on CPU: the connection closes), and the coordination service
notices the missing heartbeats after ``heartbeat_timeout`` seconds and stops every process. The
local launcher sets short timeouts (`LOCAL_HEARTBEAT_TIMEOUT`); on a cluster JAX's defaults
apply unless ``MESHDISTILL_HEARTBEAT_TIMEOUT`` is set. A rerun of the same command resumes
from the last finished checkpoint (orbax only ever finalises complete steps).

The run directory must be on a file system every process sees (NFS, GCS through gcsfuse,
...): every process reads the configuration, the teacher and the checkpoints from it.
"""

from meshdistill.parallel.distributed._launch import command_line, free_port, launch, local_env
from meshdistill.parallel.distributed._runtime import (
  AUTO,
  ENV,
  LOCAL_HEARTBEAT_TIMEOUT,
  LOCAL_SHUTDOWN_TIMEOUT,
  DistributedError,
  Settings,
  agree_on,
  any_process,
  barrier,
  batch_part,
  data_shard,
  initialize,
  is_primary,
  local_device_share,
  process_count,
  process_index,
  resolve,
)

__all__ = [
  "AUTO",
  "ENV",
  "LOCAL_HEARTBEAT_TIMEOUT",
  "LOCAL_SHUTDOWN_TIMEOUT",
  "DistributedError",
  "Settings",
  "agree_on",
  "any_process",
  "barrier",
  "batch_part",
  "command_line",
  "data_shard",
  "free_port",
  "initialize",
  "is_primary",
  "launch",
  "local_device_share",
  "local_env",
  "process_count",
  "process_index",
  "resolve",
]
