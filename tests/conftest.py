"""Shared test setup: the repository root on sys.path, CPU only, and libtpu
(`make install` puts it in .venv/libtpu, outside site-packages: see
requirements-libtpu.txt) importable for the TPU compile tests."""
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
LIBTPU_DIR = ROOT / ".venv" / "libtpu"
if LIBTPU_DIR.is_dir() and str(LIBTPU_DIR) not in sys.path:
    sys.path.append(str(LIBTPU_DIR))


def with_libtpu(env: dict) -> dict:
    """`env` for a subprocess that compiles for TPU: .venv/libtpu on its PYTHONPATH."""
    paths = [p for p in (env.get("PYTHONPATH"), str(LIBTPU_DIR)) if p]
    return dict(env, PYTHONPATH=os.pathsep.join(paths))
