"""Fixtures shared by several test modules (helpers: `helpers.py`); CPU only.

The markers each test may carry (what it needs to run) are declared in
pytest.ini and described in docs/testing.md. libtpu lives in .venv/libtpu,
outside site-packages (see requirements-libtpu.txt), and is put on the path
here for the TPU compile tests.
"""
import atexit
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On the CPU, the suite's time is mostly XLA compiling small programs, and much
# of that is LLVM optimizing their loops: without it (level 0: the same
# programs, run slower, their float32 results a few ulps apart from level 3's)
# make test spends a quarter less. This process, its xdist workers and the
# commands the tests start inherit it; an XLA_FLAGS that sets a level is kept.
OPT_LEVEL = "--xla_backend_optimization_level"
if os.environ["JAX_PLATFORMS"] == "cpu" and OPT_LEVEL not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {OPT_LEVEL}=0".strip()
# The persistent compilation cache (training/compile_cache.py) of every run a
# test starts goes to a temporary directory, never the user's cache; the
# process that made it (pytest's main process; xdist workers inherit it)
# removes it at exit.
if "TRANSFORMER_LAB_COMPILATION_CACHE" not in os.environ:
  os.environ["TRANSFORMER_LAB_COMPILATION_CACHE"] = tempfile.mkdtemp(
      prefix="transformer_lab_jax_cache_")
  atexit.register(shutil.rmtree, os.environ["TRANSFORMER_LAB_COMPILATION_CACHE"],
                  ignore_errors=True)

from data import sources  # pylint: disable=wrong-import-position
import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position
from tokenizer import bpe  # pylint: disable=wrong-import-position
from tests.helpers import BPE_TEXTS, LIBTPU_DIR, small_config  # pylint: disable=wrong-import-position

if LIBTPU_DIR.is_dir() and str(LIBTPU_DIR) not in sys.path:
  sys.path.append(str(LIBTPU_DIR))


def _installed(*modules: str) -> bool:
  return all(importlib.util.find_spec(m) is not None for m in modules)


# marker: (whether this machine has what the marked tests need, how to get it)
NEEDS = {
    "hf": (lambda: _installed("transformers", "torch"), "pip install -r requirements-test.txt"),
    "lm_eval": (lambda: _installed("lm_eval"), "make install-eval (requirements-eval.txt)"),
    "tpu": (lambda: _installed("libtpu"), "make install-tpu (requirements-libtpu.txt)"),
    "cuda": (lambda: _installed("jax_cuda13_plugin"),
             "run from a venv with pip install -r requirements-gpu.txt"),
    "slurm": (lambda: os.geteuid() == 0, "root, to start a local SLURM (make test-slurm)"),
}


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  """A test marked with a need this machine lacks is skipped, saying how to get it."""
  have = {}
  for item in items:
    for marker, (check, how) in NEEDS.items():
      if marker in item.keywords:
        if marker not in have:
          have[marker] = check()
        if not have[marker]:
          item.add_marker(pytest.mark.skip(reason=f"needs {marker}: {how}"))


@pytest.fixture(scope="module")
def tok():
  """A 290-id BPE tokenizer trained on `BPE_TEXTS` (the Hugging Face tests)."""
  return bpe.train_bpe(BPE_TEXTS, 290)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  """A small BPE tokenizer trained once on the pydoc train split, saved."""
  c = small_config("")
  texts = [t for _, t in sources.iter_documents(c.data, "train")]
  out = tmp_path_factory.mktemp("tok") / "bpe"
  tokenizer_lib.train_tokenizer("bpe", 300, texts).save(out)
  return str(out)
