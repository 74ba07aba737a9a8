"""What every sweep module shares: the repository root, and how a sweep
command ends."""
import contextlib
import os
import sys

from configs.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Terminated(BaseException):
  """SIGTERM to a sweep command, as KeyboardInterrupt is SIGINT (a
  BaseException too: no `except Exception` swallows it)."""


@contextlib.contextmanager
def command_exits(running: str):
  """A sweep command's ending: a UserError is its one line on stderr and exit
  status 2; Ctrl-C (SIGINT) or SIGTERM (`Terminated`, where the command
  turns it into one) says the `running` runs saved and exits 130 or 143
  (128 + the signal, as train.py does)."""
  try:
    yield
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except (KeyboardInterrupt, Terminated) as e:
    how, status = (("terminated", 143) if isinstance(e, Terminated) else ("interrupted", 130))
    print(f"{how}: the running {running} saved; run the same command to resume",
          file=sys.stderr)
    sys.exit(status)
