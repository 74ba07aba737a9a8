"""What every sweep module shares: the repository root, and how a sweep
command ends."""
import contextlib
import os
import sys

from configs.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def command_exits(running: str):
  """A sweep command's ending: a UserError is its one line on stderr and exit
  status 2; Ctrl-C says the `running` runs saved and exits 130."""
  try:
    yield
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt:
    print(f"interrupted: the running {running} saved; run the same command to resume",
          file=sys.stderr)
    sys.exit(130)
