"""What a run keeps on disk: checksummed checkpoints (written with `meshdistill.core.fsutil`'s atomic outputs and run
lock, and `meshdistill.core.ownership`'s owner markers)."""
