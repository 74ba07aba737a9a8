"""The statistics of a sweep's report: each variant's mean over its seeds with a
95% confidence interval, and its difference from the baseline variant (Welch).

For the n values x_i of a variant: mean m, sample standard deviation
s = sqrt(sum (x_i - m)^2 / (n - 1)), and the interval m +- t_{0.975, n-1} s / sqrt(n)
(Student t). Against the baseline b (mean m_b, s_b, n_b): the difference
d = m - m_b, its standard error se = sqrt(s^2 / n + s_b^2 / n_b), the
Welch-Satterthwaite degrees of freedom
df = se^4 / ((s^2 / n)^2 / (n - 1) + (s_b^2 / n_b)^2 / (n_b - 1)), the interval
d +- t_{0.975, df} se and Welch's two-sided p = 2 P(T_df > |d / se|), as
`scipy.stats.ttest_ind(x, x_b, equal_var=False)`. A variant whose interval
overlaps the baseline's is "not distinguishable" from it (a stricter rule
than p < 0.05). Intervals need n >= 2; with n = 1 there is the value alone.
"""
import dataclasses
import math

import numpy as np
from scipy import stats

LEVEL = 0.95  # of every interval

BASELINE = "baseline"
SAME = "not distinguishable"
DIFFERS = "differs"
NO_INTERVAL = "no interval (n=1)"


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
  """A variant against the baseline: the difference of means, its Welch
  interval and p (None where either side has n < 2, or both spread 0),
  and the verdict of the intervals' overlap."""
  diff: float | None
  low: float | None
  high: float | None
  df: float | None
  p: float | None
  verdict: str


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


def compare(a: Summary, baseline: Summary, is_baseline: bool = False) -> Comparison:
  """`a` against `baseline`: Welch's difference, interval and p, and the verdict."""
  if is_baseline:
    return Comparison(None, None, None, None, None, BASELINE if a.n else "")
  if not a.n or not baseline.n:
    return Comparison(None, None, None, None, None, "")
  diff = a.mean - baseline.mean
  if a.n < 2 or baseline.n < 2:
    return Comparison(diff, None, None, None, None, NO_INTERVAL)
  verdict = SAME if a.low <= baseline.high and baseline.low <= a.high else DIFFERS
  va, vb = a.sd ** 2 / a.n, baseline.sd ** 2 / baseline.n
  se = math.sqrt(va + vb)
  if se == 0:
    return Comparison(diff, None, None, None, None, verdict)
  df = se ** 4 / (va ** 2 / (a.n - 1) + vb ** 2 / (baseline.n - 1))
  half = _t(df) * se
  p = float(2 * stats.t.sf(abs(diff) / se, df))
  return Comparison(diff, diff - half, diff + half, df, p, verdict)
