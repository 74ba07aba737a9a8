"""Learning-rate transfer across width: configs/tiny.py at widths 128, 256
and 512 (4 heads, d_ff 3d) x learning rates 2^-11 to 2^-5 of AdamW, under
the standard parametrization and under μP with base width 128
(docs/models.md, "μP"). `sweep.py report` draws the loss against the
learning rate, one curve per width and parametrization, and says how many
grid steps each parametrization's optimum moves from width 128 to 512.

  python sweep.py run --sweep configs/sweeps/mup_transfer.py --seeds 1 --parallel 2 \
      --config.tokenizer.path=runs/tiny/tokenizer --config.train.num_steps=200 \
      --config.train.batch_size=8 --config.train.eval_every=200
  python sweep.py report --root runs/sweeps/mup_transfer

(Its result and cost: docs/sweeps.md.)
"""
NAME = "mup_transfer"
CONFIG = "configs/tiny.py"
BASE_WIDTH = 128
WIDTHS = (128, 256, 512)
LEARNING_RATES = tuple(2.0 ** e for e in range(-11, -4))


def get_sweep():
  return [{"model.parametrization": p, "model.d_model": d, "model.d_ff": 3 * d,
           **({"model.mup_base_width": BASE_WIDTH} if p == "mup" else {}),
           "train.learning_rate": lr}
          for p in ("sp", "mup") for d in WIDTHS for lr in LEARNING_RATES]
