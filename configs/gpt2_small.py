"""GPT-2 small (124M): 12 layers, d=768, 12 heads, tanh-GELU MLP 4d, LayerNorm
pre-norm, learned positions, biases, tied embeddings, context 1024, vocab
50,304 (50,257 padded to a multiple of 128). bf16 compute, float32 params.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=50304, d_model=768, num_layers=12,
                 num_heads=12, d_ff=3072, max_len=1024, pos_emb="learned", norm="layernorm",
                 norm_eps=1e-5, mlp="gelu_tanh", use_bias=True, tie_embeddings=True,
                 dtype="bfloat16",
                 scan_unroll=12)  # the scan unrolled: blocks inline (no stacked activations
  #   to copy), parameters still stacked (the optimizer on 12-layer arrays, few kernels)
  c.tokenizer.update(kind="bpe", vocab_size=50304)
  c.train.update(batch_size=32, seq_len=1024, learning_rate=6e-4, warmup_steps=700,
                 num_steps=20000, b2=0.95, weight_decay=0.1,
                 remat="none",  # unrolled, nothing to save by recomputing: 37.6 GiB fits
                 loss_impl="auto")  # the fused head-and-loss kernel on a GPU: no f32 logits
  #   in HBM; xla on a CPU. The H200 roofline of this step: docs/benchmarks.md
  return c
