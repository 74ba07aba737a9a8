"""DeepSeek-V3's load balancing on configs/tiny_moe.py (8 experts of width
96, top-2, 2 layers) under its router (`model.moe_router=deepseek`: sigmoid
affinities, the chosen experts' weights normalised), 3 seeds each at equal
training FLOPs: the auxiliary load-balancing loss (train.moe_aux_loss=0.02,
tiny_moe's weight; the baseline) against DeepSeek-V3's auxiliary-loss-free
balancing (train.moe_bias_update_rate=1e-3, V3's gamma: a per-expert
selection bias moved towards the mean load after each step, no loss), and
against neither (no balancing at all: how unbalanced the router gets by
itself). The report puts the experts' load beside the loss: `expert_load`
(eval.py on the whole validation split: the most-loaded expert's share of
the tokens over the mean share, averaged over the MoE layers; 1 is
balanced, E / k = 4 the most), `train_expert_load` (the same, the mean of
the training records) and `moe_bias_abs` (the biases' final mean |b|).

The three differ only in how the router is trained, so each step costs the
same: 3.5e12 FLOPs is 596 steps each (model/accounting.py: 2.87M training
FLOPs per token, active parameters), about tiny_moe's default 600. On this
CPU the mixtures ran at about 1,700 tokens/s (docs/sweeps.md, the moe
ablation), so a run is about 12 minutes and the sweep, two at a time, about
an hour.

  python sweep.py run --sweep configs/sweeps/deepseek_moe.py --parallel 2 \
      --config.tokenizer.path=runs/tiny/tokenizer --config.train.flop_budget=3.5e12
  python sweep.py report --root runs/sweeps/deepseek_moe
"""
NAME = "deepseek_moe"
CONFIG = "configs/tiny_moe.py"
SEEDS = 3


def get_sweep():
  router = {"model.moe_router": "deepseek"}
  return [{**router, "train.moe_aux_loss": 0.02, "train.moe_bias_update_rate": 0.0},
          {**router, "train.moe_aux_loss": 0.0, "train.moe_bias_update_rate": 1e-3},
          {**router, "train.moe_aux_loss": 0.0, "train.moe_bias_update_rate": 0.0}]
