"""Fill the token cache for a config without training: `python -m data.prepare`.

  python -m data.prepare --config configs/tiny.py --config.data.source=parquet \
      --config.data.paths='corpus/*.parquet' --config.tokenizer.path=runs/tok --workers 8
  python -m data.prepare --config ... --launcher slurm --tasks 16 --cpus_per_task 8

The run's tokenizer is `--config.tokenizer.path`, or the tokenizer of
`--workdir` (a run that has trained one). Locally, `--workers` processes
tokenise the shards that are not cached yet. With `--launcher slurm` the
shards are shared out among `--tasks` tasks of one job array (submitit, as
the sweeps submit theirs), each with `--cpus_per_task` workers; this
command waits for the array, then checks every entry and stores the packing
index of both splits, so the training job starts warm. A data.mixture is
prepared source by source. A user mistake is one line on stderr and exit
status 2.
"""
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from configs.cli import parse_flags
from configs.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file.",
                                          lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "A run whose tokenizer to use (when "
                               "config.tokenizer.path is empty).")
_WORKERS = flags.DEFINE_integer("workers", 0, "Tokenisation processes (local); 0: "
                                "data.tokenize_workers, or every usable core.")
_LAUNCHER = flags.DEFINE_enum("launcher", "local", ["local", "slurm"], "Where to tokenise.")
_TASKS = flags.DEFINE_integer("tasks", 2, "slurm: tasks of the job array (groups of shards).")
_CPUS = flags.DEFINE_integer("cpus_per_task", 4, "slurm: CPUs (tokenisation workers) per task.")
_PARTITION = flags.DEFINE_string("partition", None, "slurm: partition (default: the cluster's).")
_TIMEOUT = flags.DEFINE_integer("timeout_min", 240, "slurm: time limit of each task.")
_FOLDER = flags.DEFINE_string("folder", None, "slurm: submitit's folder for job files and "
                              "logs; default: <cache>/slurm.")
flags.mark_flags_as_required(["config"])


def tokenizer_path(config, workdir: str | None) -> str:
  """The tokenizer the run will use: config.tokenizer.path or the workdir's."""
  if config.tokenizer.path:
    return config.tokenizer.path
  if workdir and os.path.isdir(os.path.join(workdir, "tokenizer")):
    return os.path.join(workdir, "tokenizer")
  raise UserError("data.prepare needs the run's tokenizer: set --config.tokenizer.path to a "
                  "saved tokenizer, or --workdir to a run that has trained one")


def data_sections(config) -> list[tuple[str, object]]:
  """(name, `data` section) of what to prepare: each source of a data.mixture
  alone, or the one source (name "")."""
  from data import mixture  # pylint: disable=import-outside-toplevel
  return ([(source.name, source.config.data) for source in mixture.sources(config)]
          or [("", config.data)])


class PrepareTask:
  """One task of the job array: tokenises the shards its index owns, waits for none."""

  def __init__(self, config, tok_path: str, num_tasks: int):
    self.config = config
    self.tok_path = tok_path
    self.num_tasks = num_tasks

  def __call__(self, task: int) -> int:
    import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
    from data import tokens  # pylint: disable=import-outside-toplevel
    tok = tokenizer_lib.load_tokenizer(self.tok_path)
    return sum(len(tokens.load_corpus(data, tok, tokens.Share(task, self.num_tasks), wait=False))
               for _, data in data_sections(self.config))


def prepare(config, tok_path: str) -> None:
  """Every shard of the corpus in the cache (tokenised here when missing) and
  the packing index of both splits stored."""
  import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from data import packing, sources, tokens  # pylint: disable=import-outside-toplevel
  tok = tokenizer_lib.load_tokenizer(tok_path)
  for name, data in data_sections(config):
    entries = tokens.load_corpus(data, tok)
    for split in sources.SPLITS:
      index = packing.load_index(entries, split, data.val_percent, data.packing,
                                 tokens.cache_root(data))
      print(f"data: {split}" + (f" of {name}" if name else "") + f": {index.num_documents} "
            f"documents, {index.num_tokens} tokens ({index.num_bytes / 1e6:.1f} MB of text); "
            f"index {index.directory}", flush=True)


def submit_slurm(config, tok_path: str) -> None:
  """The shards as a job array of --tasks tasks; waits for it, then `prepare`."""
  import submitit  # pylint: disable=import-outside-toplevel
  from data import tokens  # pylint: disable=import-outside-toplevel
  from sweeps import slurm  # pylint: disable=import-outside-toplevel
  from configs.errors import first_line  # pylint: disable=import-outside-toplevel
  params = slurm.slurm_parameters("prepare", nodes=1, tasks_per_node=1, gpus_per_node=0,
                                  cpus_per_task=_CPUS.value, timeout_min=_TIMEOUT.value,
                                  partition=_PARTITION.value, account=None, parallel=None,
                                  setup=[])
  slurm.check_fits(params)
  folder = _FOLDER.value or os.path.join(tokens.cache_root(config.data), "slurm")
  config.data.tokenize_workers = _CPUS.value
  executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
  executor.update_parameters(**params)
  jobs = executor.map_array(PrepareTask(config, os.path.abspath(tok_path), _TASKS.value),
                            list(range(_TASKS.value)))
  print(f"submitted {jobs[0].job_id.split('_')[0]}: {len(jobs)} tasks; logs in {folder}",
        flush=True)
  for task, job in enumerate(jobs):
    try:
      job.result()
    except submitit.core.utils.UncompletedJobError as e:
      raise UserError(f"task {task} of the array did not finish ({first_line(e)}); "
                      f"see {job.paths.stderr}") from None
    except submitit.core.utils.FailedJobError as e:
      lines = [line for line in str(e).splitlines() if "UserError" in line or "error" in line]
      raise UserError(f"task {task} failed: {(lines or [first_line(e)])[-1].strip()} "
                      f"(log {job.paths.stderr})") from None
  prepare(config, tok_path)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = _CONFIG.value
  try:
    from configs.validation import validate  # pylint: disable=import-outside-toplevel
    validate(config)
    tok_path = tokenizer_path(config, _WORKDIR.value)
    if _WORKERS.value:
      config.data.tokenize_workers = _WORKERS.value
    if _LAUNCHER.value == "slurm":
      submit_slurm(config, tok_path)
    else:
      prepare(config, tok_path)
  except UserError as e:
    print(f"error: {e}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
