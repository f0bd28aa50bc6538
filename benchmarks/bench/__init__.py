"""What the benchmark scripts share: the timing harness (`harness`), the compared systems of the throughput
benchmark (`systems`, on the devices of `devices`), the renderers that write result tables (`render_*`), a
program's matmuls (`matmuls`) and result-file helpers (`results`).

The scripts in ``benchmarks/`` import this package (``from bench import harness``: Python puts a script's own
folder first on its path); no script imports another script. Measured numbers go to ``benchmarks/results/``;
narrative goes in the hand-written ``*_notes.md`` files there.
"""
