"""Llama-2-70B shapes: d=8192, 80 layers, 64 query heads of 128, 8 KV heads
(GQA, 8 query heads per KV head), SwiGLU d_ff=28,672, RMSNorm pre-norm, RoPE,
V=32,000, untied head, no biases: 68,976,648,192 parameters, as published
for Llama-2-70b; 327,680 KV-cache bytes per token in 16-bit.

Too big for one device; what a slice needs for it, without the slice:
`python compile.py --config configs/llama2_70b.py --target tpu:v5p:4x8x8 --config.mesh.fsdp=256`
(docs/compiling.md, "what fits where").
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=32000, d_model=8192, num_layers=80,
                 num_heads=64, num_kv_heads=8, d_ff=28672, max_len=4096, pos_emb="rope",
                 norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", use_bias=False,
                 tie_embeddings=False, dtype="bfloat16",
                 scan_unroll=1)  # one block's working set per scan iteration: less HBM
  c.tokenizer.update(kind="spm_bpe", vocab_size=32000)
  c.train.update(batch_size=256, seq_len=4096, learning_rate=1.5e-4, warmup_steps=2000,
                 remat="full")
  return c
