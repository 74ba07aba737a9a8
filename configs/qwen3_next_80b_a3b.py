"""Qwen3-Next-80B-A3B's shapes (config.json of Qwen/Qwen3-Next-80B-A3B): d=2048,
48 layers in cycles of three Gated DeltaNet layers (16 query/key heads of
128, 32 value heads of 128, convolutions of 4) and one gated full-attention
layer (16 query heads, 2 KV heads of 256, QK-norm, the output gate, RoPE on
the first quarter of each head, theta 1e7), every MLP 512 SwiGLU experts of
512 (10 per token, softmax top-k renormalised) with one shared expert of
512 gated by sigmoid(x W_g); zero-centred RMSNorm pre-norm, V=151,936,
untied head, 262,144 positions. 79,674,391,296 parameters, as transformers
counts Qwen3NextForCausalLM (tests/test_hf_qwen3_next.py).

Too big for one device: docs/huggingface.md has the checkpoint import.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=151936, d_model=2048, num_layers=48,
                 num_heads=16, num_kv_heads=2, head_dim=256, d_ff=5120, max_len=262144,
                 pos_emb="rope", rope_theta=10000000.0, partial_rotary_factor=0.25,
                 norm="rmsnorm_zero_centred", norm_eps=1e-6, mlp="swiglu", use_bias=False,
                 qk_norm=True, attention_output_gate=True, tie_embeddings=False,
                 dtype="bfloat16",
                 layer_types=("linear_attention+moe",) * 3 + ("full_attention+moe",),
                 linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4,
                 num_experts=512, experts_per_token=10, moe_d_ff=512, num_shared_experts=1,
                 moe_shared_expert_gate=True, moe_router="softmax_topk_norm",
                 scan_layers=True)  # one scanned cycle of four layers, 12 times
  c.tokenizer.update(vocab_size=151936)
  c.train.update(batch_size=256, seq_len=4096, remat="full")
  return c
