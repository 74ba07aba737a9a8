"""What every sweep module shares: the repository root and the first line of an error."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def first_line(error: BaseException) -> str:
  """The first line of an exception's message (its type name when it has none)."""
  text = str(error).strip().strip("\"'")
  return text.splitlines()[0] if text else type(error).__name__
