"""Ablation sweeps: named variants of a config, run locally or on SLURM, reported.

A sweep file (`configs/sweeps/*.py`) defines `get_sweep()`, returning either a
grid, `{"model.pos_emb": ["none", "rope"], "model.norm_position": ["pre",
"post"]}` (every combination; the first field varies slowest), or a list of
override dicts (one variant each). It may also set `NAME` (default: the file's
name), `CONFIG` (the base config used when `--config` is not given) and
`SEEDS` (runs per variant; `sweep.py run --seeds N` overrides it). A grid
may be given on the command line instead (`sweep.py run --grid
model.pos_emb=none,rope --grid ...`: a `Sweep` without a file, named
`grid-<fields>`), and `--grid`/`--variants` beside a file pick a part of it.

Each variant is named after its overrides (`pos_emb=rope,norm_position=pre`)
and is two commands run in `<root>/<name>`: `train.py` (which resumes from the
workdir) and, once training has reached `train.num_steps`, `eval.py`. With
seeds each variant is N runs, train.seed = k in `<root>/<name>,seed=<k>`
(a `Variant` each, the unit of status, resume and SLURM array tasks). Every
variant's config is resolved and validated exactly as train.py will do it
before anything starts. Running a sweep again skips the finished variants and
resumes the others; a variant whose workdir was trained with another config
than the sweep now asks for is `changed` (never `done`), and `run` refuses
the sweep unless told to retrain such variants in place (see sweep.py).
train.py's exit status says how a run ended: 0 finished, 130 or 143 (saved
on SIGINT or SIGTERM) stopped, to be resumed, anything else failed.

`<root>/sweep.json`               the variants and their commands (written by run)
`<root>/<name>/sweep.log`         the output of the variant's train.py and eval.py
`<root>/<name>/sweep_error.json`  the failed command and its last line of output
`<root>/<name>/sweep_times.jsonl` per command run: wall and CPU seconds, host, XLA threads
`<root>/slurm/`                   submitit's job files and logs
`<root>/report.md`, `report.csv` (per run), `report_summary.csv` (per variant),
`validation_curves.png`, `curves/<name>.png`

One module per job:
  sweep_file.py  sweep files: loading, expansion, variant names
  grid.py        --grid and --variants: a sweep from the command line, a part of a file's
  variants.py    config parsing and validation: `Variant` and its commands
  state.py       the manifest and where each variant stands (status)
  jobs.py        running a variant (`VariantJob`), exit statuses, the local launcher
  console.py     the local launcher's lines: results, ETA, progress, the runs' warnings
  slurm.py       submitit parameters, the sbatch preview, the fit to the cluster
  report.py      report.md, report.csv, report_summary.csv and the plots
  stats.py       the statistics over seeds: intervals, Welch's and the paired test, Holm
  ladder.py      a scaling ladder's cells, from a sweep file's declarative LADDER
  scaling/       scaling laws fitted to any runs (from_sweep.py: `sweep.py scaling`)

The names below are imported on first use (`sweeps.load_sweep` loads
sweep_file.py then), not with the package: `python -m sweeps.scaling`, a
numpy job, imports this package first and must not load JAX, which
state.py, jobs.py and report.py pull in through training/.
"""
import importlib

_EXPORTS = {
    "sweeps.common": ("Terminated", "command_exits"),
    "sweeps.console": ("Console",),
    "sweeps.jobs": ("STOP_TIMEOUT_S", "VariantFailed", "VariantJob", "run_local"),
    "sweeps.report": ("rebuild_statistics", "write_report"),
    "sweeps.slurm": ("check_fits", "slurm_parameters", "slurm_preview", "submit_slurm"),
    "sweeps.state": ("State", "changed_fields", "check_seeds", "read_manifest", "read_times",
                     "set_aside", "status_lines", "unfinished", "variant_state",
                     "write_manifest"),
    "sweeps.grid": ("grid_sweep", "parse_grid", "select"),
    "sweeps.sweep_file": ("DEFAULT_GRID_CONFIG", "Sweep", "expand", "format_value",
                          "load_sweep", "variant_name", "with_default_config"),
    "sweeps.variants": ("Variant", "describe", "few_points", "load_config", "make_variants"),
    "sweeps.scaling.from_sweep": ("fit_sweep", "sweep_rows"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
  """A name of _EXPORTS, imported from its module on first use (PEP 562)."""
  if name not in _MODULE_OF:
    raise AttributeError(f"module 'sweeps' has no attribute {name!r}")
  return getattr(importlib.import_module(_MODULE_OF[name]), name)
