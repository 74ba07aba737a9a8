"""Learning-rate transfer across width, and what each parametrization reaches
at its best learning rate: configs/tiny_ladder.py (tiny's decoder on bytes,
2 heads, d_ff 3d, batch 8) at widths 32, 64, 128 and 256 (8x) x AdamW
learning rates 2^-12 to 2^-5 under the standard parametrization and under μP
with base width 32 and the output multiplier tuned there
(model.mup_output_mult=4, configs/sweeps/mup_output_mult.py; docs/models.md,
"μP"), 2 seeds, 300 steps. `sweep.py report` draws the loss against the
learning rate, one curve per width and parametrization, says how many grid
steps each parametrization's optimum moves from width 32 to 256, and puts
each curve's best loss beside the other parametrization's at the same width.

  python sweep.py run --sweep configs/sweeps/mup_transfer.py --parallel 2 \
      --config.train.num_steps=300 --config.train.eval_every=300 --config.train.eval_steps=32
  python sweep.py report --root runs/sweeps/mup_transfer

(Its result and cost: docs/sweeps.md.)
"""
from configs.sweeps.mup_output_mult import BASE_WIDTH

NAME = "mup_transfer"
CONFIG = "configs/tiny_ladder.py"
SEEDS = 2
OUTPUT_MULT = 4.0  # the best of configs/sweeps/mup_output_mult.py, at its BASE_WIDTH
WIDTHS = (32, 64, 128, 256)
LEARNING_RATES = tuple(2.0 ** e for e in range(-12, -4))


def get_sweep():
  mup = {"model.mup_base_width": BASE_WIDTH, "model.mup_output_mult": OUTPUT_MULT}
  return [{"model.parametrization": p, "model.d_model": d, "model.d_ff": 3 * d,
           **(mup if p == "mup" else {}), "train.learning_rate": lr}
          for p in ("sp", "mup") for d in WIDTHS for lr in LEARNING_RATES]
