"""A CPU-sized decoder that trains on the stdlib corpus (data.source) in a few minutes.

2 layers, d=128, 4 heads, RoPE, RMSNorm pre-norm, SwiGLU, byte-level BPE with
a 1,024-token vocabulary; sequences of 128 tokens, batch 16.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=1024, d_model=128, num_layers=2, num_heads=4,
                 d_ff=384, max_len=256, pos_emb="rope", norm="rmsnorm", mlp="swiglu")
  c.tokenizer.update(kind="bpe", vocab_size=1024)
  c.train.update(num_steps=600, batch_size=16, seq_len=128, learning_rate=3e-3,
                 warmup_steps=50, log_every=20, checkpoint_every=200)
  return c
