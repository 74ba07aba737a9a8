"""sweeps/scaling: the fits recover laws drawn from a known truth, their 95%
intervals cover it at about that rate, flagged budgets stay out of the power
laws, held-out runs are predicted, and every bad input is one line, exit 2,
nothing written."""
import csv
import json
import os

import numpy as np
import pytest
from scipy import optimize, stats

from configs.errors import UserError
from sweeps import scaling
from sweeps.scaling import __main__ as cli
from sweeps.scaling import bootstrap, fit, report, synthetic
from sweeps.scaling.runs import group_budgets, make_runs

TRUTH, THETA = synthetic.TRUTH, synthetic.THETA
A_OPT = TRUTH["beta"] / (TRUTH["alpha"] + TRUTH["beta"])  # N_opt ∝ C^a
ladder = synthetic.ladder


def runs_of(rows, **kw):
  return make_runs(rows, params="params", tokens="tokens", loss="loss", budget="budget",
                   seed="seed", variant="variant", **kw)


def inside(e: dict, value: float) -> bool:
  return e["low"] <= value <= e["high"]


# The parametric fit.

def test_the_gradient_is_the_objectives_derivative():
  rng = np.random.default_rng(0)
  runs = runs_of(ladder(rng, budgets=np.logspace(18, 20, 3), sizes=5, sigma=0.05))
  data = (np.log(runs.n), np.log(runs.d), np.log(runs.loss))
  weights = rng.integers(0, 3, len(runs.n)).astype(float)
  for theta in (THETA, THETA + [0.5, -0.3, 0.1, 0.05, -0.02]):
    grad = fit.objective(theta, *data, weights)[1]
    numeric = optimize.approx_fprime(theta, lambda t: fit.objective(t, *data, weights)[0], 1e-7)
    np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-7)
    # Unit weights: the grid's vectorised objective, the same sum.
    assert fit.objective(theta, *data, np.ones(len(runs.n)))[0] == pytest.approx(
        fit.grid_objective(theta[None], *data)[0], rel=1e-12)


def test_the_frontier_is_the_least_loss_at_each_compute():
  for c in (1e18, 1e22):
    n_opt, d_opt, loss = (x[0] for x in fit.frontier(THETA, [c]))
    best = optimize.minimize_scalar(
        lambda ln_n: fit.log_loss(THETA, ln_n, np.log(c / 6) - ln_n)[0], bounds=(5, 40),
        method="bounded", options={"xatol": 1e-10})
    assert np.log(n_opt) == pytest.approx(best.x, abs=1e-4)
    assert d_opt == pytest.approx(c / (6 * n_opt))
    assert np.log(loss) == pytest.approx(best.fun, abs=1e-10)
  assert np.isnan(fit.frontier(THETA * [1, 1, 1, 0, 1], [1e20])[0]).all()


def test_the_fit_recovers_a_known_law_within_its_intervals():
  runs = runs_of(ladder(np.random.default_rng(1)))
  result = bootstrap.analyse(runs, resamples=200, starts=32)
  est = result.fits[0].estimates
  for key, value in {**TRUTH, "a": A_OPT, "b": 1 - A_OPT, "isoflop a": A_OPT}.items():
    assert inside(est[key], value), (key, est[key])
  assert est["alpha"]["high"] - est["alpha"]["low"] < 0.2
  assert result.fits[0].law["reached"] > 1


def test_the_grid_strategy_finds_the_whole_grids_optimum():
  """The best 8 of Hoffmann's grid reach the optimum that the best 100 find
  (the whole grid takes a minute: bench/scaling.py compares it)."""
  runs = runs_of(ladder(np.random.default_rng(2), sigma=0.03))
  args = (np.log(runs.n), np.log(runs.d), np.log(runs.loss))
  few, many = fit.fit_law(*args, 8), fit.fit_law(*args, 100)
  assert few["objective"] == pytest.approx(many["objective"], rel=1e-8)
  np.testing.assert_allclose(few["theta"], many["theta"], atol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about 2 minutes; 5 on a loaded 2-core machine
def test_95_percent_intervals_cover_the_truth_at_about_that_rate():
  """Over 100 synthetic draws (7 budgets of 7 sizes, the largest held out),
  each interval holds the truth in at least 87 of them: Binomial(100,
  0.95)'s 0.1% quantile, so too narrow intervals fail. The other end is not
  asserted: 100 draws cannot tell 95% from 99% there (bench.scaling
  --coverage measured 97 to 99 of 100). The held-out runs inside their
  prediction intervals: a mean fraction over the draws (runs of one draw
  share its fitted law, so the draws are the independent units) within 3.3
  standard errors of 0.95."""
  draws, covered, inside_held = 100, {}, []
  truth = {**TRUTH, "a": A_OPT, "b": 1 - A_OPT}
  for i in range(draws):
    runs = runs_of(ladder(np.random.default_rng(100 + i), sizes=7), holdout="budget>=1e21")
    f = bootstrap.analyse(runs, resamples=200, starts=16, seed=i).fits[0]
    target = fit.frontier(THETA, [f.frontier[-1]["C"]])
    checks = {**{k: inside(f.estimates[k], v) for k, v in truth.items()},
              "N_opt at target": inside(f.frontier[-1]["N_opt"], target[0][0]),
              "loss at target": inside(f.frontier[-1]["loss"], target[2][0])}
    for key, hit in checks.items():
      covered[key] = covered.get(key, 0) + hit
    inside_held.append(np.mean([not row["outside"] for row in f.held_out]))
  assert min(covered.values()) >= stats.binom.ppf(0.001, draws, 0.95), covered
  se = np.std(inside_held, ddof=1) / np.sqrt(draws)
  assert abs(np.mean(inside_held) - 0.95) <= 3.3 * se, (np.mean(inside_held), se)


# IsoFLOP parabolas.

def isoflop_rows(exponent: float, budgets, sizes: int = 7, flat: float | None = None,
                 offset: float = 0) -> list:
  """Exact parabolas in ln N about N_opt = 0.1 C^exponent, sizes within e^1.5
  of e^offset N_opt; `flat`: a budget whose loss falls with N throughout (no
  minimum)."""
  rows = []
  for c in budgets:
    ln_opt = np.log(0.1) + exponent * np.log(c)
    for ln_n in ln_opt + offset + np.linspace(-1.5, 1.5, sizes):
      loss = 10 / np.log(c) + 0.05 * (ln_n - ln_opt) ** 2
      if c == flat:
        loss = 10 / np.log(c) - 0.05 * (ln_n - ln_opt)
      rows.append({"params": np.exp(ln_n), "tokens": c / (6 * np.exp(ln_n)), "loss": loss,
                   "budget": c, "seed": 0, "variant": "v"})
  return rows


def test_isoflop_recovers_a_known_n_opt_exponent():
  budgets = np.logspace(17, 21, 5)
  f = bootstrap.analyse(runs_of(isoflop_rows(0.55, budgets)), resamples=100, starts=8).fits[0]
  assert f.estimates["isoflop a"]["value"] == pytest.approx(0.55, abs=1e-9)
  assert f.estimates["isoflop b"]["value"] == pytest.approx(0.45, abs=1e-9)  # D = C / 6N
  assert all(row["usable"] for row in f.budgets)
  for row in f.budgets:
    assert row["N_opt"]["value"] == pytest.approx(0.1 * row["budget"] ** 0.55, rel=1e-9)


def test_a_budget_whose_minimum_lies_outside_its_sizes_is_flagged_and_left_out():
  budgets = np.logspace(17, 21, 5)
  rows = [r for r in isoflop_rows(0.55, budgets) if r["budget"] != budgets[2]]
  rows += isoflop_rows(0.55, budgets[2:3], offset=2)  # every size above N_opt
  rows += isoflop_rows(0.55, [1e22], flat=1e22)
  result = bootstrap.analyse(runs_of(rows), resamples=100, starts=8)
  f = result.fits[0]
  flags = {row["budget"]: row["flag"] for row in f.budgets}
  assert flags[budgets[2]].startswith("minimum at N=") and "below the smallest size" in \
      flags[budgets[2]]
  assert flags[1e22] == "not convex: no minimum"
  assert sum(not flag for flag in flags.values()) == 4
  # The power law is the one through the four usable budgets: unchanged.
  assert f.estimates["isoflop a"]["value"] == pytest.approx(0.55, abs=1e-9)
  assert len(report.flags(result)) == 2
  assert "left out of the power laws" in report.markdown(result)


# Resampling, held-out runs, variants.

def test_a_resample_keeps_each_budgets_runs_and_each_cells_seeds_together():
  rows = ladder(np.random.default_rng(3), budgets=np.logspace(18, 20, 3), sizes=5, seeds=3)
  runs = runs_of(rows)
  weights = bootstrap.resample_weights(runs.budget, runs.n, 500, np.random.default_rng(0))
  for c in np.unique(runs.budget):
    assert (weights[:, runs.budget == c].sum(axis=1) == 15).all()
  for size in np.unique(runs.n):
    cell = weights[:, runs.n == size].sum(axis=1)
    assert (cell % 3 == 0).all()  # whole cells: 3 seeds drawn per pick
  # Cells picked 0 to 5 times; seeds within a picked cell vary.
  assert weights.max() > 3 and (weights[:, runs.n == runs.n[0]].std(axis=1) > 0).any()


def test_held_out_runs_are_predicted_and_one_off_the_law_is_said_to_be_outside():
  rows = ladder(np.random.default_rng(4), budgets=np.logspace(18, 21, 7))
  off = [r for r in rows if r["budget"] == 1e21][4]
  off["loss"] *= 1.15
  result = bootstrap.analyse(runs_of(rows, holdout="budget>=1e21"), resamples=200, starts=16)
  held = result.fits[0].held_out
  assert len(held) == 9 and all(row["budget"] == 1e21 for row in held)
  outside = [row for row in held if row["outside"]]
  assert [row["loss"] for row in outside] == [off["loss"]]
  assert sum(len(f.runs.n) - f.runs.held_out.sum() for f in result.fits) == 54
  assert "**1 of 9 held-out runs fall outside their 95% prediction interval**" in \
      report.markdown(result)


def test_variants_are_compared_by_their_laws():
  rng = np.random.default_rng(5)
  lower_e = THETA + [0, 0, np.log(1.59 / 1.69), 0, 0]
  rows = (ladder(rng, variant="base") + ladder(rng, variant="same")
          + ladder(rng, theta=lower_e, variant="lower"))
  result = bootstrap.analyse(runs_of(rows), resamples=200, starts=16, baseline="base")
  by = {c["variant"]: c for c in result.comparisons}
  assert set(by) == {"same", "lower"} and by["same"]["baseline"] == "base"
  assert result.target == 100 * 1e21
  assert not by["same"]["loss at target"]["excludes_zero"]
  lower = by["lower"]["loss at target"]
  assert lower["excludes_zero"] and inside(lower, -0.1)
  assert inside(by["lower"]["alpha"], 0) and inside(by["lower"]["a"], 0)


# Input.

def test_budgets_from_6nd_are_grouped_and_ambiguous_ones_refused():
  flops = np.array([1e19, 1.04e19, 0.98e19, 3e19, 3.2e19, 1e20])
  assert group_budgets(flops).tolist() == [1e19, 1e19, 1e19, 3.1e19, 3.1e19, 1e20]
  with pytest.raises(UserError, match=r"6\*N\*D from 1e\+19 to 1.8e\+19 form no clear "
                     "isoFLOP budget; give the budget column with --budget"):
    group_budgets(np.array([1e19, 1.2e19, 1.44e19, 1.8e19]))


def write_csv(path, rows) -> str:
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  return str(path)


def test_the_command_line_writes_every_file(tmp_path, capsys):
  rows = ladder(np.random.default_rng(6), budgets=np.logspace(18, 20.5, 6), sizes=6)
  for r in rows:
    r["held"] = "yes" if r["budget"] > 1e20 else "no"
    r["params_nonembed"] = 0.9 * r["params"]
  path = write_csv(tmp_path / "runs.csv", rows)
  out = tmp_path / "out"
  cli.main(["--csv", path, "--params", "params_nonembed", "--tokens", "tokens", "--loss", "loss",
            "--holdout", "held", "--resamples", "100", "--starts", "8", "--out", str(out)])
  printed = capsys.readouterr().out
  assert sorted(os.listdir(out)) == sorted(report.FILES)  # no staging directory left
  assert "fitted 30 runs (6 held out), 100 resamples, in" in printed
  data = json.loads((out / "scaling.json").read_text())
  assert data["params"] == "params_nonembed" and data["budget_from"].startswith("6·N·D grouped")
  variant = data["variants"]["all"]
  assert variant["runs_fitted"] == 30 and len(variant["held_out"]) == 6
  assert set(variant["parametric"]) == {"E", "A", "B", "alpha", "beta", "a", "b"}
  assert all(set(e) == {"value", "low", "high", "resamples"} for e in
             variant["parametric"].values())
  assert "N: the column `params_nonembed`" in (out / "scaling.md").read_text()


def bad_input_cases(tmp_path) -> list[tuple[list[str], str]]:
  good = ladder(np.random.default_rng(7), budgets=np.logspace(18, 20, 3), sizes=4)
  two_sizes = [r for r in good if r["params"] < sorted({r["params"] for r in good
                                                        if r["budget"] == 1e19})[2]
               or r["budget"] != 1e19]
  zero = [dict(r) for r in good]
  zero[5]["loss"] = 0
  word = [dict(r) for r in good]
  word[2]["tokens"] = "many"
  few = [r for r in good if r["budget"] < 1e20][:7]
  few = [r for r in few if r["budget"] == 1e18][:3] + [r for r in few if r["budget"] == 1e19][:3]
  csvs = {name: write_csv(tmp_path / f"{name}.csv", rows) for name, rows in
          (("good", good), ("two_sizes", two_sizes), ("zero", zero), ("word", word),
           ("few", few))}
  base = ["--params", "params", "--tokens", "tokens", "--loss", "loss", "--budget", "budget"]
  return [
      (["--csv", csvs["good"], *base[:-2], "--budget", "flops"],
       "--budget flops: no such column; the columns: params, tokens, loss, budget, seed, variant"),
      (["--csv", csvs["zero"], *base], "row 6: loss='0' must be a positive number"),
      (["--csv", csvs["word"], *base], "row 3: tokens='many' is not a number"),
      (["--csv", csvs["two_sizes"], *base], "budget 1e+19 has 2 distinct size(s)"),
      (["--csv", csvs["few"], *base], "6 fitted run(s) in 2 budget(s); the parametric law "
       "needs at least 10 runs from 2 budgets or more"),
      (["--csv", csvs["good"], *base, "--holdout", "budget>x"], "--holdout budget>x: give "
       "budget>=X"),
      (["--csv", csvs["good"], *base, "--baseline", "nope"], "--baseline nope: no such variant"),
      (["--csv", str(tmp_path / "missing.csv"), *base], "missing.csv: cannot read it"),
      (["--csv", csvs["good"], *base[2:]], "--params"),
  ]


def test_each_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
  for argv, message in bad_input_cases(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
      cli.main([*argv, "--resamples", "100", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, argv
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (argv, err)
    assert not out.exists()


def test_an_error_while_writing_leaves_nothing_half_written(tmp_path, monkeypatch):
  result = bootstrap.analyse(runs_of(ladder(np.random.default_rng(8), sizes=5)), resamples=100,
                             starts=8)
  scaling.write(result, str(tmp_path))
  before = {name: (tmp_path / name).read_bytes() for name in report.FILES}

  def fail(path, result):
    raise OSError("disk full")

  monkeypatch.setattr(report.plots, "plot_predicted", fail)
  result.seed = 99  # a different scaling.json, were it written
  with pytest.raises(OSError, match="disk full"):
    scaling.write(result, str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == sorted(report.FILES)
  assert {name: (tmp_path / name).read_bytes() for name in report.FILES} == before
