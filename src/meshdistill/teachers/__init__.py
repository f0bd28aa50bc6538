"""Where teacher outputs come from: sources, the offline cache, the sub-mesh teacher, teacher checkpoints."""
