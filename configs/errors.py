"""The one exception type for a user's mistake.

train.py, eval.py and the other command-line tools print a UserError as one
line (no traceback) and exit non-zero; anything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
  """Bad input from the user: a config value, a path, a file's contents."""


def first_line(error: BaseException | str) -> str:
  """The first line of an error's message (its type name when it has none); of
  the inner exception when one wraps another (ml_collections wraps a
  KeyError in an AttributeError). A message in quotes (a KeyError's) loses
  them; a quote that only ends it (`... with base 10: 'abc'`) stays."""
  while (isinstance(error, BaseException) and error.args
         and isinstance(error.args[0], BaseException)):
    error = error.args[0]
  text = str(error).strip()
  if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'" and text[0] not in text[1:-1]:
    text = text[1:-1]
  return text.splitlines()[0] if text else type(error).__name__
