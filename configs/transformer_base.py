"""The original transformer (Vaswani et al., 2017), base: encoder-decoder,
6 + 6 layers, d=512, 8 heads, ReLU-era MLP d_ff=2048 (GELU here), post-norm
LayerNorm, sinusoidal positions, shared and tied embeddings, vocab 37,000.
Trains on the code-summarisation task by default; for translation point
`--config.data.task=pairs --config.data.paths=train.tsv` at your pairs.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="encoder_decoder", vocab_size=37000, d_model=512, num_layers=6,
                 num_decoder_layers=6, num_heads=8, d_ff=2048, max_len=512,
                 pos_emb="sinusoidal", norm="layernorm", norm_position="post", norm_eps=1e-6,
                 mlp="gelu", use_bias=True, tie_embeddings=True)
  c.tokenizer.update(kind="spm_bpe", vocab_size=37000)
  c.data.update(task="code_summary")
  c.train.update(objective="seq2seq", batch_size=64, seq_len=256, learning_rate=7e-4,
                 warmup_steps=4000)
  return c
