"""Training library: state, steps, checkpoints, sharding, metrics, evaluation."""
