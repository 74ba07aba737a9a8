"""Ahead-of-time compilation (`compile.py`): a run's real steps compiled for TPU
slices and GPU nodes this host lacks (`compiler.py`), and the targets and
their chips' peaks (`targets.py`)."""
