"""Train a model: python train.py --config configs/tiny.py [--workdir runs/tiny]

Any field can be overridden: --config.model.pos_emb=rope. The workdir
defaults to runs/<config file stem>. Running the same command on the same
workdir resumes from its newest checkpoint.

Exit status: 0, trained to train.num_steps (or it already was); 130 or 143
(128 + the signal), stopped by SIGINT or SIGTERM: after the first step with
that step saved, before it with the workdir left as it was (a new one
removed); 2, a user error (one line on stderr); 1, a bug (a traceback).
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from configs.cli import parse_flags
from configs.errors import UserError
from training import interrupts

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created or resumed); "
                               "default: runs/<config file stem>.")
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    print(f"error: unexpected arguments: {' '.join(argv[1:])} (train.py takes --config, "
          "--workdir and --config.<field>=<value> flags only)", file=sys.stderr)
    sys.exit(2)
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO.
  sys.exit(_train())


def _train() -> int:
  """Trains; the exit status."""
  if _CONFIG.value.train.reuse_host_memory:  # before JAX starts its threads
    from training.host_memory import reuse_freed_memory  # pylint: disable=import-outside-toplevel
    reuse_freed_memory()
  from training.loop import Stopped, train  # pylint: disable=import-outside-toplevel
  from training.workdir import default_workdir  # pylint: disable=import-outside-toplevel
  workdir = _WORKDIR.value
  if workdir is None:
    workdir = default_workdir(flags.FLAGS["config"].config_filename)
    print(f"workdir: {workdir} (no --workdir given)", flush=True)
  try:
    train(_CONFIG.value, workdir)
    status = 0
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    status = 2
  except Stopped as e:  # the step is saved, and the loop said so
    status = e.exit_status
  # Decided, and everything written and closed: a signal now only hurries the exit
  # (not the start-up line's, which would misreport it).
  interrupts.exit_quietly(status)
  return status


if __name__ == "__main__":
  # Before the training loop handles them (reading the flags and the config,
  # importing JAX, the checks) nothing is written yet: a signal exits at once.
  interrupts.exit_on_signal(lambda name: f"{name} during start-up: stopped before training, "
                            "nothing written")
  app.run(main, flags_parser=parse_flags)
