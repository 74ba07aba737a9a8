"""Classify Python functions by standard-library package with a small BERT-style encoder.

data.task=stdlib_package: which of 8 packages (asyncio, email, importlib,
logging, multiprocessing, tkinter, unittest, xml) a function's source comes
from, split by module (25% of the modules held out, so every package has
held-out functions). 2 layers, d=128, post-norm LayerNorm, learned
positions, erf GELU, embedding LayerNorm, [BOS] pooled through BERT's pooler
(dense + tanh); byte-level BPE of 1,024 ids trained on the train split; the
first 64 tokens of each function. A few minutes on a CPU; eval.py reports
accuracy, macro-F1 and the confusion matrix beside the majority baseline.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="encoder", vocab_size=1024, d_model=128, num_layers=2, num_heads=4,
                 d_ff=512, max_len=128, pos_emb="learned", norm="layernorm",
                 norm_position="post", norm_eps=1e-12, mlp="gelu", use_bias=True,
                 type_vocab_size=2, embedding_norm=True, num_labels=8, pooling="cls",
                 pooler=True)
  c.tokenizer.update(kind="bpe", vocab_size=1024)
  c.data.update(task="stdlib_package", val_percent=25)
  c.train.update(objective="classify", num_steps=300, batch_size=32, seq_len=64,
                 learning_rate=1e-3, warmup_steps=40, log_every=20, eval_every=100,
                 eval_steps=100, checkpoint_every=300)
  return c
