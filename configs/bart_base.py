"""BART base (Lewis et al., 2020; transformers' `facebook/bart-base`):
encoder-decoder, 6 + 6 layers, d=768, 12 heads, erf-GELU MLP 3072, biases
everywhere, post-norm LayerNorm (eps 1e-5) with no final norm, an embedding
LayerNorm and 1024 learned positions in each stack, unscaled embeddings,
vocabulary 50,265 shared by encoder, decoder and the tied head, plus an
output bias (BART's `final_logits_bias`); the decoder starts from the eos id.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="encoder_decoder", vocab_size=50265, d_model=768, num_layers=6,
                 num_decoder_layers=6, num_heads=12, d_ff=3072, max_len=1024,
                 pos_emb="learned", norm="layernorm", norm_position="post", norm_eps=1e-5,
                 mlp="gelu", use_bias=True, scale_embeddings=False, tie_embeddings=True,
                 embedding_norm=True, output_bias=True, decoder_start="eos")
  c.tokenizer.update(kind="bpe", vocab_size=50265)
  c.data.update(task="code_summary")
  c.train.update(objective="seq2seq", batch_size=64, seq_len=512, tgt_seq_len=128,
                 learning_rate=3e-4, warmup_steps=10000)
  return c
