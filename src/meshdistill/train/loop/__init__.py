"""The training loop and what runs around it: fit, hooks, guard, safeguards, monitor, evaluation, stopping."""
