"""Flag parsing shared by the command-line tools (absl flags, snake_case).

`parse_flags` is given to `absl.app.run(main, flags_parser=parse_flags)`; a
tool with flags of its own (`tokenizer/train.py`) calls it with its own
`FlagValues`. A mistake on the command line becomes one line on stderr and
exit status 2, not a traceback:

- a dashed flag (`--vocab-size`): the snake_case spelling;
- a config field given as a flag (`--num_steps=100`): the `--config.`
  spelling (`--config.train.num_steps=100`);
- a misspelt config override (`--config.model.colour=red`): no such field,
  and the closest one;
- a config file that cannot be loaded, or a value of the wrong type;
- `--config.train.num_steps` beside a token or FLOP budget, which sets it.

Each is checked against the defined flags and the loaded config itself,
never by reading a library's error message.
"""
import ast
import difflib
import os
import sys

from absl import flags
from ml_collections import config_dict, config_flags

from configs import validation
from configs.errors import UserError, first_line

OVERRIDE = "--config."  # the prefix of a config override
_SPECIAL = ("flagfile", "undefok")  # absl's own flags, in no FlagValues

CONFIGS_DIR = os.path.dirname(os.path.abspath(__file__))
_NOT_PRESETS = ("__init__", "base", "cli", "errors", "from_run", "validation")


def presets() -> list[str]:
  """The config files of configs/ (`configs/tiny.py`, ...)."""
  names = sorted(f[:-3] for f in os.listdir(CONFIGS_DIR) if f.endswith(".py"))
  return [f"configs/{n}.py" for n in names if n not in _NOT_PRESETS]


def config_fields(config: config_dict.ConfigDict, prefix: str = "") -> list[str]:
  """Every leaf field of a config, dotted (`train.num_steps`)."""
  out = []
  for key, value in config.items():
    if isinstance(value, config_dict.ConfigDict):
      out += config_fields(value, f"{prefix}{key}.")
    else:
      out.append(prefix + key)
  return out


def check_field(field: str, fields: list[str], where: str) -> None:
  """UserError unless `field` is one of `fields`, naming the closest one."""
  if field not in fields:
    close = difflib.get_close_matches(field, fields, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UserError(f"{where}: {field}: no such config field{hint}")


def _flag_name(arg: str) -> str | None:
  """`name` of a `--name[=value]` or `-name` argument; None for a value."""
  if not arg.startswith("-") or arg in ("-", "--"):
    return None
  return arg.lstrip("-").split("=", 1)[0]


def _is_defined(name: str, values: flags.FlagValues) -> bool:
  return name in values or (name.startswith("no") and name[2:] in values)


def _check_spelling(argv: list[str], values: flags.FlagValues) -> None:
  """A dashed spelling of a defined flag gets its snake_case one."""
  for arg in argv[1:]:
    if arg == "--":
      return
    name = _flag_name(arg)
    if name and "-" in name and not name.startswith("config."):
      snake = name.replace("-", "_")
      if _is_defined(snake, values):
        raise UserError(f"--{name}: flags are snake_case: --{snake}")


def load_config(config_path: str, overrides: list[str] = ()) -> config_dict.ConfigDict:
  """The config that `--config config_path *overrides` gives, through the
  same ml_collections parser the tools use (so what passes here passes
  there)."""
  argv = ["prog", "--config", config_path, *overrides]
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, flag_values=values,
                                           lock_config=True, sys_argv=argv)
  try:
    values(argv)
    config = holder.value
    config.keys()  # a file that failed to load raises OSError here, not on first use
    return config
  except OSError as e:
    raise UserError(f"--config {config_path}: cannot load it (no such file, or it "
                    f"fails to import); the presets: {', '.join(presets())}") from e
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise UserError(first_line(e)) from e


def check_budget_overrides(config: config_dict.ConfigDict, fields: list[str]) -> None:
  """A budget sets train.num_steps (`model.accounting.with_budget`): a
  train.num_steps among the overridden `fields` beside one is refused, not
  silently replaced (a config file's own num_steps is replaced)."""
  given = validation.budget(config.train)
  if given is not None and "train.num_steps" in fields:
    raise UserError(f"train.num_steps={config.train.num_steps} is given beside "
                    f"{given[0]}={given[1]:g}, which sets it; drop one of them")


def _config_path(argv: list[str]) -> str | None:
  """The value of `--config PATH` or `--config=PATH` in `argv`, if any."""
  path = None
  for arg, following in zip(argv, argv[1:] + [None]):
    if arg.startswith("--config="):
      path = arg[len("--config="):]
    elif arg == "--config":
      path = following
  return path


def _unknown_flag(arg: str, fields: list[str]) -> UserError:
  """The error for a flag nothing defines; a config field of that name gets
  its `--config.` spelling."""
  name = _flag_name(arg)
  value = arg.split("=", 1)[1] if "=" in arg else "..."
  matches = [f for f in fields if f.rsplit(".", 1)[-1] == name]
  if len(matches) == 1:
    return UserError(f"--{name}: no such flag; the config field is "
                     f"{OVERRIDE}{matches[0]}={value}")
  if matches:
    return UserError(f"--{name}: no such flag; config fields of that name: "
                     + ", ".join(OVERRIDE + m for m in matches))
  return UserError(f"--{name}: no such flag (see --help)")


def _check(argv: list[str], values: flags.FlagValues) -> None:
  """Every flag is defined, spelt snake_case, and every override names a
  field of the config; raises UserError otherwise."""
  _check_spelling(argv, values)
  path = _config_path(argv) if "config" in values else None
  fields = config_fields(load_config(path)) if path else []
  for arg in argv[1:]:
    if arg == "--":
      return
    name = _flag_name(arg)
    if name is None:
      continue
    if arg.startswith(OVERRIDE):
      if not fields:
        raise UserError(f"--{name}: give --config first")
      check_field(name[len("config."):], fields, "command line")
    elif not _is_defined(name, values) and name not in _SPECIAL:
      raise _unknown_flag(arg, fields)


def _readable(message: str) -> str:
  """A message whose value is an exception's args tuple (`flag --x=yes: ('Non-boolean
  argument to boolean flag', 'yes')`) with the tuple written out as text."""
  head, sep, tail = message.partition(": ")
  try:
    parts = ast.literal_eval(tail) if sep else None
  except (ValueError, SyntaxError):
    return message
  if isinstance(parts, tuple) and all(isinstance(p, str) for p in parts):
    return f"{head}: {': '.join(parts)}"
  return message


def _parse(argv: list[str], values: flags.FlagValues) -> list[str]:
  _check(argv, values)
  try:
    rest = values(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise UserError(_readable(first_line(e))) from e
  config = values["config"].value if "config" in values else None
  if isinstance(config, config_dict.ConfigDict):
    overridden = [_flag_name(arg)[len("config."):] for arg in argv[1:]
                  if arg.startswith(OVERRIDE)]
    check_budget_overrides(config, overridden)
  return rest


def parse_flags(argv: list[str], values: flags.FlagValues = flags.FLAGS) -> list[str]:
  """Parses `argv` (program name first) into `values`; the arguments left,
  program name first. A mistake: one line on stderr, exit status 2."""
  try:
    return _parse(argv, values)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
