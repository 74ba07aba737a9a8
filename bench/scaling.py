"""Speed of sweeps.scaling: the whole analysis against runs and resamples, and
the parametric fit from the grid's best starts against all 4,500.

  python -m bench.scaling [--ladders 7x9 9x14 12x21 16x32] [--resamples 100 1000]
      [--grid_noise 0.01 0.05] [--coverage DRAWS] [--out bench/results/scaling.json]

Each ladder BxS is B budgets from 1e18 to 1e21 FLOPs with S sizes each, one
run per size, drawn from sweeps/scaling/synthetic.py's law with 1% noise.
`analyse` (both fits, every resample's refits, the intervals; no files) is
timed once per ladder and resample count: wall seconds, this process's CPU
seconds, and the parametric fit's share (the grid fit and the refits).
Then, per noise level, the parametric fit of a 7x9 ladder from the grid's
64 best points and from all of Hoffmann's 4,500: both objectives, the
largest parameter difference, the times. The machine's load average is
recorded beside them: timings on a shared machine vary with it.

`--coverage DRAWS` (default 0: skipped) also counts, over that many draws of
a 7x7 ladder (its largest budget held out), how often each 95% interval
(1000 resamples) holds the true value, and how many held-out runs fall
inside their 95% prediction intervals.
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import time

import numpy as np

from bench.bench_utils import command_line, git_commit
from sweeps.scaling import bootstrap, fit, synthetic
from sweeps.scaling.runs import make_runs
from training import hardware


def _runs(budgets: int, sizes: int, sigma: float, seed: int):
  rows = synthetic.ladder(np.random.default_rng(seed), budgets=np.logspace(18, 21, budgets),
                          sizes=sizes, sigma=sigma)
  return make_runs(rows, params="params", tokens="tokens", loss="loss", budget="budget")


def time_analysis(ladder: str, resamples: int) -> dict:
  """One `analyse` of a BxS ladder with `resamples` resamples, timed."""
  budgets, sizes = map(int, ladder.split("x"))
  runs = _runs(budgets, sizes, 0.01, 0)
  wall, cpu = time.perf_counter(), time.process_time()
  f = bootstrap.analyse(runs, resamples=resamples).fits[0]
  return {"ladder": ladder, "runs": len(runs.n), "resamples": resamples,
          "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
          "grid_fit_s": f.law["seconds"], "refits_s": f.law["refit_seconds"],
          "load": os.getloadavg()[0]}


def compare_grid(sigma: float) -> dict:
  """The fit from the grid's 64 best points against all 4,500, on one ladder."""
  runs = _runs(7, 9, sigma, 1)
  args = (np.log(runs.n), np.log(runs.d), np.log(runs.loss))
  out = {"noise": sigma, "runs": len(runs.n)}
  fits = {}
  for starts in (64, len(fit.hoffmann_grid())):
    wall = time.perf_counter()
    fits[starts] = fit.fit_law(*args, starts)
    out[f"seconds_{starts}"] = time.perf_counter() - wall
    out[f"objective_{starts}"] = fits[starts]["objective"]
    out[f"reached_{starts}"] = fits[starts]["reached"]
  few, every = fits.values()
  out["objective_ratio"] = few["objective"] / every["objective"]
  out["max_parameter_difference"] = float(np.abs(few["theta"] - every["theta"]).max())
  out["load"] = os.getloadavg()[0]
  return out


def coverage(draws: int) -> dict:
  """How often each 95% interval holds the truth over `draws` synthetic draws."""
  truth = {**synthetic.TRUTH, "a": 0.28 / 0.62, "b": 0.34 / 0.62, "isoflop a": 0.28 / 0.62}
  hits = dict.fromkeys([*truth, "N_opt at target", "loss at target"], 0)
  held = inside = 0
  for i in range(draws):
    rows = synthetic.ladder(np.random.default_rng(100 + i), sizes=7)
    runs = make_runs(rows, params="params", tokens="tokens", loss="loss", budget="budget",
                     holdout="budget>=1e21")
    f = bootstrap.analyse(runs, resamples=1000, seed=i).fits[0]
    n_opt, _, loss = fit.frontier(synthetic.THETA, [f.frontier[-1]["C"]])
    values = {**{k: (f.estimates[k], v) for k, v in truth.items()},
              "N_opt at target": (f.frontier[-1]["N_opt"], n_opt[0]),
              "loss at target": (f.frontier[-1]["loss"], loss[0])}
    for key, (e, value) in values.items():
      hits[key] += int(e["low"] <= value <= e["high"])
    held += len(f.held_out)
    inside += sum(not row["outside"] for row in f.held_out)
  return {"draws": draws, "covered": hits, "held_out": held, "held_out_inside": inside}


def main(argv=None) -> dict:
  """Runs the measurements, prints the tables, writes --out; returns the report."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ladders", nargs="*", default=["7x9", "9x14", "12x21", "16x32"],
                      help="BxS: B budgets of S sizes (none: skip)")
  parser.add_argument("--resamples", nargs="+", type=int, default=[100, 1000])
  parser.add_argument("--grid_noise", nargs="*", type=float, default=[0.01, 0.05],
                      help="noise levels of the 64-versus-4,500-starts comparison (none: skip)")
  parser.add_argument("--coverage", type=int, default=0, help="draws of the coverage count "
                      "(0: skip)")
  parser.add_argument("--out", type=pathlib.Path, help="write JSON here")
  args = parser.parse_args(argv)
  meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "commit": git_commit(), "command": command_line(), "cpu": hardware.cpu_model(),
          "usable_cpus": hardware.usable_cpus(), "python": platform.python_version()}
  print(f"# sweeps.scaling speed: {meta['cpu']}, {meta['usable_cpus']} usable CPUs, commit "
        f"{meta['commit']}, {meta['date']}\n")
  report = {"meta": meta, "analysis": [], "grid": []}
  if args.ladders:
    print("| ladder | runs | resamples | wall s | CPU s | grid fit s | refits s | load |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
  for ladder in args.ladders:
    for resamples in args.resamples:
      row = time_analysis(ladder, resamples)
      report["analysis"].append(row)
      print(f"| {ladder} | {row['runs']} | {resamples} | {row['wall_s']:.1f} | "
            f"{row['cpu_s']:.1f} | {row['grid_fit_s']:.2f} | {row['refits_s']:.1f} | "
            f"{row['load']:.1f} |", flush=True)
  if args.grid_noise:
    print("\n| noise | runs | objective (64) / (4,500) | largest parameter difference | "
          "s (64) | s (4,500) | load |\n|---:|---:|---:|---:|---:|---:|---:|", flush=True)
  for sigma in args.grid_noise:
    row = compare_grid(sigma)
    report["grid"].append(row)
    print(f"| {sigma:g} | {row['runs']} | {row['objective_ratio']:.12f} | "
          f"{row['max_parameter_difference']:.2g} | {row['seconds_64']:.2f} | "
          f"{row['seconds_4500']:.1f} | {row['load']:.1f} |", flush=True)
  if args.coverage:
    report["coverage"] = coverage(args.coverage)
    c = report["coverage"]
    print(f"\n| estimate | 95% intervals holding the truth, of {args.coverage} draws |\n"
          "|---|---:|")
    for key, hits in c["covered"].items():
      print(f"| {key} | {hits} ({hits / args.coverage:.0%}) |")
    print(f"| held-out runs inside their prediction interval | {c['held_out_inside']} of "
          f"{c['held_out']} ({c['held_out_inside'] / c['held_out']:.1%}) |", flush=True)
  if args.out:
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
  return report


if __name__ == "__main__":
  main()
