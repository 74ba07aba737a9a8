"""Mixtral-8x7B's shapes: the 7B-like decoder (d=4096, 32 layers, 32 query
heads of 128 over 8 KV heads, RoPE theta 1e6, RMSNorm, V=32,000, untied head)
whose every MLP is a mixture of 8 SwiGLU experts of width 14,336, each token
routed to 2 (softmax, top 2 renormalised). 46,702,792,704 parameters, of
which 12,879,925,248 are active per token, as transformers counts them.
Summarise with `python -m model.summary --config configs/mixtral_8x7b.py`.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=32000, d_model=4096, num_layers=32,
                 num_heads=32, num_kv_heads=8, d_ff=14336, max_len=32768, pos_emb="rope",
                 rope_theta=1e6, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", use_bias=False,
                 tie_embeddings=False, dtype="bfloat16", num_experts=8, experts_per_token=2,
                 moe_router="softmax_topk_norm", scan_unroll=1)
  c.tokenizer.update(kind="spm_bpe", vocab_size=32000)
  c.train.update(batch_size=64, seq_len=4096, learning_rate=3e-4, warmup_steps=2000,
                 moe_aux_loss=0.02)
  return c
