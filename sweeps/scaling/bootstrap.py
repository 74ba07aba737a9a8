"""Every estimate of a scaling fit with its 95% bootstrap interval, per variant,
and the variants' differences.

**Resampling.** A resample draws, within each budget, its (budget, size)
cells with replacement, as many as the budget has, then within each drawn
cell its seeds with replacement, as many as the cell has: every budget keeps
its count of runs (exactly, when its cells have equal seeds), and seeds of
one cell, which share a size and a budget, are never split from it. With
one seed per cell this is resampling the budget's runs. A resample is a
count per run (its weight in both fits), so nothing is copied. Each
variant is resampled on its own; a difference between variants is taken
resample by resample (independent draws, paired by index).

**Refits.** The isoFLOP parabolas of every resample are solved at once. The
parametric law is refitted per resample by L-BFGS-B from the full fit's
optimum and its rivals, up to REFIT_STARTS in all: the other distinct optima
its grid starts ended in with an objective within 25% of the optimum's
(`fit.rival_optima`; usually none), never from the whole grid; the lowest
wins.

**Intervals.** An estimate's interval is the 2.5th and 97.5th percentiles of
its resampled values (percentile bootstrap), over the resamples where it is
defined (a parabola needs 3 sizes and a convex minimum inside them; a power
law 2 usable budgets; a frontier alpha, beta > 0); the count is reported
where short of all.

**Prediction intervals.** A held-out run's predicted loss per resample is the
resample's law at its N and D times exp(r), r drawn from the full fit's log
residuals (ln loss - ln predicted over the fitted runs): the law's
uncertainty plus the runs' scatter about it, seed noise included. The 95%
prediction interval is its percentiles; the measured loss outside it is said.
"""
import dataclasses
import time

import numpy as np

from configs.errors import UserError
from sweeps.scaling import fit
from sweeps.scaling.runs import Runs

LEVEL = 0.95
REFIT_STARTS = 3
MIN_SIZES = 3
MIN_RUNS = 10  # twice the law's five parameters
PARAMETRIC = ("E", "A", "B", "alpha", "beta", "a", "b")


def resample_weights(budget: np.ndarray, n: np.ndarray, resamples: int,
                     rng: np.random.Generator) -> np.ndarray:
  """(resamples, runs) counts: each row one resample (the module docstring)."""
  weights = np.zeros((resamples, len(n)))
  for c in np.unique(budget):
    at = np.flatnonzero(budget == c)
    cells = [at[n[at] == size] for size in np.unique(n[at])]
    picks = rng.integers(len(cells), size=(resamples, len(cells)))
    for k, runs in enumerate(cells):
      times = (picks == k).sum(axis=1)
      weights[:, runs] = rng.multinomial(times * len(runs), np.full(len(runs), 1 / len(runs)))
  return weights


def estimate(value, samples: np.ndarray) -> dict:
  """{value, low, high, resamples}: the full fit's value and the percentile
  interval over the resamples where it is defined (their count)."""
  samples = np.asarray(samples, dtype=np.float64)
  defined = samples[np.isfinite(samples)]
  value = float(value) if value is not None and np.isfinite(value) else None
  if len(defined) < 2:
    return {"value": value, "low": None, "high": None, "resamples": len(defined)}
  low, high = np.percentile(defined, [50 * (1 - LEVEL), 50 * (1 + LEVEL)])
  return {"value": value, "low": float(low), "high": float(high), "resamples": len(defined)}


@dataclasses.dataclass
class VariantFit:
  """One variant's fits: `estimates` (name -> estimate), the per-budget
  parabolas, the held-out predictions, and the resampled values behind them
  (`samples`: name -> (resamples,); `thetas`: (resamples, 5)) for the plots
  and the comparisons."""
  name: str
  runs: Runs
  law: dict
  estimates: dict
  budgets: list[dict]
  frontier: list[dict]
  held_out: list[dict]
  residual_sd: float
  samples: dict
  thetas: np.ndarray
  parabolas: dict


def check_runs(runs: Runs, name: str) -> None:
  """UserError unless the variant's fitted runs allow both fits."""
  fitted = runs.select(~runs.held_out)
  where = f"variant {name}: " if name != "all" else ""
  for c in np.unique(fitted.budget):
    sizes = np.unique(fitted.n[fitted.budget == c])
    if len(sizes) < MIN_SIZES:
      raise UserError(f"{where}budget {c:.3g} has {len(sizes)} distinct size(s) "
                      f"({', '.join(f'{s:.3g}' for s in sizes)}); an isoFLOP parabola needs "
                      f"{MIN_SIZES}: add sizes or hold that budget out (--holdout 'budget>={c:g}')")
  budgets = len(np.unique(fitted.budget))
  if len(fitted.n) < MIN_RUNS or budgets < 2:
    raise UserError(f"{where}{len(fitted.n)} fitted run(s) in {budgets} budget(s); the "
                    f"parametric law needs at least {MIN_RUNS} runs from 2 budgets or more")


def _isoflop(runs: Runs, weights: np.ndarray) -> dict:
  """Every budget's parabola and the power laws, one row per row of `weights`."""
  budgets = np.unique(runs.budget)
  ln_n, ln_d = np.log(runs.n), np.log(runs.d)
  per = [fit.parabolas(ln_n[runs.budget == c], runs.loss[runs.budget == c],
                       weights[:, runs.budget == c]) for c in budgets]
  ln_n_opt = np.stack([p["ln_n_opt"] for p in per], axis=1)
  usable = np.stack([p["inside"] for p in per], axis=1)
  ln_d_opt = np.stack([np.where(u, fit.interpolate_ln_d(ln_n[runs.budget == c],
                                                       ln_d[runs.budget == c], p["ln_n_opt"]),
                                np.nan) for c, p, u in zip(budgets, per, usable.T)], axis=1)
  a, ln_kn = fit.power_laws(np.log(budgets), ln_n_opt, usable)
  b, ln_kd = fit.power_laws(np.log(budgets), ln_d_opt, usable)
  return {"budgets": budgets, "per": per, "ln_n_opt": ln_n_opt, "ln_d_opt": ln_d_opt,
          "usable": usable, "a": a, "ln_kn": ln_kn, "b": b, "ln_kd": ln_kd}


def _frontier(theta, thetas, full_iso: dict, iso: dict, flops: np.ndarray
              ) -> tuple[list[dict], np.ndarray]:
  """Per compute C: N_opt, D_opt and loss on the parametric law's frontier
  (C = 6 N D), N_opt and D_opt of the isoFLOP power laws (C in budget
  units), each an estimate; and the resampled losses (resamples, C)."""
  point, values = fit.frontier(theta, flops), fit.frontier(thetas, flops)
  rows = []
  for k, c in enumerate(flops):
    row = {"C": float(c)}
    for i, key in enumerate(("N_opt", "D_opt", "loss")):
      row[key] = estimate(point[i][..., k], values[i][:, k])
    for key, slope, intercept in (("isoflop N_opt", "a", "ln_kn"), ("isoflop D_opt", "b", "ln_kd")):
      row[key] = estimate(np.exp(full_iso[intercept][0] + full_iso[slope][0] * np.log(c)),
                          np.exp(iso[intercept] + iso[slope] * np.log(c)))
    rows.append(row)
  return rows, values[2]


def _flag(p: dict, sizes: np.ndarray) -> str:
  """Why a budget's parabola is left out of the power laws ("" if it is not)."""
  if not p["convex"][0]:
    return "not convex: no minimum"
  n_opt = np.exp(p["ln_n_opt"][0])
  if n_opt < sizes.min():
    return f"minimum at N={n_opt:.3g}, below the smallest size {sizes.min():.3g}"
  if n_opt > sizes.max():
    return f"minimum at N={n_opt:.3g}, above the largest size {sizes.max():.3g}"
  return ""


def _budget_rows(fitted: Runs, full_iso: dict, iso: dict) -> list[dict]:
  """One row per budget: its runs and sizes, the parabola's N_opt, D_opt and
  loss there (intervals over the resamples where the budget is usable), the flag."""
  rows = []
  for k, c in enumerate(full_iso["budgets"]):
    at = fitted.budget == c
    sizes = np.unique(fitted.n[at])
    flag = _flag(full_iso["per"][k], sizes)
    usable = iso["usable"][:, k]
    rows.append({
        "budget": float(c), "runs": int(at.sum()), "sizes": len(sizes),
        "smallest": float(sizes.min()), "largest": float(sizes.max()), "usable": not flag,
        "flag": flag,
        "N_opt": estimate(np.exp(full_iso["ln_n_opt"][0, k]),
                          np.exp(np.where(usable, iso["ln_n_opt"][:, k], np.nan))),
        "D_opt": estimate(np.exp(full_iso["ln_d_opt"][0, k]), np.exp(iso["ln_d_opt"][:, k])),
        "loss_opt": estimate(full_iso["per"][k]["loss_opt"][0],
                             np.where(usable, iso["per"][k]["loss_opt"], np.nan))})
  return rows


def _predict(held: Runs, theta: np.ndarray, thetas: np.ndarray, residuals: np.ndarray,
             rng: np.random.Generator) -> list[dict]:
  """Each held-out run's measured loss beside its prediction and 95%
  prediction interval (the module docstring), and whether it falls outside."""
  if not len(held.n):
    return []
  ln_n, ln_d = np.log(held.n), np.log(held.d)
  point = np.exp(fit.log_loss(theta, ln_n, ln_d))
  scatter = rng.choice(residuals, size=(len(thetas), len(held.n)))
  values = np.exp(fit.log_loss(thetas, ln_n, ln_d) + scatter)
  out = []
  for i in range(len(held.n)):
    e = estimate(point[i], values[:, i])
    out.append({"N": float(held.n[i]), "D": float(held.d[i]), "budget": float(held.budget[i]),
                "seed": str(held.seed[i]), "loss": float(held.loss[i]), "predicted": e,
                "outside": not e["low"] <= held.loss[i] <= e["high"]})
  return out


def analyse_variant(runs: Runs, name: str, resamples: int, starts: int, target: float,
                    rng: np.random.Generator) -> VariantFit:
  """The full fits and `resamples` bootstrap refits of one variant's runs
  (its held-out runs predicted, not fitted); `target`: the compute of the
  frontier's last row."""
  fitted = runs.select(~runs.held_out)
  ln_n, ln_d, ln_loss = np.log(fitted.n), np.log(fitted.d), np.log(fitted.loss)
  start = time.perf_counter()
  law = fit.fit_law(ln_n, ln_d, ln_loss, starts)
  law["seconds"] = time.perf_counter() - start
  weights = resample_weights(fitted.budget, fitted.n, resamples, rng)
  refit_from = law["optima"][:REFIT_STARTS]
  thetas = np.empty((resamples, 5))
  start = time.perf_counter()
  for r in range(resamples):
    optima, values = fit.minimise(refit_from, ln_n, ln_d, ln_loss, weights[r])
    thetas[r] = optima[np.argmin(values)]
  law.update(refit_seconds=time.perf_counter() - start, refit_starts=len(refit_from))

  # An extreme resample (a flat parabola, a vanishing term) overflows exp to
  # inf: not an error, `estimate` leaves non-finite values out and says so.
  with np.errstate(over="ignore", invalid="ignore"):
    return _summarise(name, runs, fitted, law, weights, thetas, rng, target)


def _summarise(name: str, runs: Runs, fitted: Runs, law: dict, weights: np.ndarray,
               thetas: np.ndarray, rng: np.random.Generator, target: float) -> VariantFit:
  """The estimates of one variant from its full fit and its refits."""
  ln_n, ln_d, ln_loss = np.log(fitted.n), np.log(fitted.d), np.log(fitted.loss)
  full_iso, iso = _isoflop(fitted, np.ones((1, len(ln_n)))), _isoflop(fitted, weights)
  full_named, named = fit.named(law["theta"]), fit.named(thetas)
  samples = {key: named[key] for key in PARAMETRIC}
  samples.update({"isoflop a": iso["a"], "isoflop b": iso["b"]})
  est = {key: estimate(full_named[key], named[key]) for key in PARAMETRIC}
  est.update({"isoflop a": estimate(full_iso["a"][0], iso["a"]),
              "isoflop b": estimate(full_iso["b"][0], iso["b"]),
              "isoflop k_N": estimate(np.exp(full_iso["ln_kn"][0]), np.exp(iso["ln_kn"])),
              "isoflop k_D": estimate(np.exp(full_iso["ln_kd"][0]), np.exp(iso["ln_kd"]))})
  frontier, losses = _frontier(law["theta"], thetas, full_iso, iso,
                               np.append(full_iso["budgets"], target))
  est["loss at target"], samples["loss at target"] = frontier[-1]["loss"], losses[:, -1]
  residuals = ln_loss - fit.log_loss(law["theta"], ln_n, ln_d)
  return VariantFit(
      name=name, runs=runs, law=law, estimates=est, budgets=_budget_rows(fitted, full_iso, iso),
      frontier=frontier, held_out=_predict(runs.select(runs.held_out), law["theta"], thetas,
                                           residuals, rng),
      residual_sd=float(residuals.std()), samples=samples, thetas=thetas,
      parabolas={float(c): (p["centre"], p["coef"][0])
                 for c, p in zip(full_iso["budgets"], full_iso["per"])})


COMPARED = ("loss at target", "alpha", "beta", "a", "b", "isoflop a", "isoflop b")


def compare(variant: VariantFit, baseline: VariantFit) -> dict:
  """The variant minus the baseline: the predicted loss at the target compute
  on each one's frontier and each exponent, with intervals from the
  resamples paired by index; `excludes_zero` per difference."""
  out = {"variant": variant.name, "baseline": baseline.name}
  for key in COMPARED:
    value, base = variant.estimates[key]["value"], baseline.estimates[key]["value"]
    e = estimate(None if value is None or base is None else value - base,
                 variant.samples[key] - baseline.samples[key])
    e["excludes_zero"] = e["low"] is not None and (e["low"] > 0 or e["high"] < 0)
    out[key] = e
  return out


@dataclasses.dataclass
class Result:
  """A scaling analysis: every variant's fits, the comparisons with the
  baseline, and how they were made."""
  runs: Runs
  fits: list[VariantFit]
  comparisons: list[dict]
  target: float
  resamples: int
  starts: int
  seed: int
  seconds: float


def analyse(runs: Runs, *, resamples: int = 1000, starts: int = 64, target: float | None = None,
            baseline: str | None = None, seed: int = 0) -> Result:
  """Both fits of every variant with `resamples` bootstrap refits, and each
  variant against `baseline` (default: the first) at the compute `target`
  (default: 100 times the largest fitted budget). Checks every variant before
  fitting any (UserError)."""
  start = time.perf_counter()
  names = runs.variants()
  if baseline is not None and baseline not in names:
    raise UserError(f"--baseline {baseline}: no such variant; the variants: {', '.join(names)}")
  per = {name: runs.select(runs.variant == name) for name in names}
  for name, variant_runs in per.items():
    check_runs(variant_runs, name)
  if target is None:
    target = 100 * float(runs.budget[~runs.held_out].max())
  rng = np.random.default_rng(seed)
  fits = [analyse_variant(per[name], name, resamples, starts, target, rng) for name in names]
  base = fits[names.index(baseline or names[0])]
  comparisons = [compare(f, base) for f in fits if f is not base]
  return Result(runs=runs, fits=fits, comparisons=comparisons, target=target,
                resamples=resamples, starts=starts, seed=seed,
                seconds=time.perf_counter() - start)
