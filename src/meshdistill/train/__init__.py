"""Training: what one step does (the train state, the step, the Distiller, optimizers, freezing; the schedules it reads
are `meshdistill.losses.schedules`) and, in ``loop/``, the loop around it (fit, resume, hooks, guard, safeguards, monitor, evaluation, stopping)."""
