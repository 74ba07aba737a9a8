"""Variants: each sweep entry's config parsed and validated as train.py will do
it, and the train.py and eval.py commands that run it."""
import dataclasses
import json
import os
import shlex
import sys


from ml_collections import config_dict

from configs.cli import check_field, config_fields, load_config
from configs.errors import UserError
from configs.validation import eval_points, validate
from model.config import ModelConfig
from sweeps.common import REPO
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


def make_variants(sweep: Sweep, config_path: str, extra_flags: list[str],
                  root: str) -> list[Variant]:
  """Named, validated variants; `extra_flags` (`--config.a.b=v`) apply to all."""
  fields = config_fields(load_config(config_path, []))
  extra_fields = [flag[len("--config."):].split("=", 1)[0] for flag in extra_flags]
  for field in extra_fields:
    check_field(field, fields, "command line")
  variants = []
  for overrides in sweep.overrides:
    for field in overrides:
      check_field(field, fields, f"sweep {sweep.path}")
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
