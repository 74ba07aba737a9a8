"""Llama 3: the `configs/llama3_1b.py` preset (Llama-3.2-1B's shapes) against
`transformers`' parameter count."""
import pytest
import torch
import transformers

from configs import llama3_1b
from model import accounting

pytestmark = pytest.mark.hf  # transformers and torch


def test_llama3_1b_has_the_transformers_parameter_count():
  """Counted on torch's meta device (unique tensors: the tied head once);
  nothing downloaded, nothing allocated on either side."""
  hf_config = transformers.LlamaConfig(
      vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
      num_attention_heads=32, num_key_value_heads=8, head_dim=64,
      max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192})
  with torch.device("meta"):
    hf = transformers.LlamaForCausalLM(hf_config)
  want = sum(p.numel() for p in hf.parameters())
  m = llama3_1b.get_config().model
  assert accounting.formula_params(m)["params_total"] == want == 1_235_814_400
  assert accounting.measured_params(m) == accounting.formula_params(m)
