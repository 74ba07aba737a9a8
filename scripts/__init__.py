"""Helper commands for trying the project on this machine, run as modules from
the repository root (`python -m scripts.local_slurm up`)."""
