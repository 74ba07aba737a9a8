"""Configs: `get_config()` files (ml_collections, presets and sweeps), their
fields (`base.py`) and validation (`validation.py`), the one user-error type
(`errors.py`) and the command-line parsing every tool shares (`cli.py`)."""
