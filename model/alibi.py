"""ALiBi (`model.pos_emb=alibi`; Press et al. 2022, "Train Short, Test Long"):
no position embedding; each head h adds -m_h |i - j| to the score of query i
over key j, a linear penalty on the distance with a fixed slope per head.

The slopes are the paper's, as BLOOM computes them: for n heads a power of
two, the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8); otherwise the
sequence of the largest power of two p < n, followed by every other slope of
the sequence of 2p, the first n - p of them. A causal stack sees keys j <= i
only, where -m (i - j) differs from BLOOM's m j by m i, the same for every key
of a row, which the softmax ignores; the encoder's (bidirectional) stacks
penalise the distance either way, as ALiBi encoders do.
"""
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx


def alibi_slopes(num_heads: int) -> np.ndarray:
  """The [num_heads] slopes m_h, float64."""

  def geometric(n):
    start = 2.0 ** (-8.0 / n)
    return start ** np.arange(1, n + 1)

  p = 2 ** math.floor(math.log2(num_heads))
  slopes = geometric(p)
  if p != num_heads:
    slopes = np.concatenate([slopes, geometric(2 * p)[::2][:num_heads - p]])
  return slopes


class AlibiBias(nnx.Module):
  """The stack's ALiBi bias; no parameters."""

  def __init__(self, cfg, *, bidirectional: bool, rngs: nnx.Rngs):
    del bidirectional, rngs  # the distance is symmetric; nothing is learned
    self.slopes = tuple(float(m) for m in alibi_slopes(cfg.num_heads))

  def __call__(self, q_positions_BT, k_positions_BS):
    """Float32 bias [B, H, T, S] of queries at `q_positions_BT` over keys at
    `k_positions_BS` (B may be 1 in either, broadcast)."""
    distance_BTS = jnp.abs(k_positions_BS[:, None, :] - q_positions_BT[:, :, None])
    slopes_H = jnp.asarray(self.slopes, jnp.float32)
    return -slopes_H[None, :, None, None] * distance_BTS[:, None].astype(jnp.float32)
