"""Llama-3.2-1B's shapes (Meta, 2024; transformers' `LlamaForCausalLM`,
1,235,814,400 parameters): decoder, 16 layers, d=2048, 32 query heads and 8
KV heads of 64, SwiGLU MLP 8192, pre-norm RMSNorm (eps 1e-5), RoPE with base
500,000 and Llama 3.1's wavelength bands (factor 32, low 1, high 4, original
context 8,192), context 131,072, no biases, vocabulary 128,256 tied to the
head. bf16 compute, float32 params. A step of 8 x 4,096 tokens with the
head and loss in chunks of 4,096 (without them the step needs 128 GiB on
one H200, which XLA cannot bring under its 107 GiB). Its roofline on an
H200: `python -m bench.roofline --config configs/llama3_1b.py --target
gpu:h200` (docs/benchmarks.md).
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=128256, d_model=2048, num_layers=16, num_heads=32,
                 num_kv_heads=8, head_dim=64, d_ff=8192, max_len=131072, pos_emb="rope",
                 rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=32.0,
                 rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_len=8192, norm="rmsnorm", norm_position="pre",
                 norm_eps=1e-5, mlp="swiglu", use_bias=False, tie_embeddings=True,
                 dtype="bfloat16")
  c.tokenizer.update(kind="bpe", vocab_size=128256)
  c.train.update(batch_size=8, seq_len=4096, loss_chunk_size=4096, learning_rate=3e-4,
                 warmup_steps=2000, num_steps=20000, weight_decay=0.1)
  return c
