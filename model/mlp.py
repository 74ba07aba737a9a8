"""Step 5 of the lesson: the position-wise MLP, one `MLPS` entry per `model.mlp`.

Plain kinds, W2 act(W1 x), two matrices, d_ff = 4d classically:
`gelu` (exact, erf: GELU(x) = x Phi(x), BERT's and torch's `nn.GELU()`),
`gelu_tanh` (the tanh approximation, GPT-2's), `relu` (the original
transformer's, T5 v1.0's).
Gated kinds, W2 (act(W_gate x) * W1 x), three matrices, d_ff about 8/3 d:
`swiglu` (SiLU, LLaMA), `geglu` (exact GELU), `geglu_tanh` (tanh GELU, T5
v1.1 and Gemma).
"""
import dataclasses
import functools
from collections.abc import Callable

import jax
from flax import nnx

from model.layers import Dense
from model.remat import tag
from model.registry import Registry


@dataclasses.dataclass(frozen=True)
class MLPKind:
  """A `model.mlp` choice: its activation and whether it is gated (a third,
  gate matrix). The parameter count and the activation memory follow from
  `matrices` (`model/accounting.py`)."""
  name: str
  doc: str
  activation: Callable
  gated: bool
  reads: tuple[str, ...] = ()

  @property
  def matrices(self) -> int:
    return 3 if self.gated else 2

  def params(self, d: int, f: int, bias: bool) -> int:
    """Its matrices d x f and, with `bias`, their biases."""
    return self.matrices * d * f + ((self.matrices - 1) * f + d if bias else 0)


_gelu = functools.partial(jax.nn.gelu, approximate=False)
_gelu_tanh = functools.partial(jax.nn.gelu, approximate=True)

MLPS = Registry("model.mlp", [
    MLPKind("gelu", "exact (erf) GELU, two matrices (BERT, torch's nn.GELU())", _gelu, False),
    MLPKind("gelu_tanh", "tanh-approximated GELU, two matrices (GPT-2)", _gelu_tanh, False),
    MLPKind("relu", "ReLU, two matrices (the original transformer, T5 v1.0)", jax.nn.relu, False),
    MLPKind("swiglu", "SiLU-gated, three matrices (LLaMA)", jax.nn.silu, True),
    MLPKind("geglu", "exact-GELU-gated, three matrices", _gelu, True),
    MLPKind("geglu_tanh", "tanh-GELU-gated, three matrices (T5 v1.1, Gemma)", _gelu_tanh, True),
])


def is_gated(kind: str) -> bool:
  """Whether model.mlp=`kind` has the third (gate) matrix."""
  return MLPS[kind].gated


class MLP(nnx.Module):

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, f, b = cfg.d_model, cfg.d_ff, cfg.mlp_bias
    kind = MLPS[cfg.mlp]
    self.activation = kind.activation
    std = cfg.hidden_std  # init_std, or under μP its hidden-matrix scaling
    dense = functools.partial(Dense, use_bias=b, cfg=cfg, rngs=rngs, std=std, fp8=True)
    self.up = dense(d, (f,), ("embed", "mlp"))
    self.gate = dense(d, (f,), ("embed", "mlp")) if kind.gated else None
    self.down = dense(f, (d,), ("mlp", "embed"))

  def __call__(self, x_BTM):
    if self.gate is not None:
      gate_BTF, up_BTF = tag(self.gate(x_BTM), "mlp_hidden"), tag(self.up(x_BTM), "mlp_hidden")
      with jax.named_scope("activation"):
        h_BTF = self.activation(gate_BTF) * up_BTF
    else:
      up_BTF = tag(self.up(x_BTM), "mlp_hidden")
      with jax.named_scope("activation"):
        h_BTF = self.activation(up_BTF)
    return tag(self.down(h_BTF), "mlp_out")
