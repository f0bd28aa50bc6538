"""Where arrays live: the mesh, the rules mapping logical dimensions to its axes, the layouts that wrap the one step,
FSDP, collectives; and in ``distributed/``, several processes as one job (start-up, the local launcher, platforms)."""
