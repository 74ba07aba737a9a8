"""The persistent compilation cache: compile a run's steps once per machine type.

`enable(setting)` points JAX's persistent cache at a directory before the
first compile, so a resumed, requeued or repeated run on the same kind of
machine (the same jax, XLA flags, devices and program) reads its compiled
train and eval steps from disk instead of compiling them again. Every
program is cached, however small or quick to compile. `train.py` and
`eval.py` call it with `train.compilation_cache_dir`: a directory, "" for
the default (`$TRANSFORMER_LAB_COMPILATION_CACHE`, else `jax/` in the
machine's cache, `$TRANSFORMER_LAB_CACHE` or `~/.cache/transformer_lab`:
`data.tokens.default_root`), or "none" (in either) to compile every start.
"""
import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from data import tokens

SUBDIR = "jax"  # the compilation cache's directory in the machine's cache
# Overrides the default directory (the tests point it at a temporary one).
ENV_VAR = "TRANSFORMER_LAB_COMPILATION_CACHE"
OFF = "none"


def cache_dir(setting: str) -> str | None:
  """The directory `train.compilation_cache_dir` names (None: off)."""
  setting = setting or os.environ.get(ENV_VAR) or os.path.join(tokens.default_root(), SUBDIR)
  return None if setting == OFF else os.path.abspath(os.path.expanduser(setting))


def enable(setting: str) -> str | None:
  """Caches every compiled program in `cache_dir(setting)`; returns it."""
  path = cache_dir(setting)
  compilation_cache.reset_cache()  # forget a directory set (or not) by an earlier run
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
