"""Qwen2-0.5B (Qwen team, 2024; transformers' `Qwen2ForCausalLM`,
494,032,768 parameters): decoder, 24 layers, d=896, 14 query heads and 2 KV
heads of 64, SwiGLU MLP 4864, pre-norm RMSNorm (eps 1e-6), RoPE with base
1,000,000, context 32,768, biases on W_Q, W_K, W_V only (none on W_O or the
MLP), vocabulary 151,936 tied to the head, full attention in every layer.
bf16 compute, float32 params. The released weights import with
`convert.py from_hf`, which brings their own tokenizer.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=151936, d_model=896, num_layers=24, num_heads=14,
                 num_kv_heads=2, head_dim=64, d_ff=4864, max_len=32768, pos_emb="rope",
                 rope_theta=1000000.0, norm="rmsnorm", norm_position="pre", norm_eps=1e-6,
                 mlp="swiglu", use_bias=False, qkv_bias=True, tie_embeddings=True,
                 dtype="bfloat16")
  c.tokenizer.update(kind="bpe", vocab_size=151936)
  c.train.update(batch_size=64, seq_len=4096, learning_rate=3e-4, warmup_steps=2000,
                 num_steps=20000, weight_decay=0.1)
  return c
