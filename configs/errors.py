"""The one exception type for a user's mistake.

train.py, eval.py and the other command-line tools print a UserError as one
line (no traceback) and exit non-zero; anything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
  """Bad input from the user: a config value, a path, a file's contents."""
