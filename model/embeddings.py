"""Step 2 of the lesson: token embeddings and positional information.

- `Embed`: E in R^{V x d}; `attend` gives float32 logits x E^T for a tied head.
- `sinusoidal`: PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(...).
- `LearnedPositions`: a [max_len, d] table (cannot extrapolate past max_len).
- `TokenTypes`: BERT's token-type (segment A/B) table, [type_vocab_size, d].
- RoPE: `rope_frequencies` and `apply_rope` rotate pair i of q and k at
  position m by m * theta_i, theta_i = base^(-2i/d), so scores depend only on
  the offset n - m. Context extension by rescaling the frequencies:
  `linear` (position interpolation: m / s), `ntk` (NTK-aware: base *
  s^(d/(d-2))), `yarn` (per-frequency interpolation with a ramp in the pair
  index, plus the attention factor 0.1 ln s + 1 on cos and sin) and `llama3`
  (Llama 3.1's wavelength bands); `yarn` and `llama3` are exactly
  transformers' definitions.
"""
import dataclasses
import math
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.layers import dense_init, param, token_matrix_products
from model.registry import Registry


class Embed(nnx.Module):
  """Token embedding; `attend` is the tied output head."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.dtype = cfg.dtype
    self.embedding = param(rngs, dense_init(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                           ("vocab", "embed"), cfg.param_dtype)

  def __call__(self, tokens_BT):
    return jnp.take(self.embedding[...], tokens_BT, axis=0).astype(self.dtype)

  def attend(self, x_BTM):
    """Logits x E^T [B, T, V], computed in float32 whatever the model dtype
    (as one [B*T, V] product on one CPU device: `token_matrix_products`)."""
    B, T, M = x_BTM.shape
    x = x_BTM.astype(jnp.float32)
    if token_matrix_products():
      return jnp.einsum("nm,vm->nv", x.reshape(B * T, M),
                        self.embedding[...].astype(jnp.float32)).reshape(B, T, -1)
    return jnp.einsum("btm,vm->btv", x, self.embedding[...].astype(jnp.float32))


def sinusoidal(positions_BT, d: int):
  """Sinusoidal encodings computed at any positions (no table bound)."""
  inv = 10000.0 ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angles = positions_BT[..., None].astype(jnp.float32) * inv
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(
      *positions_BT.shape, d)


class SinusoidalPositions(nnx.Module):
  """`sinusoidal` as a module of the stack (no parameters), in model.dtype."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    del rngs  # no parameters
    self.d_model, self.dtype = cfg.d_model, cfg.dtype

  def __call__(self, positions_BT):
    return sinusoidal(positions_BT, self.d_model).astype(self.dtype)


class LearnedPositions(nnx.Module):
  """BERT/GPT-2 style: a learned [max_len, d] position table."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.dtype = cfg.dtype
    self.table = param(rngs, dense_init(cfg.init_std), (cfg.max_len, cfg.d_model),
                       (None, "embed"), cfg.param_dtype)

  def __call__(self, positions_BT):
    return jnp.take(self.table[...], positions_BT, axis=0).astype(self.dtype)


class TokenTypes(nnx.Module):
  """BERT's token-type embeddings: a learned [type_vocab_size, d] table
  indexed by each token's type (0 for sentence A, 1 for sentence B)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.dtype = cfg.dtype
    self.table = param(rngs, dense_init(cfg.init_std), (cfg.type_vocab_size, cfg.d_model),
                       (None, "embed"), cfg.param_dtype)

  def __call__(self, token_types_BT):
    return jnp.take(self.table[...], token_types_BT, axis=0).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A `model.rope_scaling` choice: `frequencies(inv_freq, **p)` rescales the
  per-pair frequencies and returns them with the factor on cos and sin; `p`
  holds the head dim, theta and every scaling parameter of `rope_frequencies`,
  of which the entry reads the config fields in `reads`."""
  name: str
  doc: str
  frequencies: Callable
  reads: tuple[str, ...] = ()


def _ntk(inv_freq, *, head_dim, theta, factor, **_):
  exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
  return (theta * factor ** (head_dim / (head_dim - 2))) ** -exponents, 1.0


def _yarn(inv_freq, *, theta, factor, original_max_len, beta_fast, beta_slow, attention_factor,
          truncate, **_):
  return yarn_frequencies(inv_freq, theta, factor, original_max_len, beta_fast=beta_fast,
                          beta_slow=beta_slow, attention_factor=attention_factor,
                          truncate=truncate)


def _llama3(inv_freq, *, factor, original_max_len, low_freq_factor, high_freq_factor, **_):
  return llama3_frequencies(inv_freq, factor, original_max_len, low_freq_factor=low_freq_factor,
                            high_freq_factor=high_freq_factor), 1.0


ROPE_SCALINGS = Registry("model.rope_scaling", [
    RopeScaling("none", "the frequencies as trained", lambda inv_freq, **_: (inv_freq, 1.0)),
    RopeScaling("linear", "position interpolation: every frequency divided by the factor",
                lambda inv_freq, *, factor, **_: (inv_freq / factor, 1.0),
                ("rope_scaling_factor",)),
    RopeScaling("ntk", "NTK-aware: the base raised to base s^(d/(d-2))", _ntk,
                ("rope_scaling_factor",)),
    RopeScaling("yarn", "YaRN: a per-pair ramp and an attention factor (transformers' yarn)",
                _yarn, ("rope_scaling_factor", "rope_original_max_len", "rope_beta_fast",
                        "rope_beta_slow", "rope_attention_factor", "rope_truncate")),
    RopeScaling("llama3", "Llama 3.1's wavelength bands (transformers' llama3)", _llama3,
                ("rope_scaling_factor", "rope_original_max_len", "rope_low_freq_factor",
                 "rope_high_freq_factor")),
])


def rope_frequencies(head_dim: int, theta: float = 10000.0, scaling: str = "none",
                     factor: float = 1.0, original_max_len: int = 2048, *,
                     beta_fast: float = 32.0, beta_slow: float = 1.0,
                     attention_factor: float | None = None, truncate: bool = True,
                     low_freq_factor: float = 1.0, high_freq_factor: float = 4.0):
  """Per-pair angular frequencies theta_i [head_dim // 2] and the attention factor.

  Returns (inv_freq as a tuple of floats, attention_factor), the factor that
  multiplies cos and sin (so the attention logits by its square), as the
  `ROPE_SCALINGS` entry `scaling` rescales them: `linear` divides every
  frequency by the factor, `ntk` raises the base; `yarn` and `llama3` are
  `yarn_frequencies` and `llama3_frequencies`.
  """
  exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
  inv_freq, cos_sin_factor = ROPE_SCALINGS[scaling].frequencies(
      theta ** -exponents, head_dim=head_dim, theta=theta, factor=factor,
      original_max_len=original_max_len, beta_fast=beta_fast, beta_slow=beta_slow,
      attention_factor=attention_factor, truncate=truncate, low_freq_factor=low_freq_factor,
      high_freq_factor=high_freq_factor)
  return tuple(float(f) for f in inv_freq), cos_sin_factor


def yarn_frequencies(inv_freq, theta: float, factor: float, original_max_len: int, *,
                     beta_fast: float, beta_slow: float, attention_factor: float | None,
                     truncate: bool):
  """YaRN (Peng et al. 2023) as transformers' `modeling_rope_utils` defines it.

  The pair index at which the frequency turns `r` times over the original
  context is d ln(L / (2 pi r)) / (2 ln theta); between those of r =
  `beta_fast` and r = `beta_slow` (rounded outwards when `truncate`, clipped
  to [0, d - 1]) a linear ramp in the pair index blends the kept frequency
  (faster pairs) into the frequency divided by `factor` (slower pairs).
  The attention factor defaults to 0.1 ln(factor) + 1 (1 for factor <= 1).
  """
  d = 2 * len(inv_freq)

  def pair_index(rotations):
    return d * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = pair_index(beta_fast), pair_index(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, d - 1)
  if low == high:
    high += 0.001  # the reference's guard against a zero-width ramp
  interpolated = np.clip((np.arange(len(inv_freq)) - low) / (high - low), 0.0, 1.0)
  inv_freq = inv_freq / factor * interpolated + inv_freq * (1 - interpolated)
  if attention_factor is None:
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
  return inv_freq, attention_factor


def llama3_frequencies(inv_freq, factor: float, original_max_len: int, *,
                       low_freq_factor: float, high_freq_factor: float):
  """Llama 3.1's RoPE scaling, as transformers' `modeling_rope_utils` defines it.

  Wavelengths 2 pi / theta_i shorter than original_max_len / high_freq_factor
  are kept, longer than original_max_len / low_freq_factor divided by
  `factor`; in between, a blend by s = (original_max_len / wavelength -
  low_freq_factor) / (high_freq_factor - low_freq_factor):
  (1 - s) theta_i / factor + s theta_i.
  """
  wavelength = 2 * math.pi / inv_freq
  smooth = (original_max_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
  blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  return np.where(wavelength < original_max_len / high_freq_factor, inv_freq,
                  np.where(wavelength > original_max_len / low_freq_factor, inv_freq / factor,
                           blended))


def rope_from_config(cfg):
  """`rope_frequencies` for the resolved model config: (inv_freq, attention_factor)
  over the width each head rotates (`rotary_dim`: head_dim, or MLA's
  qk_rope_head_dim)."""
  return rope_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling,
                          cfg.rope_scaling_factor, cfg.rope_original_max_len,
                          beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow,
                          attention_factor=cfg.rope_attention_factor,
                          truncate=cfg.rope_truncate, low_freq_factor=cfg.rope_low_freq_factor,
                          high_freq_factor=cfg.rope_high_freq_factor)


def apply_rope(x_BTHD, positions_BT, inv_freq, attention_factor: float = 1.0):
  """Rotates pairs (x[i], x[i + R/2]) of the first R = 2 len(inv_freq) dims
  of every head by position * inv_freq[i]; dims past R (partial RoPE,
  `model.partial_rotary_factor` < 1) pass unchanged.

  cos and sin are multiplied by `attention_factor` (YaRN's). Computed in
  float32 and cast back to x's dtype.
  """
  angles_BTF = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
  cos = (jnp.cos(angles_BTF) * attention_factor)[:, :, None, :]
  sin = (jnp.sin(angles_BTF) * attention_factor)[:, :, None, :]
  R = 2 * len(inv_freq)
  x1, x2 = jnp.split(x_BTHD[..., :R].astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return jnp.concatenate([rotated.astype(x_BTHD.dtype), x_BTHD[..., R:]], axis=-1)
