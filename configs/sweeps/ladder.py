"""A compute ladder on configs/tiny.py's architecture for scaling laws: at each
FLOP budget of BUDGETS, SIZES models spaced evenly in log N around the
budget's compute-optimal size, each trained for exactly that budget
(`train.flop_budget`); `sweep.py scaling` fits the laws to the runs
(docs/scaling.md).

  python sweep.py run --sweep configs/sweeps/ladder.py --seeds 2 --parallel 2
  python sweep.py scaling --root runs/sweeps/ladder --holdout 'budget>=4e12'

CONFIG is configs/tiny_ladder.py: tiny's decoder (2 layers, RoPE, RMSNorm
pre-norm, SwiGLU) on bytes as tokens, 2 heads, batch 8 and a 10% warm-up, so
that the smallest sizes are not mostly embedding and a 2-core CPU runs the
whole ladder in about an hour. The size family is one rule: width k (2 <= k
<= 128) is d_model = 4k, d_ff = 3 d_model (tiny's ratio), with 2 layers and 2
heads (head_dim = 2k). Only the width grows, with the head count fixed, as μP
widens a model (docs/models.md, "μP"). N is a size's every parameter,
embeddings included (Chinchilla's count), by the closed forms of
model/accounting.py, which also give its training FLOPs per token F(N)
(attention included).

A budget C's compute-optimal size is the N at which C buys D = C / F(N) =
TOKENS_PER_PARAM x N tokens (Chinchilla's ~20 tokens per parameter,
interpolated in log N between widths); its sizes aim at that N times
SPACING^j, j = -2..2 for five sizes, each the width nearest in log N. A
budget whose aims the family cannot meet (a size farther than SPACING^(1/3)
from its aim, two aims on one width) or whose cells would train fewer than
1 or more than MAX_STEPS steps at CONFIG's batch is refused in one line that
names the budgets the family can take. Each cell (budget, size; x seed with
--seeds) is named `flop_budget=<C>,d_model=<d>,d_ff=<f>`, from which
`sweep.py scaling` reads the budget and the size. HOLDOUT's budgets (at least
4x the largest of BUDGETS) run one cell each, the middle size, for the
held-out check: `sweep.py scaling --holdout 'budget>=X'` predicts them from
the others' laws.

VARIANTS makes one sweep of several ladders, an override dict each (here
RoPE against learned positions): every cell runs under each, named
`pos_emb=rope,flop_budget=...`, and `sweep.py scaling` fits one law per
variant and compares them; `[]` is one ladder. The sizes are chosen on
CONFIG alone; a variant or --config.* override that changes a model's
parameters or FLOPs moves its cells off the aims (learned positions add
max_len x d_model parameters; the budgets stay exact: train.flop_budget).

The learning rate is tiny's, 3e-3, at every size, under the standard
parametrization: the laws are this recipe's. Under
`--config.model.parametrization=mup --config.model.mup_base_width=32
--config.model.mup_output_mult=4 --config.train.learning_rate=0.015625` the
pair tuned at width 32 serves every width: in the transfer sweep on this
ladder's config (configs/sweeps/mup_transfer.py, widths 32 to 256, 2 seeds;
docs/sweeps.md) μP's best AdamW rate was 2^-6 at every width, while the
standard parametrization's moved 4 grid steps, and μP's loss there was
within the seeds' spread of the standard parametrization's at its own best
rate. The ladder's widths reach below 32 (8 to 104), where that was not
measured.
"""
import math

from configs import tiny_ladder
from configs.errors import UserError

NAME = "ladder"
CONFIG = "configs/tiny_ladder.py"
BUDGETS = (3e10, 1e11, 3e11, 1e12)  # training FLOPs per run
SIZES = 5  # sizes per budget
SPACING = 2.0  # N of a budget's neighbouring sizes, one over the other
TOKENS_PER_PARAM = 20.0  # Chinchilla's compute-optimal D / N
WIDTHS = range(2, 129)  # k: d_model = 4k
HOLDOUT = (4e12,)  # budgets run at their compute-optimal size only, for the held-out check
MAX_STEPS = 100_000
VARIANTS = [{"model.pos_emb": "rope"}, {"model.pos_emb": "learned"}]


def size(k: int) -> dict:
  """Width k's overrides of CONFIG: the family's one rule."""
  return {"model.d_model": 4 * k, "model.d_ff": 12 * k}


def family(config) -> list[tuple[dict, int, int]]:
  """(overrides, N, training FLOPs per token) of each width of `config`."""
  # Imported here: configs/ never imports model/ (tests/test_layering.py), and
  # the sweep file is a module of configs/.
  from model import accounting  # pylint: disable=import-outside-toplevel
  out = []
  for k in WIDTHS:
    model = config.model.copy_and_resolve_references()
    for field, value in size(k).items():
      model[field.split(".", 1)[1]] = value
    out.append((size(k), accounting.formula_params(model)["params_total"],
                accounting.flops_per_token(model, config.train.seq_len, train=True)))
  return out


def optimal_params(budget: float, sizes: list[tuple[dict, int, int]]) -> float:
  """The N at which `budget` buys TOKENS_PER_PARAM tokens per parameter,
  log-linear between the widths around it (extrapolated past the ends)."""
  ratios = [math.log(budget / f / n / TOKENS_PER_PARAM) for _, n, f in sizes]  # falls with N
  i = next((i for i in range(1, len(sizes) - 1) if ratios[i] <= 0), len(sizes) - 1)
  (_, n0, _), (_, n1, _) = sizes[i - 1], sizes[i]
  t = ratios[i - 1] / (ratios[i - 1] - ratios[i])
  return math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0)))


def _cells(budget: float, sizes: list, tokens_per_step: int) -> tuple[list | None, str]:
  """The budget's sizes (overrides, N), or None and why not."""
  n_opt = optimal_params(budget, sizes)
  picked = []
  for j in range(SIZES):
    aim = n_opt * SPACING ** (j - (SIZES - 1) / 2)
    overrides, n, f = min(sizes, key=lambda s, aim=aim: abs(math.log(s[1] / aim)))
    if abs(math.log(n / aim)) > math.log(SPACING) / 3:
      return None, f"no width of the family is within {SPACING ** (1 / 3):.2f}x of N={aim:.3g}"
    if picked and picked[-1][0] == overrides:
      return None, f"N={aim:.3g} and its neighbour fall on one width"
    steps = int(budget // (f * tokens_per_step))
    if not 1 <= steps <= MAX_STEPS:
      return None, f"N={n:.3g} would train {steps} steps (1 to MAX_STEPS={MAX_STEPS})"
    picked.append((overrides, n))
  return picked, ""


def _refuse(budget: float, why: str, sizes: list, tokens_per_step: int):
  takes = [f * TOKENS_PER_PARAM * n for _, n, f in sizes]
  takes = [c for c in takes if _cells(c, sizes, tokens_per_step)[0] is not None]
  span = (f"from {min(takes):.2g} to {max(takes):.2g} FLOPs" if takes else "none")
  raise UserError(f"ladder budget {budget:g}: {why}; the family (d_model {size(WIDTHS[0])['model.d_model']} "
                  f"to {size(WIDTHS[-1])['model.d_model']}) takes budgets {span}: change "
                  "BUDGETS or HOLDOUT")


def ladder(budgets, variants: list[dict], config, holdout=()) -> list[dict]:
  """The sweep's override dicts: each variant x (budget x size, then each
  holdout budget at its middle size, the one nearest its optimum)."""
  sizes = family(config)
  tokens_per_step = config.train.batch_size * config.train.seq_len
  rows = []
  for budget in (*budgets, *holdout):
    cells, why = _cells(budget, sizes, tokens_per_step)
    if cells is None:
      _refuse(budget, why, sizes, tokens_per_step)
    if budget in holdout:
      cells = [cells[(SIZES - 1) // 2]]
    # The budget as text ("1e+12", parsed as the float field) keeps the names short.
    rows += [{"train.flop_budget": f"{budget:g}", **overrides} for overrides, _ in cells]
  return [{**extra, **row} for extra in variants or [{}] for row in rows]


def get_sweep():
  return ladder(BUDGETS, VARIANTS, tiny_ladder.get_config(), HOLDOUT)
