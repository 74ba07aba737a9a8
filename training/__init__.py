"""Training library: the loop, train state and steps, objectives, optimizer,
checkpoints, sharding, metrics, evaluation, run directories and fault
handling (`faults/`)."""
