"""A CPU-sized BERT: an encoder trained with the masked-LM objective on the
embedded corpora (Python standard library source and documentation).

15% of the tokens selected, 80/10/10 mask/random/unchanged (done by the data
pipeline, `data/masking.py`); packed rows with segment ids, so attention never
crosses documents. 2 layers, d=128, learned positions, GELU, LayerNorm,
byte-level BPE of 1,024 ids. eval.py reports the masked-token accuracy beside
the unigram baseline. `configs/bert_base.py` is BERT-base exactly.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="encoder", vocab_size=1024, d_model=128, num_layers=2, num_heads=4,
                 d_ff=512, max_len=128, pos_emb="learned", norm="layernorm", mlp="gelu",
                 attention_impl="xla")
  c.tokenizer.update(kind="bpe", vocab_size=1024)
  c.data.update(source="embedded", packing="packed")
  c.train.update(objective="mlm", mlm_probability=0.15, num_steps=2000, batch_size=32,
                 seq_len=128, learning_rate=2e-3, warmup_steps=100, log_every=50,
                 eval_every=500, eval_steps=4, checkpoint_every=500)
  return c
