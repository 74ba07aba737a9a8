"""Summarise Python functions: the standard library's functions, docstring
removed, -> the first line of the docstring (an encoder-decoder).

Split by module (`corpora.is_validation` on the module path, 5% held out);
sources up to 128 tokens, summaries up to 31 (longer pairs are dropped and
counted). eval.py scores BLEU and chrF against the copy-the-function-name
baseline. 2 + 2 layers, d=128, byte-level BPE of 1,024 ids trained on the
task's texts; a short CPU run.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="encoder_decoder", vocab_size=1024, d_model=128, num_layers=2,
                 num_decoder_layers=2, num_heads=4, d_ff=512, max_len=128, pos_emb="learned",
                 norm="layernorm", mlp="gelu", attention_impl="xla")
  c.tokenizer.update(kind="bpe", vocab_size=1024)
  c.data.update(task="code_summary", val_percent=5)
  c.train.update(objective="seq2seq", num_steps=1000, batch_size=32, seq_len=128,
                 tgt_seq_len=32, learning_rate=2e-3, warmup_steps=100, log_every=50,
                 eval_every=500, eval_steps=4, checkpoint_every=500)
  return c
