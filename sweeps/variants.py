"""Variants: each sweep entry's config parsed and validated as train.py will do
it, and the train.py and eval.py commands that run it."""
import dataclasses
import difflib
import json
import os
import shlex
import sys

from absl import flags
from ml_collections import config_dict, config_flags

from configs.errors import UserError
from configs.validation import eval_points, validate
from model.config import ModelConfig
from sweeps.common import REPO, first_line
from sweeps.sweep_file import Sweep, format_value, variant_name


@dataclasses.dataclass
class Variant:
  """One run of a sweep: the fields it sets and the two commands that run it."""
  name: str
  overrides: dict
  workdir: str
  num_steps: int
  train_command: list[str]
  eval_command: list[str]
  config: dict = dataclasses.field(default_factory=dict)  # the resolved config it trains


def load_config(config_path: str, config_flags_: list[str]) -> config_dict.ConfigDict:
  """The config train.py builds from `--config config_path *config_flags_` (the
  same ml_collections parser, so what passes here passes there)."""
  argv = ["train.py", "--config", config_path, *config_flags_]
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, flag_values=values,
                                           lock_config=True, sys_argv=argv)
  try:
    values(argv)
    return holder.value
  except OSError as e:
    raise UserError(f"--config {config_path}: cannot load it ({first_line(e)})")
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise UserError(first_line(e))


def _fields(config: config_dict.ConfigDict, prefix: str = "") -> list[str]:
  """Every leaf field of a config, dotted."""
  out = []
  for key, value in config.items():
    if isinstance(value, config_dict.ConfigDict):
      out += _fields(value, f"{prefix}{key}.")
    else:
      out.append(prefix + key)
  return out


def _check_field(field: str, fields: list[str], where: str) -> None:
  if field not in fields:
    close = difflib.get_close_matches(field, fields, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UserError(f"{where}: {field}: no such config field{hint}")


def make_variants(sweep: Sweep, config_path: str, extra_flags: list[str],
                  root: str) -> list[Variant]:
  """Named, validated variants; `extra_flags` (`--config.a.b=v`) apply to all."""
  fields = _fields(load_config(config_path, []))
  extra_fields = [flag[len("--config."):].split("=", 1)[0] for flag in extra_flags]
  for field in extra_fields:
    _check_field(field, fields, "command line")
  variants = []
  for overrides in sweep.overrides:
    for field in overrides:
      _check_field(field, fields, f"sweep {sweep.path}")
      if field in extra_fields:
        raise UserError(f"{field} is set both by sweep {sweep.path} and on the command line")
    name = variant_name(overrides)
    config_flags_ = extra_flags + [f"--config.{field}={format_value(value)}"
                                   for field, value in overrides.items()]
    try:
      config = load_config(config_path, config_flags_)
      validate(config)
      ModelConfig.resolve(config.model)  # what the chosen kernel takes, as train.py checks it
    except UserError as e:
      raise UserError(f"variant {name}: {e}") from e
    workdir = os.path.join(os.path.abspath(root), name)
    variants.append(Variant(
        name, overrides, workdir, config.train.num_steps,
        train_command=[sys.executable, os.path.join(REPO, "train.py"), "--config",
                       os.path.abspath(config_path), "--workdir", workdir, *config_flags_],
        eval_command=[sys.executable, os.path.join(REPO, "eval.py"), "--workdir", workdir],
        config=json.loads(config.to_json())))
  names = [v.name for v in variants]
  for name in names:
    if names.count(name) > 1:
      raise UserError(f"sweep {sweep.path}: {names.count(name)} variants are named {name} "
                      "(the same overrides?)")
  return variants


def few_points(variants: list[Variant], minimum: int = 5) -> list[str]:
  """A warning per variant whose in-training validation curve would have
  fewer than `minimum` points."""
  out = []
  for variant in variants:
    train = config_dict.ConfigDict(variant.config).train
    points = eval_points(train)
    if points < minimum:
      out.append(f"warning: {variant.name} validates {points} time(s) in training "
                 f"(train.eval_every={train.eval_every} of num_steps={train.num_steps}): its "
                 "curve has too few points; lower --config.train.eval_every or leave it unset "
                 "(num_steps // 10)")
  return out


def describe(variants: list[Variant]) -> list[str]:
  """The commands of each variant, for --dry_run."""
  lines = []
  for variant in variants:
    lines += [f"{variant.name}:", f"  {shlex.join(variant.train_command)}",
              f"  {shlex.join(variant.eval_command)}"]
  return lines
