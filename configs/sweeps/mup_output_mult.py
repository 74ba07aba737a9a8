"""μP's output multiplier, tuned at the base width with the learning rate:
configs/tiny_ladder.py at its base width 32 (2 heads, d_ff 96, batch 8)
under μP, model.mup_output_mult 1, 4, 8 and 16 x AdamW learning rates 2^-9 to 2^-5,
2 seeds, 300 steps. At the base width μP with multiplier 1 is the standard
parametrization; the best (multiplier, learning rate) pair is what
configs/sweeps/mup_transfer.py carries to every width (docs/models.md, "μP").

  python sweep.py run --sweep configs/sweeps/mup_output_mult.py --parallel 2 \
      --config.train.num_steps=300 --config.train.eval_every=300 --config.train.eval_steps=32
  python sweep.py report --root runs/sweeps/mup_output_mult

(Its result and cost: docs/sweeps.md.)
"""
NAME = "mup_output_mult"
CONFIG = "configs/tiny_ladder.py"
SEEDS = 2
BASE_WIDTH = 32
OUTPUT_MULTS = (1.0, 4.0, 8.0, 16.0)
LEARNING_RATES = tuple(2.0 ** e for e in range(-9, -4))


def get_sweep():
  return [{"model.parametrization": "mup", "model.mup_base_width": BASE_WIDTH,
           "model.d_model": BASE_WIDTH, "model.d_ff": 3 * BASE_WIDTH,
           "model.mup_output_mult": alpha, "train.learning_rate": lr}
          for alpha in OUTPUT_MULTS for lr in LEARNING_RATES]
