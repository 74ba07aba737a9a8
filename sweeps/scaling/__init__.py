"""Scaling laws fitted to runs: `python -m sweeps.scaling` for a CSV,
`report.write_scaling` for rows from Python (a sweep's runs; docs/scaling.md).

From runs of several sizes N trained on D tokens (at isoFLOP budgets C,
where they form them), two fits of Hoffmann et al. (2022): approach 2, a parabola of the loss
in ln N per budget and power laws N_opt ∝ C^a, D_opt ∝ C^b through their
minima; approach 3, L(N, D) = E + A/N^α + B/D^β by Huber regression on the
log loss, and the compute-optimal frontier it implies. Every estimate has a
95% bootstrap interval; held-out runs are predicted with 95% prediction
intervals; variants are compared by their laws.

One module per job:
  runs.py       rows -> `Runs`: columns checked, budgets grouped, rows held out
  fit.py        the fits (isoFLOP parabolas, power laws, the parametric law, its frontier)
  bootstrap.py  the resampling, every estimate's interval, the variants' differences
  report.py     scaling.json, scaling.md, written all or nothing; `write_scaling`
  cli.py        the fitting flags both commands share, and the summary they print
  plots.py      isoflop.png, compute.png, predicted.png
  synthetic.py  runs drawn from a known law (the tests, bench/scaling.py)
  __main__.py   the command line
  from_sweep.py a sweep's finished runs as rows (`sweep.py scaling`)

Nothing is imported with the package: `python -m sweeps.scaling --help`
answers without numpy's fits, scipy or matplotlib.
"""
