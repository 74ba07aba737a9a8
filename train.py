"""Train a model: python train.py --config configs/tiny.py [--workdir runs/tiny]

Any field can be overridden: --config.model.pos_emb=rope. The workdir
defaults to runs/<config file stem>. Running the same command on the same
workdir resumes from its newest checkpoint.
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from configs.cli import parse_flags
from configs.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created or resumed); "
                               "default: runs/<config file stem>.")
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO.
  if _CONFIG.value.train.reuse_host_memory:  # before JAX starts its threads
    from training.host_memory import reuse_freed_memory  # pylint: disable=import-outside-toplevel
    reuse_freed_memory()
  from training.loop import train  # pylint: disable=import-outside-toplevel
  from training.workdir import default_workdir  # pylint: disable=import-outside-toplevel
  workdir = _WORKDIR.value
  if workdir is None:
    workdir = default_workdir(flags.FLAGS["config"].config_filename)
    print(f"workdir: {workdir} (no --workdir given)", flush=True)
  try:
    train(_CONFIG.value, workdir)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
