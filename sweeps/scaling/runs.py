"""The runs a scaling law is fitted to: rows (a CSV's, or a sweep's) checked
and turned into arrays, grouped into isoFLOP budgets where they form them,
some held out.

A row is a dict of column -> value (strings from a CSV, numbers from a
sweep). `make_runs` names the columns: parameters N (the count the fit uses,
with or without embeddings), tokens D, loss, and optionally the budget C,
the seed, the variant and the held-out marks.

Each run's compute is in one unit, the table's FLOP model: the budget column
where there is one (this project's budgets count attention:
`model/accounting.flops_per_token(N) · D`), else 6 N D.

Budgets are optional: the parametric law needs none. Without a budget column
each run's budget is 6 N D, grouped: the runs sorted by it, a run more than
GAP (25%) above the previous one starts a new budget, and a budget is its
runs' geometric mean rounded to two significant digits (1.04e19 and 0.98e19
are one budget, 1.0e19). Where a group spans more than SPAN (x1.5) the runs
are not laid out on isoFLOP budgets (a paper's table of assorted sizes and
token counts): they get no budget (nan), and only the parametric law is
fitted to them.
"""
import csv
import dataclasses
import math

import numpy as np

from configs.errors import UserError

GAP = 1.25
SPAN = 1.5
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no", "")


@dataclasses.dataclass(frozen=True)
class Runs:
  """One entry per run (numpy arrays of one length): N, D, loss, budget C
  (nan where the runs form no isoFLOP budgets), compute `flops` in the
  FLOP model's unit, seed and variant (strings), held out (bool); `params`
  names what N counts, `budget_from` how C was found, `flop_model` the unit
  of `flops` (and of C and every compute the fits print)."""
  n: np.ndarray
  d: np.ndarray
  loss: np.ndarray
  budget: np.ndarray
  flops: np.ndarray
  seed: np.ndarray
  variant: np.ndarray
  held_out: np.ndarray
  params: str
  budget_from: str
  flop_model: str

  def select(self, mask: np.ndarray) -> "Runs":
    """The runs where `mask` is true."""
    arrays = {f.name: getattr(self, f.name)[mask] for f in dataclasses.fields(self)
              if isinstance(getattr(self, f.name), np.ndarray)}
    return dataclasses.replace(self, **arrays)

  def variants(self) -> list[str]:
    """The variants in the order they first appear."""
    return list(dict.fromkeys(self.variant.tolist()))


def read_csv(path: str) -> list[dict]:
  """The rows of a CSV file with a header line."""
  try:
    with open(path, newline="", encoding="utf-8") as f:
      rows = list(csv.DictReader(f))
  except OSError as e:
    raise UserError(f"--csv {path}: cannot read it ({e.strerror})") from e
  except (UnicodeDecodeError, csv.Error) as e:
    raise UserError(f"--csv {path}: not a UTF-8 CSV file ({e})") from e
  if not rows:
    raise UserError(f"--csv {path}: no rows under its header; give a CSV with one run a row")
  return rows


def _check_columns(rows: list[dict], columns: dict[str, str | None]) -> None:
  present = list(rows[0])
  for flag, column in columns.items():
    if column is not None and column not in present:
      raise UserError(f"--{flag} {column}: no such column; the columns: {', '.join(present)}")


def _positive(rows: list[dict], column: str) -> np.ndarray:
  """The column as floats; UserError naming the row of a value that is not a
  positive finite number (rows counted from 1, the header not counted)."""
  out = np.empty(len(rows))
  for i, row in enumerate(rows):
    value = row[column]
    try:
      out[i] = float(value)
    except (TypeError, ValueError):
      raise UserError(f"row {i + 1}: {column}={value!r} is not a number") from None
    if not math.isfinite(out[i]) or out[i] <= 0:
      raise UserError(f"row {i + 1}: {column}={value!r} must be a positive number")
  return out


def _flags(rows: list[dict], column: str) -> np.ndarray:
  """A column of held-out marks (1/0, true/false, yes/no, empty) as bools."""
  out = np.empty(len(rows), dtype=bool)
  for i, row in enumerate(rows):
    value = str(row[column]).strip().lower()
    if value not in _TRUE + _FALSE:
      raise UserError(f"row {i + 1}: {column}={row[column]!r} does not say held out or not; "
                      "write 1/0, true/false or yes/no")
    out[i] = value in _TRUE
  return out


def group_budgets(flops: np.ndarray) -> np.ndarray | None:
  """Each run's isoFLOP budget from its 6 N D, or None where the runs form no
  clear budgets (see the module docstring)."""
  order = np.argsort(flops)
  sorted_flops = flops[order]
  starts = np.concatenate([[0], np.flatnonzero(sorted_flops[1:] > GAP * sorted_flops[:-1]) + 1,
                           [len(flops)]])
  budget = np.empty(len(flops))
  for lo, hi in zip(starts[:-1], starts[1:]):
    group = sorted_flops[lo:hi]
    if group[-1] > SPAN * group[0]:
      return None
    centre = math.exp(np.log(group).mean())
    budget[order[lo:hi]] = float(f"{centre:.2g}")
  return budget


def parse_holdout(spec: str | None) -> tuple[str, float | str] | None:
  """`--holdout`: ("budget", X) for `budget>=X` (runs whose budget, or
  compute where they have no budget, is X or more), ("column", NAME) for a
  column name, None for none."""
  if not spec:
    return None
  if spec.startswith("budget>="):
    try:
      threshold = float(spec[len("budget>="):])
    except ValueError:
      raise UserError(f"--holdout {spec}: budget>= needs a number (budget>=1e20)") from None
    return ("budget", threshold)
  if any(c in spec for c in "<>="):
    raise UserError(f"--holdout {spec}: give budget>=X (budgets from X up held out) or the "
                    "name of a column marking held-out rows")
  return ("column", spec)


def make_runs(rows: list[dict], *, params: str, tokens: str, loss: str,
              budget: str | None = None, seed: str | None = None, variant: str | None = None,
              holdout: str | None = None) -> Runs:
  """The runs of `rows`, their columns named by the arguments (`holdout`: see
  `parse_holdout`). UserError for a missing column or a value that is not a
  positive number."""
  if not rows:
    raise UserError("no runs to fit")
  held = parse_holdout(holdout)
  _check_columns(rows, {"params": params, "tokens": tokens, "loss": loss, "budget": budget,
                        "seed": seed, "variant": variant,
                        "holdout": held[1] if held and held[0] == "column" else None})
  n, d, losses = _positive(rows, params), _positive(rows, tokens), _positive(rows, loss)
  if budget is not None:
    budgets, budget_from = _positive(rows, budget), f"the column `{budget}`"
    flops, flop_model = budgets, f"the budget column `{budget}`"
  else:
    flops, flop_model = 6 * n * d, "6·N·D"
    grouped = group_budgets(flops)
    if grouped is None:
      budgets = np.full(len(rows), np.nan)
      budget_from = (f"none: 6·N·D from {flops.min():.3g} to {flops.max():.3g} forms no clear "
                     "isoFLOP budgets (approach 3 only; give a budget column with --budget for "
                     "approach 2)")
    else:
      budgets = grouped
      budget_from = (f"6·N·D grouped: runs sorted by it, one more than {GAP - 1:.0%} above the "
                     "previous starts a new budget, each budget the geometric mean of its runs "
                     "to 2 significant digits")
  if held is None:
    held_out = np.zeros(len(rows), dtype=bool)
  elif held[0] == "budget":
    held_out = np.where(np.isnan(budgets), flops, budgets) >= held[1]
  else:
    held_out = _flags(rows, held[1])
  return Runs(n=n, d=d, loss=losses, budget=budgets, flops=flops,
              seed=np.array([str(r[seed]) if seed else "" for r in rows]),
              variant=np.array([str(r[variant]) if variant else "all" for r in rows]),
              held_out=held_out, params=params, budget_from=budget_from, flop_model=flop_model)
