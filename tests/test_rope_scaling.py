"""RoPE scaling types against the reference: transformers' `ROPE_INIT_FUNCTIONS`."""
import numpy as np
import pytest
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from configs import base
from model.config import ModelConfig
from model.embeddings import rope_from_config, rope_frequencies

pytestmark = pytest.mark.hf  # transformers and torch

# (rope_type, head_dim, rope_theta, transformers' rope_parameters beyond those)
CASES = [
    ("yarn", 128, 10000.0, dict(factor=4.0, original_max_position_embeddings=4096)),
    ("yarn", 64, 150000.0, dict(factor=32.0, original_max_position_embeddings=4096,
                                beta_fast=32.0, beta_slow=1.0, truncate=False)),
    ("yarn", 64, 1e6, dict(factor=8.0, original_max_position_embeddings=2048, beta_fast=16.0,
                           beta_slow=2.0, attention_factor=1.25)),
    ("yarn", 32, 10000.0, dict(factor=1.0, original_max_position_embeddings=512)),
    ("llama3", 128, 500000.0, dict(factor=8.0, original_max_position_embeddings=8192,
                                   low_freq_factor=1.0, high_freq_factor=4.0)),
    ("llama3", 64, 500000.0, dict(factor=32.0, original_max_position_embeddings=8192,
                                  low_freq_factor=2.0, high_freq_factor=8.0)),
]


def reference(rope_type, head_dim, theta, params):
  config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                       max_position_embeddings=16 * params["original_max_position_embeddings"],
                       rope_parameters=dict(rope_type=rope_type, rope_theta=theta, **params))
  inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
  return inv_freq.numpy(), attention_factor


@pytest.mark.parametrize("rope_type,head_dim,theta,params", CASES)
def test_frequencies_and_attention_factor_match_transformers(rope_type, head_dim, theta, params):
  want_freq, want_factor = reference(rope_type, head_dim, theta, params)
  got_freq, got_factor = rope_frequencies(
      head_dim, theta, rope_type, params["factor"], params["original_max_position_embeddings"],
      **{key: params[key] for key in ("beta_fast", "beta_slow", "attention_factor", "truncate",
                                      "low_freq_factor", "high_freq_factor") if key in params})
  np.testing.assert_allclose(np.float32(got_freq), want_freq, rtol=1e-6)
  assert got_factor == pytest.approx(want_factor, rel=1e-7)


def test_config_fields_reach_the_frequencies():
  m = base.get_config().model
  m.update(d_model=256, num_heads=2, rope_theta=1e6, rope_scaling="yarn", rope_scaling_factor=8.0,
           rope_original_max_len=2048, rope_beta_fast=16.0, rope_beta_slow=2.0,
           rope_attention_factor=1.25)
  want_freq, want_factor = reference("yarn", 128, 1e6, CASES[2][3])
  got_freq, got_factor = rope_from_config(ModelConfig.resolve(m))
  np.testing.assert_allclose(np.float32(got_freq), want_freq, rtol=1e-6)
  assert got_factor == want_factor


def test_yarn_differs_from_the_rotation_count_ramp():
  """The issue's case: the reference ramps in the pair index between rounded
  correction dims, so fewer pairs are blended than a ramp in rotations."""
  inv_freq, _ = rope_frequencies(128, 10000.0, "yarn", 4.0, 4096)
  unscaled, _ = rope_frequencies(128, 10000.0)
  ratio = np.array(inv_freq) / np.array(unscaled)
  kept, divided = np.isclose(ratio, 1.0), np.isclose(ratio, 0.25)
  assert kept.sum() == 21 and divided.sum() == 18  # ramp over pair indices 20..46
