"""BERT-base shapes (encoder-only, masked-LM): 12 layers, d=768, 12 heads,
GELU MLP 4d, post-norm LayerNorm, learned positions (512), biases, tied head.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="encoder", vocab_size=30522, d_model=768, num_layers=12,
                 num_heads=12, d_ff=3072, max_len=512, pos_emb="learned", norm="layernorm",
                 norm_position="post", norm_eps=1e-12, mlp="gelu", use_bias=True,
                 tie_embeddings=True)
  c.tokenizer.update(kind="spm_unigram", vocab_size=30522)
  c.train.update(objective="mlm", batch_size=256, seq_len=128, learning_rate=1e-4,
                 warmup_steps=10000)
  return c
