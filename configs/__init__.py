"""Configs: `get_config()` files (ml_collections) and their validation."""
