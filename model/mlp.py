"""Step 5 of the lesson: the position-wise MLP.

`gelu`: W2 GELU(W1 x), d_ff = 4d classically (two matrices).
`swiglu`: W2 (SiLU(W1 x) * W3 x), d_ff about 8/3 d (three matrices).
"""
import jax
from flax import nnx

from model.layers import Dense


class MLP(nnx.Module):

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, f, b = cfg.d_model, cfg.d_ff, cfg.use_bias
    self.kind = cfg.mlp
    self.up = Dense(d, (f,), ("embed", "mlp"), use_bias=b, cfg=cfg, rngs=rngs)
    if self.kind == "swiglu":
      self.gate = Dense(d, (f,), ("embed", "mlp"), use_bias=b, cfg=cfg, rngs=rngs)
    self.down = Dense(f, (d,), ("mlp", "embed"), use_bias=b, cfg=cfg, rngs=rngs)

  def __call__(self, x_BTM):
    if self.kind == "swiglu":
      h_BTF = jax.nn.silu(self.gate(x_BTM)) * self.up(x_BTM)
    else:
      h_BTF = jax.nn.gelu(self.up(x_BTM))
    return self.down(h_BTF)
