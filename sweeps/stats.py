"""The statistics of a sweep's report: each variant's mean over its seeds with a
95% confidence interval, and its difference from the baseline variant:
unpaired (Welch), paired by seed where the seeds pair, Holm-adjusted over
the variants.

For the n values x_i of a variant: mean m, sample standard deviation
s = sqrt(sum (x_i - m)^2 / (n - 1)), and the interval m +- t_{0.975, n-1} s / sqrt(n)
(Student t). Against the baseline b (mean m_b, s_b, n_b): the difference
d = m - m_b, its standard error se = sqrt(s^2 / n + s_b^2 / n_b), the
Welch-Satterthwaite degrees of freedom
df = se^4 / ((s^2 / n)^2 / (n - 1) + (s_b^2 / n_b)^2 / (n_b - 1)), the interval
d +- t_{0.975, df} se and Welch's two-sided p = 2 P(T_df > |d / se|), as
`scipy.stats.ttest_ind(x, x_b, equal_var=False)`. Paired, over the n
per-seed differences d_k = x_k - b_k: their mean, sd s_d, the interval
mean +- t_{0.975, n-1} s_d / sqrt(n) and p = 2 P(T_{n-1} > |mean| / (s_d / sqrt(n))),
as `scipy.stats.ttest_rel(x, x_b)`.

The verdict follows the difference's own 95% interval: it excludes 0 (then
p < 0.05 as well, the same t quantile) and the variant is "lower" or
"higher" than the baseline, "(better)" or "(worse)" by the metric's
direction; it contains 0 and the variant is "not distinguishable". Holm's
adjusted p (`holm`) reads the same differences as one family of
comparisons with the baseline; the verdicts stay per comparison.
Intervals need n >= 2; with n = 1 there is the value alone.
"""
import dataclasses
import math

import numpy as np
from scipy import stats

ALPHA = 0.05  # the significance level of the tests
LEVEL = 1 - ALPHA  # of every interval, 0.95

BASELINE = "baseline"
SAME = "not distinguishable"
NO_INTERVAL = "no interval (n=1)"
NO_SPREAD = "no interval (no spread)"


@dataclasses.dataclass(frozen=True)
class Summary:
  """n values: their mean, sample sd (ddof=1) and the interval of the mean;
  sd and interval None for n < 2, everything None for n = 0."""
  n: int
  mean: float | None
  sd: float | None
  low: float | None
  high: float | None


@dataclasses.dataclass(frozen=True)
class Comparison:
  """A variant against the baseline: the difference (of means, or the mean of
  per-seed differences), its 95% interval, df and two-sided p (None where
  either side has n < 2, or no spread), and the verdict of that interval."""
  diff: float | None
  low: float | None
  high: float | None
  df: float | None
  p: float | None
  verdict: str


NONE = Comparison(None, None, None, None, None, "")


def _t(df: float) -> float:
  """t_{(1 + LEVEL) / 2, df}, the quantile of a two-sided LEVEL interval."""
  return float(stats.t.ppf((1 + LEVEL) / 2, df))


def summarize(values) -> Summary:
  """The mean, sd and Student-t interval of `values` (see the module docstring)."""
  x = np.asarray(values, dtype=np.float64)
  n = len(x)
  if n == 0:
    return Summary(0, None, None, None, None)
  mean = float(x.mean())
  if n == 1:
    return Summary(1, mean, None, None, None)
  sd = float(x.std(ddof=1))
  half = _t(n - 1) * sd / math.sqrt(n)
  return Summary(n, mean, sd, mean - half, mean + half)


def verdict(low: float, high: float, lower_is_better: bool) -> str:
  """The verdict of a difference's interval [low, high]: SAME when it contains
  0, else the side of 0 it lies on and whether that is better."""
  if low <= 0 <= high:
    return SAME
  lower = high < 0
  better = lower == lower_is_better
  return f"{'lower' if lower else 'higher'} ({'better' if better else 'worse'})"


def _t_comparison(diff: float, se: float, df: float, lower_is_better: bool) -> Comparison:
  """The interval diff +- t_{0.975, df} se, its two-sided p and verdict."""
  half = _t(df) * se
  p = float(2 * stats.t.sf(abs(diff) / se, df))
  return Comparison(diff, diff - half, diff + half, df, p,
                    verdict(diff - half, diff + half, lower_is_better))


def compare(a: Summary, baseline: Summary, lower_is_better: bool,
            is_baseline: bool = False) -> Comparison:
  """`a` against `baseline`, unpaired: Welch's difference, interval, p and
  the verdict of the interval."""
  if is_baseline:
    return dataclasses.replace(NONE, verdict=BASELINE if a.n else "")
  if not a.n or not baseline.n:
    return NONE
  diff = a.mean - baseline.mean
  if a.n < 2 or baseline.n < 2:
    return dataclasses.replace(NONE, diff=diff, verdict=NO_INTERVAL)
  va, vb = a.sd ** 2 / a.n, baseline.sd ** 2 / baseline.n
  se = math.sqrt(va + vb)
  if se == 0:
    return dataclasses.replace(NONE, diff=diff, verdict=NO_SPREAD)
  df = se ** 4 / (va ** 2 / (a.n - 1) + vb ** 2 / (baseline.n - 1))
  return _t_comparison(diff, se, df, lower_is_better)


def compare_paired(values, baseline_values, lower_is_better: bool) -> Comparison:
  """`values` against `baseline_values`, the same seed at each position: the
  mean of the per-seed differences, its Student-t interval, p (paired t-test)
  and the verdict of the interval; NONE for fewer than 2 pairs."""
  d = np.asarray(values, dtype=np.float64) - np.asarray(baseline_values, dtype=np.float64)
  if len(d) < 2:
    return NONE
  diff, sd = float(d.mean()), float(d.std(ddof=1))
  if sd == 0:
    return dataclasses.replace(NONE, diff=diff, verdict=NO_SPREAD)
  return _t_comparison(diff, sd / math.sqrt(len(d)), len(d) - 1, lower_is_better)


def holm(p_values: list[float | None]) -> list[float | None]:
  """Holm-Bonferroni adjusted p-values of the family of the given p (None:
  not in the family, None back): with the m p-values sorted, p_(1) <= ... <=
  p_(m), p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))."""
  family = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
  adjusted, running = [None] * len(p_values), 0.0
  for rank, (p, i) in enumerate(family):
    running = max(running, min(1.0, (len(family) - rank) * p))
    adjusted[i] = running
  return adjusted
