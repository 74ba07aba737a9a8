"""Flag parsing shared by the command-line tools.

`parse_flags` is given to `absl.app.run(main, flags_parser=parse_flags)`. A
misspelt config override (`--config.model.colour=red`), a value of the wrong
type, a config field given as a flag of its own (`--num_steps`, pointed at
`--config.train.num_steps`) or a config file that cannot be loaded (the
presets listed) becomes one line on stderr and exit status 2, not a traceback.
"""
import os
import re
import sys

from absl import flags

CONFIGS_DIR = os.path.dirname(os.path.abspath(__file__))
_NOT_PRESETS = ("__init__", "base", "cli", "errors", "from_run", "validation")


def presets() -> list[str]:
  """The config files of configs/ (`configs/tiny.py`, ...)."""
  names = sorted(f[:-3] for f in os.listdir(CONFIGS_DIR) if f.endswith(".py"))
  return [f"configs/{n}.py" for n in names if n not in _NOT_PRESETS]


def _config_field(name: str) -> str | None:
  """`train.num_steps` for `num_steps`: the config field of that leaf name, if any."""
  from configs import base  # pylint: disable=import-outside-toplevel
  config = base.get_config()
  for section, values in config.items():
    if name in values:
      return f"{section}.{name}"
  return None


def _unknown_flag_hint(message: str) -> str:
  """The message, pointing at --config.<section>.<name> when the unknown flag
  is a config field."""
  match = re.match(r"Unknown command line flag '([^']+)'", message)
  field = match and _config_field(match.group(1))
  return f"{message}; config fields are set as --config.{field}=..." if field else message


def parse_flags(argv: list[str]) -> list[str]:
  try:
    remaining = flags.FLAGS(argv)
    if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
      _ = flags.FLAGS.config.model  # loads the config file now, not on first use
    return remaining
  except OSError:
    message = (f"--config {flags.FLAGS['config'].config_filename}: cannot load it "
               f"(no such file, or it fails to import); the presets: {', '.join(presets())}")
  except flags.Error as e:
    message = _unknown_flag_hint(str(e))
    # absl quotes a ValueError's args tuple: "('Non-boolean argument to boolean flag', 'yes')"
    message = re.sub(r"\('([^']*)', '([^']*)'\)", r"\1: \2", message)
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
