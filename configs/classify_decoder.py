"""Classify Python functions by standard-library package with a small decoder.

The task of configs/classify_encoder.py (8 packages, split by module, 25% of
the modules held out) read by a causal decoder (RoPE, RMSNorm pre-norm,
SwiGLU) that classifies from the hidden state of the last real token, the
only one whose attention saw the whole function (pooling=last, as
transformers' Qwen2ForSequenceClassification). A few minutes on a CPU.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(family="decoder", vocab_size=1024, d_model=128, num_layers=2, num_heads=4,
                 d_ff=384, max_len=128, pos_emb="rope", norm="rmsnorm", mlp="swiglu",
                 num_labels=8, pooling="last")
  c.tokenizer.update(kind="bpe", vocab_size=1024)
  c.data.update(task="stdlib_package", val_percent=25)
  c.train.update(objective="classify", num_steps=300, batch_size=32, seq_len=64,
                 learning_rate=1e-3, warmup_steps=40, log_every=20, eval_every=100,
                 eval_steps=100, checkpoint_every=300)
  return c
