"""configs/tiny.py with mixtures of experts: each layer's SwiGLU MLP becomes 8
experts of width 96, each token routed to 2, so a token uses the compute of a
d_ff=192 MLP while the layer stores 4 times tiny's MLP parameters; the
load-balancing loss at Mixtral's weight. Trains on a CPU in a few minutes.
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.update(num_experts=8, experts_per_token=2, moe_d_ff=96)
  c.train.update(moe_aux_loss=0.02)
  return c
