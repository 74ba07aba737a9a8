"""T5's relative position bias (`model.pos_emb=relative`), as transformers'
`T5Attention` defines it.

The offset key position - query position is put in one of
`relative_buckets` buckets (`relative_bucket`): exact for small offsets,
logarithmically wider up to `relative_max_distance`, beyond which offsets
share the last bucket. Bidirectional stacks (the encoder) give past and
future offsets separate halves of the buckets; causal stacks (the decoder
self-attention) only look back. A learned [buckets, H] table turns buckets
into one bias per head, added to the attention scores of every layer of
the stack: one table per stack, computed once per forward pass and shared
by its layers (T5 keeps it in the first layer; cross-attention has none).
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import dense_init, param


def relative_bucket(relative_position, *, bidirectional: bool, num_buckets: int,
                    max_distance: int):
  """Bucket ids in [0, num_buckets) of integer offsets key - query."""
  buckets = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (relative_position > 0).astype(relative_position.dtype) * num_buckets
    distance = jnp.abs(relative_position)
  else:
    distance = -jnp.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  log_ratio = (jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact)
               / math.log(max_distance / max_exact))
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(relative_position.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return buckets + jnp.where(distance < max_exact, distance, large)


class RelativeBias(nnx.Module):
  """A stack's learned bias table [relative_buckets, H]."""

  def __init__(self, cfg, *, bidirectional: bool, rngs: nnx.Rngs):
    self.bidirectional = bidirectional
    self.num_buckets = cfg.relative_buckets
    self.max_distance = cfg.relative_max_distance
    self.table = param(rngs, dense_init(cfg.init_std), (cfg.relative_buckets, cfg.num_heads),
                       (None, "heads"), cfg.param_dtype)

  def __call__(self, q_positions_BT, k_positions_BS):
    """Float32 bias [B, H, T, S] of queries at `q_positions_BT` over keys at
    `k_positions_BS` (B may be 1 in either, broadcast)."""
    offset_BTS = k_positions_BS[:, None, :] - q_positions_BT[:, :, None]
    buckets_BTS = relative_bucket(offset_BTS.astype(jnp.int32), bidirectional=self.bidirectional,
                                  num_buckets=self.num_buckets, max_distance=self.max_distance)
    bias_BTSH = jnp.take(self.table[...].astype(jnp.float32), buckets_BTS, axis=0)
    return jnp.transpose(bias_BTSH, (0, 3, 1, 2))


def positions_row(length: int):
  """Positions 0..length-1 as one [1, length] row (broadcast over the batch)."""
  return jax.lax.broadcasted_iota(jnp.int32, (1, length), 1)
