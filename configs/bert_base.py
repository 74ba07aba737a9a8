"""BERT-base exactly (`BertForMaskedLM(BertConfig())`, 109,514,298 parameters):
encoder-only masked LM, 12 layers, d=768, 12 heads, erf-GELU MLP 3072,
post-norm LayerNorm (eps 1e-12 everywhere), 30522 vocabulary, 512 learned
positions, 2 token types, embedding LayerNorm, biases, the masked-LM head
transform (dense, GELU, LayerNorm) and output bias, tied to the embedding.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="encoder", vocab_size=30522, d_model=768, num_layers=12,
                 num_heads=12, d_ff=3072, max_len=512, pos_emb="learned", norm="layernorm",
                 norm_position="post", norm_eps=1e-12, mlp="gelu", use_bias=True,
                 tie_embeddings=True, type_vocab_size=2, embedding_norm=True,
                 head_transform=True, output_bias=True)
  c.tokenizer.update(kind="spm_unigram", vocab_size=30522)
  c.train.update(objective="mlm", batch_size=256, seq_len=128, learning_rate=1e-4,
                 warmup_steps=10000)
  return c
