"""configs/tiny.py's decoder as the scaling ladder (configs/sweeps/ladder.py)
trains it: bytes as tokens (a 260-id vocabulary, the 256 bytes and 4 specials,
no BPE merges) so that the embedding does not dwarf the smallest widths; 2
heads, so that d_model can grow in steps of 4 (RoPE wants an even head_dim);
batch 8, so that the largest size of the smallest budget still takes tens of
steps; a warm-up of 10% of each run's steps (`train.warmup_fraction`), since a
budget gives each size its own step count.
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.update(vocab_size=260, num_heads=2)
  c.tokenizer.vocab_size = 260
  c.train.update(batch_size=8, warmup_fraction=0.1)
  return c
