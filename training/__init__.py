"""Training library: the loop, train state and steps, objectives, optimizer,
checkpoints, sharding, metrics and plots, evaluation, run directories, the
accelerators' peak FLOP/s (`hardware.py`) and fault handling (`faults/`)."""
