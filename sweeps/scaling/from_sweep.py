"""A sweep's runs as a scaling law's rows: `sweep.py scaling --root R`.

Each finished run of a ladder (configs/sweeps/ladder.py, or any sweep whose
runs set train.flop_budget) is a row: N (its parameters, with or without
embeddings), D (the tokens it trained on), the loss (eval.py's, on the whole
validation split), C (its train.flop_budget), its seed and its variant.
The per-run figures are report.csv's (`sweeps/report.py`), read off the runs
themselves. A run's variant is its sweep overrides less the budget and
SIZE_FIELDS, named as sweep variants are (`pos_emb=rope`; `base` for none).
"""
import os

from configs.errors import UserError
from sweeps import report
from sweeps.scaling.report import write_scaling
from sweeps.scaling.bootstrap import Result
from sweeps.state import read_manifest
from sweeps.sweep_file import variant_name

PARAMS = ("params", "params_non_embedding")
# The fields a ladder sizes its models with; any other override names a variant.
SIZE_FIELDS = ("model.d_model", "model.d_ff", "model.num_layers", "model.num_heads")
BUDGET = "train.flop_budget"


def sweep_rows(root: str) -> tuple[list[dict], int]:
  """The rows of `root`'s finished runs, and how many runs are not finished."""
  _, runs = read_manifest(root)
  rows, unfinished = [], 0
  for run in runs:
    budget = run.config["train"]["flop_budget"]
    if not budget:
      raise UserError(f"run {run.name} of {root} trains without train.flop_budget; "
                      "sweep.py scaling fits runs at FLOP budgets (a ladder: "
                      "configs/sweeps/ladder.py)")
    row = report._run_row(run, [])  # pylint: disable=protected-access  # report.csv's row
    if row["state"] != "done" or row["loss"] is None:
      unfinished += 1
      continue
    variant = {f: v for f, v in run.overrides.items() if f != BUDGET and f not in SIZE_FIELDS}
    rows.append({"params": row["params"], "params_non_embedding": row["params_non_embedding"],
                 "tokens": row["tokens"], "loss": row["loss"], "budget": budget,
                 "seed": row["seed"], "variant": variant_name(variant)})
  return rows, unfinished


def fit_sweep(root: str, out: str, params: str = "params", **options
              ) -> tuple[Result, list[str], int]:
  """Fits the laws to `root`'s finished runs and writes them into `out`: the
  analysis, the paths written and how many runs were left out unfinished.
  `options`: `write_scaling`'s holdout, resamples, starts, target, baseline,
  bootstrap_seed (sweeps/scaling/cli.fit_options)."""
  if params not in PARAMS:
    raise UserError(f"--params {params}: give one of {', '.join(PARAMS)}")
  if os.path.exists(out) and not os.path.isdir(out):
    raise UserError(f"--out {out} is a file; give a directory")
  rows, unfinished = sweep_rows(root)
  if not rows:
    raise UserError(f"no run of {root} is finished ({unfinished} not); run the sweep first: "
                    f"python sweep.py run ... --root {root}")
  result, paths = write_scaling(rows, out, params=params, tokens="tokens", loss="loss",
                                budget="budget", seed="seed", variant="variant", **options)
  return result, paths, unfinished
