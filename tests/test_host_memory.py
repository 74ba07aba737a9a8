"""training/host_memory.py: a CPU run reuses freed memory instead of page-faulting it in again."""
import subprocess
import sys
import textwrap

import pytest

from training import host_memory

# Allocates and frees 100 MB twice (as XLA's CPU client does with a step's
# temporary buffer), touching every page, from a thread other than the main
# one, and prints the minor page faults of the second round.
_PROBE = textwrap.dedent("""
    import ctypes, resource, sys, threading
    from training.host_memory import reuse_freed_memory
    applied = reuse_freed_memory() if sys.argv[1] == "reuse" else False
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 100 * 2**20
    faults = []
    def step():
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      p = libc.malloc(size)
      ctypes.memset(p, 1, size)
      libc.free(ctypes.c_void_p(p))
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    for _ in range(2):
      t = threading.Thread(target=step); t.start(); t.join()
    print(applied, faults[1])
""")


def _second_round_faults(mode: str, env: dict) -> tuple[str, int]:
  out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                       check=True, env=env).stdout.split()
  return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_step_buffer_is_reused_without_page_faults():
  env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ".", "JAX_PLATFORMS": "cpu"}
  applied, faults = _second_round_faults("reuse", env)
  assert applied == "True" and faults < 1000  # 100 MB is 25,600 pages
  _, default_faults = _second_round_faults("default", env)
  assert default_faults > 20_000  # glibc's default: a fresh mmap each time


def test_glibc_variables_set_by_the_user_decide():
  assert not host_memory.reuse_freed_memory({"MALLOC_ARENA_MAX": "8"})
  assert not host_memory.reuse_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"})
