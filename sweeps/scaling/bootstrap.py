"""Every estimate of a scaling fit with its 95% bootstrap interval, per variant,
and the variants' differences.

**Strata and cells.** A budget with at least MIN_SIZES distinct sizes among
its fitted runs is an isoFLOP group (approach 2 fits its parabola); every
other run (no budget, or a budget with fewer sizes: a paper's table of
assorted sizes and token counts) falls in one stratum of its own. Within a
stratum a cell is one (N, D): the seeds of one size at one budget.

**Resampling.** A resample draws, within each stratum, its cells with
replacement, as many as the stratum has, then within each drawn cell its
seeds with replacement, as many as the cell has: every stratum keeps its
count of runs (exactly, when its cells have equal seeds), and seeds of one
cell are never split from it. With one seed per cell this is resampling the
stratum's runs. A resample is a count per run (its weight in both fits), so
nothing is copied.

**Paired variants.** Variants whose fitted runs have one layout (the same
strata, as many cells in each, the same seeds in each cell: a ladder's
variants share budgets, sizes and seeds, though their N differ) are
resampled jointly: one draw of cells (by their rank in N within the stratum)
and seeds serves all of them, so a difference between them is paired, cell
by cell. Variants of different layouts are resampled independently and their
difference is said to be unpaired.

**Refits.** The isoFLOP parabolas of every resample are solved at once. The
parametric law is refitted per resample by L-BFGS-B from the full fit's
optimum and its rivals, up to REFIT_STARTS in all: the other distinct laws
its grid starts ended in with an objective within 25% of the optimum's
(`fit.rival_optima`; usually none), never from the whole grid; the lowest
wins.

**What the runs cannot identify.** E is not identified where it sits at its
bound 0, in the full fit or in more than 2.5% of the resamples (where the
95% interval's lower end would be the bound): E under AT_BOUND of the
predicted loss at every fitted run. Its interval would be that of an
optimiser's stopping point, not of the runs. The reduced law, E = 0, is then
fitted and resampled instead, and its estimates are the ones given, E
printed as 0 without an interval. Likewise a term A/N^alpha (or B/D^beta)
whose exponent runs off (below EXPONENT_RANGE[0]: a constant, confounded
with E; above EXPONENT_RANGE[1]: A and alpha growing together) or whose share
of the predicted loss stays under AT_BOUND at every run, in the fit or in
more than 2.5% of the resamples, is not identified: the law without it is
fitted and resampled instead (its parameters printed without a value), and
the frontier's exponents, the frontier and the loss at the target, which
need both terms, get no interval.

**Intervals.** An estimate's interval is the 2.5th and 97.5th percentiles of
its resampled values (percentile bootstrap), over the resamples where it is
defined (a parabola needs 3 sizes and a convex minimum inside them; a power
law 2 usable budgets; a frontier alpha, beta > 0); each estimate carries
that count, and the report prints it beside every estimate resting on fewer
than all resamples.

**Prediction intervals.** A held-out run's predicted loss per resample is the
resample's law at its N and D times exp(r), r drawn from the full fit's log
residuals (ln loss - ln predicted over the fitted runs): the law's
uncertainty plus the runs' scatter about it, seed noise included. The 95%
prediction interval is its percentiles; the measured loss outside it is said.

**Compute.** Every compute is in the runs' FLOP model (`Runs.flop_model`):
the frontier is the least loss along C = F(N) D (`fit.frontier_numeric`;
the closed form where F(N) = 6 N), approach 2's power laws and the target in
the same unit.
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
AT_BOUND = 1e-3  # a term under this share of the predicted loss at every run is at its bound 0
EXPONENT_RANGE = (1e-3, 5.0)  # an exponent outside it has run off
TERMS = {"E": ("E",), "N": ("A", "alpha"), "D": ("B", "beta")}  # each term's estimates
# What dropping the N or D term takes with it (the frontier needs both); dropping E keeps them.
DEPENDS_ON_EXPONENTS = ("a", "b", "loss at target")


def strata_and_cells(runs: Runs) -> tuple[np.ndarray, np.ndarray]:
  """Each run's stratum (its budget where that is an isoFLOP group of
  MIN_SIZES sizes or more, else inf: one stratum for the rest) and cell (an
  integer per distinct (stratum, N, D), increasing with N then D)."""
  groups = isoflop_groups(runs)
  stratum = np.where(np.isin(runs.budget, groups), runs.budget, np.inf)
  cell = np.unique(np.stack([stratum, runs.n, runs.d], axis=1), axis=0, return_inverse=True)[1]
  return stratum, cell.ravel()


def isoflop_groups(runs: Runs) -> np.ndarray:
  """The budgets with at least MIN_SIZES distinct sizes among `runs`, ascending."""
  budgets = np.unique(runs.budget[np.isfinite(runs.budget)])
  return np.array([c for c in budgets if len(np.unique(runs.n[runs.budget == c])) >= MIN_SIZES])


def resample_weights(stratum: np.ndarray, cell: np.ndarray, resamples: int,
                     rng: np.random.Generator) -> np.ndarray:
  """(resamples, runs) counts: each row one resample (the module docstring).
  Runs of one stratum and cell are its seeds, drawn in their order here."""
  weights = np.zeros((resamples, len(cell)))
  for c in np.unique(stratum):
    at = np.flatnonzero(stratum == c)
    cells = [at[cell[at] == k] for k in np.unique(cell[at])]
    picks = rng.integers(len(cells), size=(resamples, len(cells)))
    for k, runs in enumerate(cells):
      times = (picks == k).sum(axis=1)
      weights[:, runs] = rng.multinomial(times * len(runs), np.full(len(runs), 1 / len(runs)))
  return weights


def layout(runs: Runs) -> tuple:
  """What paired resampling needs alike: per stratum, each cell's seeds (runs
  in the order `canonical` puts them)."""
  stratum, cell = strata_and_cells(runs)
  return tuple((float(c), tuple(tuple(runs.seed[cell == k]) for k in np.unique(cell[stratum == c])))
               for c in np.unique(stratum))


def canonical(runs: Runs) -> Runs:
  """The runs sorted by stratum, N, D and seed: the order `layout` and the
  weights of paired variants follow."""
  stratum, _ = strata_and_cells(runs)
  return runs.select(np.lexsort((runs.seed, runs.d, runs.n, stratum)))


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


def not_identified(value) -> dict:
  """An estimate the runs do not pin down: its value, no interval."""
  value = float(value) if value is not None and np.isfinite(value) else None
  return {"value": value, "low": None, "high": None, "resamples": 0, "identified": False}


@dataclasses.dataclass
class VariantFit:
  """One variant's fits: `estimates` (name -> estimate), the per-budget
  parabolas, the held-out predictions, and the resampled values behind them
  (`samples`: name -> (resamples,); `thetas`: (resamples, 5)) for the plots
  and the comparisons. `unidentified`: term -> why, for the law's terms the
  runs do not pin down (`law["reduced"]`: the law was refitted with E = 0);
  `flops`: the FLOP model every compute is in; `layout`: the resampling's."""
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
  unidentified: dict
  flops: fit.FlopModel
  layout: tuple


def check_runs(runs: Runs, name: str) -> None:
  """UserError unless the variant's fitted runs allow the parametric law:
  MIN_RUNS runs, MIN_SIZES distinct N and MIN_SIZES distinct D."""
  fitted = runs.select(~runs.held_out)
  where = f"variant {name}: " if name != "all" else ""
  sizes, tokens = len(np.unique(fitted.n)), len(np.unique(fitted.d))
  if len(fitted.n) < MIN_RUNS or sizes < MIN_SIZES or tokens < MIN_SIZES:
    raise UserError(f"{where}{len(fitted.n)} fitted run(s) of {sizes} size(s) and {tokens} "
                    f"token count(s); the parametric law needs at least {MIN_RUNS} runs over "
                    f"{MIN_SIZES} sizes and {MIN_SIZES} token counts")


def _isoflop(runs: Runs, weights: np.ndarray) -> dict:
  """Every isoFLOP group's parabola and the power laws, one row per row of
  `weights`; `budgets` empty where the runs form no group."""
  budgets = isoflop_groups(runs)
  ln_n, ln_d = np.log(runs.n), np.log(runs.d)
  per = [fit.parabolas(ln_n[runs.budget == c], runs.loss[runs.budget == c],
                       weights[:, runs.budget == c]) for c in budgets]
  rows = len(weights)
  ln_n_opt = np.stack([p["ln_n_opt"] for p in per], axis=1) if per else np.zeros((rows, 0))
  usable = np.stack([p["inside"] for p in per], axis=1) if per else np.zeros((rows, 0), bool)
  ln_d_opt = np.zeros((rows, 0))
  if per:
    ln_d_opt = np.stack([np.where(u, fit.interpolate_ln_d(ln_n[runs.budget == c],
                                                         ln_d[runs.budget == c], p["ln_n_opt"]),
                                  np.nan) for c, p, u in zip(budgets, per, usable.T)], axis=1)
  a, ln_kn = fit.power_laws(np.log(budgets), ln_n_opt, usable)
  b, ln_kd = fit.power_laws(np.log(budgets), ln_d_opt, usable)
  return {"budgets": budgets, "per": per, "ln_n_opt": ln_n_opt, "ln_d_opt": ln_d_opt,
          "usable": usable, "a": a, "ln_kn": ln_kn, "b": b, "ln_kd": ln_kd}


def law_frontier(theta, flops: np.ndarray, model: fit.FlopModel):
  """(N_opt, D_opt, loss) on the law's frontier in the FLOP model's unit."""
  if model is fit.SIX_ND:
    return fit.frontier(theta, flops)
  return fit.frontier_numeric(theta, flops, model)


def _frontier(theta, thetas, full_iso: dict, iso: dict, flops: np.ndarray,
              model: fit.FlopModel, identified: bool) -> tuple[list[dict], np.ndarray]:
  """Per compute C (in the FLOP model's unit): N_opt, D_opt and loss on the
  parametric law's frontier, N_opt and D_opt of the isoFLOP power laws, each
  an estimate (the law's without an interval where not `identified`); and
  the resampled losses (resamples, C)."""
  point, values = law_frontier(theta, flops, model), law_frontier(thetas, flops, model)
  rows = []
  for k, c in enumerate(flops):
    row = {"C": float(c)}
    for i, key in enumerate(("N_opt", "D_opt", "loss")):
      row[key] = (estimate(point[i][..., k], values[i][:, k]) if identified
                  else not_identified(point[i][..., k]))
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
  """One row per isoFLOP group: its runs and sizes, the parabola's N_opt,
  D_opt and loss there (intervals over the resamples where the budget is
  usable), the flag."""
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
    budget = float(held.budget[i]) if np.isfinite(held.budget[i]) else None
    out.append({"N": float(held.n[i]), "D": float(held.d[i]), "budget": budget,
                "seed": str(held.seed[i]), "loss": float(held.loss[i]), "predicted": e,
                "outside": not e["low"] <= held.loss[i] <= e["high"]})
  return out


def _refit(law: dict, ln_n, ln_d, ln_loss, weights: np.ndarray) -> np.ndarray:
  """Each resample's law (resamples, 5), from the full fit's optimum and rivals."""
  refit_from = law["optima"][:REFIT_STARTS]
  thetas = np.empty((len(weights), 5))
  start = time.perf_counter()
  for r, w in enumerate(weights):
    optima, values = fit.minimise(refit_from, ln_n, ln_d, ln_loss, w)
    thetas[r] = optima[np.argmin(values)]
  law.update(refit_seconds=time.perf_counter() - start, refit_starts=len(refit_from))
  return thetas


def term_shares(thetas: np.ndarray, ln_n, ln_d) -> dict[str, np.ndarray]:
  """Per term of the law (E, the N term, the D term), its largest share of
  the predicted loss over the runs, for thetas (..., 5): (...,) each."""
  thetas = np.asarray(thetas)
  a, b, e, alpha, beta = (thetas[..., i, None] for i in range(5))
  total = fit.log_loss(thetas, ln_n, ln_d)
  with np.errstate(invalid="ignore"):
    return {"E": np.exp(e - total).max(axis=-1),
            "N": np.exp(a - alpha * ln_n - total).max(axis=-1),
            "D": np.exp(b - beta * ln_d - total).max(axis=-1)}


def _off(theta: np.ndarray, thetas: np.ndarray, ln_n, ln_d, term: str) -> np.ndarray:
  """Whether `term` is at its bound or its exponent has run off, for the full
  theta (first) and each resample."""
  both = np.vstack([theta, thetas])
  off = term_shares(both, ln_n, ln_d)[term] < AT_BOUND
  if term != "E":
    exponent = both[:, 3 if term == "N" else 4]
    off |= (exponent < EXPONENT_RANGE[0]) | (exponent > EXPONENT_RANGE[1])
  return off


def unidentified(theta: np.ndarray, thetas: np.ndarray, ln_n, ln_d, terms) -> dict[str, str]:
  """term -> why, for each of `terms` ("E", "N", "D") off in the full fit or
  in more than (1 - LEVEL) / 2 of the resamples (`_off`)."""
  out = {}
  allowed = (1 - LEVEL) / 2 * len(thetas)
  for term in terms:
    off = _off(theta, thetas, ln_n, ln_d, term)
    if off[0] or off[1:].sum() > allowed:
      what = "at its bound 0" if term == "E" else "vanishing or with its exponent run off"
      out[term] = (f"{what} {'in the full fit and ' if off[0] else ''}in {int(off[1:].sum())} "
                   f"of {len(thetas)} resamples")
  return out


def analyse_variant(runs: Runs, name: str, starts: int, target: float, weights: np.ndarray,
                    rng: np.random.Generator) -> VariantFit:
  """The full fits and one bootstrap refit per row of `weights` (over the
  fitted runs in `canonical` order) of one variant's runs, its held-out runs
  predicted, not fitted; the reduced law without the terms the runs do not
  identify (E first, then the N and D terms), refitted and resampled in
  their place; `target`: the compute of the frontier's last row."""
  fitted = canonical(runs.select(~runs.held_out))
  ln_n, ln_d, ln_loss = np.log(fitted.n), np.log(fitted.d), np.log(fitted.loss)
  start = time.perf_counter()
  law = fit.fit_law(ln_n, ln_d, ln_loss, starts)
  law["seconds"] = time.perf_counter() - start
  thetas = _refit(law, ln_n, ln_d, ln_loss, weights)
  full, missing = law, {}
  for terms in (["E"], ["N", "D"]):  # E first: a vanishing E is the common case
    more = unidentified(law["theta"], thetas, ln_n, ln_d, terms)
    if not more:
      continue
    missing.update(more)
    before, start = law, time.perf_counter()
    law = fit.fit_law(ln_n, ln_d, ln_loss, starts, frozenset(missing))
    law.update(seconds=before["seconds"] + time.perf_counter() - start, reduced=dict(missing),
               full_objective=full["objective"])
    thetas = _refit(law, ln_n, ln_d, ln_loss, weights)
    law["refit_seconds"] += before["refit_seconds"]
  model = (fit.SIX_ND if fitted.flop_model == fit.SIX_ND.name
           else fit.flop_model(fitted.n, fitted.d, fitted.flops, fitted.flop_model))
  # An extreme resample (a flat parabola, a vanishing term) overflows exp to
  # inf: not an error, `estimate` leaves non-finite values out and says so.
  with np.errstate(over="ignore", invalid="ignore"):
    return _summarise(name, runs, fitted, law, weights, thetas, rng, target, missing, model)


def _summarise(name: str, runs: Runs, fitted: Runs, law: dict, weights: np.ndarray,
               thetas: np.ndarray, rng: np.random.Generator, target: float,
               missing: dict, model: fit.FlopModel) -> VariantFit:
  """The estimates of one variant from its full fit and its refits."""
  ln_n, ln_d, ln_loss = np.log(fitted.n), np.log(fitted.d), np.log(fitted.loss)
  full_iso, iso = _isoflop(fitted, np.ones((1, len(ln_n)))), _isoflop(fitted, weights)
  full_named, named = fit.named(law["theta"]), fit.named(thetas)
  samples = {key: named[key] for key in PARAMETRIC}
  samples.update({"isoflop a": iso["a"], "isoflop b": iso["b"]})
  blank = {key for term in missing for key in TERMS[term]}
  if missing.keys() - {"E"}:
    blank.update(DEPENDS_ON_EXPONENTS)
  gone = {key for term in missing.keys() - {"E"} for key in TERMS[term]}  # no value: dropped
  est = {key: not_identified(None if key in gone else full_named[key]) if key in blank
         else estimate(full_named[key], named[key]) for key in PARAMETRIC}
  est.update({"isoflop a": estimate(full_iso["a"][0], iso["a"]),
              "isoflop b": estimate(full_iso["b"][0], iso["b"]),
              "isoflop k_N": estimate(np.exp(full_iso["ln_kn"][0]), np.exp(iso["ln_kn"])),
              "isoflop k_D": estimate(np.exp(full_iso["ln_kd"][0]), np.exp(iso["ln_kd"]))})
  at = full_iso["budgets"] if len(full_iso["budgets"]) else _span(fitted.flops)
  frontier, losses = _frontier(law["theta"], thetas, full_iso, iso, np.append(at, target),
                               model, "loss at target" not in blank)
  est["loss at target"], samples["loss at target"] = frontier[-1]["loss"], losses[:, -1]
  residuals = ln_loss - fit.log_loss(law["theta"], ln_n, ln_d)
  return VariantFit(
      name=name, runs=runs, law=law, estimates=est, budgets=_budget_rows(fitted, full_iso, iso),
      frontier=frontier, held_out=_predict(runs.select(runs.held_out), law["theta"], thetas,
                                           residuals, rng),
      residual_sd=float(residuals.std()), samples=samples, thetas=thetas,
      parabolas={float(c): (p["centre"], p["coef"][0])
                 for c, p in zip(full_iso["budgets"], full_iso["per"])},
      unidentified=missing, flops=model, layout=layout(fitted))


def _span(flops: np.ndarray) -> np.ndarray:
  """Where runs without isoFLOP groups get frontier rows: four computes
  evenly in log from their least to their most, to 2 significant digits."""
  return np.array([float(f"{c:.2g}") for c in np.geomspace(flops.min(), flops.max(), 4)])


COMPARED = ("loss at target", "alpha", "beta", "a", "b", "isoflop a", "isoflop b")


def compare(variant: VariantFit, baseline: VariantFit) -> dict:
  """The variant minus the baseline: the predicted loss at the target compute
  on each one's frontier and each exponent, with intervals over the
  resamples, paired cell by cell where the two share a layout (`paired`),
  else independent draws matched by index; `excludes_zero` per difference.
  A difference where either side is not identified has no interval."""
  paired = variant.layout == baseline.layout
  out = {"variant": variant.name, "baseline": baseline.name, "paired": paired}
  for key in COMPARED:
    mine, base = variant.estimates[key], baseline.estimates[key]
    both = mine["value"] is not None and base["value"] is not None
    value = mine["value"] - base["value"] if both else None
    if mine.get("identified", True) and base.get("identified", True):
      e = estimate(value, variant.samples[key] - baseline.samples[key])
    else:
      e = not_identified(value)
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
  (default: 100 times the largest fitted run's compute, in the runs' FLOP
  model). Variants of one layout share their resamples (paired). Checks every
  variant before fitting any (UserError)."""
  start = time.perf_counter()
  names = runs.variants()
  if baseline is not None and baseline not in names:
    raise UserError(f"--baseline {baseline}: no such variant; the variants: {', '.join(names)}")
  per = {name: runs.select(runs.variant == name) for name in names}
  for name, variant_runs in per.items():
    check_runs(variant_runs, name)
  if target is None:
    target = 100 * float(runs.flops[~runs.held_out].max())
  rng = np.random.default_rng(seed)
  drawn = {}  # layout -> weights: one draw per layout, shared by its variants
  fits = []
  for name in names:
    fitted = canonical(per[name].select(~per[name].held_out))
    key = layout(fitted)
    if key not in drawn:
      drawn[key] = resample_weights(*strata_and_cells(fitted), resamples, rng)
    fits.append(analyse_variant(per[name], name, starts, target, drawn[key], rng))
  base = fits[names.index(baseline or names[0])]
  comparisons = [compare(f, base) for f in fits if f is not base]
  return Result(runs=runs, fits=fits, comparisons=comparisons, target=target,
                resamples=resamples, starts=starts, seed=seed,
                seconds=time.perf_counter() - start)
