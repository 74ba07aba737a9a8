"""Reverse a string with an encoder-decoder (the lesson's third family).

Sources: 4..24 random lowercase letters; targets: the same reversed. The
held-out pairs are 18..24 letters long, longer than two thirds of the
training strings, and scored by exact match. 2 + 2 layers, d=128, learned
positions, byte-level vocabulary (260 ids: the tokenizer learns no merge on
random letters); a few minutes on 2 CPU cores. 1,800 steps over 100,000
training pairs (each seen about once): with 20,000 pairs seen six times the
held-out exact match of some seeds stopped short of 0.99 on the long strings.
Measured spread: docs/tasks.md (`python -m bench.tasks`).
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="encoder_decoder", vocab_size=260, d_model=128, num_layers=2,
                 num_decoder_layers=2, num_heads=4, d_ff=512, max_len=32, pos_emb="learned",
                 norm="layernorm", mlp="gelu", attention_impl="xla")
  c.tokenizer.update(kind="bpe", vocab_size=260)
  c.data.update(task="reverse", task_min_len=4, task_max_len=24, task_test_min_len=18,
                task_size=100000, task_test_size=500)
  c.train.update(objective="seq2seq", num_steps=1800, batch_size=64, seq_len=32,
                 learning_rate=2e-3, warmup_steps=100, weight_decay=0.01, log_every=50,
                 eval_every=600, eval_steps=4, checkpoint_every=600)
  return c
