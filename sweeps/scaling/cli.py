"""The flags of a scaling fit, one set for both commands that fit one:
`python -m sweeps.scaling` (a CSV's runs, __main__.py) and `sweep.py scaling`
(a sweep's finished runs, from_sweep.py). absl only: `--help` loads no fit.

`define_flags` defines them on the FlagValues it is given (__main__.py's
own, sweep.py's global ones); `fit_options` reads them back as the keyword
arguments of `write_scaling`. The input flags differ by nature and stay with
each command: a CSV's `--csv` and its columns, a sweep's `--root`.
"""
from absl import flags

from configs.errors import UserError


def define_flags(flag_values: flags.FlagValues) -> None:
  """The fitting flags, defined on `flag_values`."""
  flags.DEFINE_string("params", None, "Column of the parameter count N the fit uses, with "
                      "embeddings (Chinchilla's count) or without (Kaplan's); the output "
                      "names it. A sweep's runs: params (the default there) or "
                      "params_non_embedding.", flag_values=flag_values)
  flags.DEFINE_string("holdout", None, "Runs predicted, not fitted: 'budget>=X' (runs whose "
                      "budget, or compute where they have none, is X or more), or a column of "
                      "1/0 (true/false, yes/no).", flag_values=flag_values)
  flags.DEFINE_integer("resamples", 1000, "Bootstrap resamples.", lower_bound=100,
                       flag_values=flag_values)
  flags.DEFINE_integer("starts", 64, "L-BFGS-B starts: the best points of Hoffmann's grid "
                       "(4500: all of them).", lower_bound=1, upper_bound=4500,
                       flag_values=flag_values)
  flags.DEFINE_float("target_compute", None, "Compute, in the runs' FLOP model, where "
                     "variants are compared and the frontier ends (default: 100 x the largest "
                     "fitted run's).", lower_bound=0, flag_values=flag_values)
  flags.DEFINE_string("baseline", None, "The variant the others are compared with (default: "
                      "the first).", flag_values=flag_values)
  flags.DEFINE_integer("bootstrap_seed", 0, "Seed of the resampling.", flag_values=flag_values)
  flags.DEFINE_string("out", None, "Output directory (default: runs/scaling/<csv name> for a "
                      "CSV, <root>/scaling for a sweep).", flag_values=flag_values)


NAMES = ("params", "holdout", "resamples", "starts", "target_compute", "baseline",
         "bootstrap_seed", "out")  # what define_flags defines


def fit_options(flag_values: flags.FlagValues) -> dict:
  """The fitting flags as `write_scaling`'s keyword arguments (all but
  params and out, which each command reads with its own default)."""
  if flag_values.target_compute == 0:
    raise UserError("--target_compute must be positive")
  return {"holdout": flag_values.holdout, "resamples": flag_values.resamples,
          "starts": flag_values.starts, "target": flag_values.target_compute,
          "baseline": flag_values.baseline, "bootstrap_seed": flag_values.bootstrap_seed}
