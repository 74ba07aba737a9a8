"""Every model.mlp kind against transformers' activations (`ACT2FN`) and its
gated MLP. The kinds come from `MLPS`, so a new one is checked by being
added: under its own name where `ACT2FN` has it (relu, gelu, relu2, ...), or
under the name `ACT2FN_NAMES` maps it to; a kind found in neither fails."""
import jax
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaMLP

from configs import base
from model.config import ModelConfig
from model.mlp import MLP, MLPS

pytestmark = pytest.mark.hf  # transformers and torch

# model.mlp kinds whose activation `ACT2FN` spells otherwise (a gated kind:
# its gate's activation); every other kind's name is its `ACT2FN` key.
ACT2FN_NAMES = {"gelu_tanh": "gelu_pytorch_tanh", "swiglu": "silu", "geglu": "gelu",
                "geglu_tanh": "gelu_pytorch_tanh"}

# A float32 grid, with large |x| (where an activation's tails and overflow show).
GRID = np.concatenate([np.linspace(-10, 10, 201), [-3e4, -1e4, -1e3, -1e2, 1e2, 1e3, 1e4, 3e4]]
                      ).astype(np.float32)


def hf_activation(kind: str) -> str:
  """The `ACT2FN` key of model.mlp=`kind`'s activation."""
  name = ACT2FN_NAMES.get(kind, kind)
  assert name in ACT2FN, (f"model.mlp={kind!r}: transformers' ACT2FN has no {name!r}; map the "
                          "kind to the ACT2FN name of its activation in ACT2FN_NAMES")
  return name


def _mlp(kind):
  m = base.get_config().model
  m.update(d_model=16, d_ff=24, mlp=kind)
  return MLP(ModelConfig.resolve(m), rngs=nnx.Rngs(0))


def _torch(weight):
  """Our [in, out] kernel as a torch Linear weight [out, in]."""
  return torch.from_numpy(np.asarray(weight[...]).T.copy())


@pytest.mark.parametrize("kind", list(MLPS))
def test_activation_is_transformers(kind):
  """The kind's activation equals `ACT2FN`'s on the grid, large |x| included
  (ReLU for relu2, or an exp that overflows, fails here)."""
  want = ACT2FN[hf_activation(kind)](torch.from_numpy(GRID)).numpy()
  got = np.asarray(MLPS[kind].activation(jax.numpy.asarray(GRID)))
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", list(MLPS))
def test_mlp_matches_transformers(kind):
  mlp = _mlp(kind)
  x = 3 * jax.random.normal(jax.random.key(1), (2, 5, 16))
  x_torch = torch.from_numpy(np.array(x))
  with torch.no_grad():
    if mlp.gate is not None:
      ref = LlamaMLP(LlamaConfig(hidden_size=16, num_attention_heads=2, intermediate_size=24,
                                 hidden_act=hf_activation(kind)))
      for name, ours in (("gate_proj", mlp.gate), ("up_proj", mlp.up), ("down_proj", mlp.down)):
        getattr(ref, name).weight.copy_(_torch(ours.kernel))
      want = ref(x_torch)
    else:
      hidden = ACT2FN[hf_activation(kind)](x_torch @ _torch(mlp.up.kernel).T)
      want = hidden @ _torch(mlp.down.kernel).T
  np.testing.assert_allclose(np.asarray(mlp(x)), want.numpy(), atol=1e-6, rtol=1e-5)


def test_gelu_is_erf_and_gelu_tanh_differs():
  x = jax.numpy.linspace(-4, 4, 101)
  exact, tanh = (np.asarray(_mlp(kind).activation(x)) for kind in ("gelu", "gelu_tanh"))
  np.testing.assert_allclose(exact, torch.nn.GELU()(torch.from_numpy(np.array(x))).numpy(),
                             atol=1e-6)
  assert np.abs(exact - tanh).max() > 1e-4
