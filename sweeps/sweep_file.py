"""Sweep files: `get_sweep()` expanded into one override dict per variant, and
the variants' names. (A grid given on the command line is a `Sweep` too:
sweeps/grid.py.)"""
import dataclasses
import importlib.util
import itertools
import os
import re

from configs.errors import UserError, first_line
from sweeps import ladder

VALUE_TYPES = (str, int, float, bool)  # a value, or a tuple of them for a tuple field


DEFAULT_GRID_CONFIG = "configs/tiny.py"  # the base config of a --grid sweep without --config


@dataclasses.dataclass
class Sweep:
  """A loaded sweep file: its name, its CONFIG (or None), one dict per variant,
  its SEEDS (runs per variant, or None: one run with the config's train.seed).
  A sweep given by `--grid` flags has no file: `path` None, `grid` the flags."""
  path: str | None
  name: str
  config: str | None
  overrides: list[dict]
  seeds: int | None = None
  grid: list[str] | None = None  # `field=v1,v2` of each --grid flag of a command-line sweep

  @property
  def where(self) -> str:
    """What the sweep's errors name: `sweep <file>`, or `--grid`."""
    return "--grid" if self.path is None else f"sweep {self.path}"

  @property
  def source(self) -> str:
    """What sweep.json and the report name: the file's absolute path, or the
    --grid flags."""
    if self.path is None:
      return " ".join(f"--grid {flag}" for flag in self.grid)
    return os.path.abspath(self.path)


def load_sweep(path: str) -> Sweep:
  """Imports a sweep file and expands its `get_sweep()` into override dicts
  (a file declaring a LADDER instead: sweeps/ladder.py's cells of it)."""
  if not os.path.isfile(path):
    raise UserError(f"--sweep {path}: no such file")
  spec = importlib.util.spec_from_file_location("sweep_file", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    if hasattr(module, "LADDER"):  # a declarative ladder: sweeps/ladder.py builds its cells
      sweep = ladder.sweep_overrides(module.LADDER, module.CONFIG)
    else:
      sweep = module.get_sweep()
  except Exception as e:  # pylint: disable=broad-except  # any mistake in the user's file
    raise UserError(f"--sweep {path}: cannot load it ({type(e).__name__}: {first_line(e)})")
  name = getattr(module, "NAME", os.path.splitext(os.path.basename(path))[0])
  seeds = getattr(module, "SEEDS", None)
  if seeds is not None and (not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1):
    raise UserError(f"--sweep {path}: SEEDS={seeds!r} must be a positive integer (runs per "
                    "variant)")
  return Sweep(path, name, getattr(module, "CONFIG", None), expand(sweep, f"sweep {path}"),
               seeds)


def with_default_config(argv: list[str]) -> list[str]:
  """Command-line arguments with a `--config` added when they give none: the
  --sweep file's CONFIG, or configs/tiny.py for --grid without --sweep."""
  if any(arg == "--config" or arg.startswith("--config=") for arg in argv):
    return argv
  path, grid = None, False
  for arg, following in zip(argv, argv[1:] + [None]):
    if arg.startswith("--sweep="):
      path = arg[len("--sweep="):]
    elif arg == "--sweep":
      path = following
    grid = grid or arg == "--grid" or arg.startswith("--grid=")
  if path:
    config = load_sweep(path).config
  else:
    config = DEFAULT_GRID_CONFIG if grid else None
  return argv if config is None else [argv[0], f"--config={config}", *argv[1:]]


def expand(sweep, where: str) -> list[dict]:
  """A grid (field -> list of values) or a list of override dicts -> one dict per variant."""
  if isinstance(sweep, dict):
    if not sweep:
      raise UserError(f"{where}: get_sweep() returned an empty grid")
    for field, values in sweep.items():
      if not isinstance(values, (list, tuple)) or not values:
        raise UserError(f"{where}: grid field {field} needs a non-empty list of values, "
                        f"not {values!r}")
    variants = [dict(zip(sweep, values)) for values in itertools.product(*sweep.values())]
  elif isinstance(sweep, (list, tuple)):
    if not sweep:
      raise UserError(f"{where}: get_sweep() returned an empty list")
    for overrides in sweep:
      if not isinstance(overrides, dict):
        raise UserError(f"{where}: each variant must be a dict of field -> value, "
                        f"not {overrides!r}")
    variants = [dict(overrides) for overrides in sweep]
  else:
    raise UserError(f"{where}: get_sweep() must return a grid (dict) or a list of dicts, "
                    f"not {type(sweep).__name__}")
  for overrides in variants:
    for field, value in overrides.items():
      items = value if isinstance(value, tuple) else (value,)
      if not items or not all(isinstance(item, VALUE_TYPES) for item in items):
        raise UserError(f"{where}: {field}={value!r}: a value must be a str, int, float or "
                        "bool, or a non-empty tuple of them")
  return variants


def format_value(value) -> str:
  """A value as a `--config.<field>=` flag takes it (a tuple as Python writes it)."""
  if isinstance(value, bool):
    return "true" if value else "false"
  return str(value)


def _name_value(value) -> str:
  """A value in a variant's name: a tuple's items joined by `-`."""
  if isinstance(value, tuple):
    return "-".join(format_value(item) for item in value)
  return format_value(value)


def _path_safe(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def variant_name(overrides: dict) -> str:
  """`pos_emb=rope,norm_position=pre`: each field by its last part (all of it when
  two fields share the last part), a tuple's items joined by `-`
  (`layer_types=linear_attention-full_attention`); characters unsafe in a path
  become `_`."""
  if not overrides:
    return "base"
  lasts = [field.rsplit(".", 1)[-1] for field in overrides]
  return ",".join(f"{_path_safe(last if lasts.count(last) == 1 else field)}="
                  f"{_path_safe(_name_value(value))}"
                  for (field, value), last in zip(overrides.items(), lasts))
