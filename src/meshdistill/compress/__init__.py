"""Compress, then distil: a student made by pruning the teacher (Minitron), and quantization-aware students.

* `importance` -- scores of a teacher's MLP neurons, attention heads (query groups), embedding channels and layers
  on calibration batches (`score`, `Importance`);
* `prune` -- width (``mlp``, ``heads``, ``embed``) and depth (``layers``) pruning by those scores into a smaller
  decoder of the same family (`prune`, ``md.prune``; `PruneTargets`, `Kept`, `prune_weights`, `zeroed`);

``meshdistill prune`` (`meshdistill.jobs.prune_job`) runs them on a run's own data and writes the student in the
project's model-directory format and as a Hugging Face checkpoint, beside the scores and a report.
"""

from meshdistill.compress.importance import DEPTH, Importance, score
from meshdistill.compress.prune import Kept, PruneTargets, Pruned, prune, prune_weights, select, zeroed

__all__ = ["DEPTH", "Importance", "Kept", "PruneTargets", "Pruned", "prune", "prune_weights", "score", "select",
           "zeroed"]
