"""Variants: each sweep entry's config parsed and validated as train.py will do
it, and the train.py and eval.py commands that run it."""
import dataclasses
import json
import os
import shlex
import sys

from ml_collections import config_dict

from configs.cli import check_budget_overrides, check_field, config_fields, load_config
from configs.errors import UserError
from configs.validation import eval_points
from model.resolve import resolve
from sweeps.common import REPO
from sweeps.sweep_file import Sweep, format_value, variant_name


@dataclasses.dataclass
class Variant:
  """One run of a sweep: the fields it sets and the two commands that run it.

  With seeds (`--seeds N`, a sweep file's SEEDS) a variant is N of these, one
  per train.seed 0..N-1, named `<group>,seed=<k>`; without, one, its name the
  group's."""
  name: str
  overrides: dict
  workdir: str
  num_steps: int
  train_command: list[str]
  eval_command: list[str]
  config: dict = dataclasses.field(default_factory=dict)  # the resolved config it trains
  group: str = ""  # the variant's name, shared by its seeds ("": `name`, a manifest before seeds)
  seed: int | None = None  # the train.seed --seeds gave it; None: the config's own
  env: dict = dataclasses.field(default_factory=dict)  # environment variables of its commands

  def __post_init__(self):
    self.group = self.group or self.name

  def shell(self, command: list[str]) -> str:
    """`command` as a shell line, after this variant's environment variables."""
    env = "".join(f"{name}={shlex.quote(value)} " for name, value in self.env.items())
    return env + shlex.join(command)


def _seeds_check(seeds: int | None, fields: list[str], where: str) -> None:
  """With seeds, train.seed is theirs: a variant or flag setting it is refused."""
  if seeds and "train.seed" in fields:
    raise UserError(f"train.seed is set {where} and by the sweep's seeds ({seeds}: "
                    "train.seed = 0..N-1 for every variant); drop one of them")


def make_variants(sweep: Sweep, config_path: str, extra_flags: list[str], root: str,
                  seeds: int | None = None, env: dict | None = None) -> list[Variant]:
  """Named, validated variants; `extra_flags` (`--config.a.b=v`) apply to all.
  `seeds` (default: the sweep file's SEEDS): that many runs of each variant.
  `env`: environment variables set for every variant's train.py and eval.py
  (`PJRT_NPROC=1`: XLA's CPU thread count); they lead each variant's name
  (`PJRT_NPROC=1,pos_emb=rope`), so one root holds the variants under several
  environments (one call each)."""
  seeds = seeds or sweep.seeds
  env = {name: str(value) for name, value in (env or {}).items()}
  fields = config_fields(load_config(config_path, []))
  extra_fields = [flag[len("--config."):].split("=", 1)[0] for flag in extra_flags]
  for field in extra_fields:
    check_field(field, fields, "command line")
  _seeds_check(seeds, extra_fields, "on the command line")
  variants = []
  for overrides in sweep.overrides:
    for field in overrides:
      check_field(field, fields, sweep.where)
      if field in extra_fields:
        raise UserError(f"{field} is set both by {sweep.where} and by --config.{field}; drop "
                        "one of them")
    _seeds_check(seeds, list(overrides), f"by {sweep.where}")
    group = variant_name({**env, **overrides})
    config_flags_ = extra_flags + [f"--config.{field}={format_value(value)}"
                                   for field, value in overrides.items()]
    for seed in range(seeds) if seeds else [None]:
      name = group if seed is None else f"{group},seed={seed}"
      run_flags = config_flags_ + ([] if seed is None else [f"--config.train.seed={seed}"])
      try:
        config = load_config(config_path, run_flags)
        check_budget_overrides(config, extra_fields + list(overrides))
        config = resolve(config)  # as train.py resolves it: num_steps, the kernel's checks
      except UserError as e:
        raise UserError(f"variant {name}: {e}") from e
      workdir = os.path.join(os.path.abspath(root), name)
      variants.append(Variant(
          name, overrides, workdir, config.train.num_steps,
          train_command=[sys.executable, os.path.join(REPO, "train.py"), "--config",
                         os.path.abspath(config_path), "--workdir", workdir, *run_flags],
          eval_command=[sys.executable, os.path.join(REPO, "eval.py"), "--workdir", workdir],
          config=json.loads(config.to_json()), group=group, seed=seed, env=env))
  names = [v.name for v in variants]
  for name in names:
    if names.count(name) > 1:
      raise UserError(f"{sweep.where}: {names.count(name)} variants are named {name} "
                      "(the same overrides?)")
  return variants


def few_points(variants: list[Variant], minimum: int = 5) -> list[str]:
  """A warning per variant (once for all its seeds) whose in-training
  validation curve would have fewer than `minimum` points."""
  out, warned = [], set()
  for variant in variants:
    train = config_dict.ConfigDict(variant.config).train
    points = eval_points(train)
    if points < minimum and variant.group not in warned:
      warned.add(variant.group)
      out.append(f"warning: {variant.group} validates {points} time(s) in training "
                 f"(train.eval_every={train.eval_every} of num_steps={train.num_steps}): its "
                 "curve has too few points; lower --config.train.eval_every or leave it unset "
                 "(num_steps // 10)")
  return out


def describe(variants: list[Variant]) -> list[str]:
  """The commands of each variant, for --dry_run."""
  lines = []
  for variant in variants:
    lines += [f"{variant.name}:", f"  {variant.shell(variant.train_command)}",
              f"  {variant.shell(variant.eval_command)}"]
  return lines
