"""Step 2 of the lesson: token embeddings and positional information.

- `Embed`: E in R^{V x d}; `attend` gives float32 logits x E^T for a tied head.
- `sinusoidal_table`: PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(...).
- `LearnedPositions`: a [max_len, d] table (cannot extrapolate past max_len).
- RoPE: `rope_frequencies` and `apply_rope` rotate pair i of q and k at
  position m by m * theta_i, theta_i = base^(-2i/d), so scores depend only on
  the offset n - m. Context extension by rescaling the frequencies:
  `linear` (position interpolation: m / s), `ntk` (NTK-aware: base *
  s^(d/(d-2))) and `yarn` (per-frequency interpolation with a ramp between
  wavelengths, plus the attention temperature 0.1 ln s + 1).
"""
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.layers import dense_init, param


class Embed(nnx.Module):
  """Token embedding; `attend` is the tied output head."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.dtype = cfg.dtype
    self.embedding = param(rngs, dense_init(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                           ("vocab", "embed"), cfg.param_dtype)

  def __call__(self, tokens_BT):
    return jnp.take(self.embedding[...], tokens_BT, axis=0).astype(self.dtype)

  def attend(self, x_BTM):
    """Logits x E^T [B, T, V], computed in float32 whatever the model dtype."""
    return jnp.einsum("btm,vm->btv", x_BTM.astype(jnp.float32),
                      self.embedding[...].astype(jnp.float32))


def sinusoidal_table(num_positions: int, d: int) -> np.ndarray:
  """The original transformer's fixed encodings, [num_positions, d] float32."""
  pos = np.arange(num_positions, dtype=np.float64)[:, None]
  inv = 10000.0 ** (-np.arange(0, d, 2, dtype=np.float64) / d)
  table = np.zeros((num_positions, d))
  table[:, 0::2] = np.sin(pos * inv)
  table[:, 1::2] = np.cos(pos * inv)
  return table.astype(np.float32)


def sinusoidal(positions_BT, d: int):
  """Sinusoidal encodings computed at any positions (no table bound)."""
  inv = 10000.0 ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angles = positions_BT[..., None].astype(jnp.float32) * inv
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(
      *positions_BT.shape, d)


class LearnedPositions(nnx.Module):
  """BERT/GPT-2 style: a learned [max_len, d] position table."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.dtype = cfg.dtype
    self.table = param(rngs, dense_init(cfg.init_std), (cfg.max_len, cfg.d_model),
                       (None, "embed"), cfg.param_dtype)

  def __call__(self, positions_BT):
    return jnp.take(self.table[...], positions_BT, axis=0).astype(self.dtype)


def rope_frequencies(head_dim: int, theta: float = 10000.0, scaling: str = "none",
                     factor: float = 1.0, original_max_len: int = 2048):
  """Per-pair angular frequencies theta_i [head_dim // 2] and the attention scale.

  Returns (inv_freq as a tuple of floats, attention_scale); `linear` divides every frequency by
  the factor, `ntk` raises the base, `yarn` interpolates only the
  low-frequency pairs (wavelength longer than the original context) and keeps
  the fast ones, with a linear ramp between 1 and 32 rotations per context.
  """
  exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
  inv_freq = theta ** -exponents
  attention_scale = 1.0
  if scaling == "linear":
    inv_freq = inv_freq / factor
  elif scaling == "ntk":
    inv_freq = (theta * factor ** (head_dim / (head_dim - 2))) ** -exponents
  elif scaling == "yarn":
    rotations = original_max_len * inv_freq / (2 * math.pi)
    keep = np.clip((rotations - 1.0) / (32.0 - 1.0), 0.0, 1.0)
    inv_freq = keep * inv_freq + (1 - keep) * inv_freq / factor
    attention_scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
  return tuple(float(f) for f in inv_freq), attention_scale


def apply_rope(x_BTHD, positions_BT, inv_freq, attention_scale: float = 1.0):
  """Rotates pairs (x[i], x[i + D/2]) of every head by position * inv_freq[i].

  Computed in float32 and cast back to x's dtype.
  """
  angles_BTF = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
  cos = (jnp.cos(angles_BTF) * attention_scale)[:, :, None, :]
  sin = (jnp.sin(angles_BTF) * attention_scale)[:, :, None, :]
  x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHD.dtype)
