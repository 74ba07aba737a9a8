"""Flag parsing shared by the command-line tools.

`parse_flags` is given to `absl.app.run(main, flags_parser=parse_flags)`. A
misspelt config override (`--config.model.colour=red`), a value of the wrong
type or a config file that cannot be loaded becomes one line on stderr and
exit status 2, not a traceback.
"""
import sys

from absl import flags


def parse_flags(argv: list[str]) -> list[str]:
  try:
    remaining = flags.FLAGS(argv)
    if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
      _ = flags.FLAGS.config.model  # loads the config file now, not on first use
    return remaining
  except OSError:
    message = (f"--config {flags.FLAGS['config'].config_filename}: cannot load it "
               "(no such file, or it fails to import)")
  except flags.Error as e:
    message = str(e)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    # ml_collections wraps a KeyError "'name'\nDid you mean ..." in an AttributeError.
    while e.args and isinstance(e.args[0], Exception):
      e = e.args[0]
    lines = str(e.args[0] if e.args else e).splitlines() or [""]
    name = lines[0].strip("'")
    override = next((a for a in argv if a.startswith("--config.") and f".{name}" in a), None)
    message = "; ".join(lines)
    if override:
      hint = f"; {lines[1][0].lower()}{lines[1][1:]}" if len(lines) > 1 else ""
      message = f"{override.split('=')[0][2:]}: no such config field{hint}"
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)
