"""What one step does: the train state, the step, the Distiller, optimizers, schedules, freezing."""
