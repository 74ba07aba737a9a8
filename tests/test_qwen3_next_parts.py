"""Qwen3-Next's pieces as config switches: the zero-centred RMSNorm
(model.norm=rmsnorm_zero_centred, also the qk norms), partial RoPE
(model.partial_rotary_factor), the attention output gate
(model.attention_output_gate) and the shared expert's gate
(model.moe_shared_expert_gate): counted exactly, refused in one line where
they do not apply, and equal to transformers' Qwen3-Next modules."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from configs import base
from configs.errors import UserError
from model import accounting
from model.attention import Attention
from model.config import ModelConfig
from model.embeddings import apply_rope, rope_from_config
from model.moe import MoE


def small(**fields):
  m = base.get_config().model
  m.update(d_model=32, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=64, num_layers=2,
           vocab_size=64, max_len=32)
  m.update(fields)
  return m


@pytest.mark.parametrize("norm,rotary,gate,shared_gate", itertools.product(
    ("rmsnorm", "rmsnorm_zero_centred"), (1.0, 0.25), (False, True), (False, True)))
def test_measured_parameters_equal_the_formula(norm, rotary, gate, shared_gate):
  """Every combination, with biases and experts, passes the start-up check."""
  m = small(norm=norm, qk_norm=True, partial_rotary_factor=rotary, attention_output_gate=gate,
            qkv_bias=True, num_experts=4, num_shared_experts=1, moe_d_ff=8,
            moe_shared_expert_gate=shared_gate, moe_layers=(1,))
  assert accounting.measured_params(m) == accounting.formula_params(m)
  accounting.check_formula(m)


@pytest.mark.parametrize("fields,message", [
    (dict(partial_rotary_factor=0.0), "model.partial_rotary_factor=0.0: must be in (0, 1]"),
    (dict(partial_rotary_factor=0.3), "must be a positive even whole number"),
    (dict(partial_rotary_factor=0.5, pos_emb="learned"), "needs model.pos_emb=rope"),
    (dict(attention_output_gate=True, family="encoder"), "model.attention_output_gate=True"),
    (dict(moe_shared_expert_gate=True, num_experts=4), "needs model.num_experts > 0 and "
     "model.num_shared_experts > 0"),
])
def test_bad_values_are_one_line(fields, message):
  with pytest.raises(UserError, match=None) as e:
    ModelConfig.resolve(small(**fields))
  assert message in str(e.value) and "\n" not in str(e.value)


def test_zero_centred_norms_start_at_zero_and_the_qk_norms_follow_model_norm():
  cfg = ModelConfig.resolve(small(norm="rmsnorm_zero_centred", qk_norm=True))
  attn = Attention(cfg, rngs=nnx.Rngs(0))
  assert not np.any(np.asarray(attn.q_norm.scale[...]))
  x = jax.random.normal(jax.random.key(0), (2, 3, 4, 16))
  rms = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps)
  np.testing.assert_allclose(attn.k_norm(x), rms, rtol=1e-6)


def test_partial_rope_is_transformers():
  """The first head_dim / 4 dims rotate as transformers' apply_rotary_pos_emb
  rotates them (its rotary embedding built with partial_rotary_factor); the
  rest pass unchanged."""
  cfg = ModelConfig.resolve(small(partial_rotary_factor=0.25, rope_theta=1e4))
  inv_freq, factor = rope_from_config(cfg)
  assert len(inv_freq) == 2
  hf_cfg = hf_next.Qwen3NextConfig(hidden_size=32, num_attention_heads=4, head_dim=16,
                                   partial_rotary_factor=0.25, rope_theta=1e4)
  rotary = hf_next.Qwen3NextRotaryEmbedding(hf_cfg)
  x = np.random.default_rng(0).normal(size=(2, 5, 4, 16)).astype(np.float32)
  positions = np.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
  cos, sin = rotary(torch.zeros(1), torch.tensor(positions))
  xt = torch.tensor(x).transpose(1, 2)
  want, _ = hf_next.apply_rotary_pos_emb(xt, xt, cos, sin)
  got = apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq, factor)
  np.testing.assert_allclose(got, want.transpose(1, 2).numpy(), atol=1e-5)
  np.testing.assert_array_equal(got[..., 4:], x[..., 4:])


def test_gated_attention_is_qwen3_next_attention():
  """Our Attention with the output gate, zero-centred qk norms and partial
  RoPE against Qwen3NextAttention, q_proj's per-head [query, gate] halves
  split into W_Q and W_G."""
  H, K, D, d = 4, 2, 16, 32
  hf_cfg = hf_next.Qwen3NextConfig(hidden_size=d, num_attention_heads=H, num_key_value_heads=K,
                                   head_dim=D, partial_rotary_factor=0.25, rope_theta=1e4,
                                   rms_norm_eps=1e-6)
  hf_cfg._attn_implementation = "eager"
  torch.manual_seed(0)
  hf = hf_next.Qwen3NextAttention(hf_cfg, 0).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.normal_(0, 0.2)
  cfg = ModelConfig.resolve(small(norm="rmsnorm_zero_centred", qk_norm=True,
                                  partial_rotary_factor=0.25, attention_output_gate=True,
                                  rope_theta=1e4, attention_impl="reference"))
  ours = Attention(cfg, rope=rope_from_config(cfg), rngs=nnx.Rngs(0))
  t = lambda w: np.asarray(w.detach().numpy(), np.float32)
  q_and_gate = t(hf.q_proj.weight).reshape(H, 2, D, d)
  ours.q_proj.kernel[...] = jnp.asarray(q_and_gate[:, 0].transpose(2, 0, 1))
  ours.gate_proj.kernel[...] = jnp.asarray(q_and_gate[:, 1].transpose(2, 0, 1))
  ours.k_proj.kernel[...] = jnp.asarray(t(hf.k_proj.weight).reshape(K, D, d).transpose(2, 0, 1))
  ours.v_proj.kernel[...] = jnp.asarray(t(hf.v_proj.weight).reshape(K, D, d).transpose(2, 0, 1))
  ours.o_proj.kernel[...] = jnp.asarray(t(hf.o_proj.weight).reshape(d, H, D).transpose(1, 2, 0))
  ours.q_norm.scale[...] = jnp.asarray(t(hf.q_norm.weight))
  ours.k_norm.scale[...] = jnp.asarray(t(hf.k_norm.weight))
  x = np.random.default_rng(1).normal(size=(2, 6, d)).astype(np.float32)
  positions = np.tile(np.arange(6), (2, 1))
  rotary = hf_next.Qwen3NextRotaryEmbedding(hf_cfg)
  mask = torch.full((6, 6), float("-inf")).triu(1)[None, None]
  with torch.no_grad():
    want, _ = hf(torch.tensor(x), rotary(torch.zeros(1), torch.tensor(positions)), mask)
  got = ours(jnp.asarray(x), positions_BT=jnp.asarray(positions), causal=True)
  np.testing.assert_allclose(got, want.numpy(), atol=2e-5)


def test_shared_expert_gate_is_qwen3_next_moe():
  """Our MoE (softmax top-k, renormalised) with a gated shared expert against
  Qwen3NextSparseMoeBlock."""
  d, E, f, k = 32, 4, 8, 2
  hf_cfg = hf_next.Qwen3NextConfig(hidden_size=d, num_experts=E, num_experts_per_tok=k,
                                   moe_intermediate_size=f, shared_expert_intermediate_size=f,
                                   norm_topk_prob=True)
  torch.manual_seed(0)
  hf = hf_next.Qwen3NextSparseMoeBlock(hf_cfg).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.normal_(0, 0.3)
  cfg = ModelConfig.resolve(small(num_experts=E, experts_per_token=k, moe_d_ff=f,
                                  num_shared_experts=1, moe_shared_expert_gate=True))
  ours = MoE(cfg, rngs=nnx.Rngs(0))
  t = lambda w: jnp.asarray(np.asarray(w.detach().numpy(), np.float32))
  ours.router.kernel[...] = t(hf.gate.weight).T
  gate_up = t(hf.experts.gate_up_proj)  # [E, 2f, d]
  ours.gate.kernel[...] = gate_up[:, :f].transpose(0, 2, 1)
  ours.up.kernel[...] = gate_up[:, f:].transpose(0, 2, 1)
  ours.down.kernel[...] = t(hf.experts.down_proj).transpose(0, 2, 1)
  ours.shared.gate.kernel[...] = t(hf.shared_expert.gate_proj.weight).T
  ours.shared.up.kernel[...] = t(hf.shared_expert.up_proj.weight).T
  ours.shared.down.kernel[...] = t(hf.shared_expert.down_proj.weight).T
  ours.shared_gate.kernel[...] = t(hf.shared_expert_gate.weight).T
  x = np.random.default_rng(1).normal(size=(2, 5, d)).astype(np.float32)
  with torch.no_grad():
    want = hf(torch.tensor(x)).numpy()
  got, _ = ours(jnp.asarray(x))
  np.testing.assert_allclose(got, want, atol=2e-5)
