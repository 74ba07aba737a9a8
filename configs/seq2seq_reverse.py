"""Reverse a string with an encoder-decoder (the lesson's third family).

Sources: 12..24 random lowercase letters; targets: the same reversed. The
held-out pairs are 18..24 letters long and scored by exact match. 2 + 2
layers, d=128, learned positions, byte-level vocabulary (260 ids: the
tokenizer learns no merge on random letters); about 11 minutes on 2 CPU
cores. 2,400 steps over 100,000 training pairs. What moved it, over seeds
and thread counts (docs/tasks.md, `python -m bench.tasks`): at 1,200 steps
on 20,000 pairs of 4..24 letters the held-out exact match ranged 0.946 to
0.998; at 1,800 steps, 0.982 to 1.000, still with one run in five under
0.99 whether on 20,000 or 100,000 pairs, or on strings of 12..24 letters
(which train the last target positions of long strings, where the errors
of 4..24 were, 1.6 times as often at the same cost per step: every row is
padded to 32 tokens). The training loss was still falling at step 1,800;
at 2,400 every run of ten reached 1.000.
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
  c.train.update(objective="seq2seq", num_steps=2400, batch_size=64, seq_len=32,
                 learning_rate=2e-3, warmup_steps=100, weight_decay=0.01, log_every=50,
                 eval_every=600, eval_steps=4, checkpoint_every=600)
  return c
