"""The plots of a scaling analysis (matplotlib's object API, as training/plots.py):
isoFLOP curves with their parabolas, loss against compute with the frontier,
predicted against measured loss."""
import textwrap

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from sweeps.scaling import fit
from sweeps.scaling.bootstrap import law_frontier

_LEVEL_PERCENTILES = (2.5, 97.5)
_REACH = 1.0  # a minimum farther than this in ln N from a budget's sizes is not drawn


def plot_isoflop(path: str, result) -> None:
  """One panel per variant: each budget's runs (held out: hollow) against N,
  its parabola, and its minimum (star; a cross where flagged, none where it
  lies far outside the sizes: scaling.md says where)."""
  fig = Figure(figsize=(6 * len(result.fits) + 1, 4.8))
  axes = fig.subplots(1, len(result.fits), squeeze=False)[0]
  for ax, f in zip(axes, result.fits):
    budgets = sorted(set(f.parabolas) | set(f.runs.budget[f.runs.held_out & np.isfinite(
        f.runs.budget)].tolist()))
    rest = ~np.isin(f.runs.budget, budgets)
    ax.plot(f.runs.n[rest], f.runs.loss[rest], ".", color="grey", alpha=0.5,
            label="in no isoFLOP budget" if rest.any() else None)
    colours = colormaps["viridis"](np.linspace(0, 0.9, len(budgets)))
    for colour, c in zip(colours, budgets):
      at = f.runs.budget == c
      fitted, held = at & ~f.runs.held_out, at & f.runs.held_out
      ax.plot(f.runs.n[fitted], f.runs.loss[fitted], "o", color=colour, markersize=4,
              label=f"C={c:.2g}")
      ax.plot(f.runs.n[held], f.runs.loss[held], "o", color=colour, fillstyle="none",
              markersize=6, label=f"C={c:.2g} (held out)" if not fitted.any() else None)
      if c not in f.parabolas:
        continue
      centre, (c0, c1, c2) = f.parabolas[c]
      row = next(r for r in f.budgets if r["budget"] == c)
      lo, hi = np.log(row["smallest"]), np.log(row["largest"])
      n_opt = row["N_opt"]["value"]
      shown = n_opt is not None and lo - _REACH <= np.log(n_opt) <= hi + _REACH
      if shown:
        lo, hi = min(lo, np.log(n_opt)), max(hi, np.log(n_opt))
      u = np.linspace(lo - 0.2, hi + 0.2, 100) - centre
      ax.plot(np.exp(u + centre), c0 + c1 * u + c2 * u * u, color=colour, linewidth=1)
      if shown:
        ax.plot(n_opt, row["loss_opt"]["value"], "*" if row["usable"] else "x",
                color=colour, markersize=11, markeredgecolor="black")
    ax.set_xscale("log")
    ax.set_xlabel(f"N ({f.runs.params})")
    ax.set_title(textwrap.fill(f"{f.name}: isoFLOP parabolas (star: minimum; x: flagged)", 60),
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0].set_ylabel("loss")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def plot_compute(path: str, result) -> None:
  """Every run's loss against its compute in the runs' FLOP model (held out:
  hollow, black edge), each variant's parametric frontier out to the target
  with its 95% band."""
  fig = Figure(figsize=(8, 5 + 0.17 * 3 * len(result.fits)), layout="constrained")
  ax = fig.subplots()
  low = min(float(f.runs.flops.min()) for f in result.fits)
  grid = np.geomspace(low / 2, result.target * 1.5, 80)
  for k, f in enumerate(result.fits):
    colour = f"C{k}"
    flops = f.runs.flops
    held = f.runs.held_out
    ax.plot(flops[~held], f.runs.loss[~held], ".", color=colour, alpha=0.5,
            label=f"{f.name}: fitted runs")
    if held.any():
      ax.plot(flops[held], f.runs.loss[held], "o", color=colour, fillstyle="none",
              markeredgecolor="black", label=f"{f.name}: held out")
    ax.plot(grid, law_frontier(f.law["theta"], grid, f.flops)[2], color=colour,
            label=f"{f.name}: frontier (approach 3)")
    if f.estimates["loss at target"].get("identified", True):
      band = np.nanpercentile(law_frontier(f.thetas, grid, f.flops)[2], _LEVEL_PERCENTILES,
                              axis=0)
      ax.fill_between(grid, band[0], band[1], color=colour, alpha=0.2, linewidth=0)
  ax.axvline(result.target, color="grey", linestyle=":", label=f"target {result.target:.2g}")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel(f"compute (FLOPs of {result.runs.flop_model})")
  ax.set_ylabel("loss")
  ax.set_title("loss against compute, compute-optimal frontier with its 95% band", fontsize=10)
  ax.grid(alpha=0.3, which="both")
  _legend_below(fig, ax)
  fig.savefig(path, dpi=100)


def plot_predicted(path: str, result) -> None:
  """The parametric law's prediction against the measured loss, one colour
  per variant; held-out runs with their 95% prediction intervals, outlined."""
  fig = Figure(figsize=(9, 6 + 0.17 * 2 * len(result.fits)), layout="constrained")
  ax = fig.subplots()
  lows, highs = [], []
  for k, f in enumerate(result.fits):
    colour = f"C{k}"
    predicted = np.exp(fit.log_loss(f.law["theta"], np.log(f.runs.n), np.log(f.runs.d)))
    held = f.runs.held_out
    ax.plot(f.runs.loss[~held], predicted[~held], ".", color=colour, alpha=0.5,
            label=f"{f.name}: fitted")
    if f.held_out:
      loss = np.array([r["loss"] for r in f.held_out])
      mid = np.array([r["predicted"]["value"] for r in f.held_out])
      err = np.abs(np.array([[r["predicted"]["low"], r["predicted"]["high"]]
                             for r in f.held_out]).T - mid)
      ax.errorbar(loss, mid, yerr=err, fmt="o", color=colour, markeredgecolor="black",
                  capsize=3, label=f"{f.name}: held out (95% prediction interval)")
      highs.append((mid + err[1]).max())
      lows.append((mid - err[0]).min())
    lows.append(min(f.runs.loss.min(), predicted.min()))
    highs.append(max(f.runs.loss.max(), predicted.max()))
  span = [min(lows) * 0.98, max(highs) * 1.02]
  ax.plot(span, span, color="grey", linestyle=":", label="predicted = measured")
  ax.set_xlabel("measured loss")
  ax.set_ylabel("predicted loss (approach 3)")
  ax.set_title("predicted against measured", fontsize=10)
  ax.grid(alpha=0.3)
  _legend_below(fig, ax)
  fig.savefig(path, dpi=100)


def _legend_below(fig, ax) -> None:
  """The axes' legend under the plot, off the lines (variant names are long)."""
  fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", fontsize=7)
