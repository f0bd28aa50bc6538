"""What a run keeps on disk: atomic outputs, owner markers, the run lock, checksummed checkpoints."""
