"""configs/tiny.py's sizes in GPT-2's form, the model nanoGPT's train.py builds.

LayerNorm pre-norm (epsilon 1e-5), an exact-GELU MLP of 4 d, learned
positions (max_len = seq_len = 128: nanoGPT's block_size is both), tied
embeddings, biases in every projection and norm (nanoGPT's bias=True), and
concat rows (one token stream, as nanoGPT's train.bin). The training is
tiny's. `python -m bench.vs_nanogpt` trains it beside nanoGPT.
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.update(pos_emb="learned", norm="layernorm", norm_eps=1e-5, mlp="gelu", d_ff=512,
                 max_len=128, use_bias=True, tie_embeddings=True)
  c.data.packing = "concat"
  return c
