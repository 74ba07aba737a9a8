"""The lesson's "7B" shapes (LLaMA-2 7B): d=4096, 32 layers, 32 heads of 128,
SwiGLU d_ff=11,008, RMSNorm pre-norm, RoPE, V=32,000, untied head, no biases.
About 6.74B parameters; 524,288 KV-cache bytes per token in 16-bit.
Summarise with `python -m model.summary --config configs/llama2_7b.py`.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=32000, d_model=4096, num_layers=32,
                 num_heads=32, num_kv_heads=32, d_ff=11008, max_len=4096, pos_emb="rope",
                 norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", use_bias=False,
                 tie_embeddings=False, dtype="bfloat16",
                 scan_unroll=1)  # one block's working set per scan iteration: less HBM
  c.tokenizer.update(kind="spm_bpe", vocab_size=32000)
  c.train.update(batch_size=64, seq_len=4096, learning_rate=3e-4, warmup_steps=2000)
  return c
