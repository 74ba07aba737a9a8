"""Scaling laws fitted to ladders of runs: `python -m sweeps.scaling` for a CSV,
`write_scaling` for a sweep's runs (docs/scaling.md).

From runs of several sizes N trained on D tokens at several isoFLOP budgets
C, two fits of Hoffmann et al. (2022): approach 2, a parabola of the loss
in ln N per budget and power laws N_opt ∝ C^a, D_opt ∝ C^b through their
minima; approach 3, L(N, D) = E + A/N^α + B/D^β by Huber regression on the
log loss, and the compute-optimal frontier it implies. Every estimate has a
95% bootstrap interval; held-out runs are predicted with 95% prediction
intervals; variants are compared by their laws.

One module per job:
  runs.py       rows -> `Runs`: columns checked, budgets grouped, rows held out
  fit.py        the fits (isoFLOP parabolas, power laws, the parametric law, its frontier)
  bootstrap.py  the resampling, every estimate's interval, the variants' differences
  report.py     scaling.json, scaling.md, written all or nothing
  plots.py      isoflop.png, compute.png, predicted.png
  synthetic.py  runs drawn from a known law (the tests, bench/scaling.py)
  __main__.py   the command line
  from_sweep.py a sweep's finished runs as rows (`sweep.py scaling`; not imported here)
"""
from sweeps.scaling.bootstrap import Result, analyse
from sweeps.scaling.report import write
from sweeps.scaling.runs import Runs, make_runs, read_csv


def write_scaling(rows: list[dict], out_dir: str, *, params: str, tokens: str, loss: str,
                  budget: str | None = None, seed: str | None = None,
                  variant: str | None = None, holdout: str | None = None,
                  resamples: int = 1000, starts: int = 64, target: float | None = None,
                  baseline: str | None = None, bootstrap_seed: int = 0
                  ) -> tuple[Result, list[str]]:
  """Fits `rows` (dicts of column -> value; the arguments name the columns,
  see `make_runs` and `analyse`) and writes the report into `out_dir`:
  the analysis and the paths written. Bad rows raise UserError before
  anything is written."""
  runs = make_runs(rows, params=params, tokens=tokens, loss=loss, budget=budget, seed=seed,
                   variant=variant, holdout=holdout)
  result = analyse(runs, resamples=resamples, starts=starts, target=target, baseline=baseline,
                   seed=bootstrap_seed)
  return result, write(result, out_dir)
