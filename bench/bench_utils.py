"""Shared by the bench scripts: which code a measurement was made with."""
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def git_commit() -> str:
  """`git rev-parse --short HEAD`, with +dirty for a changed tree; "unknown" on failure."""
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout
    return commit.strip() + ("+dirty" if dirty.strip() else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
