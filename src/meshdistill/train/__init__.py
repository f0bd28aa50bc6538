"""Training: what one step does (the train state, the step, the Distiller, optimizers, schedules, freezing) and, in
``loop/``, the loop around it (fit, resume, hooks, guard, safeguards, monitor, evaluation, stopping)."""
