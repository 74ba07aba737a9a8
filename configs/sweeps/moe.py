"""Dense against mixture-of-experts MLPs on configs/tiny.py at equal active
training FLOPs: the dense SwiGLU of width 384, 8 experts of width 384 with
each token routed to 1 (top-1), and 8 experts of width 192 routed to 2
(top-2). Each token runs an MLP of width 384 in all three, so the FLOP
budget gives them the same steps (the router's d x E adds 0.03%); the
mixtures store 8 and 4 times the dense MLP's parameters.

  python sweep.py run --sweep configs/sweeps/moe.py --seeds 3 --config.train.flop_budget=2.3e12
  python sweep.py report --root runs/sweeps/moe
"""
NAME = "moe"
CONFIG = "configs/tiny.py"


def get_sweep():
  moe = {"model.num_experts": 8, "train.moe_aux_loss": 0.01}
  return [{"model.num_experts": 0},
          {**moe, "model.experts_per_token": 1, "model.moe_d_ff": 384},
          {**moe, "model.experts_per_token": 2, "model.moe_d_ff": 192}]
