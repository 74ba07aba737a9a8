"""Why μP's loss stops falling from width 128 to 256 (configs/sweeps/mup_transfer.py:
2.045 at 128, 2.065 at 256, 2 seeds): configs/tiny_ladder.py under μP at the
transferred pair (base width 32, model.mup_output_mult 4, learning rate
2^-6), widths 128 and 256, 3 seeds, 300 steps, one suspect changed at a time:

- as transferred (Tensor Programs V's Table 3: the input weights' Adam
  learning rate is the same at every width);
- the embedding's learning rate a quarter of it (train.embedding_lr_mult
  0.25) at both widths, a width-independent choice μP could transfer;
- an untied head (model.tie_embeddings=False), the readout no longer the
  embedding; and at the base width, untied, the rates around 2^-6, to see
  whether the pair tuned with a tied head still holds without it.

  python sweep.py run --sweep configs/sweeps/mup_width.py --parallel 2 \\
      --config.train.num_steps=300 --config.train.eval_every=300 --config.train.eval_steps=32
  python sweep.py report --root runs/sweeps/mup_width

(Its result: docs/sweeps.md, "Learning-rate transfer across width".)
"""
from configs.sweeps.mup_output_mult import BASE_WIDTH
from configs.sweeps.mup_transfer import OUTPUT_MULT

NAME = "mup_width"
CONFIG = "configs/tiny_ladder.py"
SEEDS = 3
LEARNING_RATE = 2.0 ** -6  # μP's best at every width of configs/sweeps/mup_transfer.py
UNTIED = {"model.tie_embeddings": False}
ARMS = {128: ({}, {"train.embedding_lr_mult": 0.25}, UNTIED),
        256: ({}, UNTIED, {"train.embedding_lr_mult": 0.25}),
        BASE_WIDTH: tuple({**UNTIED, "train.learning_rate": 2.0 ** e} for e in (-7, -6, -5))}


def get_sweep():
  return [{"model.d_model": width, "model.d_ff": 3 * width, **arm,
           "model.parametrization": "mup", "model.mup_base_width": BASE_WIDTH,
           "model.mup_output_mult": OUTPUT_MULT,
           "train.learning_rate": arm.get("train.learning_rate", LEARNING_RATE)}
          for width, arms in ARMS.items() for arm in arms]
