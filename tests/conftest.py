"""Shared test setup: the repository root on sys.path, CPU only, and the
compilation cache of the runs tests start in a temporary directory."""
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The persistent compilation cache (training/compile_cache.py) of every run a
# test starts goes to a temporary directory, never the user's cache.
os.environ.setdefault("TRANSFORMER_LAB_COMPILATION_CACHE",
                      tempfile.mkdtemp(prefix="transformer_lab_jax_cache_"))
