"""A scaling analysis written out: scaling.json (every estimate, interval and
flag), scaling.md (the same as tables), and the plots, all or nothing.

Every file is written into a temporary directory inside the output
directory first and moved into place once all are written: an error
leaves the files of the last good analysis, never a half-written one.
"""
import json
import os
import shutil
import tempfile

import numpy as np

from sweeps.scaling import bootstrap, fit, plots
from sweeps.scaling.bootstrap import Result

FILES = ("scaling.json", "scaling.md", "isoflop.png", "compute.png", "predicted.png")
FLOP_MODEL = ("approach 3's frontier counts C = 6·N·D (Hoffmann et al.), N as the fit counts "
              "it; approach 2's power laws and the target are in the budgets' own units")
_SYMBOLS = {"E": "E", "A": "A", "B": "B", "alpha": "α", "beta": "β", "a": "a = β/(α+β)",
            "b": "b = α/(α+β)"}


def _num(x: float | None, digits: int = 4) -> str:
  return "–" if x is None else f"{x:.{digits}g}"


def format_estimate(e: dict, digits: int = 4, resamples: int | None = None) -> str:
  """`value [low, high]`, with the count of resamples where it is short of all."""
  text = _num(e["value"], digits)
  if e["low"] is not None:
    text += f" [{_num(e['low'], digits)}, {_num(e['high'], digits)}]"
  if resamples is not None and e["resamples"] < resamples:
    text += f" ({e['resamples']} of {resamples} resamples)"
  return text


def flags(result: Result) -> list[str]:
  """Every flagged budget and every held-out run outside its interval, one line each."""
  lines = []
  for f in result.fits:
    for row in f.budgets:
      if row["flag"]:
        lines.append(f"variant {f.name}, budget {row['budget']:.3g}: {row['flag']}; left out "
                     "of the power laws")
    for row in f.held_out:
      if row["outside"]:
        p = row["predicted"]
        lines.append(f"variant {f.name}, held-out run N={row['N']:.3g} D={row['D']:.3g}: "
                     f"measured {row['loss']:.4g} outside its 95% prediction interval "
                     f"[{p['low']:.4g}, {p['high']:.4g}]")
  return lines


def _budget_ratio(result: Result) -> str:
  ratio = result.runs.budget / (6 * result.runs.n * result.runs.d)
  return (f"budget / (6·N·D): median {np.median(ratio):.3g} over the runs (from "
          f"{ratio.min():.3g} to {ratio.max():.3g})")


def _variant_section(f: bootstrap.VariantFit, result: Result) -> list[str]:
  r = result.resamples
  law = f.law
  held = int(f.runs.held_out.sum())

  def est(e: dict, digits: int = 4) -> str:
    return format_estimate(e, digits, r)

  lines = ["", f"## Variant `{f.name}`", "",
           f"{len(f.runs.n) - held} fitted runs, {held} held out.", "",
           "### Approach 3: L(N, D) = E + A/N^α + B/D^β", "",
           "| parameter | estimate [95% interval] |", "|---|---|"]
  lines += [f"| {_SYMBOLS[k]} | {est(f.estimates[k])} |" for k in bootstrap.PARAMETRIC]
  lines += ["", f"Huber (δ = {fit.DELTA:g}) on ln loss, L-BFGS-B from the {law['starts']} "
            f"best of Hoffmann's {len(fit.hoffmann_grid()):,} grid points: {law['reached']} "
            f"reached the optimum (objective {law['objective']:.6g}); "
            f"{len(law['optima']) - 1} rival optima (within {fit.RIVAL - 1:.0%} of it); each "
            f"resample refitted from {law['refit_starts']} start(s). Log-residual sd "
            f"{f.residual_sd:.4g} (the scatter of the prediction intervals)."]
  lines += ["", "### Approach 2: isoFLOP parabolas", "",
            "| budget C | runs | sizes | N from–to | N_opt [95%] | D_opt [95%] | loss at N_opt "
            "| usable in resamples | flag |", "|---:|---:|---:|---|---|---|---|---:|---|"]
  for row in f.budgets:
    lines.append(f"| {row['budget']:.3g} | {row['runs']} | {row['sizes']} | "
                 f"{row['smallest']:.3g}–{row['largest']:.3g} | "
                 f"{format_estimate(row['N_opt'], 3)} | {format_estimate(row['D_opt'], 3)} | "
                 f"{format_estimate(row['loss_opt'])} | {row['N_opt']['resamples']} of {r} | "
                 f"{row['flag'] or 'usable'} |")
  usable = sum(row["usable"] for row in f.budgets)
  e = f.estimates
  lines += ["", f"Power laws over the {usable} usable budget(s): N_opt = k_N C^a with a = "
            f"{est(e['isoflop a'])}, k_N = {est(e['isoflop k_N'], 3)}; D_opt = k_D C^b with "
            f"b = {est(e['isoflop b'])}, k_D = {est(e['isoflop k_D'], 3)}. D_opt is "
            "interpolated in ln N between the budget's own runs."]
  lines += ["", "### Compute-optimal frontier", "",
            "| C | N_opt (3) | D_opt (3) | loss (3) | N_opt (2) | D_opt (2) |",
            "|---:|---|---|---|---|---|"]
  for k, row in enumerate(f.frontier):
    name = f"**{row['C']:.3g}** (target)" if k == len(f.frontier) - 1 else f"{row['C']:.3g}"
    lines.append(f"| {name} | {est(row['N_opt'], 3)} | {est(row['D_opt'], 3)} | "
                 f"{est(row['loss'])} | {est(row['isoflop N_opt'], 3)} | "
                 f"{est(row['isoflop D_opt'], 3)} |")
  if f.held_out:
    outside = [row for row in f.held_out if row["outside"]]
    lines += ["", "### Held-out runs", "",
              "| N | D | budget | seed | measured | predicted [95% prediction interval] | |",
              "|---:|---:|---:|---|---:|---|---|"]
    lines += [f"| {row['N']:.3g} | {row['D']:.3g} | {row['budget']:.3g} | {row['seed']} | "
              f"{row['loss']:.4g} | {format_estimate(row['predicted'])} | "
              f"{'**outside**' if row['outside'] else 'inside'} |" for row in f.held_out]
    lines += ["", f"**{len(outside)} of {len(f.held_out)} held-out runs fall outside their 95% "
              f"prediction interval** ({(1 - bootstrap.LEVEL) * len(f.held_out):.1g} expected by "
              "chance where the law holds)."]
  return lines


def markdown(result: Result) -> str:
  """scaling.md: the analysis as tables."""
  runs = result.runs
  held = int(runs.held_out.sum())
  variants = ", ".join(f"`{f.name}`" for f in result.fits)
  lines = ["# Scaling laws", "",
           f"- Runs: {len(runs.n) - held} fitted, {held} held out; variants: {variants}.",
           f"- N: the column `{runs.params}` (with embeddings is Chinchilla's count, without "
           "is Kaplan's).",
           f"- Budgets: {runs.budget_from}; {_budget_ratio(result)}.",
           f"- FLOP model: {FLOP_MODEL}. Target compute {result.target:.3g}.",
           f"- Intervals: 95% percentile bootstrap over {result.resamples} resamples (cells "
           "resampled within budgets, seeds within cells; docs/scaling.md), seed "
           f"{result.seed}.",
           f"- Time: {result.seconds:.1f} s ("
           + "; ".join(f"{f.name}: grid fit {f.law['seconds']:.1f} s, refits "
                       f"{f.law['refit_seconds']:.1f} s" for f in result.fits) + ").",
           "", "## Flags", ""]
  lines += [f"- {line}" for line in flags(result)] or ["None: every parabola is convex with its "
                                                       "minimum inside its sizes, every held-out "
                                                       "run inside its interval."]
  for f in result.fits:
    lines += _variant_section(f, result)
  if result.comparisons:
    base = result.comparisons[0]["baseline"]
    keys = bootstrap.COMPARED
    lines += ["", f"## Variants against `{base}`", "",
              f"Each difference is the variant minus `{base}` with its 95% interval (resamples "
              f"paired by index); * where the interval excludes 0. Loss: on each law's frontier "
              f"at C = {result.target:.3g}.", "",
              "| variant | " + " | ".join(f"Δ {k}" for k in keys) + " |",
              "|---|" + "---|" * len(keys)]
    for c in result.comparisons:
      lines.append(f"| {c['variant']} | " + " | ".join(
          format_estimate(c[k], 3) + (" *" if c[k]["excludes_zero"] else "") for k in keys) + " |")
  lines += ["", "Plots: `isoflop.png` (each budget's runs and parabola), `compute.png` (loss "
            "against 6·N·D with the frontier and its 95% band), `predicted.png` (predicted "
            "against measured loss, held-out runs highlighted)."]
  return "\n".join(lines) + "\n"


def _variant_json(f: bootstrap.VariantFit) -> dict:
  law = f.law
  held = int(f.runs.held_out.sum())
  return {
      "runs_fitted": len(f.runs.n) - held, "runs_held_out": held,
      "parametric": {k: f.estimates[k] for k in bootstrap.PARAMETRIC},
      "parametric_fit": {"starts": law["starts"], "reached_optimum": law["reached"],
                         "rival_optima": len(law["optima"]) - 1, "objective": law["objective"],
                         "refit_starts": law["refit_starts"], "seconds": law["seconds"],
                         "refit_seconds": law["refit_seconds"],
                         "log_residual_sd": f.residual_sd,
                         "theta": dict(zip(fit.NAMES, map(float, law["theta"])))},
      "isoflop": {"budgets": f.budgets,
                  **{k: f.estimates[f"isoflop {k}"] for k in ("a", "b", "k_N", "k_D")}},
      "frontier": f.frontier, "held_out": f.held_out}


def to_json(result: Result) -> dict:
  """scaling.json: every estimate ({value, low, high, resamples}), flag and setting."""
  return {"params": result.runs.params, "budget_from": result.runs.budget_from,
          "flop_model": FLOP_MODEL, "target_compute": result.target, "level": bootstrap.LEVEL,
          "resamples": result.resamples, "grid_starts": result.starts, "seed": result.seed,
          "seconds": result.seconds, "flags": flags(result),
          "variants": {f.name: _variant_json(f) for f in result.fits},
          "comparisons": result.comparisons}


def write(result: Result, out_dir: str) -> list[str]:
  """Writes every file of FILES into `out_dir` (created if missing), all or
  nothing (the module docstring); their paths."""
  os.makedirs(out_dir, exist_ok=True)
  stage = tempfile.mkdtemp(prefix=".scaling-", dir=out_dir)
  try:
    with open(os.path.join(stage, "scaling.json"), "w", encoding="utf-8") as f:
      json.dump(to_json(result), f, indent=2, sort_keys=True)
    with open(os.path.join(stage, "scaling.md"), "w", encoding="utf-8") as f:
      f.write(markdown(result))
    plots.plot_isoflop(os.path.join(stage, "isoflop.png"), result)
    plots.plot_compute(os.path.join(stage, "compute.png"), result)
    plots.plot_predicted(os.path.join(stage, "predicted.png"), result)
    for name in FILES:
      os.replace(os.path.join(stage, name), os.path.join(out_dir, name))
  finally:
    shutil.rmtree(stage, ignore_errors=True)
  return [os.path.join(out_dir, name) for name in FILES]
