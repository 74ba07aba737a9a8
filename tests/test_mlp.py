"""Every model.mlp kind against transformers' activations and its gated MLP."""
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
from model.mlp import MLP

pytestmark = pytest.mark.hf  # transformers and torch

# model.mlp -> transformers' hidden_act of the same function.
HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "swiglu": "silu",
          "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}


def _mlp(kind):
  m = base.get_config().model
  m.update(d_model=16, d_ff=24, mlp=kind)
  return MLP(ModelConfig.resolve(m), rngs=nnx.Rngs(0))


def _torch(weight):
  """Our [in, out] kernel as a torch Linear weight [out, in]."""
  return torch.from_numpy(np.asarray(weight[...]).T.copy())


@pytest.mark.parametrize("kind", sorted(HF_ACT))
def test_mlp_matches_transformers(kind):
  mlp = _mlp(kind)
  x = 3 * jax.random.normal(jax.random.key(1), (2, 5, 16))
  x_torch = torch.from_numpy(np.array(x))
  with torch.no_grad():
    if mlp.gate is not None:
      ref = LlamaMLP(LlamaConfig(hidden_size=16, num_attention_heads=2, intermediate_size=24,
                                 hidden_act=HF_ACT[kind]))
      for name, ours in (("gate_proj", mlp.gate), ("up_proj", mlp.up), ("down_proj", mlp.down)):
        getattr(ref, name).weight.copy_(_torch(ours.kernel))
      want = ref(x_torch)
    else:
      want = ACT2FN[HF_ACT[kind]](x_torch @ _torch(mlp.up.kernel).T) @ _torch(mlp.down.kernel).T
  np.testing.assert_allclose(np.asarray(mlp(x)), want.numpy(), atol=1e-6, rtol=1e-5)


def test_gelu_is_erf_and_gelu_tanh_differs():
  x = jax.numpy.linspace(-4, 4, 101)
  exact, tanh = (np.asarray(_mlp(kind).activation(x)) for kind in ("gelu", "gelu_tanh"))
  np.testing.assert_allclose(exact, torch.nn.GELU()(torch.from_numpy(np.array(x))).numpy(),
                             atol=1e-6)
  assert np.abs(exact - tanh).max() > 1e-4
