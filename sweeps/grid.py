"""`sweep.py run --grid` and `--variants`: a sweep given on the command line,
or a part of a sweep file's variants.

`--grid model.pos_emb=rope,sinusoidal --grid model.norm_position=pre,post`
alone is a sweep of every combination (the first flag varies slowest, as in
a grid sweep file), named after its fields (`grid-pos_emb-norm_position`).
Beside `--sweep FILE`, each --grid keeps the file's variants whose field has
one of the values given, and `--variants NAME[,NAME]` the variants so named.
Values are read as `--config.<field>=<value>` would be, in the field's type.
"""
import difflib

from configs.cli import check_field, config_fields, field_type, load_config
from configs.errors import UserError
from sweeps.sweep_file import VALUE_TYPES, Sweep, expand, format_value, variant_name

_TYPE_NAMES = {bool: "a bool (true or false)", int: "an int", float: "a float", str: "a str"}


def _typed(config_path: str, field: str, text: str, kind: type):
  """`text` as `--config.<field>=<text>` sets the field."""
  try:
    config = load_config(config_path, [f"--config.{field}={text}"])
  except UserError as e:
    raise UserError(f"--grid {field}={text}: expected {_TYPE_NAMES[kind]}, got {text!r}") from e
  for part in field.split("."):
    config = config[part]
  return config


def parse_grid(flags: list[str], config_path: str) -> dict[str, list]:
  """`field=v1,v2` of each --grid flag -> {field: values}, in the order given,
  each value in the config's type for the field."""
  config = load_config(config_path, [])
  fields, grid = config_fields(config), {}
  for flag in flags:
    field, sep, values = flag.partition("=")
    if not sep or not field:
      raise UserError(f"--grid {flag}: give field=value[,value...] (--grid "
                      "model.pos_emb=rope,sinusoidal)")
    if field.startswith("config."):
      raise UserError(f"--grid {flag}: give the field without 'config.' (--grid "
                      f"{flag[len('config.'):]})")
    check_field(field, fields, "--grid")
    if field in grid:
      raise UserError(f"--grid {field}: given twice; give all its values in one --grid "
                      f"({field}=a,b)")
    texts = values.split(",")
    if not values or "" in texts:
      raise UserError(f"--grid {flag}: an empty value; give field=value[,value...] without "
                      "empty ones")
    kind = field_type(config, field)
    if kind not in VALUE_TYPES:
      raise UserError(f"--grid {field}: a {kind.__name__} field, whose values hold commas; "
                      "list its variants in a sweep file (--sweep), each value a tuple")
    typed = [_typed(config_path, field, text, kind) for text in texts]
    for value in typed:
      if typed.count(value) > 1:
        raise UserError(f"--grid {flag}: {format_value(value)} given twice")
    grid[field] = typed
  return grid


def _short_fields(fields: list[str]) -> list[str]:
  """Each field by its last part (all of it when two share the last part), as
  variant names write them."""
  lasts = [field.rsplit(".", 1)[-1] for field in fields]
  return [last if lasts.count(last) == 1 else field for field, last in zip(fields, lasts)]


def grid_sweep(flags: list[str], config_path: str) -> Sweep:
  """The sweep of every combination of the --grid flags' values."""
  grid = parse_grid(flags, config_path)
  name = "grid-" + "-".join(_short_fields(list(grid)))
  return Sweep(None, name, config_path, expand(grid, "--grid"), grid=list(flags))


def _names(text: str, names: list[str]) -> list[list[str]]:
  """Every way of reading `text` as names of `names` joined by commas."""
  ways = [[text]] if text in names else []
  for name in names:
    if text.startswith(name + ","):
      ways += [[name] + rest for rest in _names(text[len(name) + 1:], names)]
  return ways


def _named(value: str, names: list[str], where: str) -> list[str]:
  """The variants a --variants value names: a variant's name, or names joined
  by commas."""
  if value in names:
    return [value]
  ways = _names(value, names)
  if len(ways) == 1:
    return ways[0]
  if ways:
    raise UserError(f"--variants {value}: reads as several lists of variants "
                    f"({' | '.join(','.join(w) for w in ways[:2])}); give each variant "
                    "with its own --variants")
  close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
  hint = f" (did you mean {close[0]}?)" if close else ""
  shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
  raise UserError(f"--variants {value}: {where} has no such variant{hint}; its variants: "
                  f"{shown}")


def select(sweep: Sweep, grid_flags: list[str], variant_flags: list[str],
           config_path: str) -> list[str]:
  """The names of the sweep file's variants that the --grid and --variants
  flags pick (all of them without either), in the file's order."""
  names = [variant_name(overrides) for overrides in sweep.overrides]
  keep = set(names)
  if variant_flags:
    picked = set()
    for value in variant_flags:
      picked.update(_named(value, names, sweep.where))
    keep &= picked
  if grid_flags:
    grid, config = parse_grid(grid_flags, config_path), load_config(config_path, [])
    for field, values in grid.items():
      kind = field_type(config, field)
      swept = [o[field] for o in sweep.overrides if field in o]
      if not swept:
        varied = sorted({f for overrides in sweep.overrides for f in overrides})
        raise UserError(f"--grid {field}: {sweep.where} does not set it (it sets "
                        f"{', '.join(varied) or 'nothing'})")
      # The file's values read as --config flags read them, as the grid's were.
      read = {format_value(v): _typed(config_path, field, format_value(v), kind) for v in swept}
      for value in values:
        if value not in read.values():
          raise UserError(f"--grid {field}={format_value(value)}: {sweep.where} has no variant "
                          f"with it (its values: {', '.join(dict.fromkeys(read))})")
      keep &= {name for name, overrides in zip(names, sweep.overrides)
               if field in overrides and read[format_value(overrides[field])] in values}
  if not keep:
    flags = [f"--grid {g}" for g in grid_flags] + [f"--variants {v}" for v in variant_flags]
    raise UserError(f"{' '.join(flags)}: no variant of {sweep.where} has all of them")
  return [name for name in names if name in keep]
