"""Scaling laws fitted to runs from a CSV file (a paper's, another codebase's).

  python -m sweeps.scaling --csv runs.csv --params params --tokens tokens --loss loss
      [--budget budget] [--seed seed] [--variant variant]
      [--holdout 'budget>=1e21' | --holdout COLUMN] [--resamples 1000] [--starts 64]
      [--target_compute C] [--baseline VARIANT] [--bootstrap_seed 0]
      [--out runs/scaling/<csv name>]

One row a run. `--params` names the parameter count the fit uses (with
embeddings, Chinchilla's; without, Kaplan's); budgets are optional: without
`--budget` each run's compute is 6 N D, grouped into isoFLOP budgets where
the runs form them (sweeps/scaling/runs.py), and approach 3 fits any runs.
The fitting flags are sweeps/scaling/cli.py's, shared with `sweep.py scaling`.
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
from sweeps.scaling import cli

# Its own flags, not absl's global ones: main() runs inside other programs' processes (tests).
FLAGS = flags.FlagValues()
flags.DEFINE_string("csv", None, "The runs: a CSV file with a header, one run a row.",
                    flag_values=FLAGS)
flags.DEFINE_string("tokens", None, "Column of the training tokens D.", flag_values=FLAGS)
flags.DEFINE_string("loss", None, "Column of the loss.", flag_values=FLAGS)
flags.DEFINE_string("budget", None, "Column of the isoFLOP budget C in FLOPs, also the runs' "
                    "FLOP model (default: none; 6*N*D, grouped into budgets where it forms "
                    "them).", flag_values=FLAGS)
flags.DEFINE_string("seed", None, "Column of the seed (several seeds of one size and budget "
                    "are resampled together).", flag_values=FLAGS)
flags.DEFINE_string("variant", None, "Column naming each run's variant: one law each, "
                    "compared.", flag_values=FLAGS)
cli.define_flags(FLAGS)
flags.mark_flags_as_required(["csv", "params", "tokens", "loss"], flag_values=FLAGS)


def run() -> None:
  """Reads, fits, writes, prints the summary."""
  start = time.perf_counter()
  out = FLAGS.out or os.path.join("runs", "scaling",
                                  os.path.splitext(os.path.basename(FLAGS.csv))[0])
  if os.path.exists(out) and not os.path.isdir(out):
    raise UserError(f"--out {out} is a file; give a directory")
  options = cli.fit_options(FLAGS)
  # Imported here, not above: numpy's fits, scipy and matplotlib take a second or two to
  # load, and `--help` needs none of them.
  from sweeps.scaling import report, runs  # pylint: disable=import-outside-toplevel
  result, paths = report.write_scaling(
      runs.read_csv(FLAGS.csv), out, params=FLAGS.params, tokens=FLAGS.tokens,
      loss=FLAGS.loss, budget=FLAGS.budget, seed=FLAGS.seed, variant=FLAGS.variant, **options)
  print("\n".join(report.summary(result)))
  held = int(result.runs.held_out.sum())
  print(f"fitted {len(result.runs.n) - held} runs ({held} held out), {result.resamples} "
        f"resamples, in "
        f"{result.seconds:.1f} s ({time.perf_counter() - start:.1f} s with reading and "
        f"writing); wrote {', '.join(paths)}")


def main(argv: Sequence[str] | None = None) -> None:
  """`argv`: the arguments after the program name (default: the command line's);
  `--help` (or -h) prints this module's usage and every flag, and nothing else."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if any(arg in ("--help", "-h", "--helpfull") for arg in argv):
    print(f"{__doc__}\n{FLAGS.get_help()}")
    return
  FLAGS.unparse_flags()
  rest = parse_flags(["sweeps.scaling", *argv], FLAGS)
  try:
    if rest[1:]:
      raise UserError(f"unexpected argument {rest[1]!r}; every input is a flag (see --help)")
    run()
  except UserError as e:
    print(f"error: {e}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
