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
- a config file that does not exist (the presets listed), one that fails to
  import or whose get_config() fails (the error's last line);
- an override's value that is not of the field's type (`--config.train.batch_size=abc:
  expected an int, got 'abc'`);
- `--config.train.num_steps` beside a token or FLOP budget, which sets it.

Each is checked against the defined flags and the loaded config itself,
never by reading a library's error message.
"""
import ast
import difflib
import importlib.machinery
import importlib.util
import os
import sys

from absl import flags
from ml_collections import config_dict, config_flags
from ml_collections.config_flags import tuple_parser

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


def _last_line(error: BaseException) -> str:
  """What a traceback of `error` ends with: `ModuleNotFoundError: No module
  named 'x'` (a SyntaxError's names the file and line)."""
  text = str(error).strip()
  return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def check_config_file(config_path: str) -> None:
  """UserError unless `config_path` (`FILE` or `FILE:ARG`, as ml_collections
  reads it) is a file that imports and whose `get_config(ARG)` returns a
  ConfigDict. Checked by running it here, before ml_collections does (which
  lets an import error through as a traceback and wraps one of get_config in
  a page of text)."""
  path, *args = config_path.split(":", 1)
  if not os.path.isfile(path):
    raise UserError(f"no such config file: {path} (the presets: {', '.join(presets())})")
  loader = importlib.machinery.SourceFileLoader("config_check", path)
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
  try:
    loader.exec_module(module)
  except Exception as e:  # whatever the file raises, it is the file's
    raise UserError(f"{path} failed to import: {_last_line(e)}") from e
  if not callable(getattr(module, "get_config", None)):
    raise UserError(f"{path} has no get_config(): a config file defines one that returns "
                    "the config (see configs/tiny.py)")
  try:
    config = module.get_config(*args)
  except Exception as e:
    raise UserError(f"{config_path}: get_config({', '.join(map(repr, args))}) failed: "
                    f"{_last_line(e)}") from e
  if not isinstance(config, config_dict.ConfigDict):
    raise UserError(f"{config_path}: get_config() returned {type(config).__name__}, not a "
                    "ConfigDict")


def load_config(config_path: str, overrides: list[str] = ()) -> config_dict.ConfigDict:
  """The config that `--config config_path *overrides` gives, through the
  same ml_collections parser the tools use (so what passes here passes
  there)."""
  check_config_file(config_path)
  argv = ["prog", "--config", config_path, *overrides]
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, flag_values=values,
                                           lock_config=True, sys_argv=argv)
  try:
    values(argv)
    return holder.value
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise UserError(first_line(e)) from e


# What `--config.<field>=<text>` parses a field's text with, as ml_collections
# does, and the type named when it fails. A str field takes any text.
_PARSERS = {int: (flags.IntegerParser(), "an int"), float: (flags.FloatParser(), "a float"),
            bool: (flags.BooleanParser(), "a bool (true or false)"),
            tuple: (tuple_parser.TupleParser(), "a tuple, e.g. (1, 2) or ('a', 'b')")}


def field_type(config: config_dict.ConfigDict, field: str) -> type:
  """The type of a dotted field; a None field's is its placeholder's."""
  *sections, last = field.split(".")
  for section in sections:
    config = config[section]
  return config.get_type(last)


def _parses(parser, text: str) -> bool:
  """Whether `parser` takes `text`. A tuple's text that does not read as a
  Python literal is one element: refused when it has a comma (`neg,pos`,
  meant as two)."""
  try:
    value = parser.parse(text)
  except ValueError:
    return False
  return not (isinstance(parser, tuple_parser.TupleParser) and value == (text,) and "," in text)


def check_value(config: config_dict.ConfigDict, field: str, text: str) -> None:
  """UserError unless `--config.<field>=<text>` gives the field a value of its
  type, parsed as ml_collections parses it."""
  parser, wanted = _PARSERS.get(field_type(config, field), (None, None))
  if parser is not None and not _parses(parser, text):
    hint = (" (a field is set to None in a config file, not on the command line)"
            if text.strip().lower() == "none" else "")
    raise UserError(f"{OVERRIDE}{field}={text}: expected {wanted}, got {text!r}{hint}")


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


def _override_text(argv: list[str], i: int, kind: type) -> str | None:
  """The text that `argv[i]`, `--config.<field>[=text]`, gives its field of
  type `kind`: after the `=`, else the next argument (absl's `--flag value`);
  None for a bare bool flag (`--config.train.allow_config_changes`, true)."""
  arg = argv[i]
  if "=" in arg:
    return arg.split("=", 1)[1]
  if kind is bool or i + 1 >= len(argv):
    return None
  return argv[i + 1]


def _check(argv: list[str], values: flags.FlagValues) -> None:
  """Every flag is defined, spelt snake_case, every override names a field of
  the config and gives it a value of its type; raises UserError otherwise."""
  _check_spelling(argv, values)
  path = _config_path(argv) if "config" in values else None
  config = load_config(path) if path else None
  fields = config_fields(config) if config is not None else []
  for i, arg in enumerate(argv[1:], start=1):
    if arg == "--":
      return
    name = _flag_name(arg)
    if name is None:
      continue
    if arg.startswith(OVERRIDE):
      if not fields:
        raise UserError(f"--{name}: give --config first")
      field = name[len("config."):]
      check_field(field, fields, "command line")
      text = _override_text(argv, i, field_type(config, field))
      if text is not None:
        check_value(config, field, text)
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
