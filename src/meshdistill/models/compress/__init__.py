"""Compress, then distil: a student made by pruning the teacher (Minitron), and quantization-aware students.

* `importance` -- scores of a teacher's MLP neurons, attention heads (query groups), embedding channels and layers
  on calibration batches (`score`, `Importance`);
* `prune` -- width (``mlp``, ``heads``, ``embed``) and depth (``layers``) pruning by those scores into a smaller
  decoder of the same family (`prune`, ``md.prune``; `PruneTargets`, `Kept`, `prune_weights`, `zeroed`);
* `qat` -- a student that trains through fake quantization (``student.quantize_aware``: `QuantizeAware`,
  `quantize_aware`), and the same quantization applied after training (`post_training`, `dequantized`);
* `quantized_export` -- that student on disk with its integer weights and scales (the compressed-tensors format that
  vLLM and transformers load, `compressed_export`; or ``meshdistill.quantized/1``: `export_quantized`,
  `load_quantized`, `convert_quantized`, `quantized_settings`).

``meshdistill prune`` (`meshdistill.jobs.prune`) runs the first two on a run's own data and writes the student in
the project's model-directory format and as a Hugging Face checkpoint, beside the scores and a report.
"""

from meshdistill.models.compress.importance import DEPTH, Importance, score
from meshdistill.models.compress.prune import Kept, PruneTargets, Pruned, prune, prune_weights, select, zeroed
from meshdistill.models.compress.qat import QuantizeAware, dequantized, post_training, quantize_aware
from meshdistill.models.compress.quantized_export import convert_quantized, export_quantized, load_quantized
from meshdistill.models.compress.quantized_export import quantized_settings

__all__ = ["DEPTH", "Importance", "Kept", "PruneTargets", "Pruned", "QuantizeAware", "convert_quantized", "dequantized",
           "export_quantized", "load_quantized", "post_training", "prune", "prune_weights", "quantize_aware",
           "quantized_settings", "score", "select", "zeroed"]
