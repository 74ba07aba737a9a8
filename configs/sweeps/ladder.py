"""A compute ladder on configs/tiny.py's architecture for scaling laws: at each
FLOP budget of LADDER's budgets, its `sizes` models spaced evenly in log N
around the budget's compute-optimal size, each trained for exactly that
budget (`train.flop_budget`); `sweep.py scaling` fits the laws to the runs
(docs/scaling.md). The file only declares the ladder: sweeps/ladder.py
builds its cells (it needs model/accounting.py, which configs/ never
imports), and sweeps/sweep_file.py calls it for a file with LADDER.

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
tokens_per_param x N tokens (Chinchilla's ~20 tokens per parameter,
interpolated in log N between widths); its sizes aim at that N times
spacing^j, j = -2..2 for five sizes, each the width nearest in log N. A
budget the family cannot take is refused in one line that names the budgets
it can (sweeps/ladder.py says when). Each cell (budget, size; x seed with
--seeds) is named `flop_budget=<C>,d_model=<d>,d_ff=<f>`, from which
`sweep.py scaling` reads the budget and the size. The holdout budgets (at
least 4x the largest of the budgets) run one cell each, the middle size, for
the held-out check: `sweep.py scaling --holdout 'budget>=X'` predicts them
from the others' laws.

The variants make one sweep of several ladders, an override dict each: RoPE
under the standard parametrization, the same under μP, and learned
positions. Every cell runs under each, named `pos_emb=rope,flop_budget=...`,
and `sweep.py scaling` fits one law per variant and compares each with the
first on the cells they share (paired); `[]` is one ladder. The sizes are
chosen on CONFIG alone; a variant or --config.* override that changes a
model's parameters or FLOPs moves its cells off the aims (learned positions
add max_len x d_model parameters; the budgets stay exact: train.flop_budget).
μP changes neither, so its cells are the standard ones, size for size.

The standard variants train every size at tiny's learning rate, 3e-3. The μP
variant carries the pair tuned at width 32 with its tied head (base width 32,
output multiplier 4, AdamW at 2^-6; configs/sweeps/mup_output_mult.py) to
every width: in the transfer sweep (configs/sweeps/mup_transfer.py, widths 32
to 256) that rate was μP's best at every width while the standard
parametrization's moved 4 grid steps. The ladder's widths reach below 32 (8
to 104), where the transfer was not measured: the μP law says whether it
holds there.
"""
NAME = "ladder"
CONFIG = "configs/tiny_ladder.py"
LADDER = {
    "budgets": (3e10, 1e11, 3e11, 1e12),  # training FLOPs per run
    "sizes": 5,  # sizes per budget
    "spacing": 2.0,  # N of a budget's neighbouring sizes, one over the other
    "tokens_per_param": 20.0,  # Chinchilla's compute-optimal D / N
    "widths": (2, 128),  # k, both ends included
    "width_fields": {"model.d_model": 4, "model.d_ff": 12},  # width k: d_model = 4k, d_ff = 12k
    "holdout": (4e12,),  # budgets run at their compute-optimal size only, for the held-out check
    "max_steps": 100_000,
    "variants": [{"model.pos_emb": "rope"},
                 {"model.pos_emb": "rope", "model.parametrization": "mup",
                  "model.mup_base_width": 32, "model.mup_output_mult": 4.0,
                  "train.learning_rate": 2.0 ** -6},
                 {"model.pos_emb": "learned"}],
}
