"""Shared by the bench scripts: which code and command a measurement was made with."""
import pathlib
import shlex
import subprocess
import sys

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


def command_line() -> str:
  """This run's command as the docs give it: `python -m bench.<script> <args>`."""
  script = pathlib.Path(sys.argv[0]).resolve()
  if script.is_relative_to(ROOT):
    return shlex.join(["python", "-m", ".".join(script.relative_to(ROOT).with_suffix("").parts),
                       *sys.argv[1:]])
  return shlex.join(["python", *sys.argv])
