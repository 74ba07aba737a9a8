"""The two fits of a scaling law, each vectorised over bootstrap weights.

**IsoFLOP parabolas (Hoffmann et al.'s approach 2).** Per budget C, the
loss of its runs against x = ln N, fitted by weighted least squares as
loss = c0 + c1 u + c2 u^2 with u = x - (the budget's mean x); the minimum
is at u* = -c1 / (2 c2), N_opt(C) = exp(mean x + u*), where the parabola is
convex (c2 > 0). A budget with fewer than three distinct sizes has no
parabola. D_opt(C) is read off the budget's own runs: ln D interpolated
linearly in ln N between its sizes (each size's mean ln D) at ln N_opt, not
C / (6 N_opt): a run's budget may count more than 6 N D (this project's
counts attention, `model/accounting.flops_per_token`), and the runs' own
tokens are what that budget bought at that size. Power laws N_opt = k_N C^a
and D_opt = k_D C^b are least-squares lines in log-log over the usable
budgets: convex, with the minimum inside the budget's sizes.

**The parametric law (approach 3).** L(N, D) = E + A / N^alpha + B / D^beta
as Hoffmann et al. fitted it: theta = (a, b, e, alpha, beta) with a = ln A,
b = ln B, e = ln E, the predicted log loss
LSE(a - alpha ln N, b - beta ln D, e), and the objective the sum over runs
of Huber_delta(predicted - ln loss), delta = 1e-3, minimised by L-BFGS-B
(scipy) with its analytic gradient. Starts: Hoffmann's grid (alpha, beta in
{0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1}, a, b in {0, 5, ..., 25}: 4,500
points) is evaluated at once, and L-BFGS-B runs from its `starts` best points
(all 4,500 with starts=4500). Tolerances are tight (ftol 1e-15, gtol 1e-10):
looser ones stop this small, flat objective early (at ftol 1e-10, gtol 1e-6,
already tighter than scipy's defaults, three starts on one resample stopped
up to 0.4 apart in a parameter; at these, 5e-5 apart).

**Reduced laws.** Where the runs cannot identify a term (E at its bound 0:
the loss still falls as a pure power law over their range; A/N^alpha or
B/D^beta vanishing or running off), the law without it is fitted instead:
the same objective with that term held at 0 (e, or a or b, fixed at -inf,
the term's exponent at 0) over the other parameters, started from the grid
without the term's axes (E = 0: 900 points). `TERMS` names each term's
entries of theta.

**Rival optima** are distinct laws: optima whose predictions at the runs
differ by more than SAME_PREDICTION in ln loss somewhere. Optima that predict
the same losses (one law reached at different E, both near 0) are one.

**Compute-optimal frontier.** With C = 6 N D (Hoffmann's FLOP model, N the
count the fit uses), L(N, C / (6N)) is least at
N_opt = G (C/6)^a, D_opt = (C/6)^b / G, a = beta / (alpha + beta),
b = alpha / (alpha + beta), G = (alpha A / (beta B))^(1 / (alpha + beta));
undefined (nan) unless alpha, beta > 0. With another FLOP model C = F(N) D
(this project's budgets count attention), the least of L(N, C / F(N)) is
found numerically (`frontier_numeric`): ln F is read off the runs
(`FlopModel`), the loss evaluated on a grid in ln N about the 6 N D optimum
and the grid's least point refined by a parabola through its neighbours.
"""
import dataclasses
import functools

import numpy as np
import threadpoolctl
from scipy import optimize

DELTA = 1e-3
HOFFMANN_GRID = {"a": np.arange(0, 26, 5.0), "b": np.arange(0, 26, 5.0),
                 "e": np.arange(-1, 1.01, 0.5), "alpha": np.arange(0, 2.01, 0.5),
                 "beta": np.arange(0, 2.01, 0.5)}
NAMES = tuple(HOFFMANN_GRID)  # theta's order
_OPTIONS = {"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-10}
SAME_PREDICTION = 1e-4  # two optima whose ln-loss predictions all agree within this are one law
RIVAL = 1.25  # an optimum within this factor of the best objective may win a resample


# Each term of the law: its entries of theta and the values that hold it at 0.
TERMS = {"E": {"e": -np.inf}, "N": {"a": -np.inf, "alpha": 0.0},
         "D": {"b": -np.inf, "beta": 0.0}}


def hoffmann_grid(dropped: frozenset = frozenset()) -> np.ndarray:
  """Every point of Hoffmann et al.'s grid of starts, (4500, 5) in NAMES' order;
  for a reduced law without the `dropped` terms (of TERMS), the grid without
  their axes, each held at its 0 (E = 0: (900, 5))."""
  axes = dict(HOFFMANN_GRID)
  for term in dropped:
    axes.update({name: np.array([value]) for name, value in TERMS[term].items()})
  mesh = np.meshgrid(*axes.values(), indexing="ij")
  return np.stack([m.ravel() for m in mesh], axis=1)


def free_entries(theta: np.ndarray) -> np.ndarray:
  """Which entries of theta the optimiser moves: all but a dropped term's
  (a, b or e at -inf, and a dropped term's exponent)."""
  a, b, e = np.isfinite(theta[:3])
  return np.array([a, b, e, a, b])


def _huber(r: np.ndarray) -> np.ndarray:
  size = np.abs(r)
  return np.where(size <= DELTA, 0.5 * r * r, DELTA * (size - 0.5 * DELTA))


def log_loss(theta: np.ndarray, ln_n, ln_d) -> np.ndarray:
  """ln L(N, D) for thetas (..., 5) broadcast against ln N and ln D."""
  theta = np.asarray(theta)
  a, b, e, alpha, beta = (theta[..., i, None] for i in range(5))
  return np.logaddexp(np.logaddexp(a - alpha * ln_n, b - beta * ln_d), e)


def grid_objective(thetas: np.ndarray, ln_n, ln_d, ln_loss) -> np.ndarray:
  """The objective at many thetas (K, 5) at once (all weights 1)."""
  return _huber(log_loss(thetas, ln_n, ln_d) - ln_loss).sum(axis=-1)


def objective(theta: np.ndarray, ln_n, ln_d, ln_loss, weights) -> tuple[float, np.ndarray]:
  """The weighted Huber objective at one theta and its analytic gradient."""
  a, b, e, alpha, beta = theta
  x1, x2 = a - alpha * ln_n, b - beta * ln_d
  top = np.maximum(np.maximum(x1, x2), e)
  e1, e2, e3 = np.exp(x1 - top), np.exp(x2 - top), np.exp(e - top)
  total = e1 + e2 + e3
  r = top + np.log(total) - ln_loss
  psi = weights * np.clip(r, -DELTA, DELTA) / total  # Huber's derivative times dLSE/dx
  p1, p2 = psi * e1, psi * e2
  grad = np.array([p1.sum(), p2.sum(), psi @ e3, -(p1 @ ln_n), -(p2 @ ln_d)])
  return float(weights @ _huber(r)), grad


@functools.cache
def _blas() -> threadpoolctl.ThreadpoolController:
  return threadpoolctl.ThreadpoolController()


def minimise(starts: np.ndarray, ln_n, ln_d, ln_loss, weights) -> tuple[np.ndarray, np.ndarray]:
  """L-BFGS-B from each start: the optima (K, 5) and their objectives (K,).
  Runs of weight 0 are left out of the sums (a bootstrap resample's unpicked).

  The optimiser sees ln N and ln D centred on their means, and a, b shifted
  to match (a - alpha ln N = (a - alpha m) - alpha (ln N - m)): the same
  objective and optimum, better conditioned (about half the evaluations).
  BLAS runs on one thread here: L-BFGS-B's five-parameter steps call it, and
  its threads only wait on each other (one start took 2.4 s with them and
  0.026 s without on a busy 2-core machine)."""
  keep = weights > 0
  m_n, m_d = ln_n[keep].mean(), ln_d[keep].mean()
  args = (ln_n[keep] - m_n, ln_d[keep] - m_d, ln_loss[keep], weights[keep].astype(np.float64))
  free = free_entries(starts[0])  # a reduced law's starts hold its dropped terms at 0
  thetas = []
  with _blas().limit(limits=1, user_api="blas"):
    for start in starts:
      held = _shifted(start, -m_n, -m_d)
      result = optimize.minimize(_objective_of_free, held[free], args=(held, free, *args),
                                 jac=True, method="L-BFGS-B", options=_OPTIONS)
      held[free] = result.x
      thetas.append((_shifted(held, m_n, m_d), result.fun))
  return np.array([t for t, _ in thetas]), np.array([v for _, v in thetas])


def _objective_of_free(x: np.ndarray, held: np.ndarray, free: np.ndarray, *args
                       ) -> tuple[float, np.ndarray]:
  """The objective and gradient in theta's free entries `x`, the others `held`."""
  theta = held.copy()
  theta[free] = x
  value, grad = objective(theta, *args)
  return value, grad[free]


def _shifted(theta: np.ndarray, m_n: float, m_d: float) -> np.ndarray:
  """theta with a += alpha m_n, b += beta m_d (to and from centred logs)."""
  a, b, e, alpha, beta = theta
  return np.array([a + alpha * m_n, b + beta * m_d, e, alpha, beta])


def rival_optima(optima: np.ndarray, values: np.ndarray, ln_n, ln_d) -> np.ndarray:
  """The distinct laws among the optima (no two whose ln-loss predictions at
  the runs all agree within SAME_PREDICTION) whose objective is within RIVAL
  of the lowest, lowest first. Optima that predict alike are one law however
  far apart their parameters (E at 1e-12 or 1e-19: both 0 to the runs). The
  others are no rivals: starts that stalled where one term of the law
  vanishes (A/N^alpha at alpha ~ 0, a large), several times the lowest
  objective."""
  predictions = log_loss(optima, ln_n, ln_d)
  kept = []
  for i in np.argsort(values):
    if values[i] > RIVAL * values.min():
      break
    if all(np.abs(predictions[i] - predictions[j]).max() > SAME_PREDICTION for j in kept):
      kept.append(i)
  return optima[kept]


def fit_law(ln_n, ln_d, ln_loss, starts: int, dropped: frozenset = frozenset()) -> dict:
  """The full fit from the `starts` best grid points (of the reduced law
  without the `dropped` terms, where any): theta, its objective, how many
  starts reached it (within 1e-9 of it, relative), and its rivals
  (`rival_optima`, theta first)."""
  grid = hoffmann_grid(dropped)
  chosen = grid[np.argsort(grid_objective(grid, ln_n, ln_d, ln_loss), kind="stable")[:starts]]
  optima, values = minimise(chosen, ln_n, ln_d, ln_loss, np.ones(len(ln_n)))
  best = int(np.argmin(values))
  reached = int((values <= values[best] * (1 + 1e-9)).sum())
  return {"theta": optima[best], "objective": float(values[best]), "starts": len(chosen),
          "reached": reached, "optima": rival_optima(optima, values, ln_n, ln_d)}


def named(theta: np.ndarray) -> dict[str, np.ndarray]:
  """E, A, B, alpha, beta and the frontier's exponents a, b of thetas (..., 5)."""
  a, b, e, alpha, beta = (theta[..., i] for i in range(5))
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # inf: undefined
    ok = (alpha > 0) & (beta > 0)
    return {"E": np.exp(e), "A": np.exp(a), "B": np.exp(b), "alpha": alpha, "beta": beta,
            "a": np.where(ok, beta / (alpha + beta), np.nan),
            "b": np.where(ok, alpha / (alpha + beta), np.nan)}


def frontier(theta: np.ndarray, flops) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(N_opt, D_opt, loss) at compute C = 6 N D for thetas (..., 5) and budgets
  (K,): arrays (..., K); nan where alpha or beta <= 0."""
  theta = np.asarray(theta)
  a, b, e, alpha, beta = (theta[..., i, None] for i in range(5))
  ln_c6 = np.log(np.asarray(flops, dtype=np.float64) / 6)
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    ok = (alpha > 0) & (beta > 0)
    ln_g = (np.log(np.where(ok, alpha, 1)) + a - np.log(np.where(ok, beta, 1)) - b) / (alpha + beta)
    ln_n = np.where(ok, ln_g + beta / (alpha + beta) * ln_c6, np.nan)
    ln_d = ln_c6 - ln_n
    loss = np.exp(log_loss(theta[..., None, :], ln_n[..., None], ln_d[..., None])[..., 0])
  return np.exp(ln_n), np.exp(ln_d), loss


@dataclasses.dataclass(frozen=True)
class FlopModel:
  """Training FLOPs per token F(N): ln F piecewise linear in ln N through the
  points (ln_n, ln_f) (ln_n increasing), extended past the ends along the end
  segments. `name` is the unit every compute is printed in."""
  ln_n: np.ndarray
  ln_f: np.ndarray
  name: str

  def ln_flops_per_token(self, ln_n: np.ndarray) -> np.ndarray:
    """ln F at ln N (any shape)."""
    x, y = self.ln_n, self.ln_f
    low = y[0] + (y[1] - y[0]) / (x[1] - x[0]) * (ln_n - x[0])
    high = y[-1] + (y[-1] - y[-2]) / (x[-1] - x[-2]) * (ln_n - x[-1])
    return np.where(ln_n < x[0], low, np.where(ln_n > x[-1], high, np.interp(ln_n, x, y)))


SIX_ND = FlopModel(np.array([0.0, 1.0]), np.log(6) + np.array([0.0, 1.0]), "6·N·D")


def flop_model(n: np.ndarray, d: np.ndarray, flops: np.ndarray, name: str) -> FlopModel:
  """The FLOP model of runs whose compute is `flops`: F at each distinct N
  the least of its runs' flops / D (a budget turned into whole steps buys
  at most its FLOPs, so the least is the nearest F)."""
  sizes = np.unique(n)
  ln_f = np.array([np.log(flops[n == s] / d[n == s]).min() for s in sizes])
  return FlopModel(np.log(sizes), ln_f, name)


SEARCH = 4.0  # the numerical frontier searches ln N within this of the 6 N D optimum
POINTS = 401


def frontier_numeric(theta: np.ndarray, flops, model: FlopModel
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(N_opt, D_opt, loss) at compute C = F(N) D for thetas (..., 5) and
  budgets (K,): arrays (..., K), the least of L(N, C / F(N)) over N found on
  a grid of POINTS in ln N within SEARCH of the 6 N D optimum, refined by the
  parabola through the least point and its neighbours; nan where alpha or
  beta <= 0 or the least point is the grid's end."""
  theta = np.asarray(theta)
  ln_c = np.log(np.asarray(flops, dtype=np.float64))
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    centre = np.log(frontier(theta, flops)[0])  # (..., K)
    step = 2 * SEARCH / (POINTS - 1)
    ln_n = np.nan_to_num(centre)[..., None] + np.linspace(-SEARCH, SEARCH, POINTS)
    ln_d = ln_c[:, None] - model.ln_flops_per_token(ln_n)
    y = log_loss(theta[..., None, :], ln_n, ln_d)  # (..., K, POINTS)
    least = np.argmin(y, axis=-1)
    i = np.clip(least, 1, POINTS - 2)[..., None]
    y0, y1, y2 = (np.take_along_axis(y, i + k, axis=-1)[..., 0] for k in (-1, 0, 1))
    shift = np.clip(0.5 * step * (y0 - y2) / (y0 - 2 * y1 + y2), -step, step)
    best = np.take_along_axis(ln_n, i, axis=-1)[..., 0] + shift
    best = np.where(np.isfinite(centre) & (least > 0) & (least < POINTS - 1), best, np.nan)
    best_d = ln_c - model.ln_flops_per_token(best)
    loss = np.exp(log_loss(theta[..., None, :], best[..., None], best_d[..., None])[..., 0])
  return np.exp(best), np.exp(best_d), loss


def parabolas(ln_n: np.ndarray, loss: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray]:
  """One budget's parabola per row of `weights` (R, runs): its coefficients
  (R, 3) in u = ln N - mean ln N, ln N_opt (nan where not convex or fewer
  than 3 distinct sizes carry weight), the loss there, and whether the
  minimum lies inside the sizes that carry weight."""
  centre = ln_n.mean()
  u = ln_n - centre
  design = np.stack([np.ones_like(u), u, u * u], axis=1)
  sizes = np.unique(ln_n)
  present = np.stack([(weights[:, ln_n == s] > 0).any(axis=1) for s in sizes], axis=1)
  solvable = present.sum(axis=1) >= 3
  w = np.where(solvable[:, None], weights, 1.0)  # a stand-in where unsolvable, then discarded
  normal = np.einsum("ri,ij,ik->rjk", w, design, design)
  rhs = np.einsum("ri,ij,i->rj", w, design, loss)
  coef = np.linalg.solve(normal, rhs[..., None])[..., 0]
  coef[~solvable] = np.nan
  c0, c1, c2 = coef.T
  convex = c2 > 0
  with np.errstate(invalid="ignore", divide="ignore"):
    u_opt = np.where(convex, -c1 / (2 * c2), np.nan)
  lowest = np.where(present, sizes, np.inf).min(axis=1)
  highest = np.where(present, sizes, -np.inf).max(axis=1)
  ln_opt = centre + u_opt
  return {"coef": coef, "centre": centre, "ln_n_opt": ln_opt,
          "loss_opt": c0 + c1 * u_opt + c2 * u_opt ** 2,
          "convex": convex, "inside": convex & (ln_opt >= lowest) & (ln_opt <= highest)}


def interpolate_ln_d(ln_n: np.ndarray, ln_d: np.ndarray, at: np.ndarray) -> np.ndarray:
  """ln D at ln N = `at`, linear between a budget's sizes (each size's mean ln
  D); nan where `at` is nan or outside the sizes."""
  sizes = np.unique(ln_n)
  means = np.array([ln_d[ln_n == s].mean() for s in sizes])
  inside = (at >= sizes[0]) & (at <= sizes[-1])
  return np.where(inside, np.interp(np.nan_to_num(at), sizes, means), np.nan)


def power_laws(ln_c: np.ndarray, ln_y: np.ndarray, usable: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
  """Least-squares lines ln y = ln k + slope ln C over the usable budgets, one
  per row of ln_y and usable (R, budgets): (slope, ln k), nan where fewer
  than 2 budgets are usable."""
  m = usable.astype(np.float64)
  count = m.sum(axis=1)
  with np.errstate(invalid="ignore", divide="ignore"):
    y = np.where(usable, ln_y, 0.0)
    x_mean = (m * ln_c).sum(axis=1) / count
    y_mean = (m * y).sum(axis=1) / count
    dx = ln_c - x_mean[:, None]
    slope = (m * dx * (y - y_mean[:, None])).sum(axis=1) / (m * dx * dx).sum(axis=1)
    intercept = y_mean - slope * x_mean
  bad = count < 2
  return np.where(bad, np.nan, slope), np.where(bad, np.nan, intercept)
