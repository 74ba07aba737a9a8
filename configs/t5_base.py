"""T5 v1.0 base (Raffel et al., 2020; transformers' `t5-base`, 222,903,552
parameters): encoder-decoder, 12 + 12 layers, d=768, 12 heads of 64, ReLU MLP
3072 without biases, pre-norm RMSNorm (eps 1e-6, no bias, no mean), no
position embeddings but T5's relative position bias (32 buckets, max
distance 128, one table per stack), unscaled attention, vocabulary 32,128
shared by encoder, decoder and the tied head, whose input is scaled by
d_model^-0.5; the decoder starts from the pad id.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="encoder_decoder", vocab_size=32128, d_model=768, num_layers=12,
                 num_decoder_layers=12, num_heads=12, head_dim=64, d_ff=3072, max_len=512,
                 pos_emb="relative", relative_buckets=32, relative_max_distance=128,
                 norm="rmsnorm", norm_position="pre", norm_eps=1e-6, mlp="relu",
                 use_bias=False, attention_scale=1.0, scale_embeddings=False,
                 tie_embeddings=True, scale_head_input=True, decoder_start="pad")
  c.tokenizer.update(kind="spm_unigram", vocab_size=32128)
  c.data.update(task="code_summary")
  c.train.update(objective="seq2seq", batch_size=128, seq_len=512, tgt_seq_len=128,
                 learning_rate=1e-3, warmup_steps=10000)
  return c
