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
from sweeps.scaling.runs import make_runs

FILES = ("scaling.json", "scaling.md", "isoflop.png", "compute.png", "predicted.png")
_SYMBOLS = {"E": "E", "A": "A", "B": "B", "alpha": "α", "beta": "β", "a": "a = β/(α+β)",
            "b": "b = α/(α+β)"}


def _num(x: float | None, digits: int = 4) -> str:
  return "–" if x is None else f"{x:.{digits}g}"


def format_estimate(e: dict, digits: int = 4, resamples: int | None = None) -> str:
  """`value [low, high]`, with the count of resamples where it is short of all;
  `value (not identified)` for an estimate the runs do not pin down."""
  text = _num(e["value"], digits)
  if e.get("identified") is False:
    return f"{text} (not identified: no interval)"
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


def flop_model(result: Result) -> str:
  """The unit of every compute of the report, and how it relates to 6·N·D."""
  runs = result.runs
  ratio = runs.flops / (6 * runs.n * runs.d)
  text = (f"C in FLOPs of {runs.flop_model}: the budgets, approach 2's power laws, the "
          "frontier and the target alike")
  if runs.flop_model == fit.SIX_ND.name:
    return text
  return (text + f"; the frontier is the least loss along C = F(N)·D, F(N) = C/D read off the "
          f"runs (C / (6·N·D): median {np.median(ratio):.3g}, from {ratio.min():.3g} to "
          f"{ratio.max():.3g})")


_TERM_TEXT = {"E": "E", "N": "A/N^α", "D": "B/D^β"}


def _law_lines(f: bootstrap.VariantFit, r: int) -> list[str]:
  """Approach 3's section: the law's estimates, what the runs cannot identify, the fit."""
  law = f.law
  dropped = frozenset(law.get("reduced", {}))
  kept = " + ".join(_TERM_TEXT[t] for t in ("E", "N", "D") if t not in dropped)
  zero = ", ".join(f"{'E' if t == 'E' else _TERM_TEXT[t].split('/')[0]} = 0" for t in
                   ("E", "N", "D") if t in dropped)
  lines = [f"### Approach 3: L(N, D) = {kept}" + (f" ({zero})" if dropped else ""), ""]
  if "E" in dropped:
    lines += [f"**E is not identified**: {f.unidentified['E']} (E under "
              f"{bootstrap.AT_BOUND:g} of the predicted loss at every fitted run). Over these "
              "runs the loss falls as a pure power law; any E small enough fits them alike. "
              "The law below is the reduced law E = 0, and its extrapolation assumes the loss "
              "keeps falling so.", ""]
  for term in sorted(dropped - {"E"}):
    names = " and ".join(_SYMBOLS[k] for k in bootstrap.TERMS[term])
    lines += [f"**{names} are not identified**: the term {_TERM_TEXT[term]} is "
              f"{f.unidentified[term]}. The law below drops it; no interval for the "
              "frontier or the loss at the target, which need both terms.", ""]
  if dropped:
    lines += [f"Objective {law['objective']:.6g} against the full law's "
              f"{law['full_objective']:.6g}.", ""]
  lines += ["| parameter | estimate [95% interval] |", "|---|---|"]
  lines += [f"| {_SYMBOLS[k]} | {format_estimate(f.estimates[k], 4, r)} |"
            for k in bootstrap.PARAMETRIC]
  rivals = len(law["optima"]) - 1
  lines += ["", f"Huber (δ = {fit.DELTA:g}) on ln loss, L-BFGS-B from the {law['starts']} "
            f"best of Hoffmann's {len(fit.hoffmann_grid(dropped)):,} grid points: "
            f"{law['reached']} reached the optimum (objective {law['objective']:.6g}); "
            f"{rivals} rival law(s) (distinct predictions, objective within "
            f"{fit.RIVAL - 1:.0%} of it); each resample refitted from {law['refit_starts']} "
            f"start(s). Log-residual sd {f.residual_sd:.4g} (the scatter of the prediction "
            "intervals)."]
  return lines


def _isoflop_lines(f: bootstrap.VariantFit, r: int) -> list[str]:
  """Approach 2's section, or why it was not run."""
  fitted = f.runs.select(~f.runs.held_out)
  outside = ~np.isin(fitted.budget, [row["budget"] for row in f.budgets])
  lines = ["", "### Approach 2: isoFLOP parabolas", ""]
  if not f.budgets:
    return lines + ["Not run: the runs form no isoFLOP budget of "
                    f"{bootstrap.MIN_SIZES} sizes or more (budgets: {f.runs.budget_from}). "
                    "Approach 3 needs none."]
  lines += [f"| budget C (FLOPs of {f.flops.name}) | runs | sizes | N from–to | N_opt [95%] | "
            "D_opt [95%] | loss at N_opt | usable in resamples | flag |",
            "|---:|---:|---:|---|---|---|---|---:|---|"]
  for row in f.budgets:
    lines.append(f"| {row['budget']:.3g} | {row['runs']} | {row['sizes']} | "
                 f"{row['smallest']:.3g}–{row['largest']:.3g} | "
                 f"{format_estimate(row['N_opt'], 3, r)} | {format_estimate(row['D_opt'], 3, r)} "
                 f"| {format_estimate(row['loss_opt'], 4, r)} | {row['N_opt']['resamples']} of "
                 f"{r} | {row['flag'] or 'usable'} |")
  if outside.any():
    lines += ["", f"{int(outside.sum())} fitted run(s) in no isoFLOP budget of "
              f"{bootstrap.MIN_SIZES} sizes or more: fitted by approach 3 only."]
  usable = sum(row["usable"] for row in f.budgets)
  e = f.estimates
  lines += ["", f"Power laws over the {usable} usable budget(s): N_opt = k_N C^a with a = "
            f"{format_estimate(e['isoflop a'], 4, r)}, k_N = "
            f"{format_estimate(e['isoflop k_N'], 3, r)}; D_opt = k_D C^b with b = "
            f"{format_estimate(e['isoflop b'], 4, r)}, k_D = "
            f"{format_estimate(e['isoflop k_D'], 3, r)}. D_opt is interpolated in ln N between "
            "the budget's own runs."]
  return lines


def _variant_section(f: bootstrap.VariantFit, result: Result) -> list[str]:
  r = result.resamples
  held = int(f.runs.held_out.sum())

  def est(e: dict, digits: int = 4) -> str:
    return format_estimate(e, digits, r)

  lines = ["", f"## Variant `{f.name}`", "", f"{len(f.runs.n) - held} fitted runs, {held} held "
           "out.", ""]
  lines += _law_lines(f, r)
  lines += _isoflop_lines(f, r)
  both = bool(f.budgets)  # approach 2's columns where it ran
  lines += ["", f"### Compute-optimal frontier (C in FLOPs of {f.flops.name})", "",
            "| C | N_opt (3) | D_opt (3) | loss (3) |" + (" N_opt (2) | D_opt (2) |" if both
                                                         else ""),
            "|---:|---|---|---|" + ("---|---|" if both else "")]
  for k, row in enumerate(f.frontier):
    name = f"**{row['C']:.3g}** (target)" if k == len(f.frontier) - 1 else f"{row['C']:.3g}"
    lines.append(f"| {name} | {est(row['N_opt'], 3)} | {est(row['D_opt'], 3)} | "
                 f"{est(row['loss'])} |" + (f" {est(row['isoflop N_opt'], 3)} | "
                                            f"{est(row['isoflop D_opt'], 3)} |" if both else ""))
  if f.held_out:
    outside = [row for row in f.held_out if row["outside"]]
    lines += ["", "### Held-out runs", "",
              f"| N | D | budget (FLOPs of {f.flops.name}) | seed | measured | predicted [95% "
              "prediction interval] | |",
              "|---:|---:|---:|---|---:|---|---|"]
    lines += [f"| {row['N']:.3g} | {row['D']:.3g} | {_num(row['budget'], 3)} | {row['seed']} | "
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
           f"- Budgets: {runs.budget_from}.",
           f"- Compute: {flop_model(result)}. Target compute {result.target:.3g}.",
           f"- Intervals: 95% percentile bootstrap over {result.resamples} resamples (cells "
           "resampled within isoFLOP budgets, the other runs' cells together, seeds within "
           "cells; docs/scaling.md), seed "
           f"{result.seed}; an estimate resting on fewer resamples says how many.",
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
              f"Each difference is the variant minus `{base}` with its 95% interval; * where "
              f"the interval excludes 0. Loss: on each law's frontier at C = "
              f"{result.target:.3g}. Paired: the two share every (budget, size, seed) cell and "
              "were resampled cell by cell together; unpaired: independent resamples.", "",
              "| variant | resamples | " + " | ".join(f"Δ {k}" for k in keys) + " |",
              "|---|---|" + "---|" * len(keys)]
    for c in result.comparisons:
      lines.append(f"| {c['variant']} | {'paired' if c['paired'] else 'unpaired'} | " + " | ".join(
          format_estimate(c[k], 3, result.resamples) + (" *" if c[k]["excludes_zero"] else "")
          for k in keys) + " |")
  lines += ["", "Plots: `isoflop.png` (each budget's runs and parabola), `compute.png` (loss "
            f"against compute in FLOPs of {runs.flop_model} with the frontier and its 95% "
            "band), `predicted.png` (predicted against measured loss, held-out runs "
            "highlighted)."]
  return "\n".join(lines) + "\n"


def _variant_json(f: bootstrap.VariantFit) -> dict:
  law = f.law
  held = int(f.runs.held_out.sum())
  return {
      "runs_fitted": len(f.runs.n) - held, "runs_held_out": held,
      "parametric": {k: f.estimates[k] for k in bootstrap.PARAMETRIC},
      "parametric_fit": {"starts": law["starts"], "reached_optimum": law["reached"],
                         "rival_laws": len(law["optima"]) - 1, "objective": law["objective"],
                         "reduced": law.get("reduced"),
                         "full_objective": law.get("full_objective"),
                         "refit_starts": law["refit_starts"], "seconds": law["seconds"],
                         "refit_seconds": law["refit_seconds"],
                         "log_residual_sd": f.residual_sd,
                         # e = -inf (E = 0) in the reduced law: null
                         "theta": {k: float(v) if np.isfinite(v) else None
                                   for k, v in zip(fit.NAMES, law["theta"])}},
      "isoflop": {"budgets": f.budgets,
                  **{k: f.estimates[f"isoflop {k}"] for k in ("a", "b", "k_N", "k_D")}},
      "not_identified": f.unidentified, "frontier_flop_model": f.flops.name,
      "frontier": f.frontier, "held_out": f.held_out}


def to_json(result: Result) -> dict:
  """scaling.json: every estimate ({value, low, high, resamples}), flag and setting."""
  return {"params": result.runs.params, "budget_from": result.runs.budget_from,
          "flop_model": result.runs.flop_model, "compute": flop_model(result),
          "target_compute": result.target, "level": bootstrap.LEVEL,
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


def write_scaling(rows: list[dict], out_dir: str, *, params: str, tokens: str, loss: str,
                  budget: str | None = None, seed: str | None = None,
                  variant: str | None = None, holdout: str | None = None,
                  resamples: int = 1000, starts: int = 64, target: float | None = None,
                  baseline: str | None = None, bootstrap_seed: int = 0
                  ) -> tuple[Result, list[str]]:
  """Fits `rows` (dicts of column -> value; the arguments name the columns,
  see `make_runs` and `bootstrap.analyse`) and writes the report into
  `out_dir`: the analysis and the paths written. Bad rows raise UserError
  before anything is written."""
  runs = make_runs(rows, params=params, tokens=tokens, loss=loss, budget=budget, seed=seed,
                   variant=variant, holdout=holdout)
  result = bootstrap.analyse(runs, resamples=resamples, starts=starts, target=target,
                             baseline=baseline, seed=bootstrap_seed)
  return result, write(result, out_dir)


def summary(result: Result) -> list[str]:
  """Each variant's exponents (both approaches) and what the runs cannot
  identify, then the flags: the lines both commands print."""
  lines = []
  for f in result.fits:
    e = {key: format_estimate(f.estimates[key], 3, result.resamples)
         for key in ("alpha", "beta", "a", "isoflop a")}
    second = (f"{e['isoflop a']} (approach 2)" if f.budgets else
              "approach 2 not run (no isoFLOP budget of 3 sizes)")
    lines.append(f"{f.name}: alpha {e['alpha']}, beta {e['beta']}; N_opt ∝ C^a with a "
                 f"{e['a']} (approach 3), {second}")
    lines += [f"{f.name}: " + ("E" if term == "E" else f"the {term} term") + " not "
              f"identified ({why}); fitted the law without it"
              for term, why in f.unidentified.items()]
  return lines + [f"flag: {line}" for line in flags(result)]
