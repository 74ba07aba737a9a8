"""Host memory on a CPU run: keep what a step frees for the next step.

XLA's CPU client allocates each execution's temporary buffer with malloc
and frees it when the step ends; for configs/tiny.py's training step that
buffer is about 100 MB. glibc's malloc serves every request above its mmap
threshold (32 MiB at most) with a fresh `mmap` and hands it back with
`munmap` on free, so each step touches that buffer's pages for the first
time again: about 25,000 page faults a step, which was a quarter of
`make train`'s CPU time, all of it system time (docs/benchmarks.md, "Where
a CPU step's time goes"). `reuse_freed_memory` makes glibc serve every
request from one heap, the main one grown with brk (M_ARENA_MAX 1: a
thread's own arena is at most 64 MiB and falls back to mmap beyond that
whatever M_MMAP_MAX says; M_MMAP_MAX 0), and keep up to 1 GiB free at the
top of that heap (M_TRIM_THRESHOLD), so the second step reuses the first
step's pages. The price: the process's resident memory stays at its high
water mark instead of shrinking between steps.

It has to run before JAX starts its threads (their malloc arenas are made
then), so train.py and bench.vs_torch call it first (eval.py gains nothing
from it: its steps are smaller); it leaves the allocator alone
where JAX can reach a GPU or TPU plugin (host memory is not a step's working
memory there), outside glibc, and where the user set glibc's own malloc
variables (MALLOC_*_ or GLIBC_TUNABLES), which then decide.
"""
import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_KEEP_BYTES = 1 << 30  # the free top of a heap is given back only beyond 1 GiB


def _accelerator_plugin(env) -> bool:
  """True when JAX could start a GPU or TPU backend in environment `env`."""
  if env.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return False
  if importlib.util.find_spec("libtpu") is not None:
    return True
  return bool(list(importlib.metadata.entry_points(group="jax_plugins"))) or (
      importlib.util.find_spec("jax_plugins") is not None)


def _user_set_malloc(env) -> bool:
  return "GLIBC_TUNABLES" in env or any(k.startswith("MALLOC_") for k in env)


def reuse_freed_memory(env=None) -> bool:
  """Tell glibc's malloc to keep freed memory for reuse (see the module
  docstring); True when it did, False where it was left alone."""
  env = os.environ if env is None else env
  if _user_set_malloc(env) or _accelerator_plugin(env):
    return False
  name = ctypes.util.find_library("c")
  if name is None:
    return False
  libc = ctypes.CDLL(name)
  if not hasattr(libc, "gnu_get_libc_version"):  # musl, macOS: not glibc
    return False
  return all(libc.mallopt(param, value) == 1 for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _KEEP_BYTES)))
