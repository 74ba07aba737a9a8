"""Runs drawn from a known law: the reference the tests and bench/scaling.py
fit against (no published runs are bundled; a known truth is the check).

TRUTH is Hoffmann et al.'s approach-3 estimate (E = 1.69, A = 406.4,
B = 410.7, alpha = 0.34, beta = 0.28), used only as a plausible law.
"""
import numpy as np

from sweeps.scaling import fit

TRUTH = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
THETA = np.array([np.log(TRUTH["A"]), np.log(TRUTH["B"]), np.log(TRUTH["E"]), TRUTH["alpha"],
                  TRUTH["beta"]])  # in fit.NAMES' order


def ladder(rng: np.random.Generator, *, budgets=np.logspace(18, 21, 7), sizes: int = 9,
           seeds: int = 1, sigma: float = 0.01, theta: np.ndarray = THETA,
           variant: str = "base") -> list[dict]:
  """Rows (params, tokens, loss, budget, seed, variant) at each budget C:
  `sizes` sizes spanning +-0.6 decades about the law's N_opt(C), D = C / 6N,
  per seed the law's loss times exp(N(0, sigma))."""
  rows = []
  for c, n_opt in zip(budgets, fit.frontier(theta, budgets)[0]):
    for n in n_opt * np.logspace(-0.6, 0.6, sizes):
      d = c / (6 * n)
      for seed in range(seeds):
        loss = np.exp(fit.log_loss(theta, np.log(n), np.log(d))[0] + rng.normal(0, sigma))
        rows.append({"params": float(n), "tokens": float(d), "loss": float(loss),
                     "budget": float(c), "seed": seed, "variant": variant})
  return rows
