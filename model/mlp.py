"""Step 5 of the lesson: the position-wise MLP.

Plain kinds, W2 act(W1 x), two matrices, d_ff = 4d classically:
`gelu` (exact, erf: GELU(x) = x Phi(x), BERT's and torch's `nn.GELU()`),
`gelu_tanh` (the tanh approximation, GPT-2's), `relu` (the original
transformer's, T5 v1.0's).
Gated kinds, W2 (act(W_gate x) * W1 x), three matrices, d_ff about 8/3 d:
`swiglu` (SiLU, LLaMA), `geglu` (exact GELU), `geglu_tanh` (tanh GELU, T5
v1.1 and Gemma).
"""
import functools

import jax
from flax import nnx

from model.layers import Dense

# model.mlp -> (activation, gated).
KINDS = {
    "gelu": (functools.partial(jax.nn.gelu, approximate=False), False),
    "gelu_tanh": (functools.partial(jax.nn.gelu, approximate=True), False),
    "relu": (jax.nn.relu, False),
    "swiglu": (jax.nn.silu, True),
    "geglu": (functools.partial(jax.nn.gelu, approximate=False), True),
    "geglu_tanh": (functools.partial(jax.nn.gelu, approximate=True), True),
}


def is_gated(kind: str) -> bool:
  """Whether model.mlp=`kind` has the third (gate) matrix."""
  return KINDS[kind][1]


class MLP(nnx.Module):

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, f, b = cfg.d_model, cfg.d_ff, cfg.mlp_bias
    self.activation, gated = KINDS[cfg.mlp]
    self.up = Dense(d, (f,), ("embed", "mlp"), use_bias=b, cfg=cfg, rngs=rngs)
    self.gate = Dense(d, (f,), ("embed", "mlp"), use_bias=b, cfg=cfg, rngs=rngs) if gated else None
    self.down = Dense(f, (d,), ("mlp", "embed"), use_bias=b, cfg=cfg, rngs=rngs)

  def __call__(self, x_BTM):
    if self.gate is not None:
      h_BTF = self.activation(self.gate(x_BTM)) * self.up(x_BTM)
    else:
      h_BTF = self.activation(self.up(x_BTM))
    return self.down(h_BTF)
