"""Scaling laws fitted to runs from a CSV file (a paper's, another codebase's).

  python -m sweeps.scaling --csv runs.csv --params params --tokens tokens --loss loss
      [--budget budget] [--seed seed] [--variant variant]
      [--holdout 'budget>=1e21' | --holdout COLUMN] [--resamples 1000] [--starts 64]
      [--target_compute C] [--baseline VARIANT] [--bootstrap_seed 0]
      [--out runs/scaling/<csv name>]

One row a run. `--params` names the parameter count the fit uses (with
embeddings, Chinchilla's; without, Kaplan's); without `--budget` each run's
budget is 6 N D, grouped into isoFLOP budgets (sweeps/scaling/runs.py).
Writes scaling.json, scaling.md and three plots into `--out`, all or
nothing; a mistake in the input is one line on stderr, exit status 2, and
nothing written. docs/scaling.md has the method.
"""
import os
import sys
import time
from collections.abc import Sequence

from absl import flags

from configs.cli import parse_flags
from configs.errors import UserError
from sweeps import scaling

# Its own flags, not absl's global ones: main() runs inside other programs' processes (tests).
FLAGS = flags.FlagValues()
flags.DEFINE_string("csv", None, "The runs: a CSV file with a header, one run a row.",
                    flag_values=FLAGS)
flags.DEFINE_string("params", None, "Column of the parameter count N the fit uses (with or "
                    "without embeddings); the output names it.", flag_values=FLAGS)
flags.DEFINE_string("tokens", None, "Column of the training tokens D.", flag_values=FLAGS)
flags.DEFINE_string("loss", None, "Column of the loss.", flag_values=FLAGS)
flags.DEFINE_string("budget", None, "Column of the isoFLOP budget C in FLOPs (default: 6*N*D, "
                    "grouped).", flag_values=FLAGS)
flags.DEFINE_string("seed", None, "Column of the seed (several seeds of one size and budget "
                    "are resampled together).", flag_values=FLAGS)
flags.DEFINE_string("variant", None, "Column naming each run's variant: one law each, "
                    "compared.", flag_values=FLAGS)
flags.DEFINE_string("holdout", None, "Runs predicted, not fitted: 'budget>=X', or a column "
                    "of 1/0 (true/false, yes/no).", flag_values=FLAGS)
flags.DEFINE_integer("resamples", 1000, "Bootstrap resamples.", lower_bound=100,
                     flag_values=FLAGS)
flags.DEFINE_integer("starts", 64, "L-BFGS-B starts: the best points of Hoffmann's grid "
                     "(4500: all of them).", lower_bound=1, upper_bound=4500, flag_values=FLAGS)
flags.DEFINE_float("target_compute", None, "Compute where variants are compared and the "
                   "frontier ends (default: 100 x the largest fitted budget).", lower_bound=0,
                   flag_values=FLAGS)
flags.DEFINE_string("baseline", None, "The variant the others are compared with (default: "
                    "the first).", flag_values=FLAGS)
flags.DEFINE_integer("bootstrap_seed", 0, "Seed of the resampling.", flag_values=FLAGS)
flags.DEFINE_string("out", None, "Output directory (default: runs/scaling/<csv name>).",
                    flag_values=FLAGS)
flags.mark_flags_as_required(["csv", "params", "tokens", "loss"], flag_values=FLAGS)


def run() -> None:
  """Reads, fits, writes, prints the summary."""
  start = time.perf_counter()
  out = FLAGS.out or os.path.join("runs", "scaling",
                                  os.path.splitext(os.path.basename(FLAGS.csv))[0])
  if os.path.exists(out) and not os.path.isdir(out):
    raise UserError(f"--out {out} is a file; give a directory")
  if FLAGS.target_compute == 0:
    raise UserError("--target_compute must be positive")
  result, paths = scaling.write_scaling(
      scaling.read_csv(FLAGS.csv), out, params=FLAGS.params, tokens=FLAGS.tokens,
      loss=FLAGS.loss, budget=FLAGS.budget, seed=FLAGS.seed, variant=FLAGS.variant,
      holdout=FLAGS.holdout, resamples=FLAGS.resamples, starts=FLAGS.starts,
      target=FLAGS.target_compute, baseline=FLAGS.baseline, bootstrap_seed=FLAGS.bootstrap_seed)
  for f in result.fits:
    e = {key: scaling.report.format_estimate(f.estimates[key], 3)
         for key in ("alpha", "beta", "a", "isoflop a")}
    print(f"{f.name}: alpha {e['alpha']}, beta {e['beta']}; N_opt ∝ C^a with a "
          f"{e['a']} (approach 3), {e['isoflop a']} (approach 2)")
  for line in scaling.report.flags(result):
    print(f"flag: {line}")
  held = int(result.runs.held_out.sum())
  print(f"fitted {len(result.runs.n) - held} runs ({held} held out), {result.resamples} "
        f"resamples, in "
        f"{result.seconds:.1f} s ({time.perf_counter() - start:.1f} s with reading and "
        f"writing); wrote {', '.join(paths)}")


def main(argv: Sequence[str] | None = None) -> None:
  """`argv`: the arguments after the program name (default: the command line's)."""
  FLAGS.unparse_flags()
  rest = parse_flags(["sweeps.scaling", *(sys.argv[1:] if argv is None else argv)], FLAGS)
  try:
    if rest[1:]:
      raise UserError(f"unexpected argument {rest[1]!r}; every input is a flag (see --help)")
    run()
  except UserError as e:
    print(f"error: {e}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
