"""Where arrays live: the mesh, the layouts that wrap the one step, FSDP, collectives."""
