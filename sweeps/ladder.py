"""A compute ladder's cells, from a sweep file's declarative LADDER
(configs/sweeps/ladder.py): at each FLOP budget, `sizes` models spaced evenly
in log N around the budget's compute-optimal size, each trained for exactly
that budget (`train.flop_budget`); `sweep.py scaling` fits the laws to the
runs (docs/scaling.md).

LADDER is a dict:
  budgets           training FLOPs per run, one ladder rung each
  sizes             models per budget
  spacing           N of a budget's neighbouring sizes, one over the other
  tokens_per_param  D / N at the compute-optimal size (Chinchilla's ~20)
  widths            (first, last): the widths k of the size family, both included
  width_fields      field -> multiple of k: width k's overrides (d_model = 4k, ...)
  holdout           budgets run at their compute-optimal size only (the held-out check)
  max_steps         the most steps a cell may train
  variants          override dicts: every cell runs under each ([]: one ladder)

The size family is one rule, width k's overrides; N is a size's every
parameter, embeddings included (Chinchilla's count), and F(N) its training
FLOPs per token, attention included, both by the closed forms of
model/accounting.py on the sweep file's CONFIG. A budget C's compute-optimal
size is the N at which C buys D = C / F(N) = tokens_per_param x N tokens
(interpolated in log N between widths); its sizes aim at that N times
spacing^j, j centred on 0, each the width nearest in log N. A budget whose
aims the family cannot meet (a size farther than spacing^(1/3) from its aim,
two aims on one width) or whose cells would train fewer than 1 or more than
max_steps steps at CONFIG's batch is refused in one line that names the
budgets the family can take. Each cell is named `flop_budget=<C>,<width
fields>`, from which `sweep.py scaling` reads the budget and the size. The
sizes are chosen on CONFIG alone: a variant that changes a model's
parameters or FLOPs moves its cells off the aims (the budgets stay exact).

Built here, not in the sweep file: configs/ imports nothing above it, and
the sizes need model/accounting.py.
"""
import math
import os

from configs.cli import load_config
from configs.errors import UserError
from model import accounting
from sweeps.common import REPO


def size(spec: dict, k: int) -> dict:
  """Width k's overrides: the family's one rule."""
  return {field: multiple * k for field, multiple in spec["width_fields"].items()}


def family(spec: dict, config) -> list[tuple[dict, int, int]]:
  """(overrides, N, training FLOPs per token) of each width of `config`."""
  first, last = spec["widths"]
  out = []
  for k in range(first, last + 1):
    model = config.model.copy_and_resolve_references()
    for field, value in size(spec, k).items():
      model[field.split(".", 1)[1]] = value
    out.append((size(spec, k), accounting.formula_params(model)["params_total"],
                accounting.flops_per_token(model, config.train.seq_len, train=True)))
  return out


def optimal_params(spec: dict, budget: float, sizes: list[tuple[dict, int, int]]) -> float:
  """The N at which `budget` buys tokens_per_param tokens per parameter,
  log-linear between the widths around it (extrapolated past the ends)."""
  ratios = [math.log(budget / f / n / spec["tokens_per_param"]) for _, n, f in sizes]  # falls
  i = next((i for i in range(1, len(sizes) - 1) if ratios[i] <= 0), len(sizes) - 1)
  (_, n0, _), (_, n1, _) = sizes[i - 1], sizes[i]
  t = ratios[i - 1] / (ratios[i - 1] - ratios[i])
  return math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0)))


def _cells(spec: dict, budget: float, sizes: list, tokens_per_step: int
           ) -> tuple[list | None, str]:
  """The budget's sizes (overrides, N), or None and why not."""
  n_opt = optimal_params(spec, budget, sizes)
  spacing, count = spec["spacing"], spec["sizes"]
  picked = []
  for j in range(count):
    aim = n_opt * spacing ** (j - (count - 1) / 2)
    overrides, n, f = min(sizes, key=lambda s, aim=aim: abs(math.log(s[1] / aim)))
    if abs(math.log(n / aim)) > math.log(spacing) / 3:
      return None, f"no width of the family is within {spacing ** (1 / 3):.2f}x of N={aim:.3g}"
    if picked and picked[-1][0] == overrides:
      return None, f"N={aim:.3g} and its neighbour fall on one width"
    steps = int(budget // (f * tokens_per_step))
    if not 1 <= steps <= spec["max_steps"]:
      return None, f"N={n:.3g} would train {steps} steps (1 to max_steps={spec['max_steps']})"
    picked.append((overrides, n))
  return picked, ""


def _refuse(spec: dict, budget: float, why: str, sizes: list, tokens_per_step: int):
  takes = [f * spec["tokens_per_param"] * n for _, n, f in sizes]
  takes = [c for c in takes if _cells(spec, c, sizes, tokens_per_step)[0] is not None]
  span = f"from {min(takes):.2g} to {max(takes):.2g} FLOPs" if takes else "none"
  first, last = (sizes[0][0], sizes[-1][0])
  widths = ", ".join(f"{field.split('.')[-1]} {first[field]} to {last[field]}"
                     for field in first)
  raise UserError(f"ladder budget {budget:g}: {why}; the family ({widths}) takes budgets "
                  f"{span}: change LADDER's budgets or holdout")


def ladder(spec: dict, config) -> list[dict]:
  """The sweep's override dicts: each variant x (budget x size, then each
  holdout budget at its middle size, the one nearest its optimum)."""
  sizes = family(spec, config)
  tokens_per_step = config.train.batch_size * config.train.seq_len
  rows = []
  for budget in (*spec["budgets"], *spec["holdout"]):
    cells, why = _cells(spec, budget, sizes, tokens_per_step)
    if cells is None:
      _refuse(spec, budget, why, sizes, tokens_per_step)
    if budget in spec["holdout"]:
      cells = [cells[(spec["sizes"] - 1) // 2]]
    # The budget as text ("1e+12", parsed as the float field) keeps the names short.
    rows += [{"train.flop_budget": f"{budget:g}", **overrides} for overrides, _ in cells]
  return [{**extra, **row} for extra in spec["variants"] or [{}] for row in rows]


def sweep_overrides(spec: dict, config_path: str) -> list[dict]:
  """A ladder sweep file's override dicts: `ladder` on its CONFIG (a path
  relative to the repository where it is not absolute)."""
  return ladder(spec, load_config(os.path.join(REPO, config_path)))
