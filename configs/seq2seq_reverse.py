"""Reverse a string with an encoder-decoder (the lesson's third family).

Sources: 12..24 random lowercase letters; targets: the same reversed. The
held-out pairs are 18..24 letters long and scored by exact match. 2 + 2
layers, d=128, learned positions, byte-level vocabulary (260 ids: the tokenizer learns no merge on
random letters); about 8 minutes on 2 CPU cores. 1,800 steps over 100,000
training pairs (each seen about once). The errors that remained with 4..24
letters were at the last target positions of the longest strings (a letter
too many before EOS, or the wrong last letter): target positions past 20
were trained by one string in five. With no string under 12 letters they
are trained by one in three, at the same cost per step (every row is padded
to 32 tokens). Measured spread: docs/tasks.md (`python -m bench.tasks`).
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="encoder_decoder", vocab_size=260, d_model=128, num_layers=2,
                 num_decoder_layers=2, num_heads=4, d_ff=512, max_len=32, pos_emb="learned",
                 norm="layernorm", mlp="gelu", attention_impl="xla")
  c.tokenizer.update(kind="bpe", vocab_size=260)
  c.data.update(task="reverse", task_min_len=12, task_max_len=24, task_test_min_len=18,
                task_size=100000, task_test_size=500)
  c.train.update(objective="seq2seq", num_steps=1800, batch_size=64, seq_len=32,
                 learning_rate=2e-3, warmup_steps=100, weight_decay=0.01, log_every=50,
                 eval_every=600, eval_steps=4, checkpoint_every=600)
  return c
