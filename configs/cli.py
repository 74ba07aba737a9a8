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
    message = str(e).strip("\"'")
    override = next((a for a in argv if a.startswith("--config.") and message in a), None)
    if override:
      message = f"{override.split('=')[0][2:]}: no such config field ({message!r} is unknown)"
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)
