"""Ablation sweeps: python sweep.py run | status | report | scaling

  python sweep.py run --sweep configs/sweeps/pos_norm.py [--config configs/tiny.py]
      [--root runs/sweeps/pos_norm] [--launcher local|slurm] [--parallel N] [--dry_run]
      [--seeds N]                            # each variant N times, train.seed 0..N-1
      [--config.train.num_steps=200 ...]     # overrides for every variant
      [--grid model.pos_emb=rope --variants NAME[,NAME]]   # only the variants picked
  python sweep.py run --grid model.pos_emb=rope,sinusoidal --grid model.norm_position=pre,post
      [--config configs/tiny.py] [--root runs/sweeps/grid-pos_emb-norm_position] [...]
      # a sweep without a file: every combination, the first --grid varying slowest
  python sweep.py status --root runs/sweeps/pos_norm
  python sweep.py report --root runs/sweeps/pos_norm [--baseline VARIANT]
      # report.md, report.csv (per run), report_summary.csv (per variant), PNGs
      [--from_csv]   # only the statistics, from report.csv: for a report whose runs are gone
  python sweep.py scaling --root runs/sweeps/ladder [--params params|params_non_embedding]
      [--holdout 'budget>=1e13'] [--resamples 1000] [--out runs/sweeps/ladder/scaling]
      [--starts 64] [--target_compute C] [--baseline VARIANT] [--bootstrap_seed 0]
      # scaling laws fitted to a ladder's finished runs (configs/sweeps/ladder.py,
      # docs/scaling.md): scaling.json, scaling.md and plots in --out; the fitting
      # flags are `python -m sweeps.scaling`'s (sweeps/scaling/cli.py)

Running `run` again resumes the unfinished variants and skips the done ones.
Locally, `run` says each run's start, its warnings, its result as it ends
(`[3/8] done ...`: state, step, val loss, wall time) with an ETA, and every
30 s of silence where the running runs are. Its exit status: 0 when every run
is done, 1 when one failed or stopped, 130 on Ctrl-C and 143 on SIGTERM
(passed on to the runs, which save first), 2 for a mistake on the command
line (one line, nothing written).
A variant whose workdir was trained with another config than the sweep now
asks for (another global flag, say) is `changed`: `run` refuses such a sweep;
use a new --root, or --rerun_changed to retrain those variants in place
(their old workdirs are kept as <name>.replaced<N>).
The library is sweeps/; SLURM details in docs/slurm.md.
"""
import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from configs.cli import parse_flags
from configs.errors import UserError
import sweeps as sweep_lib
from sweeps.common import command_exits
from sweeps.scaling import cli as scaling_cli
from sweeps.scaling import report as scaling_report
from training.workdir import describe_changes

_SWEEP = flags.DEFINE_string("sweep", None, "run: a configs/sweeps/*.py file.")
_GRID = flags.DEFINE_multi_string("grid", [], "run: field=v1,v2 (repeatable): without --sweep, "
                                  "every combination of the values is a variant (the first "
                                  "--grid varies slowest); with it, only the file's variants "
                                  "with one of the values.")
_VARIANTS = flags.DEFINE_multi_string("variants", [], "run, with --sweep: only the variants of "
                                      "these names (NAME[,NAME...], repeatable).")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "run: the base config (default: the sweep file's CONFIG; for --grid "
    f"without --sweep, {sweep_lib.DEFAULT_GRID_CONFIG}); --config.a.b=v for every variant.")
_ROOT = flags.DEFINE_string("root", None, "The sweep's directory (run: runs/sweeps/<name>, "
                            "the sweep file's NAME, or for --grid without --sweep "
                            "grid-<its fields>, e.g. grid-pos_emb-norm_position).")
_LAUNCHER = flags.DEFINE_enum("launcher", "local", ["local", "slurm"], "Where variants run.")
_PARALLEL = flags.DEFINE_integer("parallel", None, "Variants at once: local processes "
                                 "(default 1) or the SLURM array's %N.", lower_bound=1)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands (and the submitit "
                             "parameters and sbatch script); run nothing.")
_SEEDS = flags.DEFINE_integer("seeds", None, "run: train each variant N times, train.seed = "
                              "0..N-1, in <root>/<variant>,seed=<k> (default: the sweep's "
                              "SEEDS, else once).", lower_bound=1)
_FROM_CSV = flags.DEFINE_bool("from_csv", False, "report: recompute only the statistics "
                              "(report_summary.csv, report.md's statistics section) from "
                              "<root>/report.csv, for a report whose runs are gone.")
_RERUN_CHANGED = flags.DEFINE_bool("rerun_changed", False, "run: retrain the variants trained "
                                   "with another config in place (old workdirs set aside).")
# The fitting flags of `scaling`, one set with `python -m sweeps.scaling`'s
# (--params, --holdout, --resamples, --starts, --target_compute, --baseline,
# --bootstrap_seed, --out); --baseline is `report`'s too.
scaling_cli.define_flags(flags.FLAGS)
_NODES = flags.DEFINE_integer("nodes", 1, "SLURM: nodes per variant.")
_TASKS = flags.DEFINE_integer("tasks_per_node", 1, "SLURM: processes per node (1 per GPU).")
_GPUS = flags.DEFINE_integer("gpus_per_node", 1, "SLURM: GPUs per node.")
_CPUS = flags.DEFINE_integer("cpus_per_task", 8, "SLURM: CPUs per process.")
_MEM = flags.DEFINE_integer("mem_gb", 0, "SLURM: memory per node, GB (0: the cluster's "
                            "default).", lower_bound=0)
_TIMEOUT = flags.DEFINE_integer("timeout_min", 240, "SLURM: time limit of a job, minutes.")
_PARTITION = flags.DEFINE_string("partition", None, "SLURM: partition.")
_ACCOUNT = flags.DEFINE_string("account", None, "SLURM: account to charge.")
_SETUP = flags.DEFINE_multi_string("slurm_setup", [], "SLURM: shell line before srun.")
_MAX_TIMEOUTS = flags.DEFINE_integer("max_timeouts", 3, "SLURM: requeues after time-outs "
                                     "(preemptions: always requeued).")


# The flags only some commands read; given to another, they are refused.
_OWN_FLAGS = {"seeds": ("run",), "parallel": ("run",), "dry_run": ("run",),
              "rerun_changed": ("run",), "from_csv": ("report",),
              **{name: ("scaling",) for name in scaling_cli.NAMES},
              "baseline": ("report", "scaling")}


def _check_own_flags(command: str) -> None:
  """UserError for a flag of other commands (`_OWN_FLAGS`) given to `command`."""
  for name, owners in _OWN_FLAGS.items():
    if command not in owners and flags.FLAGS[name].present:
      owned = " or ".join(f"`sweep.py {owner}`" for owner in owners)
      raise UserError(f"--{name} is a flag of {owned}, not of {command}; drop it")


def _parse(argv: list[str]) -> list[str]:
  """parse_flags, with the sweep's CONFIG as the default --config; main also gets
  the --config.* overrides, to hand them on to train.py."""
  try:
    argv = sweep_lib.with_default_config(argv)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  return parse_flags(argv) + [arg for arg in argv if arg.startswith("--config.")]


def _sweep(config: str) -> tuple[sweep_lib.Sweep, list[str] | None]:
  """The sweep of --sweep or --grid, and the names of the variants that
  --grid and --variants pick from a sweep file (None: all)."""
  if _SWEEP.value is None:
    if _VARIANTS.value:
      raise UserError("--variants picks variants of a --sweep file; with --grid alone, give "
                      "only the values to run")
    return sweep_lib.grid_sweep(_GRID.value, config), None
  sweep = sweep_lib.load_sweep(_SWEEP.value)
  if not (_GRID.value or _VARIANTS.value):
    return sweep, None
  picked = sweep_lib.select(sweep, _GRID.value, _VARIANTS.value, config)
  print(f"{len(picked)} of the {len(sweep.overrides)} variants of {sweep.where}: "
        + ", ".join(picked))
  return sweep, picked


def run(overrides: list[str]) -> int:
  if _SWEEP.value is None and not _GRID.value:
    raise UserError("run needs --sweep (a configs/sweeps/*.py file) or --grid field=v1,v2")
  if _CONFIG.value is None:
    raise UserError("run needs --config (or CONFIG in the sweep file)")
  config = config_flags.get_config_filename(flags.FLAGS["config"])
  sweep, picked = _sweep(config)
  root = _ROOT.value or os.path.join("runs", "sweeps", sweep.name)
  seeds = _SEEDS.value or sweep.seeds
  sweep_lib.check_seeds(root, seeds)
  every = sweep_lib.make_variants(sweep, config, overrides, root, seeds)
  # The manifest holds every variant of the sweep (status and report show
  # them all); a part picked by --grid or --variants is what runs now.
  variants = every if picked is None else [v for v in every if v.group in picked]
  for line in sweep_lib.few_points(variants):
    print(line, file=sys.stderr)
  changed = [(v, sweep_lib.changed_fields(v)) for v in variants]
  changed = [(v, c) for v, c in changed if c]
  if changed and not _DRY_RUN.value:
    if not _RERUN_CHANGED.value:
      sweep_lib.write_manifest(root, sweep, config, overrides, every, seeds)
      first, fields = changed[0]
      raise UserError(
          f"{len(changed)} variant(s) in {root} were trained with another config than this "
          f"sweep asks for ({first.name}: {describe_changes(fields)}); use a new "
          "--root, or --rerun_changed to retrain them in place (old workdirs kept as "
          "<name>.replaced<N>)")
    for variant, _ in changed:
      print(f"rerun {variant.name}: its old workdir moved to {sweep_lib.set_aside(variant)}")
  todo = sweep_lib.unfinished(variants)
  folder, params = os.path.join(root, "slurm"), sweep_lib.slurm_parameters(
      sweep.name, nodes=_NODES.value, tasks_per_node=_TASKS.value, gpus_per_node=_GPUS.value,
      cpus_per_task=_CPUS.value, timeout_min=_TIMEOUT.value, partition=_PARTITION.value,
      account=_ACCOUNT.value, parallel=_PARALLEL.value, setup=_SETUP.value, mem_gb=_MEM.value)
  if _DRY_RUN.value:
    print("\n".join(sweep_lib.describe(todo)))
    if _LAUNCHER.value == "slurm":
      print(sweep_lib.slurm_preview(params, folder, len(todo), _MAX_TIMEOUTS.value))
    return 0
  if _LAUNCHER.value == "slurm" and todo:
    sweep_lib.check_fits(params)
  sweep_lib.write_manifest(root, sweep, config, overrides, every, seeds)
  if not todo:
    print(f"every run is done; the report: python sweep.py report --root {root}")
    return 0
  if _LAUNCHER.value == "local":
    not_done = sweep_lib.run_local(todo, _PARALLEL.value or 1)
    print(f"status: python sweep.py status --root {root}; report: python sweep.py report "
          f"--root {root}")
    return 1 if not_done else 0
  for job, variant in zip(sweep_lib.submit_slurm(todo, folder, params, _MAX_TIMEOUTS.value), todo):
    print(f"submitted {job.job_id}  {variant.name}")
  print(f"job files and logs in {folder}; follow with: python sweep.py status --root {root}")
  return 0


def scaling() -> None:
  """Fits the laws to the sweep's finished runs; prints the exponents, the
  flags, what was fitted and the time."""
  start = time.perf_counter()
  out = flags.FLAGS.out or os.path.join(_ROOT.value, "scaling")
  result, paths, unfinished = sweep_lib.fit_sweep(_ROOT.value, out,
                                                  flags.FLAGS.params or "params",
                                                  **scaling_cli.fit_options(flags.FLAGS))
  print("\n".join(scaling_report.summary(result)))
  held = int(result.runs.held_out.sum())
  if unfinished:
    print(f"left out {unfinished} unfinished run(s); `python sweep.py status --root "
          f"{_ROOT.value}` says where they stand")
  print(f"fitted {len(result.runs.n) - held} runs ({held} held out), {result.resamples} "
        f"resamples, in {time.perf_counter() - start:.1f} s; wrote {', '.join(paths)}")


def main(argv):
  commands = [arg for arg in argv[1:] if not arg.startswith("--config.")]
  overrides = argv[1 + len(commands):]
  if len(commands) != 1 or commands[0] not in ("run", "status", "report", "scaling"):
    raise app.UsageError("give one command: run, status, report or scaling")
  if overrides and commands[0] != "run":
    raise app.UsageError(f"{commands[0]} takes no --config.* overrides")
  with command_exits("variants"):
    _check_own_flags(commands[0])
    if commands[0] != "run" and (_GRID.value or _VARIANTS.value):
      raise UserError(f"{commands[0]} takes no --grid or --variants (flags of run); give "
                      "--root")
    if commands[0] == "run":
      sys.exit(run(overrides))
    if _ROOT.value is None:
      raise UserError(f"{commands[0]} needs --root (the sweep's directory)")
    if commands[0] == "status":
      print("\n".join(sweep_lib.status_lines(_ROOT.value)))
    elif commands[0] == "scaling":
      scaling()
    else:
      write = sweep_lib.rebuild_statistics if _FROM_CSV.value else sweep_lib.write_report
      print("wrote " + ", ".join(write(_ROOT.value, flags.FLAGS.baseline)))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse)
