"""Does linear attention pay? configs/tiny.py at 4 layers (d_model 128, 4
heads of 32) at equal training FLOPs, 3 seeds each: softmax attention in
every layer, the Qwen3-Next hybrid (three Gated DeltaNet layers before
each full-attention layer, `model.layer_types`) and Gated DeltaNet in
every layer.

The linear layers keep tiny's heads (4 query/key heads and 4 value heads of
32, the delta rule in chunks of 64, a convolution of width 4). At tiny's 128
tokens a row the delta rule's chunked form costs more than softmax
attention does (model/accounting.py counts the chunk's WY products and
the solve's substitution): per step of 16 x 128 tokens, 13.7 GFLOPs all
softmax, 15.1 the hybrid, 15.6 all linear. So the budget, 8.2e12 FLOPs
(all softmax's 598 steps), gives the hybrid 541 steps and all-linear 524:
at this length a linear layer buys nothing per FLOP, and the ablation asks
whether it buys loss per step, and whether a state of fixed size reads
past the training length (eval.py --seq_len 512, four times it,
`report`'s loss by position).

  python sweep.py run --sweep configs/sweeps/hybrid.py --parallel 2 \\
      --config.tokenizer.path=runs/tiny/tokenizer --config.train.flop_budget=8.2e12
  for run in runs/sweeps/hybrid/*/; do python eval.py --workdir $run --seq_len 512; done
  python sweep.py report --root runs/sweeps/hybrid
"""
NAME = "hybrid"
CONFIG = "configs/tiny.py"
SEEDS = 3

LINEAR = ("linear_attention",)
FULL = ("full_attention",)


def get_sweep():
  return [{"model.num_layers": 4, "model.layer_types": kinds}
          for kinds in (FULL, LINEAR * 3 + FULL, LINEAR)]
