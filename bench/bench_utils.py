"""Shared by the bench scripts: which code a measurement was made with."""
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def git_commit() -> str:
  """`git rev-parse --short HEAD`, with +dirty if a tracked file has changed
  (untracked files, such as a result just written, do not count); "unknown"
  on failure."""
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout
    return commit.strip() + ("+dirty" if dirty.strip() else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
